"""`rlcd demo`: the whole chain offline on the embedded default (what `make demo` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, placement


def demo(out: Annotated[Path, typer.Option(help="demo output directory (replaced)")] = Path("runs/demo"),
         steps: Annotated[Optional[int], typer.Option(min=1, help="override the demo's training budget")] = None,
         device: DeviceOpt = "auto",
         dtype: DTypeOpt = DType.auto) -> None:
    """Data, splits, train tiny, calibrate, evaluate, report: offline, a few minutes on a CPU."""
    from rlcd.demo import run_demo

    run_demo(out, steps=steps, placement=placement(device, dtype))
