# Sourced by the real-weights scripts that stop at a time and resume (run-forms.sh, run-backbone-topk.sh,
# run-data-scale.sh, run-bf16-control.sh): stamps, STOP_AT bounds, the train-or-resume step and the data-scale
# recipe. Needs STOP_AT (may be empty), STAMPS (a file the stamps are also appended to, or empty), THREADS, DEVICE
# and RLCD (the command, an array); the script calls stop_at_checked first.
stamp() {
  local line; line="== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"
  echo "$line"; [ -z "${STAMPS:-}" ] || echo "$line" >> "$STAMPS"
}
left() {  # seconds until STOP_AT (a large number without one)
  [ -n "$STOP_AT" ] || { echo 999999; return; }
  echo $(( ${STOP_EPOCH:?stop_at_checked sets it} - $(date -u +%s) ))
}
bounded() {  # run "$@" until STOP_AT; 124 when it was stopped there. With COSTS (a file) and LABEL set, appends
             # "LABEL <TAB> wall s <TAB> user s <TAB> sys s <TAB> exit" (GNU time, outside the timeout) to COSTS
  local s; s=$(left)
  [ "$s" -gt 60 ] || return 124
  if [ -n "${COSTS:-}" ] && [ -n "${LABEL:-}" ]; then
    /usr/bin/time -q -a -o "$COSTS" -f "$LABEL	%e	%U	%S	%x" timeout --signal=TERM --kill-after=30 "$s" "$@"
  else
    timeout --signal=TERM --kill-after=30 "$s" "$@"
  fi
}
stopped() { stamp "stopped at STOP_AT=$STOP_AT during $1: re-run the same command to go on"; exit 0; }
checked() {  # the exit status of a bounded stage: exit 0 saying where it stopped at STOP_AT, or fail on an error
  [ "$1" = 124 ] && stopped "$2"
  [ "$1" = 0 ] || exit "$1"
}
stop_at_checked() {  # refuse a STOP_AT that is not a time, in one line (exit 2)
  [ -z "$STOP_AT" ] || { [[ "$STOP_AT" =~ ^[0-9]{1,2}:[0-9]{2}(:[0-9]{2})?$ ]] && date -u -d "$STOP_AT" +%s > /dev/null 2>&1; } \
    || { echo "$(basename "$0"): STOP_AT=$STOP_AT: not a UTC time of day (e.g. 16:30)" >&2; exit 2; }
  # the next such time, fixed once: a time already past today (01:50 asked at 23:20) means tomorrow's
  [ -z "$STOP_AT" ] || { STOP_EPOCH=$(date -u -d "$STOP_AT" +%s)
    [ "$STOP_EPOCH" -gt "$(date -u +%s)" ] || STOP_EPOCH=$((STOP_EPOCH + 86400)); }
}
last_step() {  # the update of a run's last checkpoint, or "none"
  grep -o '"step": [0-9]*' "$1/checkpoints/last/state.json" 2>/dev/null | head -1 | grep -o '[0-9]*$' || echo none
}
train_or_resume() {  # RUN STEPS then `rlcd train` arguments after the run dir: resumes its last checkpoint, else
                     # starts it; bounded by STOP_AT (stops the script cleanly there); logs to RUN.train.{json,log}
  local run=$1 steps=$2 rc=0; shift 2
  if [ -e "$run/checkpoints/last" ]; then
    stamp "resume $run"
    OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" train --resume "$run" --device "$DEVICE" \
      > "$run.train.json" 2>> "$run.train.log" || rc=$?
  else
    if [ -e "$run" ]; then
      echo "$(basename "$0"): $run was stopped before its first checkpoint (update 0): nothing to resume; remove it and re-run" >&2
      exit 2
    fi
    stamp "train $run"
    OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" train "$run" --device "$DEVICE" "$@" \
      > "$run.train.json" 2> "$run.train.log" || rc=$?
  fi
  checked "$rc" "the training of $run (last checkpoint: update $(last_step "$run") of $steps)"
}
# The data-scale arms' recipe (issue 69; run-data-scale.sh and its control run-bf16-control.sh), one copy so that an
# arm and its control cannot drift apart: a CE head on the frozen features (head LR 5e-3), then CE from that head
# with LoRA on the top K layers (LoRA LR 1e-3, head LR 5e-4), one case per micro-batch, selected by dev NLL -- wave
# 6's best real-weights recipe (run-backbone-topk.sh). The caller adds --steps, --init and --recipe lora_layers=K.
CE_HEAD_RECIPE=(--objective ce --recipe head_only=true --recipe lr_head=0.005)
TOPK_RECIPE=(--objective ce --recipe lr_head=0.0005 --recipe select_by=nll --recipe batch_by=case --recipe lr_lora=0.001)
