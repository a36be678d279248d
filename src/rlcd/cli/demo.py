"""`rlcd demo`: the whole chain offline on the embedded default (what `make demo` runs; see rlcd.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt


def demo(out: Annotated[Path, typer.Option(help="demo output directory (replaced)")] = Path("runs/demo"),
         steps: Annotated[Optional[int], typer.Option(min=1, help="override the text model's training budget (updates)")] = None,
         cases: Annotated[Optional[int], typer.Option(min=10, help="known-posterior synth cases of the text part "
                                                      "(six questions each)")] = None,
         model: Annotated[str, typer.Option(help="the text backbone: a preset (default smollm2-135m; gemma3-270m "
                                            "after `make gemma`), a local directory or a .gguf file")] = "smollm2-135m",
         layers: Annotated[Optional[int], typer.Option(min=1, help="decoder layers the text backbone reads (its first "
                                                       "N, then its final norm; default 12 for smollm2-135m, "
                                                       "all for another --model)")] = None,
         device: DeviceOpt = "auto",
         dtype: DTypeOpt = DType.auto) -> None:
    """Real SmolLM2-135M features -> head-only training -> calibrate, evaluate, export, report, plus an
    image question on the tiny VLM: offline, under 5 minutes on a 2-core CPU."""
    from rlcd.demo import DEMO_CASES, demo_placement, run_demo

    run_demo(out, steps=steps, cases=cases or DEMO_CASES, placement=demo_placement(device, dtype.value), model=model,
             layers=layers)
