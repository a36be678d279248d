#!/usr/bin/env bash
# Train any2jev on an rlcd processed directory's train split, temperature-fit on its calibration split.
#   bash benchmarks/peers/any2jev/train.sh DATA_DIR OUT_DIR
# Writes OUT_DIR/data/ (converted JSONL), OUT_DIR/model/ (any2jev checkpoint), OUT_DIR/train.log.
# Env knobs (defaults): A2J_STEPS (70: optimizer steps; empty = full epochs), A2J_EPOCHS (1),
#   A2J_BATCH (4 records = 4 cases per step), A2J_LORA_R (16), A2J_SEED (0), A2J_LR (2e-4),
#   A2J_TIES (first: tied top targets get the first candidate as label; exclude: drop those rows),
#   OMP_NUM_THREADS (1), A2J_NICE (10), A2J_VENV, A2J_BASE.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA="${1:?usage: train.sh DATA_DIR OUT_DIR}"
OUT="${2:?usage: train.sh DATA_DIR OUT_DIR}"
VENV="${A2J_VENV:-/work/peers/any2jev-venv}"
BASE="${A2J_BASE:-/work/peers/smollm2-135m-instruct-a2j}"
STEPS="${A2J_STEPS-70}"  # ~17 min on rw6 at 1 thread (README: Timings)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[[ -x "$VENV/bin/any2jev" ]] || { echo "run setup.sh first (no $VENV/bin/any2jev)" >&2; exit 2; }
[[ -f "$BASE/tokenizer.json" ]] || { echo "run setup.sh first (no base dir $BASE)" >&2; exit 2; }
mkdir -p "$OUT"
python3 "$HERE/to_any2jev.py" "$DATA" "$OUT/data" --ties "${A2J_TIES:-first}"
VAL=()
for s in calibration dev; do
  if [[ -s "$OUT/data/$s.jsonl" ]]; then VAL=(--val "$OUT/data/$s.jsonl"); break; fi
done
ARGS=(--base "$BASE" --data "$OUT/data/train.jsonl" --out "$OUT/model" "${VAL[@]}"
      --epochs "${A2J_EPOCHS:-1}" --batch-size "${A2J_BATCH:-4}" --lora-r "${A2J_LORA_R:-16}"
      --seed "${A2J_SEED:-0}" --lr "${A2J_LR:-2e-4}")
[[ -n "$STEPS" ]] && ARGS+=(--max-steps "$STEPS")
echo "any2jev train ${ARGS[*]}  (OMP_NUM_THREADS=$OMP_NUM_THREADS, nice ${A2J_NICE:-10})" | tee "$OUT/train.log"
start=$(date +%s.%N)
nice -n "${A2J_NICE:-10}" "$VENV/bin/any2jev" train "${ARGS[@]}" 2>&1 | grep --line-buffered -v -E "Loading weights|warnings.warn\(|FutureWarning|UserWarning" | tee -a "$OUT/train.log"
end=$(date +%s.%N)
python3 - "$OUT" "$start" "$end" <<'PY'
import json, sys
out, s, e = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rep = json.load(open(f"{out}/model/train_report.json"))
h = rep.get("history", [])
steps = h[-1]["step"] if h else None
print(f"wall (incl. model load + calibration + save): {e - s:.1f}s; train loop: {rep['train_seconds']}s"
      + (f" for {steps} steps = {rep['train_seconds'] / steps:.1f}s/step" if steps else "")
      + f"; temperature {rep.get('temperature')}")
PY
