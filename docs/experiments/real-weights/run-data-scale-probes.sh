#!/usr/bin/env bash
# Issue 69, item 4: does coherence follow truth? Per arm of run-data-scale.sh (SIZES, default the 1k arm), on the
# 1k benchmark's test split (DATA, default $OUT/d1000: every arm's data nests, so these cases are test cases of
# every arm and the rows are the same for all, paired by row):
#   `rlcd probe coherence RUN --data DATA`   the probability laws on derived forms (violation rates, TV to targets)
#   `rlcd probe order RUN --data DATA`       how much a choice answer moves with its options' order
#   JevBench-mini, canonical                 `rlcd serve RUN` asked by JevBench (benchmarks/peers/jevbench/run.sh)
# Each step is skipped when its output exists; STOP_AT (UTC time) stops any step cleanly and a re-run goes on.
# GNU time of each step goes to $OUT/costs.tsv beside the arms' stages; stamps to $OUT/stamps.txt.
# collect (COLLECT=1, the default): the probe JSON (paths relative) and JevBench reports into $DOCS/probes/.
#   STOP_AT=06:50 bash docs/experiments/real-weights/run-data-scale-probes.sh               # the 1k arm
#   SIZES="1000 4000" bash docs/experiments/real-weights/run-data-scale-probes.sh           # and the 4k arm
set -eEuo pipefail
trap 'echo "run-data-scale-probes: stopped at line $LINENO (exit $?)" >&2' ERR
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/ds}
DOCS=${DOCS:-docs/experiments/real-weights/data-scale}
K=${K:-2}
SIZES=${SIZES:-1000}
DATA=${DATA:-$OUT/d1000}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cpu}
STOP_AT=${STOP_AT:-}
COLLECT=${COLLECT:-1}
JEVBENCH_VENV=${JEVBENCH_VENV:-/work/venvs/jevbench}
HERE=docs/experiments/real-weights
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RLCD=("$PY" -m rlcd.cli)
STAMPS=$OUT/stamps.txt
COSTS=$OUT/costs.tsv
source "$HERE/lib-run.sh"  # stamp, bounded (+ COSTS/LABEL), checked, stop_at_checked
die() { echo "run-data-scale-probes: $*" >&2; exit 2; }

read -r -a SZ <<< "$SIZES"
[ "${#SZ[@]}" -ge 1 ] || die "SIZES is empty"
for n in "${SZ[@]}"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "'$n': SIZES are positive integers"
  [ -f "$OUT/d$n-top$K/eval/evaluation.json" ] || die "$OUT/d$n-top$K is not evaluated yet (run-data-scale.sh first)"
done
[ -f "$DATA/test.jsonl" ] || die "DATA=$DATA has no test split"
stop_at_checked
mkdir -p "$OUT/probes"

probe() {  # KIND (coherence | order) RUN NAME: `rlcd probe KIND RUN --data DATA`, once
  local kind=$1 run=$2 name=$3 rc=0 f="$OUT/probes/probe-$1-$3"
  [ ! -s "$f.json" ] || return 0
  stamp "probe $kind $run on $DATA"
  OMP_NUM_THREADS=$THREADS LABEL="probe $kind $name" bounded "${RLCD[@]}" probe "$kind" "$run" --data "$DATA" \
    --device "$DEVICE" --dtype float32 --json-out "$f.json.tmp" > "$f.txt" 2> "$f.log" || rc=$?
  checked "$rc" "the $kind probe of $run"; mv "$f.json.tmp" "$f.json"
}

for n in "${SZ[@]}"; do
  run=$OUT/d$n-top$K name=d$n-top$K
  probe coherence "$run" "$name"
  probe order "$run" "$name"
  if [ ! -s "$OUT/probes/jevbench-$name-mini-canonical.json" ]; then
    stamp "jevbench-mini $run (canonical)"
    rc=0; OMP_NUM_THREADS=$THREADS JEVBENCH_VENV=$JEVBENCH_VENV RLCD="$(dirname "$PY")/rlcd" LABEL="jevbench-mini $name" bounded \
      bash benchmarks/peers/jevbench/run.sh "$run" "ds-$name-mini-canonical" \
      "$OUT/probes/jevbench-$name-mini-canonical.json" --device "$DEVICE" --row-cache-mb 64 \
      > "$OUT/probes/jevbench-$name-mini-canonical.log" 2>&1 || rc=$?
    checked "$rc" "JevBench-mini of $run"
  fi
done

if [ "$COLLECT" = 1 ]; then
  stamp "collect probes into $DOCS/probes"
  mkdir -p "$DOCS/probes"
  for f in "$OUT"/probes/*.json "$OUT"/probes/*.json.gz "$OUT"/probes/*.txt; do [ -e "$f" ] && cp "$f" "$DOCS/probes/"; done
  "$PY" -m rlcd.relpaths "$DOCS/probes"
fi
stamp "probes done"
