#!/usr/bin/env bash
# Issue 54: one probability per meaning. On the full-budget benchmark (data seed 1, 1,000 cases, SmolLM2-135M), the
# top-4 LoRA arm trained with derived question forms against the same recipe without them, both from the same head,
# equal updates:
#   top4        the committed full-budget top-4 arm (run-full-budget.sh: CE, head LR 5e-4 kept, LoRA LR 1e-3 on the top
#               4 layers, batch_by=case, select_by=nll, 3,600 x 32); reused from $BASE/top4 when it is there, else
#               rebuilt with the same arguments on $BASE/processed
#   top4-forms  the same arguments + --recipe forms=derived, on $OUT/derived (`rlcd data derive $BASE/processed`):
#               2 of every 8 rows are derived forms; the pool of original rows, the dev subset, the calibration and
#               test rows are the same as top4's (derived rows never enter them)
# then per arm: evaluate (the original forms only), `rlcd probe order`, `rlcd probe coherence` (both arms asked the
# same derived questions: the probe re-derives the test split's original rows, a pure function of each row), and
# rlcd compare top4 vs top4-forms by case (nll, brier, accuracy; overall and per type), JevBench-mini of each arm
# served as asked and canonical (benchmarks/peers/jevbench/run.sh; JEVBENCH_VENV names its venv), and the paired coherence table
# (table_forms.py: violation rate and gap per family and form, and the order probe's flip rates per type, forms arm
# minus the other, case-bootstrap intervals). What the page cites is copied into DOCS (default
# docs/experiments/real-weights/forms) after each arm and at the end, so it can be committed as it comes.
# From the repo root:  nohup bash docs/experiments/real-weights/run-forms.sh > runs/rw7/run.log 2>&1 &
# A re-run skips what is done and resumes an unfinished run (`rlcd train --resume`). UNTIL=derive stops after the
# derived data and its cut-state cache, UNTIL=arms before the probes. DEVICE=cuda runs every stage on the GPU (still
# float32). A dry run: MODEL=tiny K=2 CASES=12 STEPS=8 BASE=/tmp/f54 OUT=/tmp/f54 (builds its own data and head).
# ARMS names the arms to train (default "top4 top4-forms"); the derived data's cut states are only extracted when
# top4-forms is among them (or UNTIL=derive). STOP_AT (a UTC time, e.g. 16:30) stops the extraction, a training or a
# probe there (timeout; each resumes from its committed chunks or last checkpoint), so that a session ends cleanly:
# re-run the same command to go on.
# Sizes (measured on this benchmark's data, 1,000 cases seed 1): `rlcd data derive` turns 6,000 rows into 46,801
# (40,801 derived: train 37,418 rows in all, 29 s); the rows' cached candidate orders (sampling.orders_of) grow from
# 13,433 to 105,700 cut-state entries, each a suffix on its case's shared prefix -- time the cut-state extraction
# (UNTIL=derive) before planning the rest.
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
PY=${PY:-".venv/bin/python"}
BASE=${BASE:-runs/rw6}
OUT=${OUT:-runs/rw7}
K=${K:-4}
DATA_SEED=${DATA_SEED:-1}
STEPS=${STEPS:-3600}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
MODEL=${MODEL:-smollm2-135m}
CASES=${CASES:-1000}
UNTIL=${UNTIL:-all}
ARMS=${ARMS:-"top$K top$K-forms"}
FORMS_SHARE=${FORMS_SHARE:-0.25}
STOP_AT=${STOP_AT:-}
arm() { [[ " $ARMS " == *" $1 "* ]]; }
die() { echo "run-forms: $*" >&2; exit 2; }
done_run() { [ -f "$1/eval/evaluation.json" ]; }
DOCS=${DOCS:-docs/experiments/real-weights/forms}
RLCD=("$RLCD") STAMPS=$OUT/stamps.txt
source docs/experiments/real-weights/lib-run.sh  # stamp, bounded, checked, train_or_resume
stop_at_checked
case "$UNTIL" in derive|arms|all) ;; *) die "UNTIL=$UNTIL: one of derive, arms, all";; esac
collect() {  # what the page cites, copied into $DOCS as it comes (a re-run refreshes it; missing pieces are skipped)
  mkdir -p "$DOCS"
  local f run name
  for f in derive.txt cut-states.json paired-coherence.md paired-coherence.json stamps.txt; do
    [ ! -s "$OUT/$f" ] || cp "$OUT/$f" "$DOCS/$f"
  done
  [ ! -s "$OUT/derived/manifest.json" ] || cp "$OUT/derived/manifest.json" "$DOCS/derived-manifest.json"
  for run in "$BASE/top$K" "$OUT/top$K-forms"; do
    name=$(basename "$run")
    [ ! -f "$run/config.json" ] || cp "$run/config.json" "$DOCS/$name.config.json"
    [ ! -f "$run/metrics.jsonl" ] || gzip -9nc "$run/metrics.jsonl" > "$DOCS/$name.metrics.jsonl.gz"
    [ ! -f "$run/eval/evaluation.json" ] || gzip -9nc "$run/eval/evaluation.json" > "$DOCS/$name.evaluation.json.gz"
    for f in "$OUT/probe-coherence-$name.json" "$OUT/probe-order-$name.json"; do
      [ ! -s "$f" ] || gzip -9nc "$f" > "$DOCS/$(basename "$f").gz"
    done
  done
  for f in "$OUT"/compare-*.json "$OUT"/jevbench-*-mini-*.json "$OUT"/jevbench-*-mini-*.report.json.gz \
           "$OUT"/jevbench-table/jevbench-forms.*; do
    [ ! -s "$f" ] || cp "$f" "$DOCS/"
  done
  PYTHONPATH="$PWD/src" $PY -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
}
mkdir -p "$OUT" "$BASE"
if [ ! -f "$BASE/processed/test.jsonl" ]; then
  stamp "data: $CASES cases, seed $DATA_SEED"
  "${RLCD[@]}" data synth --out "$BASE/synth.jsonl" --cases "$CASES" --seed "$DATA_SEED"
  "${RLCD[@]}" data prepare "$BASE/synth.jsonl" --out "$BASE/processed" --seed "$DATA_SEED"
fi
if [ ! -f "$OUT/derived/manifest.json" ]; then
  stamp "derive $BASE/processed -> $OUT/derived"
  "${RLCD[@]}" data derive "$BASE/processed" --out "$OUT/derived" --force > "$OUT/derive.txt"
fi
if [ ! -s "$OUT/cut-states.json" ] && { arm "top$K-forms" || [ "$UNTIL" = derive ]; }; then
  stamp "cut states K=$K on the derived data"
  rc=0; OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" features "$OUT/derived" --model "$MODEL" --cut "$K" --device "$DEVICE" \
    --dtype float32 > "$OUT/cut-states.json.tmp" || rc=$?
  checked "$rc" "the derived data's cut states"
  mv "$OUT/cut-states.json.tmp" "$OUT/cut-states.json"
fi
if [ "$UNTIL" = derive ]; then collect; stamp "done (UNTIL=derive)"; exit 0; fi

train_eval() {  # run dir, data dir, then train arguments: trains or resumes until STOP_AT, then evaluates
  local run=$1 data=$2 rc=0; shift 2
  done_run "$run" && return 0
  train_or_resume "$run" "$STEPS" --data "$data" --model "$MODEL" --dtype float32 "$@"
  stamp "evaluate $run"
  OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" evaluate "$run" --device "$DEVICE" --dtype float32 \
    > "$run.eval.txt" 2> "$run.eval.log" || rc=$?
  checked "$rc" "the evaluation of $run"
}
if ! done_run "$BASE/head"; then
  stamp "head-only init (RL+CE, head LR 5e-3, $STEPS x 32) on $BASE/processed"
  if [ ! -f "$BASE/head/config.json" ]; then
    OMP_NUM_THREADS=$THREADS "${RLCD[@]}" features "$BASE/processed" --model "$MODEL" --device "$DEVICE" --dtype float32 \
      > "$BASE/features.json"
  fi
  train_eval "$BASE/head" "$BASE/processed" --steps "$STEPS" --seed 0 --objective rlcd --recipe head_only=true \
    --recipe lr_head=0.005
fi
ARM=(--seed 0 --init "$BASE/head" --objective ce --steps "$STEPS" --recipe lr_head=0.0005 --recipe select_by=nll
     --recipe "lora_layers=$K" --recipe batch_by=case --recipe lr_lora=0.001)
if arm "top$K"; then
  if [ ! -s "$BASE/cut-states.json" ]; then
    stamp "cut states K=$K on $BASE/processed (the arm without forms)"
    rc=0; OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" features "$BASE/processed" --model "$MODEL" --cut "$K" \
      --device "$DEVICE" --dtype float32 > "$BASE/cut-states.json.tmp" || rc=$?
    checked "$rc" "the cut states of $BASE/processed"
    mv "$BASE/cut-states.json.tmp" "$BASE/cut-states.json"
  fi
  stamp "top-$K LoRA without forms, $STEPS updates (reused when $BASE/top$K is done)"
  train_eval "$BASE/top$K" "$BASE/processed" "${ARM[@]}"
  collect
fi
if arm "top$K-forms"; then
  stamp "top-$K LoRA with derived forms (share $FORMS_SHARE), $STEPS updates"
  train_eval "$OUT/top$K-forms" "$OUT/derived" "${ARM[@]}" --recipe forms=derived --recipe "forms_share=$FORMS_SHARE"
  collect
fi
if [ "$UNTIL" = arms ]; then stamp "done (UNTIL=arms)"; exit 0; fi
# Each arm's probes and JevBench run once that arm is evaluated; the paired steps (compare, the coherence table) once
# both are. So ARMS=top$K-forms probes the forms arm while the other is still to train, and a later run adds the rest.
for run in "$BASE/top$K" "$OUT/top$K-forms"; do
  name=$(basename "$run")
  if ! done_run "$run"; then stamp "probes of $run: skipped (not evaluated yet)"; continue; fi
  if [ ! -f "$run/eval/probe-coherence.json" ]; then
    stamp "probe coherence $run"
    rc=0; OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" probe coherence "$run" --device "$DEVICE" --dtype float32 \
      --json-out "$OUT/probe-coherence-$name.json" > "$OUT/probe-coherence-$name.txt" \
      2> "$OUT/probe-coherence-$name.log" || rc=$?
    checked "$rc" "probe coherence $run"
  fi
  if [ ! -f "$run/eval/probe-order.json" ]; then
    stamp "probe order $run"
    rc=0; OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" probe order "$run" --device "$DEVICE" --dtype float32 \
      --json-out "$OUT/probe-order-$name.json" > "$OUT/probe-order-$name.txt" 2> "$OUT/probe-order-$name.log" || rc=$?
    checked "$rc" "probe order $run"
  fi
  "${RLCD[@]}" report "$run" > /dev/null
done
both=1; done_run "$BASE/top$K" && done_run "$OUT/top$K-forms" || both=0
[ "$both" = 1 ] && stamp compare
for metric in nll brier accuracy; do
  [ "$both" = 1 ] || break
  "${RLCD[@]}" compare "$BASE/top$K" "$OUT/top$K-forms" --metric "$metric" \
    --json-out "$OUT/compare-top$K-vs-forms-$metric.json" > /dev/null
  for t in choice noul score; do
    "${RLCD[@]}" compare "$BASE/top$K" "$OUT/top$K-forms" --metric "$metric" --type "$t" \
      --json-out "$OUT/compare-top$K-vs-forms-$metric-$t.json" > /dev/null 2>&1
  done
done
# JevBench-mini (PyPI jevbench, its own venv: benchmarks/peers/jevbench/setup.sh) of both arms served by `rlcd serve`:
# as asked (the trained model's own answers to every derived form) and canonical (the serving default, issue 55).
# JEVBENCH_MODES="" skips it; each report is kept, so a re-run asks only the missing ones.
for run in "$BASE/top$K" "$OUT/top$K-forms"; do
  done_run "$run" || continue
  for mode in ${JEVBENCH_MODES-as-asked canonical}; do
    name=$(basename "$run")-mini-$mode
    [ -s "$OUT/jevbench-$name.json" ] && continue
    stamp "jevbench-mini $run ($mode)"
    flags=(--device "$DEVICE" --row-cache-mb 64); [ "$mode" = as-asked ] && flags+=(--as-asked)
    rc=0; OMP_NUM_THREADS=$THREADS RLCD=${RLCD[0]} bounded bash benchmarks/peers/jevbench/run.sh "$run" "rw7-$name" \
      "$OUT/jevbench-$name.json" "${flags[@]}" > "$OUT/jevbench-$name.log" 2>&1 || rc=$?
    checked "$rc" "jevbench-mini $run ($mode)"
  done
done
if ls "$OUT"/jevbench-*-mini-*.json > /dev/null 2>&1; then
  stamp "jevbench table"
  mkdir -p "$OUT/jevbench-table"  # beside the leaderboard's published scores, each arm with its test accuracy
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" $PY benchmarks/peers/jevbench/to_bench.py --name jevbench-forms \
    --results-dir "$OUT/jevbench-table" "$OUT"/jevbench-*-mini-*.json > /dev/null
  "${RLCD[@]}" bench report --results-dir "$OUT/jevbench-table" --out "$OUT/jevbench-table/jevbench-forms.md"
fi
if [ "$both" = 0 ]; then collect; stamp "done with one arm (the paired steps wait for both: re-run with both ARMS)"; exit 0; fi
stamp "paired coherence table"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" $PY docs/experiments/real-weights/table_forms.py \
  "$BASE/top$K/eval/probe-coherence.json" "$OUT/top$K-forms/eval/probe-coherence.json" \
  --order "$OUT/probe-order-top$K.json" "$OUT/probe-order-top$K-forms.json" \
  --out "$OUT/paired-coherence.json" > "$OUT/paired-coherence.md"
collect
stamp done
