#!/usr/bin/env bash
# Serve a trained any2jev checkpoint: POST /v1/systemone, GET /v1/models, GET /health (no auth).
#   bash benchmarks/peers/any2jev/serve.sh OUT_DIR PORT        (OUT_DIR from train.sh, or a checkpoint dir)
# Runs in the foreground; env A2J_MODEL_NAME (any2jev-latest), A2J_HOST (127.0.0.1), OMP_NUM_THREADS (1), A2J_NICE (10).
set -euo pipefail
OUT="${1:?usage: serve.sh OUT_DIR PORT}"
PORT="${2:?usage: serve.sh OUT_DIR PORT}"
VENV="${A2J_VENV:-/work/peers/any2jev-venv}"
CKPT="$OUT"; [[ -f "$OUT/model/any2jev.json" ]] && CKPT="$OUT/model"
[[ -f "$CKPT/any2jev.json" ]] || { echo "no any2jev checkpoint in $OUT" >&2; exit 2; }
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec nice -n "${A2J_NICE:-10}" "$VENV/bin/any2jev" serve "$CKPT" --host "${A2J_HOST:-127.0.0.1}" --port "$PORT" \
  --model-name "${A2J_MODEL_NAME:-any2jev-latest}" --device cpu
