"""What every report section reads: the prediction rows, the evaluation content, the run's stored
inputs, and a writer that saves a figure under ``eval/plots/`` and returns its report block."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcd.report.document import Figure
from rlcd.run import Run


class FigureWriter:
    """Saves PNG bytes as ``eval/plots/<name>.png`` (old PNGs are removed first) and returns a ``Figure``."""

    def __init__(self, plots_dir: Path):
        self.dir = plots_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("*.png"):
            old.unlink()

    def add(self, name: str, png: bytes, alt: str, caption: str | None = None) -> Figure:
        (self.dir / f"{name}.png").write_bytes(png)
        return Figure(path=f"{self.dir.name}/{name}.png", alt=alt, png=png, caption=caption)


@dataclass
class Context:
    run: Run
    preds: dict[str, list[dict[str, Any]]]
    ev: dict[str, Any]
    notes: list[str]
    stored: dict[str, Any] | None
    figures: FigureWriter
    training: tuple[list[dict], list[dict], int] | None = None  # (train, eval, unreadable) of metrics.jsonl
    config: dict[str, Any] | None = field(default=None)

    @property
    def meta(self) -> dict[str, Any]:
        return self.ev.get("meta") or {}

    @property
    def name(self) -> str:
        return str(self.meta.get("run") or self.run.root.name)

    @property
    def head(self) -> str:
        return self.ev["headline_split"]

    @property
    def raw(self) -> dict[str, Any]:
        return self.ev["raw"]

    @property
    def cal(self) -> dict[str, Any]:
        return self.ev["calibrated"]

    @property
    def temperatures(self) -> dict[str, float]:
        return self.ev["temperatures"]


def read_config(run: Run) -> dict[str, Any] | None:
    """config.json of the run when it is there and readable (the report's recipe section), else None."""
    try:
        return json.loads(run.config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
