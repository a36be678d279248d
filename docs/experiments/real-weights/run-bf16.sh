#!/usr/bin/env bash
# Issue 60: does a bfloat16 backbone on the CPU train the top-4 LoRA arm as well as float32? On the full-budget
# benchmark (data seed 1, SmolLM2-135M, runs/rw6 of run-full-budget.sh, its head-only `head` run as the init),
# two short top-4 arms with the full-budget arm's recipe, 400 updates each, alike but for --dtype:
#   top4-fp32   --dtype float32   (the CPU default; reads the float32 cut-state cache)
#   top4-bf16   --dtype bfloat16  (a recorded precision_deviation; builds and reads a bfloat16 cut-state cache)
# Both are evaluated in float32 at the weights their 400th update left (`--checkpoint last`: a short arm's dev
# selection may keep the init, which would compare the head with itself), so the difference is the training's;
# then compared paired by case on the dev split (raw NLL, per type) and the test split (calibrated NLL). Updates per second come from each train log.
# From the repo root, after `UNTIL=control bash docs/experiments/real-weights/run-full-budget.sh`:
#   bash docs/experiments/real-weights/run-bf16.sh > runs/rw6/bf16.log 2>&1
# STEPS shrinks it (the committed numbers are STEPS=400). DTYPES picks the arms (default both, one after the other);
# the committed run trained them side by side, one thread each, so each met the same neighbour load:
#   DTYPES=float32 THREADS=1 bash ... > runs/rw6/bf16-fp32.log 2>&1 &  DTYPES=bfloat16 THREADS=1 bash ... > runs/rw6/bf16-bf16.log 2>&1 &
# and the compare runs when both arms are evaluated (a re-run with both done only compares).
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw6}
STEPS=${STEPS:-400}
K=${K:-4}
DTYPES=${DTYPES:-"float32 bfloat16"}
THREADS=${THREADS:-2}
MODEL=${MODEL:-smollm2-135m}
RES=${RES:-docs/experiments/real-weights/bf16}
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
[ -f "$OUT/head/eval/evaluation.json" ] || { echo "no $OUT/head: run run-full-budget.sh (UNTIL=control) first" >&2; exit 2; }
mkdir -p "$RES"
ARM=(--seed 0 --init "$OUT/head" --objective ce --steps "$STEPS" --recipe lr_head=0.0005 --recipe select_by=nll
     --recipe lora_layers=$K --recipe batch_by=case --recipe lr_lora=0.001)
for dt in $DTYPES; do
  run="$OUT/top4-${dt/float32/fp32}"; run="${run/bfloat16/bf16}"
  if [ ! -f "$run/eval/evaluation.json" ]; then
    if [ -f "$run/config.json" ]; then
      stamp "resume $run"
      OMP_NUM_THREADS=$THREADS $RLCD train --resume "$run" > "$run.train.json" 2> "$run.train.log"
    else
      stamp "train $run ($dt, $STEPS updates)"
      OMP_NUM_THREADS=$THREADS $RLCD train "$run" --data "$OUT/processed" --model "$MODEL" --device cpu \
        --dtype "$dt" "${ARM[@]}" > "$run.train.json" 2> "$run.train.log"
    fi
    stamp "evaluate $run (float32, last checkpoint)"
    OMP_NUM_THREADS=$THREADS $RLCD evaluate "$run" --device cpu --dtype float32 --checkpoint last > "$run.eval.txt" 2> "$run.eval.log"
  fi
  cp "$run/config.json" "$RES/$(basename "$run").config.json"
  gzip -c "$run/metrics.jsonl" > "$RES/$(basename "$run").metrics.jsonl.gz"
  gzip -c "$run/eval/evaluation.json" > "$RES/$(basename "$run").evaluation.json.gz"
  cp "$run.train.json" "$RES/$(basename "$run").train.json"
done
for arm in top4-fp32 top4-bf16; do
  [ -f "$OUT/$arm/eval/evaluation.json" ] || { stamp "no compare yet: $OUT/$arm is not evaluated"; exit 0; }
done
stamp compare
for split in dev test; do
  raw=(); [ "$split" = dev ] && raw=(--raw)
  $RLCD compare "$OUT/top4-fp32" "$OUT/top4-bf16" --split "$split" "${raw[@]}" --metric nll \
    --json-out "$RES/compare-fp32-vs-bf16-$split-nll.json" > /dev/null
  for t in choice noul score; do
    $RLCD compare "$OUT/top4-fp32" "$OUT/top4-bf16" --split "$split" "${raw[@]}" --metric nll --type "$t" \
      --json-out "$RES/compare-fp32-vs-bf16-$split-nll-$t.json" > /dev/null 2>&1
  done
done
PYTHONPATH="$PWD/src" .venv/bin/python -m rlcd.relpaths "$RES"  # committed JSON names paths relative to the repo (runs/...), not this machine's
stamp done
