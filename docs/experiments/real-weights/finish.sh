#!/usr/bin/env bash
# The rest of the real-weights experiment, run after the session running run.sh and run-last.sh ended
# during the CE evaluations: both CE evaluations (best and last), both tiny arms, every compare.
set -uo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
export OMP_NUM_THREADS=1 PYTHONPATH=${SRC:-src}  # SRC: the src/ snapshot to run (7aab087 for the page)
RLCD="${PYTHON:-.venv/bin/python} -m rlcd.cli"
OUT=runs/rw; DOCS=docs/experiments/real-weights; STEPS=60; EVERY=15
OVERRIDES=(--recipe grad_accum=1 --recipe dev_cap=16 --recipe "eval_every=$EVERY"
           --recipe "checkpoint_every=$EVERY" --recipe log_every=1 --recipe "diagnostics_every=$EVERY")
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
copy_best() { local name=$1; mkdir -p "$DOCS/$name"
  cp "$OUT/$name/eval/evaluation.json" "$OUT/$name/eval/temperatures.json" "$OUT/$name/config.json" "$DOCS/$name/"
  grep '"event": "eval"' "$OUT/$name/metrics.jsonl" > "$DOCS/$name/dev-evals.jsonl"; }
copy_last() { local name=$1; mkdir -p "$DOCS/$name-last"
  cp "$OUT/$name-last/eval/evaluation.json" "$OUT/$name-last/eval/temperatures.json" "$DOCS/$name-last/"
  grep '"event": "eval"' "$OUT/$name-last/metrics.jsonl" > "$DOCS/$name-last/dev-evals.jsonl"
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("event") == "train":
        print(json.dumps({k: d.get(k) for k in ("step", "loss", "ce_loss", "grad_norm", "examples_per_s")}))
' "$OUT/$name-last/metrics.jsonl" > "$DOCS/$name-last/train-curve.jsonl"; }
mklast() { local name=$1; rm -rf "$OUT/$name-last"; mkdir -p "$OUT/$name-last"
  (cd "$OUT/$name" && tar --exclude=./eval --exclude=./export -cf - .) | (cd "$OUT/$name-last" && tar -xf -); }
ev() { local name=$1; shift; stamp "evaluate $name $*"; local t0=$SECONDS
  $RLCD evaluate "$OUT/$name" --device cpu "$@" > "$OUT/$name.eval.log" 2>&1; stamp "evaluate $name done in $((SECONDS - t0)) s (rc $?)"; }

# smollm2 CE: both evaluations at once (one thread each, two cores)
rm -rf "$OUT/smollm2-ce/eval" "$OUT/smollm2-ce/export"
mklast smollm2-ce
ev smollm2-ce & ev smollm2-ce-last --checkpoint last & wait
copy_best smollm2-ce; copy_last smollm2-ce
# tiny reference arms at the same budget
for obj in rlcd ce; do
  name=tiny-$obj; rm -rf "$OUT/$name"
  stamp "train $name"; t0=$SECONDS
  $RLCD train "$OUT/$name" --model tiny --data "$OUT/processed" --steps $STEPS --seed 0 --objective $obj --sigma 0.3 "${OVERRIDES[@]}" --device cpu > "$OUT/$name.train.log" 2>&1
  stamp "train $name done in $((SECONDS - t0)) s"
  mklast $name
  ev $name & ev $name-last --checkpoint last & wait
  copy_best $name; copy_last $name
done
for metric in nll accuracy brier; do
  stamp "compare $metric"
  for pre in "" "last-"; do sfx=${pre:+-last}
    $RLCD compare "$OUT/smollm2-rlcd$sfx" "$OUT/smollm2-ce$sfx" --metric $metric --grouped --json-out "$DOCS/compare-${pre}smollm2-rlcd-vs-ce-$metric.json"
    $RLCD compare "$OUT/tiny-rlcd$sfx" "$OUT/tiny-ce$sfx" --metric $metric --grouped --json-out "$DOCS/compare-${pre}tiny-rlcd-vs-ce-$metric.json"
  done
done
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
stamp done
