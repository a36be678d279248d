#!/usr/bin/env bash
# Create the JevBench venv (outside the repo), with the pinned suite.
#   bash benchmarks/peers/jevbench/setup.sh
# Env: JEVBENCH_VENV (default /work/venvs/jevbench), JEVBENCH_PYTHON (default python3; jevbench needs >= 3.10).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${JEVBENCH_VENV:-/work/venvs/jevbench}"
PY="${JEVBENCH_PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), "jevbench needs Python >= 3.10"'
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt"
"$VENV/bin/python" -c 'import importlib.metadata as m; print("jevbench", m.version("jevbench"), "httpx", m.version("httpx"))'
echo "jevbench venv: $VENV"
