"""Order votes: the mean of log-probabilities (logmean, PriDe) against the mean of probabilities, on a run's test split.

    OMP_NUM_THREADS=1 python benchmarks/vote_combine.py RUN [--votes 2,4] [--json benchmarks/results/vote-combine-demo.json]

RUN is copied (with its processed data, which `rlcd evaluate` records a test look beside) into a scratch directory;
the copy is evaluated with `--order-votes N --vote-combine C` for every N and C (`rlcd.evaluate.evaluate_run`,
temperatures fitted on the voted calibration split, as `rlcd evaluate` does), and probed with `rlcd probe order`
(`rlcd.analysis.probes.probe_order_run`: flip rate of the top answer over the other option orders, with its 95%
case-bootstrap interval). Reported for choice rows (votes touch nothing else): calibrated NLL and accuracy with the
evaluation's 95% intervals, and the paired NLL difference logmean - mean per N with its 95% case-bootstrap interval
(`rlcd.bootstrap.bootstrap_means`, the evaluation's resampling unit). Writes one bench result (`save_result`).

The two combinations score the same rows (they differ only in how the orders' logits are averaged), so every row's
logits are computed once: `memo_rows` keeps them by the row's token ids and image, and a later call scores only the
rows it has not seen (on the same prefix). `--probe-limit N` probes the first N choice rows only (the probe asks
every row in up to 8 orders, each voted: its cost is rows x orders x N). `--json` is rewritten as each arm ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np


def _row_nll(row: dict, t: float) -> float:
    z = np.asarray(row["logits"], dtype=np.float64) / t
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    return float(-(np.asarray(row["target"], dtype=np.float64) * logp).sum())


def _error(message: str) -> int:
    """A mistake on the command line: one line on stderr, exit status 2, nothing written."""
    print(f"vote_combine.py: error: {message}", file=sys.stderr)
    return 2


@contextmanager
def memo_rows():
    """`CaseRunner.score_cases` with its rows' logits kept: a row met again (same token ids, same image) is not
    scored again; a case's unseen rows are scored together on its prefix. Yields the counters {scored, reused}."""
    import dataclasses

    from rlcd.model.runner import CaseRunner

    original, memo, counts = CaseRunner.score_cases, {}, {"scored": 0, "reused": 0}

    def keyed(case, row) -> tuple:
        return (getattr(case, "image_digest", None) if case.pixel_values is not None else None, tuple(row.ids))

    def score_cases(self, cases, **kw):
        keys = [[keyed(c, r) for r in c.rows] for c in cases]
        todo = [(i, [j for j, k in enumerate(ks) if k not in memo]) for i, ks in enumerate(keys)]
        todo = [(i, js) for i, js in todo if js]
        if todo:
            subs = [dataclasses.replace(cases[i], rows=[cases[i].rows[j] for j in js]) for i, js in todo]
            for (i, js), (logits, _) in zip(todo, original(self, subs, **kw)):
                for j, lg in zip(js, logits):
                    memo[keys[i][j]] = lg.clone()
                counts["scored"] += len(js)
        counts["reused"] += sum(len(ks) for ks in keys) - sum(len(js) for _, js in todo)
        return [([memo[k].clone() for k in ks], {"input_tokens": sum(len(r) for r in c.rows)})
                for c, ks in zip(cases, keys)]

    CaseRunner.score_cases = score_cases
    try:
        yield counts
    finally:
        CaseRunner.score_cases = original


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--votes", default="2,4")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--probe-limit", type=int, default=None, help="probe the first N rows of each type only")
    ap.add_argument("--no-memo", action="store_true", help="score every row each time it is asked (a check)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/vote-combine-demo.json"))
    args = ap.parse_args(argv)

    from rlcd.analysis.probes import probe_order_run
    from rlcd.bench.report import save_result
    from rlcd.bootstrap import bootstrap_means, group_key
    from rlcd.evaluate import evaluate_run
    from rlcd.order_votes import COMBINES

    try:
        votes = [int(x) for x in args.votes.split(",")]
    except ValueError:
        return _error(f"--votes {args.votes!r}: give vote counts separated by commas, e.g. 2,4")
    if not (args.run / "config.json").is_file():
        return _error(f"{args.run}: not a run directory (no config.json); give a trained and evaluated run")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="vote-combine-"))
    memo = ExitStack()
    counts = {} if args.no_memo else memo.enter_context(memo_rows())
    cmd = (f"python benchmarks/vote_combine.py {args.run} --votes {args.votes} --json {args.json}"
           + (f" --probe-limit {args.probe_limit}" if args.probe_limit else "")
           + (f" --threads {args.threads}" if args.threads else ""))
    try:
        config = json.loads((args.run / "config.json").read_text())
        data = scratch / "processed"
        shutil.copytree(config["data_dir"], data)
        run = scratch / "run"
        shutil.copytree(args.run, run, ignore=shutil.ignore_patterns("export"))
        config["data_dir"] = str(data)
        (run / "config.json").write_text(json.dumps(config, indent=2))
        out: dict = {"run": str(args.run), "split": "test", "type": "choice", "votes": votes, "arms": {}}
        rows: dict = {}
        for n in votes:
            for how in COMBINES:
                print(f"evaluate --order-votes {n} --vote-combine {how}", file=sys.stderr, flush=True)
                evaluate_run(run, order_votes=n, vote_combine=how, export=False, progress=False)
                ev = json.loads((run / "eval" / "evaluation.json").read_text())
                temps = json.loads((run / "eval" / "temperatures.json").read_text())["temperatures"]
                ch = ev["calibrated"]["per_type"]["choice"]
                test = [json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()]
                test = [r for r in test if r["type"] == "choice"]
                nlls = [_row_nll(r, temps["choice"]) for r in test]
                assert abs(np.mean(nlls) - ch["nll"]) < 1e-6, (np.mean(nlls), ch["nll"])  # the evaluation's NLL
                rows[(n, how)] = (test, nlls)
                out["arms"][f"{how}-{n}"] = {"order_votes": n, "vote_combine": how, "n": ch["n"],
                                             "temperature": temps["choice"], "nll": ch["nll"],
                                             "nll_ci95": ch["ci95"]["nll"], "accuracy": ch["accuracy"],
                                             "accuracy_ci95": ch["ci95"]["accuracy"]}
                out["rows_scored"] = dict(counts)
                save_result("vote-combine", cmd, out, path=args.json)  # as each arm ends
        paired = {}
        for n in votes:
            (a_rows, a), (b_rows, b) = rows[(n, "logmean")], rows[(n, "mean")]
            assert [r["id"] for r in a_rows] == [r["id"] for r in b_rows]
            d = np.asarray(a) - np.asarray(b)
            boot = bootstrap_means(d, resamples=args.resamples, seed=0, groups=[group_key(r) for r in a_rows])
            paired[str(n)] = {"nll_logmean_minus_mean": float(d.mean()),
                              "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}
        out["nll_paired"] = paired
        save_result("vote-combine", cmd, out, path=args.json)
        out["probe"] = {}
        for how in COMBINES:
            print(f"probe order --order-votes 1,{','.join(map(str, votes))} --vote-combine {how}", file=sys.stderr,
                  flush=True)
            res = probe_order_run(run, votes=[1, *votes], vote_combine=how, resamples=args.resamples, save=False,
                                  limit=args.probe_limit)
            ch = res["per_type"]["choice"]
            out["probe"][how] = {"1": {k: ch[k] for k in ("flip_rate", "flip_rate95", "mean_tv", "n_rows",
                                                          "n_comparisons")},
                                 **{str(n): {k: ch["votes"][str(n)][k] for k in ("flip_rate", "flip_rate95", "mean_tv")}
                                    for n in votes}}
            out["rows_scored"] = dict(counts)
            save_result("vote-combine", cmd, out, path=args.json)
        better = {str(n): ("logmean" if paired[str(n)]["nll_logmean_minus_mean"] < 0 else "mean") for n in votes}
        out["lower_nll"] = better
        out["rows_scored"] = dict(counts)
        path = save_result("vote-combine", cmd, out, path=args.json)
        print(json.dumps(out, indent=2))
        print(f"wrote {path}", file=sys.stderr)
    finally:
        memo.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
