#!/usr/bin/env bash
# Copy what the top-layer section cites from runs/rw4 (run-top-layers.sh, run-top-layers-probes.sh) into docs/experiments/real-weights/top-layers/full/:
# per run its eval/evaluation.json and metrics.jsonl (gzip -9n) and config.json, the compare JSON, the timing and the
# cut-state cache's size line; then print the tables and draw the curves (table_top_layers.py).
set -euo pipefail
OUT=${OUT:-runs/rw4}
K=${K:-4}
DOCS=${DOCS:-docs/experiments/real-weights/top-layers/full}  # the probes: DOCS=.../top-layers/probes (their head is rebuilt)
mkdir -p "$DOCS"
for run in head "top$K-ce" "top$K-rlcd" "top$K-ce-head5e4" "top$K-ce-head5e4-lora1e3"; do
  [ -f "$OUT/$run/eval/evaluation.json" ] || continue
  gzip -9nc "$OUT/$run/eval/evaluation.json" > "$DOCS/$run.evaluation.json.gz"
  gzip -9nc "$OUT/$run/metrics.jsonl" > "$DOCS/$run.metrics.jsonl.gz"
  cp "$OUT/$run/config.json" "$DOCS/$run.config.json"
done
cp "$OUT"/compare-*.json "$OUT/timing.json" "$OUT/cut-states.json" "$OUT/features.json" "$OUT/cut-states.first.json" "$DOCS/" 2>/dev/null || true
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
.venv/bin/python docs/experiments/real-weights/table_top_layers.py "$DOCS" | tee "$DOCS/tables.md"
