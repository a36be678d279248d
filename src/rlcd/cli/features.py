"""`rlcd features DATA --model M`: precompute the frozen-feature cache that head-only runs share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, echo_json


def features(
    data: Annotated[Path, typer.Argument(metavar="DATA", help="processed data directory (rlcd data prepare)",
                                         show_default=False)],
    model: Annotated[str, typer.Option(help="backbone: a preset, a local directory, a .gguf file or a hub id "
                                            "(as for rlcd train)")] = "qwen3.5-0.8b",
    model_seed: Annotated[int, typer.Option(help="seed of a random-weight preset (tiny, tiny-llama)")] = 0,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Extract (h_dec, h_cand) of every row of DATA's four splits with the frozen backbone, once.

    Every head-only run (`--recipe head_only=true`) and every head warm-up (`--recipe head_warmup=N`)
    over DATA with this backbone, prompt and dtype reuses the cache in DATA/features/KEY/; `train`
    builds it on first need too. Prints the cache directory and its counts (JSON) on stdout.
    """
    import time

    from rlcd.cli._common import placement as resolve
    from rlcd.features import ensure_features
    from rlcd.model.backbone import check_backbone_spec
    from rlcd.model.build import build_model
    from rlcd.progress import echo
    from rlcd.train import check_data_dir

    data_dir = check_data_dir(data, flag="DATA")
    check_backbone_spec(model)
    where = resolve(device, dtype)
    t0 = time.perf_counter()
    m = build_model({"model": model, "model_seed": model_seed, "recipe": {}}, device=where.torch_device,
                    dtype=where.torch_dtype)
    cache = ensure_features(m, data_dir, progress=True, say=echo)
    echo_json({"features": str(cache.root), "key_id": cache.manifest["key_id"], "entries": cache.manifest["splits"],
               "row_tokens": cache.manifest["row_tokens"], "extract_seconds": cache.manifest["seconds"],
               "seconds": round(time.perf_counter() - t0, 3)})
