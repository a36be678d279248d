"""What DDP needs from the training code: the rank, the split of an update over ranks, reductions.

An update is always the recipe's global batch: A = grad_accum micro-batches of B examples, absolute
indices `[step*A, (step+1)*A)`, whatever the world size. Under `torchrun`, rank r of N takes the
contiguous block of A/N of them; each rank averages its loss over its A/N micro-batches and DDP averages
over ranks, so the gradient equals one process's (N must divide A; other N are refused with the options).
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlcd.errors import OptionError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def reduce(self):
        """`dist.all_reduce` under DDP (for sums kept on the device), else None."""
        return dist.all_reduce if self.active else None

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


_OWNED = {"group": False}  # whether init_distributed created the process group (so finish_distributed may end it)


def init_distributed() -> Dist:
    """Join the torchrun process group when launched by torchrun; a plain launch uses none."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        _OWNED["group"] = True
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local)


def finish_distributed(*, clean: bool = True) -> None:
    """End the process group init_distributed created (a caller's own group is left alone).

    Without it a gloo rank can abort at interpreter exit ("terminate called without an active exception",
    pytorch#190489: its worker threads outlive the interpreter). `clean`: every rank got here (barrier first, so
    no rank tears its group down while a peer still talks to it); a failing rank only destroys its own.

    Callers drop their DDP model first: DDP's reducer holds the group, and a group it keeps alive past
    `destroy_process_group` is torn down during interpreter finalization, the abort above (pytorch#179291).
    The `gc.collect()` frees such a model caught in a reference cycle."""
    if not (_OWNED["group"] and dist.is_initialized()):
        return
    gc.collect()
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    _OWNED["group"] = False


def exit_torchrun_rank(code: int = 0) -> None:
    """End a torchrun rank whose work is done and written: flush stdout/stderr, then `os._exit(code)`.

    Skips interpreter finalization, where gloo can still abort a rank after its group was ended ("terminate
    called without an active exception": seen twice in CI on finished 2-rank runs); torchrun would then report
    a complete run as failed. A plain (non-torchrun) process returns and exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def local_accum(grad_accum: int, world: int, batch_size: int = 8) -> int:
    """Micro-batches each of `world` ranks runs per update so that the update keeps the recipe's batch."""
    if world < 1 or grad_accum % world:
        ok = [n for n in range(1, grad_accum + 1) if grad_accum % n == 0]
        raise OptionError(
            f"{world} processes cannot share an update of {grad_accum} micro-batches of {batch_size} "
            f"(global batch {grad_accum * batch_size}): launch {', '.join(map(str, ok))} processes, or keep the "
            f"global batch with --recipe grad_accum=G --recipe batch_size=B where G is a multiple of {world} and "
            f"G x B = {grad_accum * batch_size}")
    return grad_accum // world


def micro_indices(step: int, *, accum: int, rank: int = 0, world: int = 1) -> list[int]:
    """Absolute micro-batch indices of update `step` for `rank`: its contiguous block of the A = `accum`
    indices `[step*A, (step+1)*A)` shared by all ranks (A/world each)."""
    per = local_accum(accum, world)
    base = step * accum + rank * per
    return list(range(base, base + per))


def reduce_stats(stats: dict[str, Any], d: Dist) -> dict[str, Any]:
    """Average float stats over ranks (rank 0 logs the mean)."""
    if not d.active:
        return stats
    keys = sorted(k for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    out = dict(stats)
    for k, v in zip(keys, (t / d.world).tolist()):
        out[k] = v if not k.startswith("_") else v * d.world  # token/example counts are sums
    return out


def broadcast_flag(value: bool, d: Dist) -> bool:
    """Rank 0's `value` on every rank (a decision only rank 0 can make, e.g. early stopping)."""
    if not d.active:
        return value
    flag = torch.tensor([1.0 if value else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.broadcast(flag, src=0)
    return bool(flag.item())
