"""The device policy: one function decides where a model runs and in which dtype.

Every command that runs a model (train, evaluate, calibrate, predict, serve, probe, bench) takes
`--device auto|cpu|cuda|cuda:N` and `--dtype auto|float32|bfloat16` and passes them here.
`auto` means CUDA with a bfloat16 backbone when a GPU is visible, else the CPU in float32; the
candidate scorer always stays float32 (`DecisionModel` keeps its head in FP32 whatever the
backbone dtype). The resolved placement is recorded in every output (evaluation.json meta,
/v1/models, bench JSON), so a number always says where it was measured. torch is imported lazily:
`rlcd --help` must not pay for it.

**bfloat16 on the CPU.** `--dtype bfloat16` runs a CPU backbone in bf16 whatever the CPU. `auto` on
the CPU picks bf16 only for a run given as `run=` (serving, predicting) when both hold: the CPU has
bf16 units (`cpu_bf16_units`: AMX-BF16 or AVX512-BF16 on x86, FEAT_BF16 on arm64; without them bf16
matmuls are emulated, measured 6x slower than fp32 on AVX2), and the run's bf16 parity record
(`rlcd export RUN --precision bfloat16`, `rlcd.precision`) exists, matches its export and passed.
Otherwise float32; the reason is the Placement's `reason` (the startup line, /v1/models).

**Attention.** `--attention sdpa|eager` (predict, serve, the batch job) picks the decoder's attention kernel for
inference (`apply_attention`, on the inference loads: `load_export`, `load_checkpoint_model`). `sdpa` (the default)
is torch's fused kernel: its blocking over keys follows the padded length, so a state scored beside others
(left-padded to their width) differs from the same state alone by float noise. `eager` (matmul, masked softmax,
matmul) adds exact zeros for the padding, so padding no longer moves an answer; what is left is the noise of other
matrix shapes (a row's suffix batched with other rows, a full row against prefix + suffix). Its cost grows with
the state's length. Measured: docs/SERVING.md, `benchmarks/attention_parity.py`. Training and cut states keep sdpa.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcd.errors import DeviceError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
ATTENTION_CHOICES = ("sdpa", "eager")  # transformers' attn_implementation names
_CUDA_N = re.compile(r"cuda:(\d+)")


@dataclass(frozen=True)
class Placement:
    """A resolved (device, dtype) pair, e.g. ("cuda:0", "bfloat16") or ("cpu", "float32")."""

    device: str
    dtype: str
    reason: str = field(default="", compare=False)  # why `auto` chose this dtype (empty when asked for)
    attention: str = "sdpa"  # the decoder's attention kernel at inference (ATTENTION_CHOICES)

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
        return {"device": self.device, "dtype": self.dtype, **({"reason": self.reason} if self.reason else {}),
                **({"attention": self.attention} if self.attention != "sdpa" else {})}

    def __str__(self) -> str:
        return (f"{self.device} {self.dtype}" + (f" {self.attention} attention" if self.attention != "sdpa" else "")
                + (f" ({self.reason})" if self.reason else ""))


# x86: AMX-BF16 tiles or AVX512-BF16 (vdpbf16ps); arm64: FEAT_BF16 ("bf16" in /proc/cpuinfo Features)
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_bf16_units(cpuinfo: str | None = None) -> tuple[bool, str]:
    """(has bf16 units, what says so) for this machine's CPU.

    Reads the `flags` (x86) or `Features` (arm64) line of `cpuinfo` (default: /proc/cpuinfo); where there is
    none (not Linux), torch's own CPU probe (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`).
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags = set(value.split())
            found = [f for f in BF16_FLAGS if f in flags]
            if found:
                return True, f"the CPU has bf16 units ({', '.join(found)})"
            return False, "the CPU has no bf16 units (no amx_bf16 / avx512_bf16 / bf16 flag)"
    import torch

    probe = getattr(torch, "cpu", None)
    try:
        amx, avx = bool(probe._is_amx_tile_supported()), bool(probe._is_avx512_bf16_supported())
    except AttributeError:
        return False, "the CPU's bf16 units are unknown (no CPU flags, no torch probe)"
    if amx or avx:
        return True, f"the CPU has bf16 units ({'amx' if amx else 'avx512_bf16'}, torch's probe)"
    return False, "the CPU has no bf16 units (torch's probe)"


_said: set[str] = set()


def _say_once(msg: str) -> None:
    """An AVX2-only CPU staying float32 under `auto` is said once a process, not at every load."""
    if msg not in _said:
        _said.add(msg)
        import logging

        logging.getLogger(__name__).info("%s", msg)


def cpu_auto_dtype(run: str | Path | None) -> tuple[str, str]:
    """(dtype, reason) that `--dtype auto` means on the CPU for `run` (module docstring)."""
    if run is None:
        return "float32", ""
    units, why = cpu_bf16_units()
    if not units:
        reason = f"auto: float32, {why}"
        _say_once(f"device: {reason}; bfloat16 would be emulated (slower); --dtype bfloat16 forces it")
        return "float32", reason
    from rlcd.precision_record import parity_verdict

    ok, verdict = parity_verdict(run)
    if not ok:
        return "float32", f"auto: float32, {why} but {verdict}"
    return "bfloat16", f"auto: bfloat16, {why} and {verdict}"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(device: str | None = "auto", dtype: str | None = "auto", *,
                      local_rank: int | None = None, run: str | Path | None = None,
                      attention: str | None = "sdpa") -> Placement:
    """`--device` / `--dtype` -> a Placement, or a one-line `DeviceError` naming the fix.

    `local_rank` (under torchrun) maps `auto` and `cuda` to `cuda:<local_rank>`. `run`: the run (or export)
    a model is served from; with it `auto` on the CPU may mean bfloat16 (`cpu_auto_dtype`).
    """
    device = (device or "auto").strip().lower()
    dtype = (dtype or "auto").strip().lower()
    attention = (attention or "sdpa").strip().lower()
    if attention not in ATTENTION_CHOICES:
        raise DeviceError(f"--attention {attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
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
    reason = ""
    if dtype == "auto":
        if device.startswith("cuda"):
            dtype = "bfloat16"
        else:
            dtype, reason = cpu_auto_dtype(run)
    return Placement(device, dtype, reason, attention)


def apply_attention(model: Any, placement: Placement) -> None:
    """Set `placement.attention` on a DecisionModel's decoder (every sub-model of it: transformers'
    `set_attn_implementation`). Numbers, not weights, change: see the module's note. The default (`sdpa`) leaves the
    decoder as it was loaded: transformers' own choice per sub-model (sdpa where it has one), so a default load
    answers exactly as before this option existed."""
    if placement.attention == "sdpa":
        return
    backbone = getattr(model, "backbone", model)
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(placement.attention)
    else:
        raise DeviceError(f"--attention {placement.attention}: this backbone ({type(base).__name__}) cannot switch "
                          "its attention kernel")


def describe(placement: Placement) -> str:
    """One line for logs: `device cuda:0 (NVIDIA H200), backbone bfloat16, scorer float32`."""
    name = ""
    if placement.is_cuda:
        import torch

        name = f" ({torch.cuda.get_device_name(placement.torch_device)})"
    why = f" ({placement.reason})" if placement.reason else ""
    return f"device {placement.device}{name}, backbone {placement.dtype}, scorer float32{why}"
