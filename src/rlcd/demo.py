"""`make demo`: the whole chain offline on the embedded default, in a few minutes on 2 CPU cores.

Known-posterior synthetic cases + a small easy-vqa subset -> isolated splits -> train the random
`tiny` Qwen3.5 preset -> calibrate -> evaluate -> report. The demo's budget (DEMO_RECIPE) is the
recipe with fewer updates and a proportionally denser evaluation/checkpoint cadence; every value
is recorded in the run's config.json.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from rlcd.recipe import Recipe

DEMO_MODEL = "tiny"
DEMO_STEPS = 600
DEMO_CASES = 600
DEMO_EASY_VQA = 1200


def demo_recipe(steps: int = DEMO_STEPS) -> Recipe:
    """The recipe at demo scale: one micro-batch per update and a 10x head LR.

    A random-weight tiny backbone on 2 CPU cores gets a few hundred updates; measured in
    QWEN35-NOTES.md, the frozen random tiny model learns in that budget with head LR 5e-3 and
    per-micro-batch updates, and stays at its initial accuracy with the full-scale head LR 5e-4
    and 4x accumulation over 160 updates (a demo run showed dev macro 0.42 -> 0.25).
    """
    every = max(1, steps // 4)
    return Recipe(steps=steps, grad_accum=1, lr_head=5e-3, eval_every=every, checkpoint_every=every,
                  log_every=max(1, steps // 40), diagnostics_every=max(1, steps // 8))


def demo_data(out_dir: Path, seed: int = 0, n_cases: int = 400, easy_vqa_limit: int = 400) -> dict:
    """Synth cases + a small easy-vqa subset, prepared into `<out_dir>/processed`; returns the manifest."""
    from rlcd.data import importers, synth
    from rlcd.data.io import excluded_path, write_jsonl
    from rlcd.data.prepare import prepare

    out_dir = Path(out_dir)
    raw = out_dir / "raw"
    write_jsonl(raw / "synth.jsonl", synth.generate(n_cases, seed))
    records, excluded = importers.import_easy_vqa(raw, limit=easy_vqa_limit)
    write_jsonl(raw / "easy-vqa.jsonl", records)
    write_jsonl(excluded_path(raw / "easy-vqa.jsonl"), excluded)
    return prepare([raw / "synth.jsonl", raw / "easy-vqa.jsonl"], out_dir / "processed", seed=seed)


def run_demo(out: Path, *, steps: int | None = None, cases: int = DEMO_CASES, easy_vqa: int = DEMO_EASY_VQA,
             placement: Any = None) -> dict:
    from rlcd.data.summary import print_manifest
    from rlcd.device import resolve_placement
    from rlcd.evaluate import evaluate_run
    from rlcd.report import format_summary
    from rlcd.train import train

    out = Path(out)
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print(f"[1/4] data: {cases} known-posterior cases + {easy_vqa} easy-vqa questions -> {out / 'processed'}")
    manifest = demo_data(out, seed=0, n_cases=cases, easy_vqa_limit=easy_vqa)
    print_manifest(manifest)
    recipe = demo_recipe(steps or DEMO_STEPS)
    print(f"[2/4] train: preset {DEMO_MODEL!r}, {recipe.steps} updates x {recipe.batch_size * recipe.grad_accum} "
          f"examples, objective {recipe.objective} (sigma {recipe.sigma}, ce_weight {recipe.ce_weight})")
    run = out / "run"
    placement = placement or resolve_placement("auto")
    train(run, data_dir=out / "processed", model=DEMO_MODEL, recipe=recipe, device=placement.device,
          dtype=placement.dtype)
    print("[3/4] calibrate + evaluate (merged best checkpoint)")
    ev = evaluate_run(run, placement=placement, print_fn=print)
    print("[4/4] summary")
    print(format_summary(ev))
    print(f"report: {run / 'eval' / 'report.md'}")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return ev
