"""What the up-front render check (`rlcd.row_check`) costs at the start of `rlcd train`.

Run: PYTHONPATH=src python benchmarks/row_check_cost.py [--cases 1000] [--model smollm2-135m] [--json OUT.json]

Prepares `--cases` synth cases (six questions each) into a temporary directory, loads the backbone's prompt
encoder as training builds it, and times, over the rows training checks (the train pool + the dev subset of
the pinned recipe): the check as `train/setup.py:check_rows` runs it (each case's state tokenised once, its
questions on the shared prefix ids), and the naive pass (`encoder.encode` per row, the state tokenised again for
every question). Prints one JSON object; seconds are wall time of one pass after one warm-up pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from rlcd.data.io import load_split, write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.sampling import dev_subset, eligible_pool
    from rlcd.recipe import Recipe
    from rlcd.row_check import RowCheck
    from rlcd.data.synth import generate

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_jsonl(tmp / "synth.jsonl", generate(args.cases, seed=0))
        prepare([tmp / "synth.jsonl"], tmp / "data")
        train, dev = load_split(tmp / "data", "train"), load_split(tmp / "data", "dev")
    r = Recipe()
    by_id = {x.id: x for x in train + dev}
    rows = [by_id[i] for ids in eligible_pool(train, cap=r.pool_cap).values() for i in ids]
    rows += [by_id[i] for ids in dev_subset(dev, cap=r.dev_cap).values() for i in ids]

    t0 = time.perf_counter()
    check = RowCheck.for_backbone(args.model)
    load_s = time.perf_counter() - t0

    def shared() -> int:
        return len(RowCheck(check.encoder, check.image_processor).problems(rows))  # a fresh prefix memo each pass

    def naive() -> int:
        for rec in rows:
            check.encoder.encode(rec.state, rec.question, row=rec.id)
        return 0

    out = {"model": args.model, "cases": args.cases, "rows": len(rows), "backbone_load_s": round(load_s, 2)}
    for name, fn in (("shared_prefix", shared), ("per_row_encode", naive)):
        fn()
        t = time.perf_counter()
        found = fn()
        out[f"{name}_s"] = round(time.perf_counter() - t, 3)
        out[f"{name}_problems"] = found
    out["tokens_max"] = max(len(check.encoder.encode(x.state, x.question)) for x in rows)
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
