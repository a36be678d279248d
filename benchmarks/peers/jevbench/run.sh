#!/usr/bin/env bash
# Run a JevBench suite against `rlcd serve` of a run, on 127.0.0.1, and write the report JSON.
#   bash benchmarks/peers/jevbench/run.sh RUN NAME OUT_JSON [rlcd serve options...]
# e.g. bash benchmarks/peers/jevbench/run.sh runs/demo/run demo-canonical benchmarks/peers/jevbench/results/demo-canonical.json
#      bash benchmarks/peers/jevbench/run.sh runs/demo/run demo-as-asked  .../demo-as-asked.json --as-asked
# Env: JEVBENCH_VENV (default /work/venvs/jevbench; created by setup.sh when missing), JEVBENCH_SUITE (default
#      jevbench-mini, the suite the leaderboard reports), RLCD (default: .venv/bin/rlcd, else rlcd on PATH).
#      JEVBENCH_DOMAINS, JEVBENCH_RELATIONS, JEVBENCH_GROUPS: comma-separated selections (default: the whole suite).
# One request in flight (JevBench's default: the sequential answers); no request cache (each run asks afresh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
RUN="$1"; NAME="$2"; OUT="$3"; shift 3
VENV="${JEVBENCH_VENV:-/work/venvs/jevbench}"
SUITE="${JEVBENCH_SUITE:-jevbench-mini}"
RLCD="${RLCD:-}"
if [[ -z "$RLCD" ]]; then
  if [[ -x "$ROOT/.venv/bin/rlcd" ]]; then RLCD="$ROOT/.venv/bin/rlcd"; else RLCD=rlcd; fi
fi
[[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import jevbench' 2>/dev/null || JEVBENCH_VENV="$VENV" bash "$HERE/setup.sh"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$(mktemp -t rlcd-serve-XXXX.log)"
"$RLCD" serve "$RUN" --host 127.0.0.1 --port "$PORT" --quiet "$@" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "rlcd serve exited:"; tail -20 "$LOG"; exit 1; fi
  sleep 0.5
done
"$VENV/bin/python" "$HERE/run_suite.py" --url "http://127.0.0.1:$PORT" --name "$NAME" --suite "$SUITE" \
  --out "$OUT" --serve-options "$*" --run "$RUN" --domains "${JEVBENCH_DOMAINS:-}" \
  --relations "${JEVBENCH_RELATIONS:-}" --groups "${JEVBENCH_GROUPS:-}"
