#!/usr/bin/env bash
# Issue 21's head-only experiments on SmolLM2-135M features (tables 1-3 of docs/experiments/real-weights.md).
# From the repo root:  nohup bash docs/experiments/real-weights/run-head-only.sh > runs/rw3/run.log 2>&1 &
# The feature cache is built once (`rlcd features`) and every arm reads it; runs land in runs/rw3/.
# The two sweeps run side by side, one torch thread each (head-only updates are small ops: a second
# thread buys little, a second process nearly 2x). Re-running resumes: finished runs are skipped.
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw3}
DTYPE=${DTYPE:-float32}   # the cache key holds the dtype: every arm and evaluation must use the same one
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

mkdir -p "$OUT"
if [ ! -f "$OUT/processed/test.jsonl" ]; then
  $RLCD data synth --out "$OUT/synth.jsonl" --cases 1000 --seed 0
  $RLCD data prepare "$OUT/synth.jsonl" --out "$OUT/processed" --seed 0
fi
stamp features
OMP_NUM_THREADS=2 $RLCD features "$OUT/processed" --model smollm2-135m --device cpu --dtype "$DTYPE"

sweep() {  # name, then sweep arguments
  local name=$1; shift
  stamp "sweep $name $*"
  OMP_NUM_THREADS=1 $RLCD sweep --data "$OUT/processed" --model smollm2-135m --steps 3600 \
    --recipe head_only=true --dtype "$DTYPE" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  stamp "sweep $name done"
}
# 1 + 3: CE-only, RL+CE (the recipe, sigma 0.3) and RL-only (ce_weight 0), 5 seeds each; table 1 is its
# CE and RL+CE arms. 2: RLCD at five sigmas, 3 seeds each (run side by side with the ablation).
sweep ablation --grid objective=rlcd,ce --grid ce_weight=1,0 --seeds 5 &
sweep sigma --grid objective=rlcd --grid sigma=0.25,0.5,1,2,4 --seeds 3 &
wait
# the sigma summary with CE beside it: the ablation's CE runs of seeds 0-2 are the same runs (same recipe,
# data and seeds), linked instead of trained again (the sweep checks each linked run's config)
mkdir -p "$OUT/sigma/runs"
for s in 0 1 2; do ln -sfn "$(realpath "$OUT/ablation/runs/ce-s$s")" "$OUT/sigma/runs/ce-s$s"; done
sweep sigma --grid objective=rlcd,ce --grid sigma=0.25,0.5,1,2,4 --seeds 3

stamp compare
runs() { local arm=$1 n=$2; seq 0 $((n - 1)) | sed "s|^|$OUT/ablation/runs/$arm-s|" | paste -sd, -; }
CE=$(runs ce 5); RLCE=$(runs rlcd-ce_weight1 5); RL=$(runs rlcd-ce_weight0 5)
for metric in nll brier accuracy; do
  $RLCD compare "$CE" "$RLCE" --metric "$metric" --json-out "$OUT/compare-ce-vs-rlce-$metric.json" > /dev/null
  $RLCD compare "$CE" "$RL" --metric "$metric" --json-out "$OUT/compare-ce-vs-rl-$metric.json" > /dev/null
  $RLCD compare "$RLCE" "$RL" --metric "$metric" --json-out "$OUT/compare-rlce-vs-rl-$metric.json" > /dev/null
done
stamp done
