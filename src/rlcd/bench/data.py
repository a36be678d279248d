"""`rlcd bench data`: how fast the data layer turns cases into prepared splits (rows/s).

Times `mixed_data` (synthetic cases + easy-vqa import + `prepare`) and the sampler's
`microbatch` in one run; the last line is machine-readable:

    data: prepare_rows_per_s=... demo_data_s=... sampler_rows_per_s=...
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

SAMPLER_ROWS_TARGET = 100_000.0


def mixed_data(out_dir: Path, seed: int, n_cases: int, easy_vqa_limit: int) -> dict:
    """Synth cases + an easy-vqa subset (images written) prepared together into `<out_dir>/processed`: what
    the data bench times (import, validation, isolation, splits, writing)."""
    from rlcd.data import synth
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.demo import write_easy_vqa

    raw = Path(out_dir) / "raw"
    write_jsonl(raw / "synth.jsonl", synth.generate(n_cases, seed))
    return prepare([raw / "synth.jsonl", write_easy_vqa(raw, easy_vqa_limit)], Path(out_dir) / "processed", seed=seed)


def run_data_bench(cases: int = 400, easy_vqa: int = 400, seed: int = 0, sampler_calls: int = 20_000,
                   print_fn: Callable[[str], None] | None = print) -> dict[str, Any]:
    from rlcd.bench.train import sampler_bench
    from rlcd.data.io import load_split
    from rlcd.data.sampling import eligible_pool
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-data-") as tmp:
        t0 = time.perf_counter()
        manifest = mixed_data(Path(tmp), seed=seed, n_cases=cases, easy_vqa_limit=easy_vqa)
        wall = time.perf_counter() - t0
        pool = eligible_pool(load_split(Path(tmp) / "processed", "train"))
    samp = sampler_bench(pool, calls=sampler_calls, seed=seed)
    res = {"cases": cases, "easy_vqa": easy_vqa, "seed": seed, "rows_read": manifest["read"],
           "rows_used": manifest["used"], "demo_data_s": wall, "prepare_rows_per_s": manifest["read"] / wall,
           "sampler": samp, "sampler_rows_per_s": samp["rows_per_s"],
           "sampler_pass": samp["rows_per_s"] > SAMPLER_ROWS_TARGET}
    if print_fn is not None:
        print_fn(f"demo_data: {manifest['read']} rows read, {manifest['used']} used in {wall:.2f} s")
        print_fn(f"{'PASS' if res['sampler_pass'] else 'FAIL'} sampler {samp['rows_per_s']:.0f} rows/s "
                 f"(target > {SAMPLER_ROWS_TARGET:,.0f})")
        print_fn(f"data: prepare_rows_per_s={res['prepare_rows_per_s']:.0f} demo_data_s={wall:.2f} "
                 f"sampler_rows_per_s={samp['rows_per_s']:.0f}")
    return res
