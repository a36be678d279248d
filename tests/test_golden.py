"""Golden numbers: the first 10 training losses of a tiny-toy run, pinned.

Invariant tests (resume equals uninterrupted, DDP equals one process) cannot see a change that
moves every run alike; these numbers can. They were produced by the code before the second-wave
refactor (run, model builder, DDP batch) and must not move unless the recipe's numerics are meant
to change. Regenerate (and review the diff) with:

    .venv/bin/python tests/test_golden.py

which prints the GOLDEN table below from a fresh run.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from conftest import synth_processed  # noqa: E402

# (step, loss, ce_loss) of updates 1..10: synth 40 cases (seed 11), tiny-toy, Recipe(steps=10, lr_head=5e-3)
GOLDEN: list[tuple[int, float, float]] = [
    (1, 0.7391447722911835, 1.1726419627666473),
    (2, 1.3017665445804596, 1.3094084560871124),
    (3, 0.9991519600152969, 1.3301197290420532),
    (4, 0.9152961820363998, 1.1470085382461548),
    (5, 1.2607347667217255, 1.1530274152755737),
    (6, 1.028667613863945, 1.3014413565397263),
    (7, 0.9122758060693741, 1.1901676654815674),
    (8, 1.0975039303302765, 1.2113181352615356),
    (9, 0.8526718020439148, 1.2691683918237686),
    (10, 0.96371129155159, 1.1293213367462158),
]


def golden_run(tmp: Path) -> list[tuple[int, float, float]]:
    from rlcd.recipe import Recipe
    from rlcd.train import train

    torch.set_num_threads(1)
    data = synth_processed(tmp, 40, seed=11)
    recipe = Recipe(steps=10, lr_head=5e-3, log_every=1, eval_every=5, checkpoint_every=5, diagnostics_every=5)
    train(tmp / "run", data_dir=data, model="tiny-toy", recipe=recipe, progress=False)
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce_loss"]) for r in rows if r["event"] == "train"]


def test_first_ten_losses_are_pinned(tmp_path):
    got = golden_run(tmp_path)
    assert [s for s, _, _ in got] == list(range(1, 11))
    torch.testing.assert_close(torch.tensor([[l, c] for _, l, c in got], dtype=torch.float64),
                               torch.tensor([[l, c] for _, l, c in GOLDEN], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        rows = golden_run(Path(d))
    print("GOLDEN: list[tuple[int, float, float]] = [")
    for s, l, c in rows:
        print(f"    ({s}, {l!r}, {c!r}),")
    print("]")
