"""The batch job in one process: rows read in windows, scored by one `Predictor`, committed part by part.

`score_rows(predictor, rows)` is the scoring core the Ray actors run too. It uses the Predictor's own three
steps -- `prepare` (validation, tokenising), the model call, `respond` -- and adds only how the calls are made
(`rlcd.batch.packing`): a window's requests about one state (the request's state and image specs, as JSON) are
packed into one case, its prefix run once for all of them, and `batch_size` states of similar length go through one
model call. Answers do not depend on that (each request's logits equal its single ones up to float noise, its usage
is its own).

A request that breaks a rule (a `RecordError` from `prepare`, or its own model call failing while the
rest of its batch succeeds: `Predictor.score_many`) is a reject `{"field", "reason"}`, never a failed job.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from rlcd.batch.io import Outcome, PartWriter, Row
from rlcd.batch.packing import score_packed
from rlcd.schema import RecordError

DEFAULT_BATCH_SIZE = 16  # states per batched model call
DEFAULT_CHUNK_ROWS = 256  # rows per committed part


@dataclass(frozen=True)
class PredictorSpec:
    """How to build the job's Predictor, in each process that scores (picklable: a Ray actor builds its own).
    `run`: a run (or export) dir, torch; or `export`: a portable ONNX export dir, onnxruntime (no state cache).
    `threads`: torch's intra-op threads, or onnxruntime's; None leaves the library's default. `device` / `dtype`:
    as asked (`auto`), or as `resolved()` pinned them with `reason`, why (what the start-up line says)."""

    run: str | None = None
    export: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    order_votes: int = 1
    state_cache_mb: float = 256.0
    canonical: bool = True
    vote_combine: str = "logmean"
    reason: str = ""
    attention: str = "sdpa"  # --attention: the decoder's attention kernel (rlcd.device.apply_attention)

    def placement(self) -> Any:
        """The torch Placement the job's Predictor loads onto (None for a portable export: onnxruntime, float32):
        `--device` / `--dtype` resolved for the run, so `--dtype auto` honours its bf16 parity gate exactly as
        single `rlcd predict` and `rlcd serve` do (`rlcd.device.cpu_auto_dtype`)."""
        if self.export is not None:
            return None
        from rlcd.device import Placement, resolve_placement

        p = resolve_placement(self.device, self.dtype, run=self.run, attention=self.attention)
        return Placement(p.device, p.dtype, self.reason, p.attention) if self.reason and not p.reason else p

    def resolved(self) -> "PredictorSpec":
        """This spec with its placement pinned (device, dtype and why), resolved once where the job starts: every
        process that scores (a Ray actor too) loads the same placement, and `identity` records it."""
        import dataclasses

        p = self.placement()
        if p is None:
            return self
        return dataclasses.replace(self, device=p.device, dtype=p.dtype, reason=p.reason)

    def load(self) -> Any:
        if self.export is not None:
            from rlcd.portable.runtime import load_portable

            return load_portable(self.export, threads=self.threads, order_votes=self.order_votes,
                                 canonical=self.canonical, vote_combine=self.vote_combine)
        if self.threads:
            import torch

            torch.set_num_threads(int(self.threads))
        from rlcd.predict import Predictor

        return Predictor.from_run(self.run, placement=self.placement(), lazy=True,
                                  state_cache_mb=self.state_cache_mb, order_votes=self.order_votes,
                                  canonical=self.canonical, vote_combine=self.vote_combine)

    def identity(self) -> dict[str, Any]:
        """What a resumed job must share with its start: the model, the placement it runs on (device and dtype:
        float32 and bfloat16 answers differ by up to ~1e-3; the attention kernel, when not the default) and the
        options that change answers."""
        src = Path(self.export or self.run).resolve()
        p = self.placement()
        where = {"device": p.device, "dtype": p.dtype} if p is not None else {"device": "cpu", "dtype": "float32"}
        if p is not None and p.attention != "sdpa":  # answers differ by float noise (~1e-5): a resume keeps it
            where["attention"] = p.attention
        return {"model": str(src), "portable": self.export is not None, **where, "order_votes": self.order_votes,
                "canonical": self.canonical, "vote_combine": self.vote_combine}


def _reject(e: Exception) -> dict[str, str]:
    if isinstance(e, RecordError):
        out = {"field": str(e.field), "reason": str(getattr(e, "message", None) or e.rule)}
        if getattr(e, "question", None) is not None:
            out["question"] = e.question
        return out
    return {"field": "request", "reason": f"{type(e).__name__}: {e}"}


def state_key(prepared: Any) -> str:
    """What requests about the same state share: the state and the image specs, as JSON."""
    r = prepared.request
    return json.dumps([r.state, r.images], sort_keys=True, ensure_ascii=False, default=str)


def score_rows(predictor: Any, rows: list[Row], *, batch_size: int = DEFAULT_BATCH_SIZE,
               image_root: Path | None = None, on_done: Callable[[int], None] | None = None) -> list[Outcome]:
    """One outcome per row, in the rows' order: the Predictor's response, or the reject. `on_done(n)` is called
    as n more rows are finished (the progress bar)."""
    out: dict[int, Outcome] = {}
    live: list[tuple[Row, Any]] = []
    for row in rows:
        if row.reason is not None:
            out[row.line] = Outcome(row.line, row.id, reject={"field": row.field, "reason": row.reason})
            continue
        try:
            live.append((row, predictor.prepare(row.request, image_root=image_root)))
        except RecordError as e:
            out[row.line] = Outcome(row.line, row.id, reject=_reject(e))
    if on_done is not None and out:
        on_done(len(out))
    results = score_packed(predictor, [p for _, p in live], [state_key(p) for _, p in live], batch_size=batch_size,
                           on_done=on_done)
    for (row, p), res in zip(live, results):
        if isinstance(res, Exception):
            if not isinstance(res, RecordError):
                raise res
            out[row.line] = Outcome(row.line, row.id, reject=_reject(res))
        else:
            out[row.line] = Outcome(row.line, row.id, response=predictor.respond(p, *res))
    return [out[row.line] for row in rows]


def windows(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    buf: list[Row] = []
    for row in rows:
        buf.append(row)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def run_local(predictor: Any, rows: Iterable[Row], writer: PartWriter, *, batch_size: int = DEFAULT_BATCH_SIZE,
              chunk_rows: int = DEFAULT_CHUNK_ROWS, image_root: Path | None = None, progress: Any = None) -> dict:
    """Score `rows` (a resumed job's remaining ones) window by window, committing a part per window; then
    `writer.finish()`. Returns the job's counts (all sessions) and this session's rows and seconds."""
    t0 = time.perf_counter()
    session = [0]

    def done(n: int) -> None:
        session[0] += n
        if progress is not None:
            progress.update(progress.start + session[0])

    writer.start()
    predictor.runner  # noqa: B018 - loaded now (a lazy Predictor's), so scoring_seconds is the scoring alone
    if progress is not None:
        progress.ready()  # the eta counts scoring, not the loading
    t1, c1 = time.perf_counter(), time.process_time()
    for window in windows(rows, chunk_rows):
        writer.commit(score_rows(predictor, window, batch_size=batch_size, image_root=image_root, on_done=done))
    t2, c2 = time.perf_counter(), time.process_time()
    writer.finish()
    return summary(writer, session[0], time.perf_counter() - t0, t2 - t1, c2 - c1)


def summary(writer: PartWriter, session_rows: int, seconds: float, scoring: float | None = None,
            scoring_cpu: float | None = None) -> dict[str, Any]:
    """The end line: rows read == answered + rejected (the whole job, resumed sessions included); this session's
    rows, `seconds` (all of it), `scoring_seconds` (from the model(s) loaded to the last row scored) and
    `scoring_cpu_seconds` (the CPU time of the scoring processes over that span: what a row costs whatever else
    runs on the machine)."""
    from rlcd.batch.io import rejects_path

    n = writer.answered + writer.rejected
    return {"output": str(writer.output), "rejects": str(rejects_path(writer.output)), "rows": n,
            "answered": writer.answered, "rejected": writer.rejected, "session_rows": session_rows,
            "seconds": round(seconds, 3), "rows_per_s": round(session_rows / seconds, 3) if seconds > 0 else None,
            "scoring_seconds": None if scoring is None else round(scoring, 3),
            "scoring_rows_per_s": round(session_rows / scoring, 3) if scoring else None,
            "scoring_cpu_seconds": None if scoring_cpu is None else round(scoring_cpu, 3),
            "rows_per_cpu_s": round(session_rows / scoring_cpu, 3) if scoring_cpu else None}


__all__ = ["PredictorSpec", "score_rows", "run_local", "state_key", "windows", "summary", "DEFAULT_BATCH_SIZE",
           "DEFAULT_CHUNK_ROWS"]
