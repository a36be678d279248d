#!/usr/bin/env bash
# Issue 34: the probe that beat its head (top-4 CE, head LR 5e-4, LoRA LR 1e-3; run-top-layers-probes.sh) was chosen
# after the first arms' test split had been scored. This repeats it on a benchmark no run has seen: a new data seed
# (synth --seed 1: new cases, new test split), its own cut states and head-only run, then the probe's configuration
# alone on both threads, 1,200 updates, dev-selected, calibrated, compared with that head.
# From the repo root:  nohup bash docs/experiments/real-weights/run-top-layers-confirm.sh > runs/rw5/run.log 2>&1 &
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
export OUT=${OUT:-runs/rw5} K=${K:-4} DATA_SEED=${DATA_SEED:-1}
STEPS=${STEPS:-1200}
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
mkdir -p "$OUT"
UNTIL=head bash docs/experiments/real-weights/run-top-layers.sh
run="$OUT/top$K-ce-head5e4-lora1e3"
stamp "top-$K CE, head LR 5e-4, LoRA LR 1e-3, $STEPS updates, 2 threads"
if [ ! -f "$run/eval/evaluation.json" ]; then
  if [ -f "$run/config.json" ]; then
    OMP_NUM_THREADS=2 $RLCD train --resume "$run" --device cpu > "$run.train.json" 2> "$run.train.log"
  else
    OMP_NUM_THREADS=2 $RLCD train "$run" --data "$OUT/processed" --model smollm2-135m --device cpu --dtype float32 \
      --init "$OUT/head" --recipe "lora_layers=$K" --recipe batch_by=case --objective ce --steps "$STEPS" --seed 0 \
      --recipe lr_head=0.0005 --recipe lr_lora=0.001 > "$run.train.json" 2> "$run.train.log"
  fi
  stamp evaluate
  OMP_NUM_THREADS=2 $RLCD evaluate "$run" --device cpu --dtype float32 > "$run.eval.txt" 2> "$run.eval.log"
fi
for metric in nll brier accuracy; do
  $RLCD compare "$OUT/head" "$run" --metric "$metric" --json-out "$OUT/compare-head-vs-$(basename "$run")-$metric.json" > /dev/null
done
stamp done
