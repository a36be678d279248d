"""The tokenizer of an rlcd export, as transformers loads it (`trust_remote_code=True`).

transformers resets the BPE's `ignore_merges` flag whenever it loads a tokenizer; the Qwen3.5 vocabulary
needs it set (tokens then agree with tiktoken id for id). This subclass restores the value saved in
tokenizer.json after loading (overriding `__init__` instead would change how transformers builds the
tokenizer). The exporter writes the base class's name below.
"""

import json
import os

import transformers

BASE_CLASS = "Qwen3_5Tokenizer"


class RlcdTokenizer(getattr(transformers, BASE_CLASS)):
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        tok = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        path = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "", "tokenizer.json")
        backend = getattr(tok, "_tokenizer", None)
        if backend is not None and os.path.isfile(path) and hasattr(backend.model, "ignore_merges"):
            with open(path, encoding="utf-8") as f:
                backend.model.ignore_merges = bool(json.load(f)["model"].get("ignore_merges", False))
        return tok
