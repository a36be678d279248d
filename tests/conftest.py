"""Shared test setup: offline, single-threaded torch so parallel helpers and CI stay predictable."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers: one torch thread each, no oversubscription
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def synth_processed(base, cases: int, seed: int):
    """A processed dir of `cases` known-posterior cases (generator seed `seed`, split seed 0)."""
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.synth import generate

    write_jsonl(base / "synth.jsonl", generate(cases, seed=seed))
    prepare([base / "synth.jsonl"], base / "processed", seed=0)
    return base / "processed"
