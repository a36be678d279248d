#!/usr/bin/env bash
# Issue 44: the recipe's full budget on real weights. On the 1,000-case known-posterior benchmark (data seed 1, the
# confirmation seed), SmolLM2-135M:
#   head     the page's head-only run (RL+CE, head LR 5e-3, 3,600 x 32): the init of both arms
#   top4     + LoRA on the top 4 layers, CE, head LR 5e-4 (kept, not re-warmed: init_head=keep), LoRA LR 1e-3,
#            3,600 x 32, dev-selected on NLL (select_by=nll), dev curve per type every 400
#   control  the matched-budget head-only control: the same init, objective, head LR, updates, examples, selection
# then evaluate (calibrate on the calibration split, the test split scored once per arm) and rlcd compare by case.
# The balanced candidate orders (sampling.orders_of) are in every cache this builds.
# From the repo root:  nohup bash docs/experiments/real-weights/run-full-budget.sh > runs/rw6/run.log 2>&1 &
# UNTIL=features stops after the caches, UNTIL=control after the matched control, UNTIL=arms before the compares; a re-run
# skips what is done and resumes an unfinished run. DEVICE=cuda runs every stage on the GPU (still float32); MODEL, CASES
# and STEPS shrink it for a dry run (MODEL=tiny K=2 CASES=12 STEPS=8: the tiny model has 4 layers); CUT_STATES=0 with UNTIL=control skips the cut-state
# cache the head-only runs do not need. ARMS names the arms to train after the head (default "control top$K"; the GPU
# machine, given the head run trained here, runs ARMS=top4 FEATURES=0: no head-only feature cache, which only the
# head-only runs read).
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw6}
K=${K:-4}
DATA_SEED=${DATA_SEED:-1}
STEPS=${STEPS:-3600}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
MODEL=${MODEL:-smollm2-135m}
CASES=${CASES:-1000}
UNTIL=${UNTIL:-all}
ARMS=${ARMS:-"control top$K"}
FEATURES=${FEATURES:-1}
arm() { [[ " $ARMS " == *" $1 "* ]]; }
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
done_run() { [ -f "$1/eval/evaluation.json" ]; }
mkdir -p "$OUT"
if [ ! -f "$OUT/processed/test.jsonl" ]; then
  $RLCD data synth --out "$OUT/synth.jsonl" --cases "$CASES" --seed "$DATA_SEED"
  $RLCD data prepare "$OUT/synth.jsonl" --out "$OUT/processed" --seed "$DATA_SEED"
fi
if [ "${CUT_STATES:-1}" = 1 ]; then
  stamp "cut states K=$K"
  OMP_NUM_THREADS=$THREADS $RLCD features "$OUT/processed" --model "$MODEL" --cut "$K" --device "$DEVICE" \
    --dtype float32 > "$OUT/cut-states.json"
fi
if [ "$FEATURES" = 1 ]; then
  stamp "features (from the cut states when there are some)"
  OMP_NUM_THREADS=$THREADS $RLCD features "$OUT/processed" --model "$MODEL" --device "$DEVICE" --dtype float32 \
    > "$OUT/features.json"
fi
if [ "$UNTIL" = features ]; then stamp "done (UNTIL=features)"; exit 0; fi

train_eval() {  # run dir, then train arguments
  local run=$1; shift
  if ! done_run "$run"; then
    if [ -f "$run/config.json" ]; then
      OMP_NUM_THREADS=$THREADS $RLCD train --resume "$run" --device "$DEVICE" > "$run.train.json" 2> "$run.train.log"
    else
      OMP_NUM_THREADS=$THREADS $RLCD train "$run" --data "$OUT/processed" --model "$MODEL" --device "$DEVICE" \
        --dtype float32 "$@" > "$run.train.json" 2> "$run.train.log"
    fi
    stamp "evaluate $run"
    OMP_NUM_THREADS=$THREADS $RLCD evaluate "$run" --device "$DEVICE" --dtype float32 > "$run.eval.txt" 2> "$run.eval.log"
  fi
}
stamp "head-only init (RL+CE, head LR 5e-3, $STEPS x 32)"
train_eval "$OUT/head" --steps "$STEPS" --seed 0 --objective rlcd --recipe head_only=true --recipe lr_head=0.005
ARM=(--seed 0 --init "$OUT/head" --objective ce --steps "$STEPS" --recipe lr_head=0.0005 --recipe select_by=nll)
if arm control; then
  stamp "matched head-only control, $STEPS updates"
  train_eval "$OUT/control" "${ARM[@]}" --recipe head_only=true
fi
if [ "$UNTIL" = control ]; then stamp "done (UNTIL=control)"; exit 0; fi
if arm "top$K"; then
  stamp "top-$K LoRA, $STEPS updates"
  train_eval "$OUT/top$K" "${ARM[@]}" --recipe "lora_layers=$K" --recipe batch_by=case --recipe lr_lora=0.001
fi
if [ "$UNTIL" = arms ]; then stamp "done (UNTIL=arms)"; exit 0; fi
stamp compare
for pair in "head control" "head top$K" "control top$K"; do
  set -- $pair
  for metric in nll brier accuracy; do
    $RLCD compare "$OUT/$1" "$OUT/$2" --metric "$metric" --json-out "$OUT/compare-$1-vs-$2-$metric.json" > /dev/null
    for t in choice noul score; do
      $RLCD compare "$OUT/$1" "$OUT/$2" --metric "$metric" --type "$t" \
        --json-out "$OUT/compare-$1-vs-$2-$metric-$t.json" > /dev/null 2>&1
    done
  done
done
stamp done
