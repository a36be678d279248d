"""Options and helpers shared by the command modules (torch-free)."""

from __future__ import annotations

import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

DEVICE_HELP = "where the model runs: auto (CUDA when visible, else CPU), cpu, cuda, cuda:N"
DTYPE_HELP = ("backbone dtype (the scorer stays float32): auto = bfloat16 on CUDA, float32 on CPU (serving a run: "
              "bfloat16 when the CPU has bf16 units and `rlcd export RUN --precision bfloat16` passed)")


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


DeviceOpt = Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda|cuda:N", help=DEVICE_HELP)]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help=DTYPE_HELP)]
RunArg = Annotated[Optional[Path], typer.Argument(metavar="RUN", help="run directory", show_default=False)]
RunAlias = Annotated[Optional[Path], typer.Option("--run", help="the run directory (alias of RUN)",
                                                   show_default=False)]

MAX_ORDER_VOTES = 8  # rlcd.order_votes.MAX_VOTES, spelled here so --help imports nothing of it
class VoteCombine(str, Enum):
    """How order votes combine the orders' answers (rlcd.order_votes.COMBINES)."""

    logmean = "logmean"
    mean = "mean"


VoteCombineOpt = Annotated[VoteCombine, typer.Option(
    help="how --order-votes combines the orders: logmean (the normalised mean of log-probabilities, PriDe: cancels "
         "an additive position bias) or mean (the mean probability)")]
OrderVotesOpt = Annotated[int, typer.Option(
    "--order-votes", metavar="N", help=f"ask each choice question in N option orders (1..{MAX_ORDER_VOTES}; 1 = "
                                       "off), combined by --vote-combine; each extra order is one more "
                                       "suffix on the shared state (docs/SERVING.md)")]


def check_order_votes(n: int) -> int:
    """--order-votes outside 1..MAX_ORDER_VOTES is one line and exit 2 (before anything loads)."""
    from rlcd.errors import OptionError

    if not 1 <= n <= MAX_ORDER_VOTES:
        raise OptionError(f"--order-votes {n}: give a whole number from 1 (no votes) to {MAX_ORDER_VOTES} "
                          "(the orders each choice question is asked in)")
    return n


def placement(device: str, dtype: DType | str, *, run: Path | None = None, attention: str = "sdpa") -> Any:
    """The device policy (`rlcd.device.resolve_placement`); a bad value is a one-line DeviceError. `run`: the run
    served (its bf16 parity record lets `auto` choose bfloat16 on a CPU with bf16 units); `attention`: --attention."""
    from rlcd.device import resolve_placement

    return resolve_placement(device, dtype.value if isinstance(dtype, DType) else dtype, run=run, attention=attention)


AttentionOpt = Annotated[str, typer.Option(
    "--attention", metavar="KERNEL", help="the decoder's attention kernel: sdpa (fastest) or eager (a request "
                                          "scored beside others, as the batch job and the batching server pack "
                                          "them, gets its lone answer to ~1e-7 instead of ~1e-5; slower on long "
                                          "states: docs/SERVING.md)")]


def run_path(arg: Optional[Path], alias: Optional[Path], *, what: str = "RUN") -> Path:
    """RUN given positionally or as --run (both: they must agree)."""
    if arg is not None and alias is not None and Path(arg) != Path(alias):
        raise typer.BadParameter(f"{what} given twice ({arg} and --run {alias}); give it once")
    path = arg if arg is not None else alias
    if path is None:
        raise typer.BadParameter(f"missing {what}: the run directory (e.g. runs/a)")
    return Path(path)


def is_main_process() -> bool:
    """False on the ranks > 0 of a torchrun launch (RANK set by torchrun), whose results rank 0 prints."""
    import os

    return int(os.environ.get("RANK", "0") or 0) == 0


def echo_json(obj: Any) -> None:
    import json

    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


class _StderrHandler(logging.Handler):
    """Writes each record to the *current* sys.stderr (a test runner swaps it for every command)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end a command
            self.handleError(record)


def show_status() -> None:
    """Show the library's INFO messages (what model is loaded, from where) on stderr, stdout staying the result.

    Library code logs to the `rlcd` loggers and prints nothing on its own; the CLI turns them on here, once.
    Under torchrun only rank 0 tells (the other ranks load the same model): they show warnings alone.
    """
    logger = logging.getLogger("rlcd")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)


def quiet_progress_bars() -> None:
    """No transformers / hub tqdm bars (`Writing model shards`, `Loading weights`) when stderr is not a terminal:
    in a pipe or a log they are carriage-return noise between rlcd's own progress lines. Set before either
    library is imported (huggingface_hub reads it once); an explicit HF_HUB_DISABLE_PROGRESS_BARS wins."""
    import os

    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
