#!/usr/bin/env bash
# Issue 21's head-only experiments on SmolLM2-135M features (not yet run to completion: see the page).
# From the repo root:  nohup bash docs/experiments/real-weights/run-head-only.sh > runs/rw3/run.log 2>&1 &
# The feature cache is built once (`rlcd features`) and every arm below reads it; runs land in runs/rw3/.
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw3}
DTYPE=${DTYPE:-float32}   # the cache key holds the dtype: every arm and evaluation must use the same one
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

mkdir -p "$OUT"
if [ ! -f "$OUT/processed/test.jsonl" ]; then
  $RLCD data synth --out "$OUT/synth.jsonl" --cases 1000 --seed 0
  $RLCD data prepare "$OUT/synth.jsonl" --out "$OUT/processed" --seed 0
fi
stamp features
$RLCD features "$OUT/processed" --model smollm2-135m --device cpu --dtype "$DTYPE"

sweep() {  # name, then sweep arguments
  local name=$1; shift
  stamp "sweep $name"
  $RLCD sweep --data "$OUT/processed" --model smollm2-135m --steps 3600 --recipe head_only=true \
    --dtype "$DTYPE" --out "$OUT/$name" "$@"
}
sweep table1 --grid objective=rlcd,ce --seeds 3                                  # 1. head-only, full budget
sweep sigma --grid sigma=0.25,0.5,1,2,4 --grid objective=rlcd,ce --seeds 3      # 2. Sev's sigma sweep
sweep ablation --grid objective=rlcd,ce --grid ce_weight=1,0 --seeds 5          # 3. CE / RL+CE / RL-only
stamp done
