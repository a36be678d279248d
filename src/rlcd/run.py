"""`Run`: the run directory, the one place that knows its layout.

    RUN/
      .lock                the writer lock (`Run.lock`: flock, holder's pid inside)
      config.json          resolved recipe + model + data + versions (frozen at the first start)
      samples.json         frozen training pool and dev subset ids, data file sha256s
      metrics.jsonl        one JSON object per logged update / evaluation
      checkpoints/last/    trainable weights, optimizer, RNG, state (atomic, see rlcd.checkpoint)
      checkpoints/best/
      eval/                predictions-<split>.jsonl, temperatures.json, evaluation.json,
                           report.md, report.html, plots/
      export/              model.json + trainable.safetensors (rlcd's predictor), hf/ (transformers)
      tb/                  TensorBoard event files (`rlcd train --log tensorboard`)
      dev-evals/           step-N.jsonl.gz: dev-subset logits at every evaluation (rlcd.dev_evals)
      eval-NAME/           `rlcd evaluate RUN --data OTHER [--out NAME]`: the eval/ files for another data set

Every other module asks a `Run` for paths instead of spelling them. A new run is written only
after its inputs were checked and its model was built (`Run.create`), so a failed start leaves
nothing behind; opening an existing run checks that it is one and says how to make one if not.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from rlcd.errors import RunError
from rlcd.files import write_atomic

SPLITS = ("dev", "calibration", "test")
LOCK = ".lock"
_HELD: dict[str, int] = {}  # resolved run root -> nesting depth of this process's lock on it


class RunBusy(RunError):
    """Another process holds the run's lock (a trainer, evaluate, calibrate or export still writing it)."""


class Run:
    """A run directory (it need not exist yet: see `create` and `open`)."""

    CONFIG = "config.json"
    SAMPLES = "samples.json"
    METRICS = "metrics.jsonl"

    def __init__(self, root: str | Path, eval_name: str = "eval"):
        self.root = Path(root)
        self.eval_name = eval_name  # "eval", or "eval-NAME" for another data set (`on_data`)
        self._config: dict | None = None

    def __repr__(self) -> str:
        return f"Run({str(self.root)!r})"

    # ------------------------------------------------------------------ layout
    @property
    def name(self) -> str:
        return self.root.resolve().name or "rlcd"

    @property
    def config_path(self) -> Path:
        return self.root / self.CONFIG

    @property
    def samples_path(self) -> Path:
        return self.root / self.SAMPLES

    @property
    def metrics_path(self) -> Path:
        return self.root / self.METRICS

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, which: str) -> Path:
        return self.checkpoints_dir / which

    @property
    def eval_dir(self) -> Path:
        return self.root / self.eval_name

    def on_data(self, name: str) -> "Run":
        """This run with `eval-NAME/` as its eval directory: where `rlcd evaluate RUN --data OTHER --out NAME`
        writes predictions, temperatures, evaluation.json, the report and plots (eval/ and export/ untouched)."""
        return Run(self.root, eval_name=f"eval-{name}")

    def predictions_path(self, split: str) -> Path:
        return self.eval_dir / f"predictions-{split}.jsonl"

    @property
    def temperatures_path(self) -> Path:
        return self.eval_dir / "temperatures.json"

    @property
    def evaluation_path(self) -> Path:
        return self.eval_dir / "evaluation.json"

    @property
    def probe_order_path(self) -> Path:
        """`rlcd probe order RUN` on the run's own test split (read by the report)."""
        return self.eval_dir / "probe-order.json"

    @property
    def report_md(self) -> Path:
        return self.eval_dir / "report.md"

    @property
    def report_html(self) -> Path:
        return self.eval_dir / "report.html"

    @property
    def plots_dir(self) -> Path:
        return self.eval_dir / "plots"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def hf_export_dir(self) -> Path:
        return self.export_dir / "hf"

    @property
    def tb_dir(self) -> Path:
        return self.root / "tb"

    @property
    def dev_evals_dir(self) -> Path:
        return self.root / "dev-evals"

    def dev_eval_path(self, step: int) -> Path:
        return self.dev_evals_dir / f"step-{int(step)}.jsonl.gz"

    # ------------------------------------------------------------------ opening
    def exists(self) -> bool:
        return self.config_path.is_file()

    @classmethod
    def open(cls, path: str | Path) -> "Run":
        """An existing run at `path` (or at the parent of its `export/`), else a one-line RunError."""
        p = Path(path).expanduser()
        if not (p / cls.CONFIG).is_file() and p.name == "export" and (p.parent / cls.CONFIG).is_file():
            p = p.parent
        if not p.exists():
            raise RunError(f"{p}: no such run directory; train one with `rlcd train {p} --data DATA`")
        if not (p / cls.CONFIG).is_file():
            raise RunError(f"{p} is not a run directory (no {cls.CONFIG}); train one with "
                           f"`rlcd train {p} --data DATA`")
        return cls(p)

    @classmethod
    def create(cls, path: str | Path, config: dict, samples: dict) -> "Run":
        """Write config.json and samples.json of a new run (refused when `path` already holds one)."""
        run = cls(path)
        if run.exists():
            raise RunError(f"{run.root} already holds a run; resume it with `rlcd train --resume {run.root}` "
                           "or choose another run directory")
        run.root.mkdir(parents=True, exist_ok=True)
        write_atomic(run.samples_path, json.dumps(samples, indent=2, sort_keys=True), durable=False)
        write_atomic(run.config_path, json.dumps(config, indent=2, sort_keys=True), durable=False)  # last: marks a run
        run._config = config
        run.metrics_path.write_text("")
        return run

    # ------------------------------------------------------------------ one writer at a time
    @contextlib.contextmanager
    def lock(self, what: str = "write") -> Iterator["Run"]:
        """Hold an exclusive OS lock (``flock`` on RUN/.lock) while this process writes the run.

        The kernel drops the lock when the process exits or crashes, so there is no stale marker to
        clean up; the file only carries the holder's pid (and command) for the refusal message. A
        second writer gets a one-line `RunBusy` (exit 2) at once instead of waiting. Re-entrant within
        one process (evaluate calling calibrate code, tests calling commands in turn).
        """
        import fcntl

        key = str(self.root.resolve())
        if _HELD.get(key):
            _HELD[key] += 1
            try:
                yield self
            finally:
                _HELD[key] -= 1
            return
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
                pid = holder[0] if holder else "unknown"
                doing = f" ({' '.join(holder[1:])})" if len(holder) > 1 else ""
                raise RunBusy(f"{self.root} is in use by process {pid}{doing}; wait for it to finish (or stop it) "
                              f"before running `{what}` on this run") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
            _HELD[key] = 1
            try:
                yield self
            finally:
                _HELD.pop(key, None)
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ contents
    def config(self) -> dict:
        if self._config is None:
            try:
                self._config = json.loads(self.config_path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise RunError(f"{self.root} is not a run directory (no {self.CONFIG})") from None
            except json.JSONDecodeError as e:
                raise RunError(f"{self.config_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        return self._config

    def write_config(self, config: dict) -> None:
        write_atomic(self.config_path, json.dumps(config, indent=2, sort_keys=True), durable=False)
        self._config = config

    def samples(self) -> dict:
        if not self.samples_path.is_file():
            raise RunError(f"{self.root} has no {self.SAMPLES}; it is not a complete run")
        return json.loads(self.samples_path.read_text(encoding="utf-8"))

    @property
    def data_dir(self) -> Path:
        return Path(self.config()["data_dir"])

    def require_checkpoint(self, which: str = "best") -> Path:
        """The loadable checkpoint `which` (or its `.old` twin), else a RunError saying how to get one."""
        from rlcd import checkpoint as ckpt

        found = ckpt.resolve(self.checkpoint(which))
        if found is None:
            raise RunError(f"{self.root} has no loadable checkpoints/{which}; train the run first "
                           f"(`rlcd train --resume {self.root}`)")
        return found

    def require_export(self) -> Path:
        if not (self.export_dir / "model.json").is_file():
            raise RunError(f"{self.root} has no export/; run `rlcd evaluate {self.root}` first")
        return self.export_dir

    def prediction_paths(self) -> dict[str, Path]:
        """{split: path} of the prediction files present, in dev, calibration, test order first."""
        found = {p.name[len("predictions-"):-len(".jsonl")]: p for p in sorted(self.eval_dir.glob("predictions-*.jsonl"))}
        order = [s for s in SPLITS if s in found] + sorted(s for s in found if s not in SPLITS)
        return {s: found[s] for s in order}

    def training_progress(self) -> dict[str, Any]:
        """{"step": updates checkpoints/last holds, "steps": the run's budget} (None where unknown)."""
        from rlcd import checkpoint as ckpt

        found = ckpt.resolve(self.checkpoint("last"))
        step = json.loads((found / ckpt.STATE).read_text()).get("step") if found is not None else None
        return {"step": step, "steps": (self.config().get("recipe") or {}).get("steps")}

    # ------------------------------------------------------------------ the metrics log
    def log(self, row: dict) -> None:
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")

    def metrics(self) -> list[dict]:
        """The logged rows, without a last line that lacks its newline: a row a full disk or a kill cut off part-way
        (`log` writes whole lines), which a resume drops anyway (`trim_metrics`)."""
        if not self.metrics_path.is_file():
            return []
        lines = self.metrics_path.read_text(encoding="utf-8").split("\n")[:-1]
        return [json.loads(ln) for ln in lines if ln.strip()]

    def trim_metrics(self, step: int) -> None:
        """Drop log lines after `step` (written after the checkpoint a resume starts from), and a last line without
        its newline: a row that a full disk cut off part-way (`log` writes whole lines; that row came after the
        checkpoint too)."""
        if not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text(encoding="utf-8").split("\n")[:-1]
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        write_atomic(self.metrics_path, "".join(ln + "\n" for ln in keep), durable=False)


def find_export(path: Path) -> Path:
    """The export directory for `path` (a run dir or an export dir), else a one-line RunError."""
    path = Path(path).expanduser()
    if (Run(path).export_dir / "model.json").is_file():
        return Run(path).export_dir
    if (path / "model.json").is_file():
        return path
    if not path.exists():
        raise RunError(f"{path}: no such run or export directory")
    if (path / Run.CONFIG).is_file():
        raise RunError(f"{path} has no export/ yet; run `rlcd evaluate {path}` first")
    raise RunError(f"{path} is neither a run directory nor an export (no model.json)")


def write_json(path: Path, obj: Any) -> Path:
    """JSON file written atomically (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", durable=False)
    return path


__all__ = ["Run", "RunBusy", "SPLITS", "write_json", "find_export"]


