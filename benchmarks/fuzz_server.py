"""Schema-driven fuzzing of `rlcd serve`, long: about `--requests` generated requests and a JSON summary.

Run: PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/fuzz_server.py --requests 10000 \\
         --json benchmarks/results/fuzz-server.json

The bounded test `tests/test_fuzz_server.py`, longer: the tiny export of `tests/_tiny_export.py` (random weights, no
training) served by two `rlcd serve` processes on 127.0.0.1, one with an API key (through RLCD_API_KEY) and one
without; schemathesis with the checks of `tests/_schema_fuzz.py` -- its coverage phase once per server, then fuzzing
rounds with seeds 0, 1, 2, ... (`--examples` generated requests per operation and round), the servers in turn, each
round followed by `--examples // 4` bodies with generated encodings and content types (`fuzz_encodings`) -- until
`--requests` requests were sent or `--max-minutes` passed (checked between rounds; every request has a 60 s
timeout). Written (`rlcd.bench.report.save_result`): requests, operations, status counts, 5xx, the distinct
failures (check, operation, status, a curl line that reproduces it), and what each server's health check said at
the end (`/health`, a known-good request, no traceback or 5xx line in its log). Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny export and the fuzz driver the test uses

KEY = "fuzz-key-Q7x.9_k"
ENCODINGS = "POST /v1/systemone (encodings)"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000, help="stop after this many requests (between rounds)")
    ap.add_argument("--examples", type=int, default=400, help="generated requests per operation and round")
    ap.add_argument("--max-minutes", type=float, default=30.0, help="start no round after this long")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here (rlcd.bench.report format)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from _schema_fuzz import fuzz, fuzz_encodings, report, start_server
    from _tiny_export import make_tiny_export

    t0 = time.monotonic()
    statuses: collections.Counter = collections.Counter()
    by_operation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    operations: set[str] = set()
    failures: dict[tuple, dict] = {}
    errors: list[str] = []
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rlcd-fuzz-") as tmp:
        run = make_tiny_export(Path(tmp) / "tiny-run")
        servers = {"key": start_server(run, api_key=KEY, log_dir=tmp), "open": start_server(run, log_dir=tmp)}
        try:
            for s in servers.values():
                s.wait()
            seed, sent = 0, 0
            while sent < args.requests and time.monotonic() - t0 < 60 * args.max_minutes:
                for name, server in servers.items():
                    phases = ("coverage", "fuzzing") if seed == 0 else ("fuzzing",)
                    s = fuzz(server.url, api_key=server.api_key, max_examples=args.examples, seed=seed, phases=phases)
                    raw = fuzz_encodings(server.url, api_key=server.api_key, max_examples=args.examples // 4, seed=seed)
                    raw["status_counts_by_operation"] = {ENCODINGS: raw["status_counts"]}
                    for part, what in ((s, "schemathesis: " + "+".join(phases)), (raw, "encodings")):
                        sent += part["requests"]
                        statuses.update(part["status_counts"])
                        operations.update(part.get("operations", ()))  # the document's operations
                        for op, counts in part["status_counts_by_operation"].items():
                            by_operation[op].update(counts)
                        errors += part["errors"]
                        for f in part["failures"]:
                            failures.setdefault((f["code"], f["operation"], f["title"], f["status"]),
                                                {**f, "server": name})
                        rounds.append({"server": name, "seed": seed, "what": what, "requests": part["requests"],
                                       "c5xx": part["c5xx"], "failures": len(part["failures"]),
                                       "seconds": part["seconds"]})
                        print(f"seed={seed} server={name} {what}: {part['requests']} requests, {part['c5xx']} 5xx, "
                              f"{len(part['failures'])} failures, {part['seconds']} s (total {sent})", flush=True)
                        if part["failures"] or part["errors"]:
                            print(report(part), flush=True)
                seed += 1
            problems = {name: s.problems() for name, s in servers.items()}
        finally:
            for s in servers.values():
                s.stop()
    results = {
        "requests": sum(statuses.values()), "operations": sorted(operations),
        "status_counts": dict(sorted(statuses.items())),
        "status_counts_by_operation": {op: dict(sorted(c.items())) for op, c in sorted(by_operation.items())},
        "c5xx": sum(v for k, v in statuses.items() if k.isdigit() and int(k) >= 500),
        "distinct_failures": len(failures), "failures": list(failures.values()), "errors": errors,
        "server_problems": problems, "rounds": seed, "examples_per_operation_and_round": args.examples,
        "per_round": rounds, "seconds": round(time.monotonic() - t0, 1),
        "schemathesis": metadata.version("schemathesis"), "hypothesis": metadata.version("hypothesis")}
    print(f"fuzz-server: requests={results['requests']} operations={len(operations)} c5xx={results['c5xx']} "
          f"distinct_failures={len(failures)} errors={len(errors)} "
          f"server_problems={sum(map(len, problems.values()))} seconds={results['seconds']}", flush=True)
    if args.json is not None:
        from rlcd.bench.report import save_result

        command = shlex.join(["python", "benchmarks/fuzz_server.py", *(sys.argv[1:] if argv is None else argv)])
        save_result("fuzz-server", "PYTHONPATH=src OMP_NUM_THREADS=1 " + command, results, path=args.json)
    return results


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["distinct_failures"] or out["c5xx"] or out["errors"]
             or any(out["server_problems"].values()) else 0)
