"""The batch job on a Ray cluster: Ray Data reads the rows, `map_batches` scores them with one Predictor per actor.

`predict_dataset(ds, spec)` is the library entry for users with their own Ray Data pipeline: `ds` has an
`id` column and a `request` column (the /v1/systemone request as a JSON string, or a dict), optionally
`line` (a row number, kept in the output) and `reason`/`field` (a row already known to be a reject). It
returns a lazy Dataset with one row per input row: `line`, `id`, `outcome` (JSON: `{"response": ...}` or
`{"reject": {"field", "reason"}}`), `t0`/`t1` (the wall-clock span of the actor call that scored it) and `cpu` (that call's
CPU seconds per row). `map_batches` runs `_Scorer`, a callable class: Ray starts
`num_actors` actors (`compute=ActorPoolStrategy(size=num_actors)`), each with `cpus_per_actor` CPUs and `gpus_per_actor` GPUs, each building
its own Predictor once (`PredictorSpec.load`) and scoring its batches with `rlcd.batch.local.score_rows`
(the same grouping by state as the one-process job). Scheduling, retries, back-pressure and spilling are
Ray Data's.

`run_ray(...)` is `rlcd predict --ray`: the input is read once by `rlcd.batch.io.scan` into
`FILE.parts/todo.parquet` (the rows not yet committed, numbered, with their rejects' reasons), which
`ray.data.read_parquet` reads; the scored rows come back in order (`preserve_order`) and the driver commits
them with the same `PartWriter` as the one-process job: same layout, resume and rejects.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from rlcd.batch.io import Outcome, PartWriter, Row
from rlcd.batch.local import DEFAULT_BATCH_SIZE, DEFAULT_CHUNK_ROWS, PredictorSpec, score_rows, summary
from rlcd.errors import UserError

TODO = "todo.parquet"
CONNECT_TIMEOUT_S = 5.0  # a cluster address that does not answer a TCP connect in this long is refused


def require_ray() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UserError("--ray needs Ray Data: pip install 'rlcd[ray]'")


def check_address(address: str | None) -> None:
    """Refuse, in at most CONNECT_TIMEOUT_S and before anything is written, a cluster address (`address`, else
    RAY_ADDRESS) where nothing answers: `ray.init` against it retries for minutes in warnings, and a job that
    had begun would leave its ``FILE.parts`` behind. A plain TCP connect to HOST:PORT (``ray://`` too); ``auto``
    and ``local`` are Ray's own and pass."""
    import os
    import socket

    addr = address if address is not None else os.environ.get("RAY_ADDRESS")
    if not addr or addr in ("auto", "local"):
        return
    where = f"--ray-address {addr}" if address is not None else f"RAY_ADDRESS={addr}"
    host, sep, port = addr.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"{where}: give HOST:PORT of a Ray cluster's head (e.g. 127.0.0.1:6379), ray://HOST:PORT "
                        "or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or type(e).__name__).lower()
        raise UserError(f"{where}: no Ray cluster answers there ({why} within {CONNECT_TIMEOUT_S:g} s); start one "
                        "with `ray start --head`, or leave --ray-address out for a local cluster") from None


class _Scorer:
    """One actor's Predictor (built once) scoring Ray Data batches (dicts of numpy arrays)."""

    def __init__(self, spec: PredictorSpec, batch_size: int = DEFAULT_BATCH_SIZE, image_root: str | None = None):
        self.predictor = spec.load()
        self.predictor.runner  # noqa: B018 - loaded once, here, not in the first batch
        self.batch_size = batch_size
        self.image_root = Path(image_root) if image_root else None

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        n = len(batch["id"])
        lines = batch["line"] if "line" in batch else np.arange(n)
        reasons = batch.get("reason")
        fields = batch.get("field")
        rows = []
        for i in range(n):
            rid = batch["id"][i]
            rid = None if rid is None or (isinstance(rid, float) and rid != rid) else str(rid)
            reason = reasons[i] if reasons is not None else None
            if reason is not None and reason == reason:  # NaN-safe: a null string column may read back as NaN
                rows.append(Row(int(lines[i]), rid, reason=str(reason),
                                field=str(fields[i]) if fields is not None and fields[i] else "request"))
                continue
            req = batch["request"][i]
            if isinstance(req, (str, bytes)):
                try:
                    req = json.loads(req)
                except json.JSONDecodeError as e:
                    rows.append(Row(int(lines[i]), rid, reason=f"the request is not valid JSON: {e.msg}"))
                    continue
            rows.append(Row(int(lines[i]), rid, _plain(req)))
        t0, c0 = time.time(), time.process_time()  # wall clock: comparable between the actors of one machine
        outcomes = score_rows(self.predictor, rows, batch_size=self.batch_size, image_root=self.image_root)
        t1, cpu = time.time(), (time.process_time() - c0) / max(1, len(outcomes))
        return {"t0": np.full(len(outcomes), t0), "t1": np.full(len(outcomes), t1),
                "cpu": np.full(len(outcomes), cpu),
                "line": np.array([o.line for o in outcomes], dtype=np.int64),
                "id": np.array([o.id for o in outcomes], dtype=object),
                "outcome": np.array([json.dumps({"response": o.response} if o.reject is None else
                                                {"reject": o.reject}, ensure_ascii=False) for o in outcomes],
                                    dtype=object)}


def _plain(value: Any) -> Any:
    """A struct column's value as plain Python (numpy arrays -> lists, recursively)."""
    import numpy as np

    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def predict_dataset(ds: Any, spec: PredictorSpec | str | Path, *, batch_size: int = DEFAULT_BATCH_SIZE,
                    rows_per_call: int = DEFAULT_CHUNK_ROWS, num_actors: int = 1, cpus_per_actor: float = 1,
                    gpus_per_actor: float = 0, image_root: str | Path | None = None) -> Any:
    """`ds` scored by `num_actors` Predictor actors (see the module docstring). `spec`: a `PredictorSpec`, or a
    run directory (its defaults). `rows_per_call`: rows per `map_batches` batch (one actor call); `batch_size`:
    states per model call inside it."""
    if not isinstance(spec, PredictorSpec):
        spec = PredictorSpec(run=str(spec))
    kw: dict[str, Any] = {"num_cpus": cpus_per_actor}
    if gpus_per_actor:
        kw["num_gpus"] = gpus_per_actor
    from ray.data import ActorPoolStrategy

    return ds.map_batches(_Scorer, fn_constructor_kwargs={"spec": spec, "batch_size": batch_size,
                                                          "image_root": str(image_root) if image_root else None},
                          batch_size=rows_per_call, batch_format="numpy",
                          compute=ActorPoolStrategy(size=num_actors), **kw)  # `concurrency` is deprecated


def rows_per_block(rows: int, chunk_rows: int, num_actors: int) -> int:
    """Rows per Ray Data block of the job's input: at most a part's (`chunk_rows`), and small enough that each actor
    gets about 4 blocks. A file read as one block is one task, which one actor runs while the others wait (2 actors
    scored at one's rate, 0.60x a local process at 2 threads, before: benchmarks/results/batch.json); several a
    piece keep the last actor from running one long block alone."""
    return max(1, min(chunk_rows, -(-rows // (4 * max(1, num_actors)))))


def write_todo(rows: Iterable[Row], path: Path) -> int:
    """The rows to score as a Parquet file (line, id, request JSON, reason, field) for `ray.data.read_parquet`,
    written in slices (bounded memory). Returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("line", pa.int64()), ("id", pa.string()), ("request", pa.string()),
                        ("reason", pa.string()), ("field", pa.string())])
    n = 0
    with pq.ParquetWriter(path, schema) as w:
        buf: list[Row] = []

        def flush() -> None:
            w.write_table(pa.table({"line": [r.line for r in buf], "id": [r.id for r in buf],
                                    "request": [None if r.reason is not None else json.dumps(r.request, ensure_ascii=False)
                                                for r in buf],
                                    "reason": [r.reason for r in buf],
                                    "field": [r.field if r.reason is not None else None for r in buf]}, schema=schema),
                          row_group_size=DEFAULT_CHUNK_ROWS)
            buf.clear()

        for r in rows:
            buf.append(r)
            n += 1
            if len(buf) >= 4096:
                flush()
        if buf:
            flush()
    return n


def run_ray(spec: PredictorSpec, rows: Iterable[Row], writer: PartWriter, *, address: str | None = None,
            num_actors: int = 1, cpus_per_actor: float = 1, gpus_per_actor: float = 0,
            batch_size: int = DEFAULT_BATCH_SIZE, chunk_rows: int = DEFAULT_CHUNK_ROWS,
            image_root: Path | None = None, progress: Any = None, num_cpus: int | None = None) -> dict:
    """`rlcd predict --ray`: see the module docstring. Connects to `address` (None: RAY_ADDRESS, else a local
    cluster of `num_cpus` CPUs started here and stopped at the end)."""
    import ray

    check_address(address)
    t0 = time.perf_counter()
    writer.start()
    todo = writer.parts / TODO
    n = write_todo(rows, todo)
    started, first, last, cpu = False, 0.0, 0.0, 0.0
    if n:
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=num_cpus if address is None else None, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
            started = True
        try:
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            ctx.enable_progress_bars = False
            source = ray.data.read_parquet(str(todo)).repartition(
                target_num_rows_per_block=rows_per_block(n, chunk_rows, num_actors))
            ds = predict_dataset(source, spec, batch_size=batch_size,
                                 rows_per_call=chunk_rows, num_actors=num_actors, cpus_per_actor=cpus_per_actor,
                                 gpus_per_actor=gpus_per_actor, image_root=image_root)
            done, first, last = 0, float("inf"), float("-inf")
            for batch in ds.iter_batches(batch_size=chunk_rows, batch_format="numpy"):
                first, last = min(first, float(batch["t0"].min())), max(last, float(batch["t1"].max()))
                cpu += float(batch["cpu"].sum())
                outcomes = []
                for line, rid, raw in zip(batch["line"], batch["id"], batch["outcome"]):
                    d = json.loads(raw)
                    outcomes.append(Outcome(int(line), None if rid is None else str(rid), d.get("response"),
                                            d.get("reject")))
                writer.commit(outcomes)
                if progress is not None:
                    progress.update(progress.start + done + len(outcomes))
                    if not done:  # the actors have loaded their models: the eta counts scoring from here
                        progress.ready()
                done += len(outcomes)
        finally:
            if started:
                ray.shutdown()
    todo.unlink(missing_ok=True)
    writer.finish()
    return summary(writer, n, time.perf_counter() - t0, (last - first) if n else None, cpu if n else None)


__all__ = ["predict_dataset", "run_ray", "rows_per_block", "write_todo", "require_ray", "check_address", "TODO"]
