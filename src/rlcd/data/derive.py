"""Derived question forms with exact targets: one state, the same meaning asked in other words.

For a row with target ``p`` over its K candidates (and posterior ``q`` when known), a derived form is a
new question about the same state whose exact answer is a fixed map of ``p``. Every map here is a
*partition map*: derived candidate j collects a set ``cells[j]`` of base candidates,

    t_j = sum_{i in cells[j]} p_i                      (a cell may be empty: an impossible option, t_j = 0)
    t   = t / sum_j t_j      only for `removed` (the cells leave out the removed option: renormalised)

(``transform``). The same map applied to the posterior gives the derived posterior, and applied to a model's
answer to the base question gives the answer coherence asks of the derived question
(``rlcd.analysis.coherence``). ``derived`` in the written row holds the form, its family, the base row id,
``cells``, ``renormalise`` and the form's own parameters (``option``, ``level``, ``options``, ``blocks``).

Forms (base type, K) -> derived type: exact target, by family:

- **equivalence**: ``noul_as_choice`` noul -> 2-option choice yes/no: (p_true, p_false);
  ``noul_as_score`` noul -> 2-level score (false, true): (p_false, p_true);
  ``binary_as_noul`` 2-option choice or 2-level score -> noul "the second rather than the first?": P(true) = p_1.
- **complement**: ``negated`` noul -> noul asking the negation (descriptions swapped): P(true) = p_false = 1 - p_true;
  ``not_option`` choice -> noul "anything other than o?": 1 - p_o; ``not_level`` score -> noul "not level k?": 1 - p_k.
- **marginal**: ``is_option`` choice -> noul "is the answer o?": p_o; ``tail`` score (K >= 3) -> noul
  "level k or higher?": sum_{l >= k} p_l, k = 1..K-1.
- **merge**: ``merge_two`` choice (K >= 3): options a, b become one option "a or b" at a's place: p_a + p_b;
  ``blocks`` choice (K >= 4): the options grouped into 2 (K < 6) or 3 blocks of near-equal size (members
  drawn at random, listed in base order): block sums; ``merge_levels`` score (K >= 3): adjacent levels
  k, k+1 become one level: p_k + p_{k+1}; ``catch_all`` choice (K >= 3): option o replaced by "none of the
  other options", listed last: p_o there, the others unchanged.
- **submenu**: ``removed`` choice (K >= 3): option o left out, the rest renormalised p_j / (1 - p_o)
  (excluded ``removed_all_mass`` when 1 - p_o <= 1e-12 in the target or the posterior: nothing to renormalise);
  ``added`` choice (K <= 254): an unrelated option (``UNRELATED``: a pancake recipe, the weather on Mars, ...)
  inserted at a random place. Its exact mass is 0: it is no possible answer about any state of this data,
  so P(added) = 0 and the others keep p_j exactly (renormalising by 1 - 0 changes nothing). This is an
  assumption about the data: a set whose states could make such an option true must leave `added` out.
- **order** (only with ``reorder``; the pinned recipe keeps these orders fixed): ``levels_reversed``
  score -> the levels listed high-to-low (level i shows base level K-1-i): p_{K-1-i};
  ``noul_swapped`` noul whose criteria describe false and true differently -> the descriptions swapped:
  (p_true, p_false) (excluded ``undescribed_noul`` otherwise).

Per-option forms (``is_option``, ``not_option``, ``catch_all``, ``removed``, ``merge_two``, ``tail``,
``not_level``, ``merge_levels``) write at most ``per_option`` (default 2) instances per row, the options
(levels, pairs) drawn without replacement. Everything random -- which options, which wording -- comes from
``numpy.random.default_rng`` seeded by sha256(base id, form), so deriving is a pure function of the row.
Wordings: several per form, English and German (the data's languages; other languages get English), our own.
A derived row keeps its base row's state, image, language, source, task, group and split; its ``case_id``
is the base row's case (``rlcd.bootstrap.group_key`` of the base when it has none), so isolation and the
case bootstrap hold. Its id is ``<base id>~<form>`` (``~<n>`` per instance of a per-option form).
Accounting: every instance a form asks of a row is written or excluded with a reason.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from rlcd.errors import UserError
from rlcd.schema import MAX_CANDIDATES, SPLITS, Record, RecordError, parse_record, text_of

FORMAT = "rlcd.derive/1"
FAMILIES: dict[str, str] = {
    "equivalence": "type equivalence",
    "complement": "complement",
    "merge": "partition and merge",
    "marginal": "marginal and tail",
    "submenu": "sub-menu",
    "order": "order and wording",
}
FORMS: dict[str, str] = {  # form -> family, in writing order
    "noul_as_choice": "equivalence", "noul_as_score": "equivalence", "binary_as_noul": "equivalence",
    "negated": "complement", "not_option": "complement", "not_level": "complement",
    "is_option": "marginal", "tail": "marginal",
    "merge_two": "merge", "blocks": "merge", "merge_levels": "merge", "catch_all": "merge",
    "removed": "submenu", "added": "submenu",
    "levels_reversed": "order", "noul_swapped": "order",
}
ORDER_FORMS = tuple(f for f, fam in FORMS.items() if fam == "order")
DEFAULT_FORMS = tuple(f for f in FORMS if f not in ORDER_FORMS)
PER_OPTION = 2
ALL_MASS_TOL = 1e-12
REASONS = ("removed_all_mass", "label_clash", "undescribed_noul", "too_many_candidates", "invalid")
EN, DE = "en", "de"

# --- wordings (our own; {q} the base question's text, {o} / {a} / {b} option or level names) ----------------

WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "noul_as_choice": {EN: ("{q}\nAnswer yes or no.", "{q}\nPick one: yes or no.", "{q}\nChoose the fitting reply."),
                       DE: ("{q}\nAntworten Sie mit ja oder nein.", "{q}\nWählen Sie: ja oder nein.",
                            "{q}\nWählen Sie die passende Antwort.")},
    "noul_as_score": {EN: ("{q}\nRate it on this two-step scale.", "{q}\nPlace it on the scale below."),
                      DE: ("{q}\nOrdnen Sie es auf dieser zweistufigen Skala ein.", "{q}\nWo liegt es auf der Skala?")},
    "binary_as_noul": {EN: ("{q}\nIs it \"{b}\" rather than \"{a}\"?", "{q}\nOf \"{a}\" and \"{b}\", is it \"{b}\"?"),
                       DE: ("{q}\nIst es eher „{b}“ als „{a}“?", "{q}\nVon „{a}“ und „{b}“: ist es „{b}“?")},
    "negated": {EN: ("Is the following false? {q}", "Does the following NOT hold? {q}",
                     "True here means the opposite of: {q}"),
                DE: ("Ist Folgendes falsch? {q}", "Trifft Folgendes NICHT zu? {q}",
                     "Wahr bedeutet hier das Gegenteil von: {q}")},
    "not_option": {EN: ("{q}\nIs the answer anything other than \"{o}\"?", "{q}\nWould you pick an option other "
                        "than \"{o}\"?", "{q}\nIs \"{o}\" the wrong option here?"),
                   DE: ("{q}\nIst die Antwort etwas anderes als „{o}“?", "{q}\nWürden Sie eine andere Option als „{o}“ "
                        "wählen?", "{q}\nIst „{o}“ hier die falsche Option?")},
    "not_level": {EN: ("{q}\nIs the level anything other than \"{o}\"?", "{q}\nIs it not exactly \"{o}\"?"),
                  DE: ("{q}\nIst die Stufe eine andere als „{o}“?", "{q}\nIst es nicht genau „{o}“?")},
    "is_option": {EN: ("{q}\nIs the answer \"{o}\"?", "{q}\nWould you pick \"{o}\"?",
                       "{q}\nIs \"{o}\" the right option here?"),
                  DE: ("{q}\nLautet die Antwort „{o}“?", "{q}\nWürden Sie „{o}“ wählen?",
                       "{q}\nIst „{o}“ hier die richtige Option?")},
    "tail": {EN: ("{q}\nIs it \"{o}\" or higher?", "{q}\nDoes it reach at least \"{o}\"?"),
             DE: ("{q}\nIst es „{o}“ oder höher?", "{q}\nErreicht es mindestens „{o}“?")},
}
JOIN = {EN: (" or ", " / "), DE: (" oder ", " / ")}
CATCH_ALL = {EN: ("none of the other options", "something not listed here"),
             DE: ("keine der anderen Optionen", "etwas, das hier nicht steht")}
YES_NO = {EN: ("yes", "no"), DE: ("ja", "nein")}
UNRELATED = {EN: ("a pancake recipe", "the weather on Mars", "a chess opening", "a species of songbird"),
             DE: ("ein Pfannkuchenrezept", "das Wetter auf dem Mars", "eine Schacheröffnung", "eine Singvogelart")}


def _lang(record: Record) -> str:
    return DE if record.language == DE else EN


def _rng(base_id: str, form: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{base_id}\0{form}\0derive".encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _pick(rng: np.random.Generator, options: Sequence[str]) -> tuple[int, str]:
    i = int(rng.integers(len(options)))
    return i, options[i]


def transform(cells: Sequence[Sequence[int]], p: Sequence[float], renormalise: bool = False) -> np.ndarray:
    """The derived distribution of base distribution ``p``: ``t_j = sum_{i in cells[j]} p_i`` (float64, an empty
    cell gives 0), divided by its sum when ``renormalise``. A sum of 0 there raises ValueError."""
    p = np.asarray(p, dtype=np.float64)
    t = np.array([float(np.sum(p[list(c)])) if len(c) else 0.0 for c in cells], dtype=np.float64)
    if renormalise:
        s = float(t.sum())
        if not s > 0:
            raise ValueError("nothing to renormalise: the kept options hold no mass")
        t = t / s
    return t


def apply_derived(meta: dict, p: Sequence[float]) -> np.ndarray:
    """``transform`` with a derived row's own map (its ``derived`` field)."""
    return transform(meta["cells"], p, bool(meta.get("renormalise")))


# --- one form -> specs ------------------------------------------------------------------------------------
# A spec is (question dict, cells, renormalise, params, wording index); the target follows from the cells.


def _desc(record: Record) -> list[str]:
    """Name of each candidate in words: its label (choice, with its description in parentheses when it has one),
    the level description (score), or the false/true description (noul, else "false"/"true")."""
    q = record.question
    out = []
    for label, d in zip(q.labels, q.descriptions()):
        if q.type == "score":
            out.append(str(d))
        elif q.type == "choice":
            out.append(label if not d else f"{label} ({d})")
        else:
            out.append(d or label)
    return out


def _noul(text: str) -> dict:
    return {"type": "noul", "instructions": text}


def _choice_spec(record: Record, labels: list[str], descs: list[str | None] | None = None):
    q = record.question
    if descs is not None and any(d for d in descs):
        criteria: Any = {lab: d for lab, d in zip(labels, descs)}
    else:
        criteria = list(labels)
    return {"type": "choice", "instructions": q.instructions, "criteria": criteria}


def _instances(rng: np.random.Generator, n: int, per_option: int) -> list[int]:
    return sorted(rng.choice(n, size=min(n, per_option), replace=False).tolist())


def specs_of(record: Record, form: str, per_option: int = PER_OPTION) -> list[tuple[dict, list, bool, dict, int] | tuple[str, str]]:
    """The instances `form` asks of `record`: specs, or (reason, detail) for an instance that cannot be written.
    [] when the form does not apply to the row's type and K."""
    q, k, lang = record.question, record.question.k, _lang(record)
    rng = _rng(record.id, form)
    text = text_of(q.instructions).strip()
    names = _desc(record)
    words = WORDS.get(form, {}).get(lang)

    def worded(**kw) -> tuple[str, int]:
        i, w = _pick(rng, words)
        return w.format(q=text, **kw).strip(), i

    out: list = []
    if form == "noul_as_choice" and q.type == "noul":
        instr, wi = worded()
        yes, no = YES_NO[lang]
        d = q.descriptions()
        spec = _choice_spec(record, [yes, no], [d[1], d[0]])
        spec["instructions"] = instr
        out.append((spec, [[1], [0]], False, {}, wi))
    elif form == "noul_as_score" and q.type == "noul":
        instr, wi = worded()
        d = q.descriptions()
        yes, no = YES_NO[lang]
        out.append(({"type": "score", "instructions": instr, "criteria": [d[0] or no, d[1] or yes]},
                    [[0], [1]], False, {}, wi))
    elif form == "binary_as_noul" and q.type in ("choice", "score") and k == 2:
        instr, wi = worded(a=names[0], b=names[1])
        out.append((_noul(instr), [[0], [1]], False, {}, wi))
    elif form == "negated" and q.type == "noul":
        instr, wi = worded()
        d = q.descriptions()
        criteria = {lab: desc for lab, desc in (("false", d[1]), ("true", d[0])) if desc}
        out.append(({"type": "noul", "instructions": instr, "criteria": criteria or None}, [[1], [0]], False, {}, wi))
    elif form in ("not_option", "is_option") and q.type == "choice":
        for o in _instances(rng, k, per_option):
            instr, wi = worded(o=names[o])
            rest = [i for i in range(k) if i != o]
            cells = [[o], rest] if form == "not_option" else [rest, [o]]
            out.append((_noul(instr), cells, False, {"option": o}, wi))
    elif form == "not_level" and q.type == "score":
        for lv in _instances(rng, k, per_option):
            instr, wi = worded(o=names[lv])
            out.append((_noul(instr), [[lv], [i for i in range(k) if i != lv]], False, {"level": lv}, wi))
    elif form == "tail" and q.type == "score" and k >= 3:
        for lv in (1 + i for i in _instances(rng, k - 1, per_option)):
            instr, wi = worded(o=names[lv])
            out.append((_noul(instr), [list(range(lv)), list(range(lv, k))], False, {"level": lv}, wi))
    elif form == "merge_two" and q.type == "choice" and k >= 3:
        pairs = [(a, b) for a in range(k) for b in range(a + 1, k)]
        for idx in _instances(rng, len(pairs), per_option):
            a, b = pairs[idx]
            wi, join = _pick(rng, JOIN[lang])
            cells = [[a, b] if i == a else [i] for i in range(k) if i != b]
            out.append(_merged(record, cells, join, wi, {"options": [a, b]}))
    elif form == "blocks" and q.type == "choice" and k >= 4:
        n_blocks = 2 if k < 6 else 3
        order = rng.permutation(k).tolist()
        cells = sorted(sorted(order[j::n_blocks]) for j in range(n_blocks))
        wi, join = _pick(rng, JOIN[lang])
        out.append(_merged(record, cells, join, wi, {"blocks": cells}))
    elif form == "merge_levels" and q.type == "score" and k >= 3:
        for lv in _instances(rng, k - 1, per_option):
            wi, join = _pick(rng, JOIN[lang])
            cells = [[lv, lv + 1] if i == lv else [i] for i in range(k) if i != lv + 1]
            criteria = [join.join(names[c] for c in cell) for cell in cells]
            out.append(({"type": "score", "instructions": q.instructions, "criteria": criteria}, cells, False,
                        {"levels": [lv, lv + 1]}, wi))
    elif form == "catch_all" and q.type == "choice" and k >= 3:
        for o in _instances(rng, k, per_option):
            wi, label = _pick(rng, CATCH_ALL[lang])
            rest = [i for i in range(k) if i != o]
            if label in q.labels:
                out.append(("label_clash", f"the catch-all label {label!r} is already an option"))
                continue
            descs = q.descriptions()
            spec = _choice_spec(record, [q.labels[i] for i in rest] + [label],
                                [descs[i] for i in rest] + [None])
            out.append((spec, [[i] for i in rest] + [[o]], False, {"option": o}, wi))
    elif form == "removed" and q.type == "choice" and k >= 3:
        for o in _instances(rng, k, per_option):
            worst = max([record.target[o]] + ([record.posterior[o]] if record.posterior is not None else []))
            if 1.0 - worst <= ALL_MASS_TOL:
                out.append(("removed_all_mass", f"option {q.labels[o]!r} holds all the mass (p = {worst:.17g}): "
                                                "the rest cannot be renormalised"))
                continue
            rest = [i for i in range(k) if i != o]
            descs = q.descriptions()
            spec = _choice_spec(record, [q.labels[i] for i in rest], [descs[i] for i in rest])
            out.append((spec, [[i] for i in rest], True, {"option": o}, 0))
    elif form == "added" and q.type == "choice":
        if k >= MAX_CANDIDATES:
            return [("too_many_candidates", f"{k} options: one more would exceed {MAX_CANDIDATES}")]
        free = [w for w in UNRELATED[lang] if w not in q.labels]
        if not free:
            return [("label_clash", "every unrelated option is already an option")]
        wi, label = _pick(rng, free)
        at = int(rng.integers(k + 1))
        labels, descs = list(q.labels), list(q.descriptions())
        labels.insert(at, label)
        descs.insert(at, None)
        cells: list[list[int]] = [[i] for i in range(k)]
        cells.insert(at, [])
        out.append((_choice_spec(record, labels, descs), cells, False, {"position": at}, wi))
    elif form == "levels_reversed" and q.type == "score":
        rev = list(range(k - 1, -1, -1))
        out.append(({"type": "score", "instructions": q.instructions, "criteria": [q.criteria[i] for i in rev]},
                     [[i] for i in rev], False, {}, 0))
    elif form == "noul_swapped" and q.type == "noul":
        d = q.descriptions()
        f, t = (d[0] or "").strip(), (d[1] or "").strip()
        if not f or not t or f == t:
            return [("undescribed_noul", "noul criteria do not describe false and true differently: no wording "
                                         "to swap")]
        out.append(({"type": "noul", "instructions": q.instructions, "criteria": {"false": d[1], "true": d[0]}},
                    [[1], [0]], False, {}, 0))
    return out


def _merged(record: Record, cells: list[list[int]], join: str, wi: int, params: dict):
    q = record.question
    descs = q.descriptions()
    labels = [join.join(q.labels[i] for i in cell) for cell in cells]
    merged_desc = [join.join(descs[i] for i in cell if descs[i]) or None if len(cell) > 1 else descs[cell[0]]
                   for cell in cells]
    if len(set(labels)) != len(labels):
        return ("label_clash", f"merged labels collide: {labels}")
    return (_choice_spec(record, labels, merged_desc), cells, False, params, wi)


# --- rows -------------------------------------------------------------------------------------------------


def _case_of(record: Record) -> str:
    from rlcd.bootstrap import group_key

    return record.case_id if record.case_id is not None else group_key({"id": record.id})


def derive_record(record: Record, forms: Iterable[str] = DEFAULT_FORMS, *,
                  per_option: int = PER_OPTION) -> tuple[list[Record], list[dict]]:
    """The derived rows of one base row and the exclusions (``{"row", "form", "reason", "detail"}``) of the
    instances that could not be written."""
    if record.derived is not None:
        raise RecordError(record.id, "derived", "is already a derived row; derive from original rows only")
    rows, excluded = [], []
    base = record.model_dump(mode="json")
    for form in forms:
        specs = specs_of(record, form, per_option)
        many = len(specs) > 1 or form in ("is_option", "not_option", "not_level", "tail", "merge_two",
                                          "merge_levels", "catch_all", "removed")
        for n, spec in enumerate(specs):
            rid = f"{record.id}~{form}" + (f"~{n}" if many else "")
            if isinstance(spec[0], str):
                excluded.append({"row": rid, "base": record.id, "form": form, "reason": spec[0], "detail": spec[1]})
                continue
            question, cells, renorm, params, wording = spec
            meta = {"form": form, "family": FORMS[form], "base": record.id, "cells": cells, "renormalise": renorm,
                    **params, "wording": wording}
            obj = {**base, "id": rid, "question": question, "case_id": _case_of(record), "derived": meta,
                   "target": apply_derived(meta, record.target).tolist(),
                   "posterior": (apply_derived(meta, record.posterior).tolist()
                                 if record.posterior is not None else None)}
            try:
                rows.append(parse_record(obj))
            except RecordError as e:
                excluded.append({"row": rid, "base": record.id, "form": form, "reason": "invalid", "detail": str(e)})
    return rows, excluded


def parse_forms(text: str | None, *, reorder: bool = False) -> tuple[str, ...]:
    """``--forms``: comma-separated form or family names (``all``: every form but the order family); ``reorder``
    adds the order family. Unknown names raise UserError listing the known ones."""
    names = [x.strip() for x in (text or "all").split(",") if x.strip()]
    chosen: list[str] = []
    for name in names:
        if name in ("all", "derived"):
            picked = list(DEFAULT_FORMS)
        elif name in FAMILIES:
            picked = [f for f, fam in FORMS.items() if fam == name]
        elif name in FORMS:
            picked = [name]
        else:
            raise UserError(f"--forms {name}: not a form or family (families: {', '.join(FAMILIES)}; forms: "
                            f"{', '.join(FORMS)})")
        chosen += [f for f in picked if f not in chosen]
    if reorder:
        chosen += [f for f in ORDER_FORMS if f not in chosen]
    if not chosen:
        raise UserError("--forms names no form")
    return tuple(f for f in FORMS if f in chosen)


def derive_records(records: Iterable[Record], forms: Iterable[str] = DEFAULT_FORMS, *,
                   per_option: int = PER_OPTION) -> tuple[list[Record], list[dict]]:
    """Every base row followed by its derived rows (input order kept), and the exclusions."""
    forms = tuple(forms)
    out, excluded = [], []
    for r in records:
        rows, ex = derive_record(r, forms, per_option=per_option)
        out += [r, *rows]
        excluded += ex
    return out, excluded


def derive_dir(src: Path, out: Path, forms: Iterable[str] = DEFAULT_FORMS, *, per_option: int = PER_OPTION) -> dict:
    """A processed directory -> one with every split's base rows and their derived rows; returns the manifest.

    ``out/manifest.json`` keeps prepare's keys (``splits``, ``counts``, ``read``, ``used``, ``excluded``,
    ``exclusions``, ``outputs``) so that every consumer of a processed directory reads it, plus ``derive``:
    the forms, the per-form counts per split, the instances asked, written and excluded (by reason), and the
    source manifest. Checked before anything is written: every split file is readable, no row is derived yet.
    ``read`` (base rows) == base rows written; instances asked == derived rows written + instances excluded."""
    from rlcd.data.io import load_split, sha256_file, write_jsonl

    src, out = Path(src), Path(out)
    forms = tuple(forms)
    by_split: dict[str, list[Record]] = {}
    for split in SPLITS:
        if (src / f"{split}.jsonl").is_file():
            by_split[split] = load_split(src, split)
    for rows in by_split.values():
        for r in rows:
            if r.derived is not None:
                raise RecordError(r.id, "derived", f"{src} already holds derived rows; derive from the original "
                                                   "processed directory")
    written: dict[str, list[Record]] = {}
    excluded: list[dict] = []
    per_form: dict[str, dict[str, int]] = {f: {s: 0 for s in SPLITS} for f in forms}
    for split, rows in by_split.items():
        written[split], ex = derive_records(rows, forms, per_option=per_option)
        excluded += [{**e, "split": split} for e in ex]
        for r in written[split]:
            if r.derived is not None:
                per_form[r.derived["form"]][split] += 1
    n_base = sum(len(v) for v in by_split.values())
    n_derived = sum(sum(v.values()) for v in per_form.values())
    asked = n_derived + len(excluded)
    base_written = sum(1 for rows in written.values() for r in rows if r.derived is None)
    if base_written != n_base:
        raise RuntimeError(f"derive: read {n_base} base rows but wrote {base_written}")
    source_manifest = src / "manifest.json"
    base_manifest = json.loads(source_manifest.read_text(encoding="utf-8")) if source_manifest.is_file() else {}
    out.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for split, rows in written.items():
        write_jsonl(out / f"{split}.jsonl", rows)
        outputs[f"{split}.jsonl"] = sha256_file(out / f"{split}.jsonl")
    write_jsonl(out / "derive-excluded.jsonl", excluded)
    outputs["derive-excluded.jsonl"] = sha256_file(out / "derive-excluded.jsonl")
    if (src / "excluded.jsonl").is_file():
        shutil.copyfile(src / "excluded.jsonl", out / "excluded.jsonl")
        outputs["excluded.jsonl"] = sha256_file(out / "excluded.jsonl")
    if (src / "images").is_dir():
        shutil.copytree(src / "images", out / "images", dirs_exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for split, rows in written.items():
        for r in rows:
            counts.setdefault(r.group, {s: 0 for s in SPLITS})[split] += 1
    manifest = {
        **{k: v for k, v in base_manifest.items() if k not in ("outputs", "splits", "counts", "used")},
        "render_check": None,  # the derived rows were not rendered; `rlcd train` checks its rows at the start
        "splits": {s: len(written.get(s, [])) for s in SPLITS},
        "counts": dict(sorted(counts.items())),
        "used": n_base + n_derived,
        "outputs": dict(sorted(outputs.items())),
        "derive": {
            "format": FORMAT, "source": str(src.resolve()), "forms": list(forms), "per_option": per_option,
            "base_rows": n_base, "base_written": base_written, "derived_written": n_derived,
            "instances": asked, "excluded": len(excluded),
            "exclusions": dict(sorted(Counter(e["reason"] for e in excluded).items())),
            "per_form": {f: c for f, c in per_form.items()},
            "per_family": {fam: sum(sum(per_form[f].values()) for f in forms if FORMS[f] == fam)
                           for fam in FAMILIES if any(FORMS[f] == fam for f in forms)},
            "source_outputs": base_manifest.get("outputs", {}),
            "source_render_check": base_manifest.get("render_check"),
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest
