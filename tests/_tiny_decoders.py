"""Random-weight text decoders of the real backbones' architectures (Gemma 3, Qwen2), built from a config in
memory, with small byte-level tokenizers that place the special tokens where the real vocabularies do. No
network, no package: the tests of the `gemma3-270m` preset and of the Qwen2.5 `--model FILE.gguf` path run on these.
"""

from __future__ import annotations

import torch

# the Qwen2.5 ChatML template, trimmed to what rlcd renders (system turn, user/assistant turns, generation prompt)
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
          "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(specials: dict[int, str], *, size: int | None = None, bos: str | None = None,
                   eos: str | None = None, pad: str | None = None, unk: str | None = None,
                   chat_template: str | None = None, filler: str = "<unused{}>", special_filler: bool = True):
    """A byte-level BPE tokenizer (no merges: one token per byte) whose special tokens sit at the given ids;
    the ids between them are filled with `filler` tokens (special too when `special_filler`), the 256 bytes follow,
    then fillers up to `size`. With `bos`, encoding prepends it (as Gemma's tokenizer does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    top = max(specials) + 1
    names = [specials.get(i, filler.format(i)) for i in range(top)]
    vocab = {t: i for i, t in enumerate(names)}
    for b in bytes_to_unicode().values():
        vocab[b] = len(vocab)
    if size is not None:
        n = 0
        while len(vocab) < size:
            vocab[f"<pad_fill_{n}>"] = len(vocab)
            n += 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    added = names if special_filler else [t for i, t in enumerate(names) if i in specials]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                               special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
                                  unk_token=unk)
    tok.chat_template = chat_template
    return tok


def gemma3_tokenizer(size: int | None = None):
    """Gemma 3's layout: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, <unused..>, <start_of_turn> 105,
    <end_of_turn> 106; BOS prepended; no chat template (the base model's)."""
    return byte_tokenizer({0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<start_of_turn>",
                           106: "<end_of_turn>"}, size=size, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>")


def qwen25_tokenizer(size: int | None = None):
    """Qwen2.5's layout: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, ... <|fim_suffix|>
    151661 (the ids, not the 151,643 BPE ranks before them: those are fillers here); ChatML template."""
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
             "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    return byte_tokenizer({151643 + i: t for i, t in enumerate(names)}, size=size, eos="<|im_end|>",
                          pad="<|endoftext|>", chat_template=CHATML, filler="r{}", special_filler=False)


def _vocab(tok) -> int:
    return int(-(-len(tok) // 64) * 64)


def tiny_gemma3(seed: int = 0, *, sliding_window: int = 16):
    """A random-weight Gemma3ForCausalLM: 4 layers (3 sliding-window, 1 global), hidden 64, 1 KV head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = gemma3_tokenizer()
    cfg = Gemma3TextConfig(vocab_size=_vocab(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=sliding_window,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(cfg)
    return model.eval(), tok


def tiny_qwen2(seed: int = 0):
    """A random-weight Qwen2ForCausalLM (Qwen2.5's architecture: q/k/v biases, GQA, tied embeddings): 4 layers,
    hidden 64, over the Qwen2.5 id layout (151,936 embedding rows, as the Qwen2.5-Coder GGUF has)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = qwen25_tokenizer(size=151936)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=151645, pad_token_id=151643)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.eval(), tok
