#!/usr/bin/env bash
# Copy what the full-budget section cites from runs/rw6 (run-full-budget.sh) into docs/experiments/real-weights/full-budget/:
# per run its eval/evaluation.json and metrics.jsonl (gzip -9n) and config.json, the compare JSON and the caches' size
# lines (top4-h200: the H200's unfinished top-4 arm, gpu-full-budget.sh, its dev curve only); then print the tables, write summary.json and draw the plots (table_full_budget.py). Safe mid-run: a run still
# training contributes its metrics (the dev curve) only.
set -euo pipefail
OUT=${OUT:-runs/rw6}
DOCS=${DOCS:-docs/experiments/real-weights/full-budget}
mkdir -p "$DOCS"
for run in head control top4 top4-h200; do
  [ -f "$OUT/$run/metrics.jsonl" ] || continue
  gzip -9nc "$OUT/$run/metrics.jsonl" > "$DOCS/$run.metrics.jsonl.gz"
  cp "$OUT/$run/config.json" "$DOCS/$run.config.json"
  [ -f "$OUT/$run/eval/evaluation.json" ] && gzip -9nc "$OUT/$run/eval/evaluation.json" > "$DOCS/$run.evaluation.json.gz"
  # the frozen dev subset's rows with their posteriors: its Bayes floor, so a dev curve reads as a gap
  [ -f "$OUT/$run/dev-evals/step-0.jsonl.gz" ] && cp "$OUT/$run/dev-evals/step-0.jsonl.gz" "$DOCS/dev-step-0.jsonl.gz"
done
# this experiment's pairs only (runs/rw6 also holds issue 46's compares, which order-and-peers/ keeps)
cp "$OUT"/compare-{head-vs-control,head-vs-top4,control-vs-top4}-*.json "$OUT/cut-states.json" "$OUT/features.json" \
  "$DOCS/" 2>/dev/null || true
grep "^==" "$OUT/run.log" > "$DOCS/stamps.txt" || true
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
.venv/bin/python docs/experiments/real-weights/table_full_budget.py "$DOCS" | tee "$DOCS/tables.md"
