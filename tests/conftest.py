"""Shared test setup: offline, single-threaded torch so parallel helpers and CI stay predictable."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers: one torch thread each, no oversubscription
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(session, config, items):
    """Files with the most `slow` tests first (stable otherwise). xdist's `--dist loadfile` hands files to the
    workers in collection order (`--no-loadscope-reorder` in pyproject; its default sorts by test count, which
    sent the 300 s learning test's four-test file out last and left one worker idle for minutes at the end)."""
    from collections import Counter

    def file_of(item):
        return item.nodeid.split("::")[0]

    slow = Counter(file_of(item) for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[file_of(item)])


def torchrun(*args, cwd, env=None):
    """`python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS` (gloo, one thread a rank) in `cwd`;
    asserts it exits 0 and returns the CompletedProcess."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def user_error(args, *, code: int = 2, contains: str | None = None, max_lines: int = 2):
    """`rlcd ARGS` in this process (typer's runner), a user's mistake: exit `code`, 1..`max_lines` lines on stderr
    (holding `contains`), no traceback. Returns the result."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (args, res.exit_code, res.output, res.exception)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= max_lines, (args, res.stderr)
    assert "Traceback" not in res.output
    if contains is not None:
        assert contains in res.stderr, (args, res.stderr)
    return res


def synth_processed(base, cases: int, seed: int):
    """A processed dir of `cases` known-posterior cases (generator seed `seed`, split seed 0)."""
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.synth import generate

    write_jsonl(base / "synth.jsonl", generate(cases, seed=seed))
    prepare([base / "synth.jsonl"], base / "processed", seed=0)
    return base / "processed"


def fresh_data(tmp_path, data_dir):
    """A copy of the processed dir `data_dir` under `tmp_path` without its caches (a test's own cache state)."""
    import shutil

    out = tmp_path / "data"
    shutil.copytree(data_dir, out, ignore=shutil.ignore_patterns("features"))
    return out


def killed_extraction(data, module: str, ensure: str, recipe: dict):
    """Run `module.ensure(build_model(tiny-toy with `recipe`), data)` in a process SIGKILLed when it starts
    extracting the dev split; asserts the kill, that it left its temp dir and a partial directory holding the
    train split's chunks (`rlcd.partial`), and that it published nothing. Returns the cache root."""
    import subprocess
    import sys
    from pathlib import Path

    from rlcd.features import cache_root

    script = (
        "import os, signal\n"
        f"import {module} as m\n"
        "from rlcd.model.build import build_model\n"
        "real = m.extract_split\n"
        "def dying(model, records, collator, split, *a, **kw):\n"
        "    if split == 'dev':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(model, records, collator, split, *a, **kw)\n"
        "m.extract_split = dying\n"
        f"m.{ensure}(build_model({{'model': 'tiny-toy', 'model_seed': 0, 'recipe': {recipe!r}}}), {str(data)!r},"
        " progress=False)\n")
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    root = cache_root(data)
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")], "the killed writer left its temp dir"
    import json

    partials = [p for p in root.iterdir() if p.name.startswith(".partial-")]
    assert len(partials) == 1 and list(json.loads((partials[0] / "progress.json").read_text())["done"]) == ["train"]
    assert not [p for p in root.iterdir() if not p.name.startswith(".")], "nothing was published"
    return root


def answer_probs(answer: dict) -> list[float]:
    """A System One answer's probabilities in candidate order (a noul as [1 - p, p])."""
    return [1.0 - answer["noul"], answer["noul"]] if answer["type"] == "noul" else list(answer["probabilities"].values())


def answer_gap(a: dict, b: dict) -> float:
    """The largest probability difference between two responses to the same questions."""
    assert list(a["answers"]) == list(b["answers"])
    return max(max(abs(x - y) for x, y in zip(answer_probs(a["answers"][q]), answer_probs(b["answers"][q])))
               for q in a["answers"])
