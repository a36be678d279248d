"""Gate decisions on served answers (`"x_gate": true` in a request), from the run's `eval/thresholds.json`.

Why: System One users gate on probabilities (act on the confident answers, escalate the rest), and `rlcd gate`
writes the cut-points in jev-eval's `thresholds.json` contract (`rlcd.gate`). With it loaded, `rlcd serve` adds to
each answer of a request that asks for it

    "x_gate": {"decision": "auto" | "escalate", "confidence": c, "threshold": t, "gate": "questions.team"}

where c is the answer's gate confidence (choice and score `confidence`, noul `|noul - 0.5| * 2`) and the decision
is "auto" when c >= t. The gate is the file's `questions.<id>` whose `definitions` entry is the same question
(type, instructions, option labels and descriptions; the question id in the request may differ), else the file's
per-type gate (`x_rlcd.types.<type>`); an answer without either gets `{"decision": null, "gate": null}`. The
response also carries a row decision, `"x_gate": {"decision", "confidence": min over the choice/score answers,
"threshold", "gate": "x_rlcd.rowGate"}` (null decision when there is no row gate or no choice/score answer).
Every name is `x_`-prefixed, the family's convention for extensions, so the official SDK and jevcompat ignore them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from rlcd.schema import Question, RecordError, parse_question


def answer_confidence(answer: Mapping[str, Any]) -> float | None:
    """The gate confidence of a wire answer (rlcd.gate.gate_confidence, read off the answer)."""
    if answer.get("type") == "noul":
        return abs(float(answer["noul"]) - 0.5) * 2
    c = answer.get("confidence")
    return float(c) if isinstance(c, (int, float)) else None


def question_key(q: Question) -> str:
    """What makes two questions the same question for a gate: type, instructions, labels and descriptions."""
    return json.dumps([q.type, q.instructions, q.labels, q.descriptions()], sort_keys=True, ensure_ascii=False)


def _verdict(c: float, threshold: float) -> str:
    return "auto" if c >= threshold else "escalate"


class Gates:
    """The gates of one `thresholds.json` (contract version 1, with or without rlcd's `x_rlcd`)."""

    def __init__(self, doc: Mapping[str, Any], source: str = "thresholds.json"):
        if not isinstance(doc, Mapping) or doc.get("version") != 1 or not isinstance(doc.get("questions"), Mapping):
            raise ValueError(f"{source}: not a thresholds.json (contract version 1)")
        self.source = source
        self.doc = dict(doc)
        self.by_definition: dict[str, tuple[str, float]] = {}
        definitions = doc.get("definitions") or {}
        for qid, entry in doc["questions"].items():
            d = definitions.get(qid)
            if not isinstance(d, Mapping):
                continue
            try:
                q = parse_question(dict(d), qid=str(qid), min_candidates=1)
            except (RecordError, ValueError, TypeError):
                continue
            self.by_definition[question_key(q)] = (f"questions.{qid}", float(entry["threshold"]))
        ext = doc.get("x_rlcd") or {}
        self.by_type = {t: (f"x_rlcd.types.{t}", float(e["threshold"])) for t, e in (ext.get("types") or {}).items()}
        row = ext.get("rowGate")
        self.row = ("x_rlcd.rowGate", float(row["threshold"])) if row else None

    @classmethod
    def load(cls, path: Path | str) -> "Gates":
        path = Path(path)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a thresholds.json ({e})") from None
        return cls(doc, str(path))

    def gate_for(self, q: Question) -> tuple[str, float] | None:
        return self.by_definition.get(question_key(q)) or self.by_type.get(q.type)

    def decide(self, q: Question, c: float) -> str | None:
        """An answer's decision from its gate confidence `c`: "auto", "escalate", or None (no gate covers `q`)."""
        gate = self.gate_for(q)
        return None if gate is None else _verdict(c, gate[1])

    @staticmethod
    def _decision(c: float | None, gate: tuple[str, float] | None) -> dict[str, Any]:
        if gate is None or c is None:
            return {"decision": None, "confidence": c, "threshold": None, "gate": None}
        return {"decision": _verdict(c, gate[1]), "confidence": c, "threshold": gate[1], "gate": gate[0]}

    def annotate(self, response: dict[str, Any], qids: list[str], questions: list[Question]) -> dict[str, Any]:
        """`response` with `x_gate` on each answer and on the response (the module docstring)."""
        gated = []
        for qid, q in zip(qids, questions):
            answer = response["answers"][qid]
            c = answer_confidence(answer)
            answer["x_gate"] = self._decision(c, self.gate_for(q))
            if q.type in ("choice", "score") and c is not None:
                gated.append(c)
        response["x_gate"] = self._decision(min(gated) if gated else None, self.row)
        return response


__all__ = ["Gates", "answer_confidence", "question_key"]
