#!/usr/bin/env bash
# Copy what the page cites from runs/rw3 (run-head-only.sh, run-lpft.sh) into docs/experiments/real-weights/head-only/:
# each run's eval/evaluation.json (gzip -9n) and config.json, the sweeps' summaries, the compare JSON;
# then draw the sigma plots and print the tables (table_head_only.py).
set -euo pipefail
OUT=${OUT:-runs/rw3}
DOCS=docs/experiments/real-weights/head-only
mkdir -p "$DOCS"
for sweep in ablation sigma; do
  for run in "$OUT/$sweep"/runs/*/; do
    name=$(basename "$run")
    [ -L "${run%/}" ] && continue  # a linked run belongs to the sweep it was trained in
    [ -f "$run/eval/evaluation.json" ] || continue
    mkdir -p "$DOCS/$sweep/$name"
    gzip -9nc "$run/eval/evaluation.json" > "$DOCS/$sweep/$name/evaluation.json.gz"
    cp "$run/config.json" "$DOCS/$sweep/$name/"
  done
  cp "$OUT/$sweep/summary.md" "$DOCS/$sweep-summary.md" 2>/dev/null || true
  cp "$OUT/$sweep/summary.json" "$DOCS/$sweep-summary.json" 2>/dev/null || true
done
for run in lpft lpft-last; do  # table 4: best (dev-selected) and last checkpoint
  if [ -f "$OUT/$run/eval/evaluation.json" ]; then
    mkdir -p "$DOCS/lpft/$run-s0"
    gzip -9nc "$OUT/$run/eval/evaluation.json" > "$DOCS/lpft/$run-s0/evaluation.json.gz"
    cp "$OUT/$run/config.json" "$DOCS/lpft/$run-s0/"
    grep '"event": "eval"' "$OUT/$run/metrics.jsonl" > "$DOCS/lpft/$run-s0/dev-evals.jsonl"
  fi
done
cp "$OUT/lpft.log" "$OUT/lpft-last.log" "$DOCS/lpft/" 2>/dev/null || true
cp "$OUT"/compare-*.json "$DOCS/" 2>/dev/null || true
cp "$OUT/features-extract.log" "$DOCS/features.log" 2>/dev/null || true
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
.venv/bin/python docs/experiments/real-weights/table_head_only.py "$DOCS"
