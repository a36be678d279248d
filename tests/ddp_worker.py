"""Worker for the DDP tests, launched by torchrun (2 gloo ranks) or plainly (1 process).

`grads DATA OUT [BATCH_BY]`: first-update gradients of an update of 8 micro-batches (8 // world per
rank; `BATCH_BY` the recipe's `batch_by`, default row, or `head-only`: a head-only run on the feature cache, or
`cut`: LoRA on the top 2 layers over the cut-state cache), saved by rank 0 as OUT/grads-world{N}.pt.
`train DATA RUN`: a 3-update run with the recipe's batch (8 x 4 examples per update, whatever the
world size).

The tests run the one-process reference in their own process (`grads(...)`, `run(...)`): one interpreter start
fewer per test.
"""

import sys
from pathlib import Path

import torch

from rlcd.recipe import Recipe
from rlcd.train import (build_session, exit_torchrun_rank, finish_distributed, init_centring, init_distributed,
                        new_run, train)


def grads(data_dir: Path, out: Path, batch_by: str = "row") -> None:
    _first_update_grads(init_distributed(), data_dir, out, batch_by)  # its session (and DDP) is released here
    finish_distributed()  # no rank exits with its gloo group alive (an abort at exit, pytorch#190489)


def _first_update_grads(d, data_dir: Path, out: Path, batch_by: str) -> None:
    recipe = (Recipe(steps=10, grad_accum=8, head_only=True) if batch_by == "head-only"
              else Recipe(steps=10, grad_accum=8, lora_layers=2) if batch_by == "cut"
              else Recipe(steps=10, grad_accum=8, batch_by=batch_by))
    config, samples = new_run(out / "unused", data_dir, "tiny-toy", recipe, world_size=d.world)
    s = build_session(config, samples, d)
    init_centring(s)
    s.set_lr(0)
    s.accumulate(0)
    if d.main:
        torch.save({n: p.grad.detach().clone() for n, p in s.model.named_parameters() if p.grad is not None},
                   out / f"grads-world{d.world}.pt")


def run(data_dir: Path, run_dir: Path) -> None:
    recipe = Recipe(steps=3, eval_every=2, checkpoint_every=1, log_every=1, diagnostics_every=2)
    train(run_dir, data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False)
    import torch.distributed as dist

    # train() ends the process group it joined: no rank exits with a live gloo group (pytorch#190489)
    print(f"group after train: {'alive' if dist.is_initialized() else 'ended'}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, data, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    grads(data, out, *sys.argv[4:5]) if mode == "grads" else run(data, out)
    exit_torchrun_rank(0)  # as `rlcd train` does: finalization, where gloo can still abort a rank, is skipped
