#!/usr/bin/env bash
# The real-weights experiment (docs/experiments/real-weights.md), sequential, from the repo root:
#   nohup bash docs/experiments/real-weights/run.sh > runs/rw/run.log 2>&1 &
# Runs land in runs/rw/ (ignored by git); the JSON the page cites is copied to
# docs/experiments/real-weights/ at the end. RLCD=... overrides the CLI (default: the venv's rlcd).
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw}
DOCS=docs/experiments/real-weights
STEPS=${STEPS:-60}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread: see the page (an oversubscribed 2-core box)

# identical for every arm: the budget (STEPS updates of one micro-batch of 8) and its cadence
EVERY=$((STEPS / 4))
OVERRIDES=(--recipe grad_accum=1 --recipe dev_cap=16 --recipe "eval_every=$EVERY"
           --recipe "checkpoint_every=$EVERY" --recipe log_every=1 --recipe "diagnostics_every=$EVERY")

stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

mkdir -p "$OUT"
if [ ! -f "$OUT/processed/test.jsonl" ]; then
  stamp data
  $RLCD data synth --out "$OUT/synth.jsonl" --cases 1000 --seed 0
  $RLCD data prepare "$OUT/synth.jsonl" --out "$OUT/processed" --seed 0
fi

arm() {  # name model objective
  local name=$1 model=$2 objective=$3
  if [ ! -f "$OUT/$name/eval/evaluation.json" ]; then
    stamp "train $name ($model, $objective)"
    local t0=$SECONDS
    $RLCD train "$OUT/$name" --model "$model" --data "$OUT/processed" --steps "$STEPS" --seed 0 \
      --objective "$objective" --sigma 0.3 "${OVERRIDES[@]}" --device cpu
    stamp "train $name done in $((SECONDS - t0)) s"
    t0=$SECONDS
    $RLCD evaluate "$OUT/$name" --device cpu
    stamp "evaluate $name done in $((SECONDS - t0)) s"
  fi
  mkdir -p "$DOCS/$name"
  cp "$OUT/$name/eval/evaluation.json" "$OUT/$name/eval/temperatures.json" "$OUT/$name/config.json" "$DOCS/$name/"
  grep '"event": "eval"' "$OUT/$name/metrics.jsonl" > "$DOCS/$name/dev-evals.jsonl"
}

arm smollm2-rlcd smollm2-135m rlcd
arm smollm2-ce smollm2-135m ce
arm tiny-rlcd tiny rlcd
arm tiny-ce tiny ce

for metric in nll accuracy brier; do
  stamp "compare $metric"
  $RLCD compare "$OUT/smollm2-rlcd" "$OUT/smollm2-ce" --metric "$metric" --grouped \
    --json-out "$DOCS/compare-smollm2-rlcd-vs-ce-$metric.json"
  $RLCD compare "$OUT/tiny-rlcd" "$OUT/tiny-ce" --metric "$metric" --grouped \
    --json-out "$DOCS/compare-tiny-rlcd-vs-ce-$metric.json"
done
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
stamp done
