#!/usr/bin/env bash
# Issue 34: LoRA on the top K layers of SmolLM2-135M over the cut-state cache, against the best head-only run.
# From the repo root:  nohup bash docs/experiments/real-weights/run-top-layers.sh > runs/rw4/run.log 2>&1 &
# Steps: data (as the head-only tables) -> cut states at K (rlcd features --cut K) -> the frozen features from them
# (the top K layers only) -> the best head-only run of the page (RL+CE, head LR 5e-3, 3,600 x 32) -> CE and RL+CE
# with LoRA on the top K layers, started from that head (--init), side by side at one thread each -> evaluate
# (calibrate on the calibration split, the test split scored once) -> rlcd compare against the head-only run.
# Re-running skips what is done (a finished run is not trained again; an unfinished one resumes).
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw4}
K=${K:-4}
BUDGET_S=${BUDGET_S:-5400}   # wall seconds of training per arm (two arms side by side)
LR_HEAD=${LR_HEAD:-0.005}
DATA_SEED=${DATA_SEED:-0}    # the benchmark's seed (the page's tables: 0)
UNTIL=${UNTIL:-all}          # UNTIL=head stops after the head-only run (what run-top-layers-probes.sh needs)
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
done_run() { [ -f "$1/eval/evaluation.json" ]; }

mkdir -p "$OUT"
if [ ! -f "$OUT/processed/test.jsonl" ]; then
  $RLCD data synth --out "$OUT/synth.jsonl" --cases 1000 --seed "$DATA_SEED"
  $RLCD data prepare "$OUT/synth.jsonl" --out "$OUT/processed" --seed "$DATA_SEED"
fi
stamp "cut states K=$K"
OMP_NUM_THREADS=2 $RLCD features "$OUT/processed" --model smollm2-135m --cut "$K" --device cpu --dtype float32 \
  > "$OUT/cut-states.json"
stamp "features from the cut states"
OMP_NUM_THREADS=2 $RLCD features "$OUT/processed" --model smollm2-135m --device cpu --dtype float32 > "$OUT/features.json"

train_eval() {  # run dir, threads, then train arguments
  local run=$1 threads=$2; shift 2
  if ! done_run "$run"; then
    if [ -f "$run/config.json" ]; then
      OMP_NUM_THREADS=$threads $RLCD train --resume "$run" --device cpu > "$run.train.json" 2> "$run.train.log"
    else
      OMP_NUM_THREADS=$threads $RLCD train "$run" --data "$OUT/processed" --model smollm2-135m --device cpu \
        --dtype float32 "$@" > "$run.train.json" 2> "$run.train.log"
    fi
    OMP_NUM_THREADS=$threads $RLCD evaluate "$run" --device cpu --dtype float32 > "$run.eval.txt" 2> "$run.eval.log"
  fi
}
stamp "head-only (the page's best: RL+CE, head LR 5e-3)"
train_eval "$OUT/head" 2 --steps 3600 --seed 0 --objective rlcd --recipe head_only=true --recipe lr_head=0.005
if [ "$UNTIL" = head ]; then stamp "done (UNTIL=head)"; exit 0; fi
TOP=(--seed 0 --init "$OUT/head" --recipe "lora_layers=$K" --recipe batch_by=case --recipe "lr_head=$LR_HEAD")
if [ ! -f "$OUT/steps" ]; then  # size the budget: 24 updates of each arm side by side, the median s per update after 4
  stamp "timing"
  rm -rf "$OUT/timing-ce" "$OUT/timing-rlcd"
  for arm in ce rlcd; do
    OMP_NUM_THREADS=1 $RLCD train "$OUT/timing-$arm" --data "$OUT/processed" --model smollm2-135m --device cpu \
      --dtype float32 --steps 24 "${TOP[@]}" --objective $arm --recipe log_every=1 > /dev/null 2> "$OUT/timing-$arm.log" &
  done
  wait
  python3 - "$OUT" "$BUDGET_S" <<'PY' > "$OUT/steps"
import json, statistics, sys
out, budget = sys.argv[1], float(sys.argv[2])
per = []
for arm in ("ce", "rlcd"):
    rows = [json.loads(x) for x in open(f"{out}/timing-{arm}/metrics.jsonl")]
    per.append(statistics.median(r["examples"] / r["examples_per_s"] for r in rows if r["event"] == "train" and r["step"] > 4))
s = max(per)
steps = min(3600, int(budget / (s * 1.08)) // 100 * 100)  # 8% for the dev evaluations and checkpoints
json.dump({"seconds_per_update": per, "steps": steps}, open(f"{out}/timing.json", "w"))
print(steps)
PY
fi
STEPS=$(cat "$OUT/steps")
TOP+=(--steps "$STEPS")
stamp "top-$K LoRA from the head, CE and RL+CE side by side, $STEPS updates"
train_eval "$OUT/top$K-ce" 1 "${TOP[@]}" --objective ce &
train_eval "$OUT/top$K-rlcd" 1 "${TOP[@]}" --objective rlcd &
wait
stamp compare
for arm in ce rlcd; do
  for metric in nll brier accuracy; do
    $RLCD compare "$OUT/head" "$OUT/top$K-$arm" --metric "$metric" \
      --json-out "$OUT/compare-head-vs-top$K-$arm-$metric.json" > /dev/null
  done
done
for metric in nll brier accuracy; do
  $RLCD compare "$OUT/top$K-ce" "$OUT/top$K-rlcd" --metric "$metric" --json-out "$OUT/compare-top$K-ce-vs-rlcd-$metric.json" > /dev/null
done
stamp done
