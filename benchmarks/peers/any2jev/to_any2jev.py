#!/usr/bin/env python3
"""Convert an rlcd processed data directory into any2jev's training format.

any2jev (0.1.0) trains on "labelled requests": one JSON object per line, exactly a
`/v1/systemone` request whose questions each carry a hard `label`
(choice -> option key, noul -> bool, score -> level index); see any2jev/data.py.

rlcd rows are one question each, with a soft `target` distribution. This script:
  * groups the rows of one case (`case_id`, else the row `id`) into one any2jev record with the
    case's state and one question per row (question id = the part of the row id after the last
    ':', made unique if needed), in file order;
  * turns each soft target into a HARD label: the argmax of `target`. any2jev's loss is
    cross-entropy on a hard label; the soft targets are lost here. Ties (e.g. a noul at 0.5/0.5:
    262 of rw6's 4,800 train rows) resolve to the first candidate, as rlcd's own accuracy does
    (`--ties first`, the default), or are excluded with a reason (`--ties exclude`);
  * choice criteria given as a list of labels become {label: None} (any2jev needs a mapping);
    noul and score criteria are passed through; noul label = (argmax == 1) ("true" is index 1 in
    rlcd's candidate order ["false", "true"], and in any2jev's too);
  * a state that is not str / object / array (a bare number or bool) becomes its JSON text;
  * rows with an `image` are EXCLUDED (any2jev has no image input), as are rows whose case has a
    different state from the case's first row; every exclusion is written with its reason to
    OUT/excluded.jsonl, and read == used + excluded is printed per split.

Usage (stdlib only, any python3):
    python3 to_any2jev.py RLCD_PROCESSED_DIR OUT_DIR [--splits train,dev,calibration,test] [--ties first|exclude]

Writes OUT_DIR/{split}.jsonl for each split file that exists, plus OUT_DIR/ids.{split}.jsonl
(any2jev record index -> rlcd row ids per question) and OUT_DIR/manifest.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path


def argmax(xs: list[float]) -> int:
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def convert_question(q: dict, target: list[float]) -> dict:
    t = q["type"]
    y = argmax(target)
    out: dict = {"type": t}
    if q.get("instructions") is not None:
        out["instructions"] = q["instructions"]
    crit = q.get("criteria")
    if t == "choice":
        if isinstance(crit, list):
            crit = {str(k): None for k in crit}
        keys = list(crit.keys())
        if len(target) != len(keys):
            raise ValueError(f"target has {len(target)} entries for {len(keys)} choice labels")
        out["criteria"] = crit
        out["label"] = keys[y]
    elif t == "noul":
        if crit is not None:
            out["criteria"] = crit
        if len(target) != 2:
            raise ValueError("noul target must have 2 entries [P(false), P(true)]")
        out["label"] = bool(y == 1)
    elif t == "score":
        if len(target) != len(crit):
            raise ValueError(f"target has {len(target)} entries for {len(crit)} score levels")
        out["criteria"] = list(crit)
        out["label"] = y
    else:
        raise ValueError(f"unknown question type {t!r}")
    return out


def is_tie(target: list[float]) -> bool:
    s = sorted(target)
    return len(s) > 1 and s[-1] == s[-2]


def convert_split(src: Path, dst: Path, ids_dst: Path, excl: list[dict], ties: str = "first") -> dict:
    cases: "OrderedDict[str, dict]" = OrderedDict()
    read = used = 0
    n_excl0 = len(excl)
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            read += 1
            row = json.loads(line)
            rid = row.get("id", f"{src.name}:{n}")
            if row.get("image"):
                excl.append({"file": src.name, "line": n, "id": rid, "reason": "row has an image; any2jev takes no images"})
                continue
            state = row["state"]
            if not isinstance(state, (str, dict, list)):
                state = json.dumps(state, ensure_ascii=False)
            key = row.get("case_id") or rid
            case = cases.setdefault(key, {"state": state, "questions": OrderedDict(), "ids": {}})
            if case["state"] != state:
                excl.append({"file": src.name, "line": n, "id": rid,
                             "reason": f"state differs from the first row of case {key!r}"})
                continue
            if ties == "exclude" and is_tie(row["target"]):
                excl.append({"file": src.name, "line": n, "id": rid, "reason": "target has a tie for the top candidate"})
                continue
            try:
                q = convert_question(row["question"], row["target"])
            except (KeyError, ValueError, TypeError) as e:
                excl.append({"file": src.name, "line": n, "id": rid, "reason": f"cannot convert: {e}"})
                continue
            qid = rid.rsplit(":", 1)[-1] if ":" in rid else f"q{len(case['questions'])}"
            base, k = qid, 2
            while qid in case["questions"]:
                qid, k = f"{base}_{k}", k + 1
            case["questions"][qid] = q
            case["ids"][qid] = rid
            used += 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f, open(ids_dst, "w", encoding="utf-8") as g:
        for key, case in cases.items():
            if not case["questions"]:
                continue
            f.write(json.dumps({"state": case["state"], "questions": case["questions"]}, ensure_ascii=False) + "\n")
            g.write(json.dumps({"case_id": key, "ids": case["ids"]}, ensure_ascii=False) + "\n")
    n_records = sum(1 for c in cases.values() if c["questions"])
    excluded = len(excl) - n_excl0
    assert read == used + excluded, (read, used, excluded)
    return {"read": read, "used": used, "excluded": excluded, "records": n_records}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="rlcd processed directory (train.jsonl, dev.jsonl, ...)")
    ap.add_argument("out", type=Path, help="output directory (any2jev JSONL per split)")
    ap.add_argument("--splits", default="train,dev,calibration,test")
    ap.add_argument("--ties", choices=["first", "exclude"], default="first",
                    help="a target whose top probability is shared: label the first such candidate, or exclude the row")
    a = ap.parse_args(argv)
    if a.out.resolve() == a.src.resolve():
        ap.error("OUT_DIR must differ from the source directory")
    excl: list[dict] = []
    manifest = {"source": str(a.src.resolve()), "label_rule": f"argmax of target (hard label); ties: {a.ties}", "splits": {}}
    for split in a.splits.split(","):
        src = a.src / f"{split}.jsonl"
        if not src.is_file():
            continue
        st = convert_split(src, a.out / f"{split}.jsonl", a.out / f"ids.{split}.jsonl", excl, a.ties)
        manifest["splits"][split] = st
        print(f"{split}: read {st['read']} rows = used {st['used']} + excluded {st['excluded']} -> {st['records']} records")
    with open(a.out / "excluded.jsonl", "w", encoding="utf-8") as f:
        for e in excl:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if not manifest["splits"]:
        print(f"no split files found in {a.src}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
