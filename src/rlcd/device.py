"""The device policy: one function decides where a model runs and in which dtype.

Every command that runs a model (train, evaluate, calibrate, predict, serve, probe, bench) takes
`--device auto|cpu|cuda|cuda:N` and `--dtype auto|float32|bfloat16` and passes them here.
`auto` means CUDA with a bfloat16 backbone when a GPU is visible, else the CPU in float32; the
candidate scorer always stays float32 (`DecisionModel` keeps its head in FP32 whatever the
backbone dtype). The resolved placement is recorded in every output (evaluation.json meta,
/v1/models, bench JSON), so a number always says where it was measured. torch is imported lazily:
`rlcd --help` must not pay for it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from rlcd.errors import DeviceError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
_CUDA_N = re.compile(r"cuda:(\d+)")


@dataclass(frozen=True)
class Placement:
    """A resolved (device, dtype) pair, e.g. ("cuda:0", "bfloat16") or ("cpu", "float32")."""

    device: str
    dtype: str

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict[str, str]:
        return {"device": self.device, "dtype": self.dtype}

    def __str__(self) -> str:
        return f"{self.device} {self.dtype}"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(device: str | None = "auto", dtype: str | None = "auto", *,
                      local_rank: int | None = None) -> Placement:
    """`--device` / `--dtype` -> a Placement, or a one-line `DeviceError` naming the fix.

    `local_rank` (under torchrun) maps `auto` and `cuda` to `cuda:<local_rank>`.
    """
    device = (device or "auto").strip().lower()
    dtype = (dtype or "auto").strip().lower()
    if dtype not in DTYPE_CHOICES:
        raise DeviceError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if device not in ("auto", "cpu", "cuda") and not _CUDA_N.fullmatch(device):
        raise DeviceError(f"--device {device!r} is not one of auto, cpu, cuda, cuda:N (N a GPU index)")
    n = _cuda_count() if device != "cpu" else 0
    if device == "auto":
        device = "cuda" if n else "cpu"
    if device.startswith("cuda"):
        if n == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise DeviceError(f"--device {device}: no CUDA device is visible on this machine{hint}; "
                              "use --device cpu (or auto)")
        if device == "cuda":
            device = f"cuda:{local_rank if local_rank is not None else 0}"
        index = int(device.split(":")[1])
        if index >= n:
            raise DeviceError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return Placement(device, dtype)


def describe(placement: Placement) -> str:
    """One line for logs: `device cuda:0 (NVIDIA H200), backbone bfloat16, scorer float32`."""
    name = ""
    if placement.is_cuda:
        import torch

        name = f" ({torch.cuda.get_device_name(placement.torch_device)})"
    return f"device {placement.device}{name}, backbone {placement.dtype}, scorer float32"
