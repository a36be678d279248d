"""Sanity check of the text-decoder family's learning: tiny-llama at hidden 256 (the tiny Qwen3.5
preset's width) with the same demo-scale recipe as the tiny check; dev curve only.

    OMP_NUM_THREADS=1 PYTHONPATH=src python docs/experiments/real-weights/check_llama256.py runs/rw/check-tiny-llama256-demo

(The CLI has no --hidden for train, so the backbone is handed to `train`; the run's config says
tiny-llama, whose preset is hidden 64: use the run for its dev curve only, not to evaluate.)
"""
import sys
from pathlib import Path
from rlcd.model.backbone import load_backbone
from rlcd.recipe import Recipe
from rlcd.train import train
out = Path(sys.argv[1])
recipe = Recipe(steps=600, grad_accum=1, lr_head=5e-3, eval_every=150, checkpoint_every=150, log_every=15,
                diagnostics_every=75, dev_cap=64)
train(out, data_dir=Path("runs/rw/processed"), model="tiny-llama", recipe=recipe, device="cpu",
      backbone=load_backbone("tiny-llama", hidden=256), progress=False)
