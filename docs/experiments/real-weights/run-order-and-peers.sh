#!/usr/bin/env bash
# Issue 46 on the real-weights benchmark (data seed 1, SmolLM2-135M; the runs of run-full-budget.sh):
#   1. the order probe of the matched control (choice in all orders up to K = 4, score reversed, noul swapped;
#      votes 1, 2, 3) -> OUT/probe/control.json
#   2. the control served by `rlcd serve`, scored remotely with and without order votes (2 orders, client side)
#      -> OUT/remote-control, OUT/remote-control-votes2, and their paired comparison by case
#   3. any2jev (benchmarks/peers/any2jev: its own venv, trained on the same train split) served and scored the
#      same way -> OUT/remote-any2jev, compared with the control on the same rows
# From the repo root:  bash docs/experiments/real-weights/run-order-and-peers.sh
# Env: OUT (runs/rw6), A2J_OUT (a trained any2jev dir; skipped when absent), THREADS (2), PORT (8741).
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw6}
A2J_OUT=${A2J_OUT:-}
THREADS=${THREADS:-2}
PORT=${PORT:-8741}
DATA="$OUT/processed"
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wait_up() {  # url pid
  for _ in $(seq 240); do curl -sf "$1/health" > /dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 1; done
  return 1
}
compare() {  # a b name
  for metric in nll brier accuracy; do
    $RLCD compare "$1" "$2" --metric "$metric" --json-out "$OUT/compare-$3-$metric.json" > /dev/null
    for t in choice noul score; do
      $RLCD compare "$1" "$2" --metric "$metric" --type "$t" --json-out "$OUT/compare-$3-$metric-$t.json" > /dev/null 2>&1
    done
  done
}
mkdir -p "$OUT/probe"
if [ ! -f "$OUT/probe/control.json" ]; then
  stamp "order probe of the control"
  OMP_NUM_THREADS=$THREADS $RLCD probe order "$OUT/control" --order-votes 1,2,3 --json-out "$OUT/probe/control.json" \
    > "$OUT/probe/control.log" 2>&1
fi
stamp "serve the control"
OMP_NUM_THREADS=$THREADS $RLCD serve --run "$OUT/control" --port "$PORT" --quiet > "$OUT/serve-control.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
wait_up "http://127.0.0.1:$PORT" "$SERVER"
for votes in 1 2; do
  dir="$OUT/remote-control$([ "$votes" = 1 ] || echo "-votes$votes")"
  if [ ! -f "$dir/eval/evaluation.json" ]; then
    stamp "remote evaluation of the served control, order votes $votes"
    rm -rf "$dir"
    $RLCD evaluate --remote "http://127.0.0.1:$PORT" --data "$DATA" --out "$dir" --order-votes "$votes" \
      --concurrency 2 > "$dir.txt" 2> "$dir.log"
  fi
done
kill $SERVER; wait $SERVER 2>/dev/null || true
compare "$OUT/remote-control" "$OUT/remote-control-votes2" "votes1-vs-votes2"
compare "$OUT/control" "$OUT/remote-control" "local-vs-remote-control"
if [ -n "$A2J_OUT" ] && [ -d "$A2J_OUT" ]; then
  stamp "serve any2jev ($A2J_OUT)"
  A2J_NICE=0 OMP_NUM_THREADS=$THREADS bash benchmarks/peers/any2jev/serve.sh "$A2J_OUT" "$PORT" > "$OUT/serve-any2jev.log" 2>&1 &
  SERVER=$!
  wait_up "http://127.0.0.1:$PORT" "$SERVER"
  if [ ! -f "$OUT/remote-any2jev/eval/evaluation.json" ]; then
    rm -rf "$OUT/remote-any2jev"
    stamp "remote evaluation of any2jev"
    $RLCD evaluate --remote "http://127.0.0.1:$PORT" --data "$DATA" --out "$OUT/remote-any2jev" --concurrency 2 \
      > "$OUT/remote-any2jev.txt" 2> "$OUT/remote-any2jev.log"
  fi
  kill $SERVER; wait $SERVER 2>/dev/null || true
  compare "$OUT/control" "$OUT/remote-any2jev" "control-vs-any2jev"
fi
stamp done
