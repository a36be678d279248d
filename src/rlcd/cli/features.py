"""`rlcd features DATA --model M [--cut K]`: precompute the frozen-feature cache that head-only runs share, or
the cut-state cache of top-K-layer LoRA runs (`--recipe lora_layers=K`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, echo_json


def features(
    data: Annotated[Path, typer.Argument(metavar="DATA", help="processed data directory (rlcd data prepare)",
                                         show_default=False)],
    model: Annotated[str, typer.Option(help="backbone: a preset, a local directory, a .gguf file or a hub id "
                                            "(as for rlcd train)")] = "qwen3.5-0.8b",
    model_seed: Annotated[int, typer.Option(help="seed of a random-weight preset (tiny, tiny-llama)")] = 0,
    cut: Annotated[Optional[int], typer.Option(
        "--cut", metavar="K", help="instead: the cut-state cache of runs with LoRA on the top K decoder layers "
                                   "(--recipe lora_layers=K): every token's hidden state below them")] = None,
    storage: Annotated[Optional[str], typer.Option(
        help="--cut: storage dtype of the states (float32 or bfloat16; default: the frozen precision)")] = None,
    frozen_precision: Annotated[str, typer.Option(
        "--frozen-precision", help="what the frozen layers compute in: float32, or bfloat16 (autocast; ~2x faster on a "
                                   "CPU with AVX512-BF16, ~1-2% per state) for runs with --recipe frozen_precision="
                                   "bfloat16; without --cut, features from a cut-state cache of that precision")] = "float32",
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Extract (h_dec, h_cand) of every row of DATA's four splits with the frozen backbone, once.

    Every head-only run (`--recipe head_only=true`) and every head warm-up (`--recipe head_warmup=N`)
    over DATA with this backbone, prompt and dtype reuses the cache in DATA/features/KEY/; `train`
    builds it on first need too (from a cut-state cache of the same backbone when DATA has one: only the
    layers above its cut run). With `--cut K`: the hidden states of every token entering the top K
    decoder layers, which every `--recipe lora_layers=K` run over DATA reuses (DATA/features/cut-KEY/).
    A killed extraction resumes: run the same command again (its finished chunks are in
    DATA/features/.partial-*). Prints the cache directory, its counts, size and time (JSON) on stdout.
    """
    import time

    from rlcd.cli._common import placement as resolve
    from rlcd.errors import OptionError
    from rlcd.features import ensure_features
    from rlcd.model.backbone import check_backbone_spec
    from rlcd.model.build import build_model
    from rlcd.progress import echo
    from rlcd.train import check_data_dir

    data_dir = check_data_dir(data, flag="DATA")
    check_backbone_spec(model)
    where = resolve(device, dtype)
    t0 = time.perf_counter()
    if cut is not None and cut < 1:
        raise typer.BadParameter(f"{cut}: K is the number of top decoder layers with LoRA, 1 or more", param_hint="--cut")
    if frozen_precision not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"{frozen_precision!r}: float32 or bfloat16", param_hint="--frozen-precision")
    if storage is None:
        storage = frozen_precision
    if storage not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"{storage!r}: float32 or bfloat16", param_hint="--storage")
    if frozen_precision == "bfloat16" and storage != "bfloat16":
        raise typer.BadParameter("states computed in bfloat16 are stored in bfloat16 (float32 would hold no more)",
                                 param_hint="--storage")
    try:
        m = build_model({"model": model, "model_seed": model_seed, "recipe": {"lora_layers": cut}},
                        device=where.torch_device, dtype=where.torch_dtype)
    except OptionError as e:  # the layer count is known only once the backbone is built: say it of --cut
        raise OptionError(str(e).replace(f"lora_layers={cut}", f"--cut {cut}", 1)) from None
    if cut is not None:
        from rlcd.cut_cache import ensure_cut_states

        cs = ensure_cut_states(m, data_dir, storage=storage, progress=True, say=echo, precision=frozen_precision)
        mf = cs.manifest
        echo_json({"cut_states": str(cs.root), "key_id": mf["key_id"], "cut_layer": m.cut_layer,
                   "layers": m.num_layers, "entries": {s: v["entries"] for s, v in mf["splits"].items()},
                   "stored_tokens": mf["stored_tokens"], "row_tokens": mf["row_tokens"], "bytes": mf["bytes"],
                   "storage": mf["storage"], "precision": mf.get("precision", "float32"), "extract_seconds": mf["seconds"], "attempts": mf.get("attempts", 1),
                   "seconds": round(time.perf_counter() - t0, 3)})
        return
    from rlcd.cut_cache import find_cut_states

    # on a miss, from a cut-state cache of this backbone when DATA has one: the top layers only
    cache = ensure_features(m, data_dir, progress=True, say=echo, precision=frozen_precision,
                            cut_states=lambda: find_cut_states(m, data_dir, any_cut=True, precision=frozen_precision))
    echo_json({"features": str(cache.root), "key_id": cache.manifest["key_id"], "entries": cache.manifest["splits"],
               "row_tokens": cache.manifest["row_tokens"], "extract_seconds": cache.manifest["seconds"],
               "attempts": cache.manifest.get("attempts", 1),
               # a cache made from cut states ran only the layers above the cut: its extract_seconds are not a
               # whole backbone pass (the cut states' own seconds are in their manifest)
               "from_cut_states": cache.key.get("from_cut_states"),
               "precision": cache.key.get("precision", "float32"),
               "seconds": round(time.perf_counter() - t0, 3)})
