"""`rlcd bench serve RUN --state-cache --scenarios cold_1q_off,cold_1q,warm_1q` measured on another rlcd source tree
(e.g. the commit before a change: `git archive 00e4d48 src | tar -x -C /tmp/before`), with this checkout's bench loop
(`rlcd/bench/state_cache.py`, loaded into that tree's package), so before and after run the same measurement.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/state_cache_on_tree.py /tmp/before/src RUN OUT.json

OUT.json is a bench result (`serve-state-cache`) whose command names the tree.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def main(tree: str, run: str, out: str) -> None:
    loop = HERE / "src" / "rlcd" / "bench" / "state_cache.py"
    sys.path.insert(0, tree)
    import rlcd.bench  # noqa: F401  (the tree measured)

    spec = importlib.util.spec_from_file_location("rlcd.bench._state_cache_loop", loop)
    m = importlib.util.module_from_spec(spec)
    m.__package__ = "rlcd.bench"
    spec.loader.exec_module(m)
    from rlcd.predict import Predictor

    if not Path(rlcd.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported {rlcd.__file__}, not the tree {tree}")
    res = m.run_state_cache_bench(Predictor.from_run(run), threads=(1, 2), repeats=7,
                                  scenarios=("cold_1q_off", "cold_1q", "warm_1q"))
    sys.path.pop(0)
    for name in [n for n in sys.modules if n == "rlcd" or n.startswith("rlcd.")]:
        del sys.modules[name]
    sys.path.insert(0, str(HERE / "src"))
    from rlcd.bench.report import save_result

    rev = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    save_result("serve-state-cache", "OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python "
                f"benchmarks/state_cache_on_tree.py {tree} {run} {out}  (the tree measured; the bench loop of {rev.stdout.strip()})", res, path=out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
