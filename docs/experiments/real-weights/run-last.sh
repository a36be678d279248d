#!/usr/bin/env bash
# The last-checkpoint evaluations of docs/experiments/real-weights.md: for each arm of run.sh, a copy
# of the run (without eval/ and export/) evaluated with `--checkpoint last` (the weights the 60th update
# left), then RLCD vs CE compared on those. Runs beside run.sh: it waits for each arm's training.
#   nohup bash docs/experiments/real-weights/run-last.sh > runs/rw/run-last.log 2>&1 &
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw}
DOCS=docs/experiments/real-weights
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

last() {  # name
  local name=$1
  until grep -q "train $name done" "$OUT/run.log" 2>/dev/null; do sleep 30; done
  if [ ! -f "$OUT/$name-last/eval/evaluation.json" ]; then
    rm -rf "$OUT/$name-last"
    mkdir -p "$OUT/$name-last"
    (cd "$OUT/$name" && tar --exclude=./eval --exclude=./export -cf - .) | (cd "$OUT/$name-last" && tar -xf -)
    stamp "evaluate $name --checkpoint last"
    local t0=$SECONDS
    $RLCD evaluate "$OUT/$name-last" --checkpoint last --device cpu
    stamp "evaluate $name-last done in $((SECONDS - t0)) s"
  fi
  mkdir -p "$DOCS/$name-last"
  cp "$OUT/$name-last/eval/evaluation.json" "$OUT/$name-last/eval/temperatures.json" "$DOCS/$name-last/"
  grep '"event": "eval"' "$OUT/$name-last/metrics.jsonl" > "$DOCS/$name-last/dev-evals.jsonl"
  # the training curve: one line per update (loss, CE, grad norm, throughput)
  python3 - "$OUT/$name-last/metrics.jsonl" > "$DOCS/$name-last/train-curve.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("event") == "train":
        print(json.dumps({k: d.get(k) for k in ("step", "loss", "ce_loss", "grad_norm", "examples_per_s")}))
PY
}

last smollm2-rlcd
last smollm2-ce
last tiny-rlcd
last tiny-ce

for metric in nll accuracy brier; do
  stamp "compare $metric (last checkpoints)"
  $RLCD compare "$OUT/smollm2-rlcd-last" "$OUT/smollm2-ce-last" --metric "$metric" --grouped \
    --json-out "$DOCS/compare-last-smollm2-rlcd-vs-ce-$metric.json"
  $RLCD compare "$OUT/tiny-rlcd-last" "$OUT/tiny-ce-last" --metric "$metric" --grouped \
    --json-out "$DOCS/compare-last-tiny-rlcd-vs-ce-$metric.json"
done
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
stamp done
