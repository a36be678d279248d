#!/usr/bin/env bash
# Issue 34, after the first two arms (run-top-layers.sh) missed the bar: two more CE runs with LoRA on the top 4
# layers, the same 1,200 updates from the same head, seed 0, side by side at one thread each. In the first arms the
# train CE jumped from ~1.0 to ~1.5 during the warmup (the head LR re-warmed to 5e-3, ten times the rate the head
# had finished at) and spent most of the budget recovering; these two start the head at 5e-4:
#   top4-ce-head5e4          head LR 5e-4 (the head-only run's final rate), LoRA LR 1e-4 as the first arms
#   top4-ce-head5e4-lora1e3  head LR 5e-4, LoRA LR 1e-3 (is LoRA step-size limited once the head holds still?)
# Each is dev-selected, calibrated and compared with the head-only run as before.
# On a machine without the first arms' run directory, rebuild the head first (data, cut states, features, head-only
# run; ~37 min here) and give the probes the first arms' 1,200 updates:
#   UNTIL=head bash docs/experiments/real-weights/run-top-layers.sh && echo 1200 > runs/rw4/steps
# From the repo root, after run-top-layers.sh:  nohup bash docs/experiments/real-weights/run-top-layers-probes.sh > runs/rw4/probes.log 2>&1 &
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw4}
K=${K:-4}
STEPS=$(cat "$OUT/steps")
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
run() {  # run dir, then train arguments
  local run=$1; shift
  if [ ! -f "$run/eval/evaluation.json" ]; then
    if [ -f "$run/config.json" ]; then
      OMP_NUM_THREADS=1 $RLCD train --resume "$run" --device cpu > "$run.train.json" 2> "$run.train.log"
    else
      OMP_NUM_THREADS=1 $RLCD train "$run" --data "$OUT/processed" --model smollm2-135m --device cpu --dtype float32 \
        --init "$OUT/head" --recipe "lora_layers=$K" --recipe batch_by=case \
        --objective ce --steps "$STEPS" "$@" > "$run.train.json" 2> "$run.train.log"
    fi
    OMP_NUM_THREADS=1 $RLCD evaluate "$run" --device cpu --dtype float32 > "$run.eval.txt" 2> "$run.eval.log"
  fi
  for metric in nll brier accuracy; do
    $RLCD compare "$OUT/head" "$run" --metric "$metric" --json-out "$OUT/compare-head-vs-$(basename "$run")-$metric.json" > /dev/null
  done
}
stamp "probes: top-$K CE at head LR 5e-4, LoRA LR 1e-4 and 1e-3, $STEPS updates each, side by side"
run "$OUT/top$K-ce-head5e4" --seed 0 --recipe lr_head=0.0005 &
run "$OUT/top$K-ce-head5e4-lora1e3" --seed 0 --recipe lr_head=0.0005 --recipe lr_lora=0.001 &
wait
stamp done
