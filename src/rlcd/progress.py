"""Progress of the long steps (training updates, scoring rows), on stderr.

stdout carries a command's result (the JSON of `rlcd predict`, `rlcd train`, `rlcd calibrate`; the
summary of `rlcd evaluate`), stderr carries what happens on the way: progress, model loading, notices.
So `rlcd evaluate RUN | cat` still shows the progress, and `rlcd predict RUN | jq` reads pure JSON.

On a terminal, `Progress` is a rich bar (done/total, rate, time remaining). Elsewhere (a pipe, a CI
log, a sweep worker's log file) it prints plain lines, one each time another 1/`lines` of the total is
done or `every_s` seconds have passed, and one at the end:

    evaluate test: 1200/4000 rows (30%), 38.2 rows/s, eta 1m13s

rate = units done since the clock started / seconds since then (shown as seconds per unit below one
per second); eta = (total - done) / rate. The clock starts when the bar is made, or again at `ready()`: a
caller that loads a model after making the bar calls it once the model is loaded, so the loading (often most
of a short job) is not counted as slow scoring (`eta 1m25s` for an 11-second job).
`enabled=False` prints nothing (a library caller that wants silence).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text


def echo(message: str) -> None:
    """One status line on stderr (resolved at call time, so a test runner's capture sees it)."""
    print(message, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """42s, 3m05s, 2h07m."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def speed(rate: float, unit: str) -> str:
    """'38.2 rows/s', or '31.0 s/update' below one per second."""
    if 0 < rate < 1:
        return f"{1 / rate:.1f} s/{unit.removesuffix('s')}"
    return f"{rate:.1f} {unit}/s"


class Progress:
    """Counts `done` of `total` units of one step; see the module docstring for what is shown where."""

    def __init__(self, label: str, total: int, *, unit: str = "rows", start: int = 0, enabled: bool = True,
                 bar: bool | None = None, lines: int = 20, every_s: float = 30.0, stream: TextIO | None = None):
        self.label, self.total, self.unit = label, int(total), unit
        self.enabled = enabled
        self.start = self.done = self.since = int(start)
        self.lines, self.every_s = max(1, lines), every_s
        self.stream = stream
        self.t0 = self.t_line = time.perf_counter()
        self.next_line = self._next_mark(self.start)
        self._bar: Any = None
        if not enabled:
            return
        console = Console(file=stream or sys.stderr)
        if console.is_terminal if bar is None else bar:
            self._start_bar(console)

    def _start_bar(self, console: Any) -> None:
        self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[unit]}"), _RateColumn(), _EtaColumn(),
                        TextColumn("{task.fields[info]}"), console=console,
                                 get_time=lambda: time.perf_counter())  # the clock of the plain lines
        self._bar.start()
        self._task = self._bar.add_task(self.label, total=self.total, completed=self.start, unit=self.unit,
                                        first=self.start, info="")

    def ready(self) -> None:
        """Start the clock now (the model is loaded): rate and eta count the units done from here on."""
        self.since = self.done
        self.t0 = self.t_line = time.perf_counter()
        if self._bar is not None:
            self._bar.reset(self._task, start=True, total=self.total, completed=self.done, unit=self.unit,
                            first=self.done, info="")  # reset replaces the fields: all of them again

    def _next_mark(self, done: int) -> int:
        step = max(1, self.total // self.lines)
        return (done // step + 1) * step

    def rate(self) -> float:
        """Units per second since the clock started (construction or `ready()`)."""
        return (self.done - self.since) / max(time.perf_counter() - self.t0, 1e-9)

    def line(self, info: str = "") -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.rate()
        eta = duration((self.total - self.done) / rate) if rate > 0 else "?"
        text = f"{self.label}: {self.done}/{self.total} {self.unit} ({pct:.0f}%), {speed(rate, self.unit)}, eta {eta}"
        return f"{text}, {info}" if info else text

    def update(self, done: int, info: str = "") -> None:
        """`done` units are finished (absolute count); `info` is a short text shown after the counts."""
        self.done = int(done)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=info)
            return
        now = time.perf_counter()
        if self.done >= self.total or self.done >= self.next_line or now - self.t_line >= self.every_s:
            print(self.line(info), file=self.stream or sys.stderr, flush=True)
            self.next_line = self._next_mark(self.done)
            self.t_line = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _task_rate(task: Any) -> float:
    """(done - start) / elapsed of a rich task: the rate of the plain lines."""
    elapsed = task.finished_time if task.finished else task.elapsed
    return (task.completed - task.fields["first"]) / elapsed if elapsed else 0.0


class _RateColumn(ProgressColumn):
    """'38.2 rows/s' (or '31.0 s/update')."""

    def render(self, task: Any) -> Text:
        rate = _task_rate(task)
        return Text(speed(rate, task.fields["unit"]) if rate > 0 else "")


class _EtaColumn(ProgressColumn):
    """'eta 1m13s' = (total - done) / rate."""

    def render(self, task: Any) -> Text:
        rate = _task_rate(task)
        return Text(f"eta {duration((task.total - task.completed) / rate)}" if rate > 0 else "eta ?")


__all__ = ["Progress", "duration", "echo", "speed"]
