"""What a reader must know before trusting the numbers: an unfinished run, an untrained selected
checkpoint, data that changed under the run, a test split already scored before (`rlcd.data.looks`), the rows a
remote evaluation got answers for (per split). The CLI summary and the report both print these lines."""

from __future__ import annotations

from typing import Any, Mapping


def result_notes(meta: Mapping[str, Any] | None) -> list[str]:
    """Plain sentences (no markup) from an evaluation's metadata; empty when there is nothing to say."""
    meta = meta or {}
    out = []
    prog = meta.get("training_progress") or {}
    step, steps = prog.get("step"), prog.get("steps")
    if isinstance(step, int) and isinstance(steps, int) and step < steps:
        out.append(f"the run stopped at update {step} of {steps}: these numbers are from an unfinished run "
                   f"(finish it with `rlcd train --resume {meta.get('run', 'RUN')}`)")
    if meta.get("selected_step") == 0:
        out.append("the selected checkpoint is the untrained step 0: no dev evaluation beat the starting model")
    changed = meta.get("data_changed") or {}
    if changed.get("files"):
        out.append(f"data files changed since the run started ({', '.join(changed['files'])}); scored on the new "
                   "data as --allow-data-change asked")
    remote = meta.get("remote") or {}
    by_split = remote.get("rows_by_split") if isinstance(remote, Mapping) else None
    if by_split:  # rlcd evaluate --remote: which rows the numbers are on
        per = ", ".join(f"{s} {c.get('answered')} of {c.get('read')}" for s, c in by_split.items())
        out.append(f"remote: {remote.get('rows_scored')} of {remote.get('rows_read')} rows read were answered ({per}); "
                   "the model, the majority baseline, the uniform answer and the Bayes floor are all scored on the "
                   "answered rows")
    from rlcd.data.looks import looks_note

    looked = looks_note(meta.get("test_looks"))
    if looked:
        out.append(looked)
    return out
