"""`rlcd evaluate --remote URL --data D --out DIR`: any System One endpoint scored with rlcd's statistics.

D's rows go out one request per state (a case's questions together, at most MAX_QUESTIONS per request),
`concurrency` requests at a time (`SystemOneClient` retries a 503/429 after its Retry-After). Each answer is
mapped back to its candidates (`rlcd.remote.answers.map_answer`) and written as a prediction row with
``logits = log max(p, 1e-12)``, so everything downstream is the code an rlcd run uses: temperatures fitted
per type on the remote's calibration answers when D has a calibration split (else T = 1), raw and calibrated
metrics with intervals, the report, the gates. DIR gets the layout of a run's evaluation --
``DIR/eval/{predictions-<split>.jsonl, temperatures.json, evaluation.json, report.md, report.html,
thresholds.json}`` -- plus ``DIR/remote.json``, so ``rlcd compare RUN DIR`` pairs it with any run by case.

Nothing is dropped silently: a question the system did not answer, or answered unusably (wrong type, not a
probability, unknown label, a failed request after retries), is written to ``DIR/eval/unanswered.jsonl`` with
its reason and counted in evaluation.json's ``meta.remote``; rows read == rows scored + rows unanswered, per split
in ``rows_by_split``. Every comparison is made on the rows the model was scored on: the majority baseline is the
training majority's score on the answered rows of the split (the uniform answer and the Bayes floor come from the
scored prediction rows themselves). When more than ``max_lost`` (default 5%) of the rows read got no usable answer
(a server that died mid-run), DIR is still written -- unanswered.jsonl says why each row was lost -- and `RowsLost`
is raised (exit 3); sending stops early once that is certain or the server stops answering (`_send`). When no test
row was answered because every request was refused (a wrong model), nothing is written (exit 2). DIR must be new
or empty; ``force`` replaces an earlier remote evaluation. A calibration split with no answered row says so
(T = 1), never "no split".
Answers rebuilt from a top answer and a confidence (no ``probabilities`` sent) are scored and counted as
reconstructed. With ``order_votes`` N > 1 each choice question is also asked in N-1 other orders
(`rlcd.order_votes`) inside the same request and the answers are combined in candidate space (`vote_combine`).

The rows are the ones `rlcd evaluate` scores (`rlcd.evaluate.scored_records`): original rows only (derived question
forms, `rlcd data derive`, are left out, counted in ``derived_rows_left_out``), each sent in the canonical form
`rlcd serve` asks it (``requests``: canonical; ``--as-asked``: as the data writes it).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlcd.errors import UserError
from rlcd.order_votes import DEFAULT_COMBINE, check_combine, check_votes, combine, permute_question, vote_orders
from rlcd.remote.answers import map_answer
from rlcd.remote.client import SystemOneClient
from rlcd.run import Run, write_json
from rlcd.schema import Question, Record

MAX_QUESTIONS = 64  # System One's limit per request (transformers: 1..64)
FLOOR = 1e-12  # a probability of 0 becomes log(1e-12): the metrics' own floor
FORMAT = "rlcd.remote_evaluation/1"
MAX_LOST = 0.05  # the share of rows read that may go unanswered before the evaluation fails (exit 3)
FAILURES_IN_A_ROW = 8  # requests failed one after another (after their retries) that stop the run: the server is gone


class RowsLost(UserError):
    """More rows than ``--max-lost`` allows got no usable answer, or the server stopped answering; DIR is written
    when any row was answered (``evaluation`` holds its evaluation dict, else None), the command exits 3."""

    exit_code = 3

    def __init__(self, message: str, evaluation: dict[str, Any] | None):
        super().__init__(message)
        self.evaluation = evaluation


@dataclass
class Asked:
    """One question of D asked (in one or more orders) within one request."""

    record: Record
    split: str
    qids: list[str]
    orders: list[list[int]]


@dataclass
class Outgoing:
    body: dict[str, Any]
    asked: list[Asked] = field(default_factory=list)


def case_key(rec: Record) -> str:
    return rec.case_id if rec.case_id is not None else rec.id.split(":", 1)[0]


def wire_question(q: Question) -> dict[str, Any]:
    """A question as the request carries it, in transformers' canonical form (`Question.from_request`): a choice's
    criteria as a mapping label -> description, None where the data gave a label only. rlcd serve also takes a
    list of labels, other servers do not (any2jev 0.1.0 answers 422); both forms render the same prompt."""
    d = q.model_dump(exclude_none=True)
    if q.type == "choice" and isinstance(q.criteria, list):
        d["criteria"] = {label: None for label in q.criteria}
    return d


def build_requests(records: dict[str, list[Record]], model: str, votes: int = 1
                   ) -> tuple[list[Outgoing], list[dict[str, Any]]]:
    """The requests for every split's records (one per state, split at MAX_QUESTIONS questions) and the rows
    that cannot be sent (an image: this client sends text states only), each with its reason."""
    groups: dict[tuple[str, str, str], list[Record]] = {}
    skipped = []
    for split, recs in records.items():
        for rec in recs:
            if rec.image:
                skipped.append({"id": rec.id, "split": split, "kind": "not_sent",
                                "reason": "the row has an image; remote evaluation sends text states only"})
                continue
            state = json.dumps(rec.state, sort_keys=True, ensure_ascii=False)
            groups.setdefault((split, case_key(rec), state), []).append(rec)
    out: list[Outgoing] = []
    for (split, _, _), recs in groups.items():
        req = None
        for rec in recs:
            orders = vote_orders(rec.question.k, votes) if rec.question.type == "choice" else [list(range(rec.question.k))]
            if req is None or len(req.body["questions"]) + len(orders) > MAX_QUESTIONS:
                req = Outgoing({"model": model, "state": rec.state, "questions": {}})
                out.append(req)
            qids = []
            for perm in orders:
                qid = f"q{len(req.body['questions'])}"
                q = rec.question if perm == sorted(perm) else permute_question(rec.question, perm)
                req.body["questions"][qid] = wire_question(q)
                qids.append(qid)
            req.asked.append(Asked(rec, split, qids, orders))
    return out, skipped


def prediction_row(rec: Record, split: str, logits: list[float], reconstructed: str | None) -> dict[str, Any]:
    """The row `rlcd.evaluate.predict_rows` writes, from the remote's logits."""
    from rlcd.evaluate import state_excerpt

    row = {"id": rec.id, "group": rec.group, "type": rec.question.type, "labels": rec.question.labels,
           "target": rec.target, "posterior": rec.posterior, "logits": logits,
           "instructions": rec.question.instructions, "state_excerpt": state_excerpt(rec), "split": split}
    if rec.case_id is not None:
        row["case_id"] = rec.case_id
    if reconstructed:
        row["reconstructed"] = reconstructed
    return row


def read_answers(out: Outgoing, reply, how: str = DEFAULT_COMBINE
                 ) -> tuple[list[tuple[Asked, list[float], str | None]], list[dict[str, Any]]]:
    """(asked, logits, reconstructed) for each usable answer of one request, and the unusable ones with reasons;
    a voted question's orders combined by `how` (`order_votes.combine`)."""
    scored, bad = [], []
    answers = reply.body.get("answers") if reply.error is None and isinstance(reply.body, dict) else None
    for a in out.asked:
        base = {"id": a.record.id, "split": a.split}
        if reply.error is not None:  # attempts 0: never sent, the run stopped first
            bad.append({**base, "kind": "request_failed" if reply.attempts else "not_sent", "reason": reply.error})
            continue
        if not isinstance(answers, dict):
            bad.append({**base, "kind": "malformed", "reason": "the response has no answers object"})
            continue
        per_order, rebuilt, why = [], None, None
        for qid, perm in zip(a.qids, a.orders):
            if qid not in answers:
                why = ("no_answer", f"no answer for question {qid}")
                break
            q = a.record.question if perm == sorted(perm) else permute_question(a.record.question, perm)
            m = map_answer(q, answers[qid])
            if m.probs is None:
                why = ("malformed", m.reason)
                break
            rebuilt = rebuilt or m.reconstructed
            per_order.append([math.log(max(p, FLOOR)) for p in m.probs])
        if why is not None:
            bad.append({**base, "kind": why[0], "reason": why[1]})
            continue
        logits = per_order[0] if len(per_order) == 1 else combine(per_order, a.orders, how)
        scored.append((a, [max(x, math.log(FLOOR)) for x in logits], rebuilt))
    return scored, bad


def check_out_dir(out: Path, force: bool = False) -> Path:
    """DIR for a remote evaluation: new or empty; with `force` also an earlier remote evaluation, which
    `clear_out_dir` empties before the new one is written (a file left from the old one would be read as the new
    one's: `rlcd compare` pairs whatever predictions-*.jsonl it finds). Never a run, never another directory."""
    from rlcd.errors import OptionError

    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out}: exists and is not a directory")
    if (out / Run.CONFIG).is_file():
        raise OptionError(f"--out {out} is a run directory; a remote evaluation goes into a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / "remote.json").is_file():
            raise OptionError(f"--out {out} is not empty and not a remote evaluation; give a new or empty directory")
        if not force:
            raise OptionError(f"--out {out} holds an earlier remote evaluation; give a new directory, or --force to "
                              "replace it (its files are removed first)")
    return out


def clear_out_dir(out: Path) -> None:
    """Empty an earlier remote evaluation (`check_out_dir` with force let it through) before the new one is written."""
    import shutil

    if out.is_dir() and (out / "remote.json").is_file():
        for p in out.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def evaluate_remote(url: str, data_dir: Path, out_dir: Path, *, split: str = "test", api_key: str | None = None,
                    model: str | None = None, concurrency: int = 4, votes: int = 1,
                    vote_combine: str = DEFAULT_COMBINE, progress: bool = True,
                    timeout_s: float = 120.0, retries: int = 4, print_fn: Callable[[str], None] | None = None,
                    client: SystemOneClient | None = None, max_lost: float = MAX_LOST,
                    canonical: bool = True, force: bool = False,
                    failures_in_a_row: int | None = None) -> dict[str, Any]:
    """Score `data_dir`'s `split` (and its calibration split, for the temperatures) on the System One server at
    `url`; write `out_dir` (see the module doc) and return the evaluation dict. The rows are those `rlcd evaluate`
    scores (`rlcd.evaluate.scored_records`): original rows only, each sent in its canonical form (what `rlcd serve`
    asks anyway), or as the data writes it with `canonical` False (`--as-asked`). Inputs and the server are checked
    before anything is written; `RowsLost` (after writing) when more than `max_lost` of the rows read are
    unanswered. Sending stops early (`_send`) once the failed requests alone lose more than `max_lost`, or after
    `failures_in_a_row` (default FAILURES_IN_A_ROW) requests failed one after another; the rows not sent are `not_sent`, and a stop for lost
    connections is `RowsLost` (exit 3) whatever `max_lost` says. `force` replaces an earlier remote evaluation in
    `out_dir` (`check_out_dir`)."""
    from rlcd.calibrate import GUARD, fit_per_type
    from rlcd.data.io import write_jsonl
    from rlcd.errors import OptionError, RunError
    from rlcd.evaluate import SPLITS, _test_look, check_other_data, original_records, requests_form, scored_records
    from rlcd.gate import default_gates
    from rlcd.metrics import majority_baseline
    from rlcd.report import evaluation_from_predictions, write_evaluation, write_report
    from rlcd.train.inputs import data_hashes

    say = print_fn or (lambda _: None)
    votes = check_votes(votes)
    check_combine(vote_combine)
    if concurrency < 1:
        raise OptionError(f"--concurrency must be at least 1, got {concurrency}")
    if not (isinstance(max_lost, (int, float)) and 0 <= max_lost <= 1):
        raise OptionError(f"--max-lost must be a share of the rows between 0 and 1, got {max_lost}")
    if split not in SPLITS:
        raise OptionError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    data = check_other_data(data_dir, recalibrate=False)
    if not (data / f"{split}.jsonl").is_file():
        raise RunError(f"--data {data}: no {split}.jsonl to evaluate (--split names another)")
    out_dir = check_out_dir(out_dir, force)
    records = {split: scored_records(data, split, canonical=canonical)}
    if split != "calibration" and (data / "calibration.jsonl").is_file():
        records["calibration"] = scored_records(data, "calibration", canonical=canonical)
    derived = {s: _derived_rows(data, s) for s in records}
    records = {s: r for s, r in records.items() if r}
    if split not in records:
        raise RunError(f"--data {data}: {split}.jsonl has no original rows")
    own = client is None
    client = client or SystemOneClient(url, api_key=api_key, timeout_s=timeout_s, retries=retries)
    try:
        try:
            name, served, line = client.pick_model(model)  # with --remote-model, /v1/models is a check only
        except ConnectionError as e:
            raise RunError(f"--remote {url}: {e}") from None
        say(line)
        outgoing, skipped = build_requests(records, name, votes)
        started = _dt.datetime.now(_dt.timezone.utc)
        n_read = sum(len(r) for r in records.values())
        results, stopped = _send(client, outgoing, concurrency, progress, n_read, say=say,
                                 may_lose=max_lost * n_read - len(skipped),
                                 failures_in_a_row=failures_in_a_row or FAILURES_IN_A_ROW)
        finished = _dt.datetime.now(_dt.timezone.utc)
    finally:
        if own:
            client.close()
    preds: dict[str, list[dict[str, Any]]] = {s: [] for s in records}
    unanswered = list(skipped)
    reconstructed: Counter[str] = Counter()
    attempts = 0
    for out, reply in zip(outgoing, results):
        attempts += reply.attempts
        scored, bad = read_answers(out, reply, vote_combine)
        unanswered += bad
        for a, logits, rebuilt in scored:
            preds[a.split].append(prediction_row(a.record, a.split, logits, rebuilt))
            if rebuilt:
                reconstructed[rebuilt] += 1
    order = {s: {r.id: i for i, r in enumerate(recs)} for s, recs in records.items()}
    for s in preds:
        preds[s].sort(key=lambda row: order[s][row["id"]])
    assert n_read == sum(len(p) for p in preds.values()) + len(unanswered), "every row is scored or unanswered"
    by_split = {s: {"read": len(records[s]), "answered": len(preds[s])} for s in records}
    lost_by_split = {s: Counter(u["kind"] for u in unanswered if u["split"] == s) for s in records}
    if not preds[split]:
        first = next((u["reason"] for u in unanswered if u["kind"] != "not_sent"), None) or \
            (unanswered[0]["reason"] if unanswered else "none")
        msg = f"--remote {url}: no usable answer for any of the {len(records[split])} {split} rows (first reason: {first})"
        if stopped is not None and stopped.lost_connection:  # the server answered /v1/models, then went away
            raise RowsLost(f"{msg}; {stopped.why}; nothing written", None)
        raise RunError(msg + "; nothing written")

    view = Run(out_dir)
    clear_out_dir(out_dir)
    view.eval_dir.mkdir(parents=True, exist_ok=True)
    remote = {"format": FORMAT, "url": client.base, "model": name, "served_models": served,
              "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
              "seconds": round((finished - started).total_seconds(), 3), "requests": len(outgoing),
              "attempts": attempts, "concurrency": concurrency, "order_votes": votes, "vote_combine": vote_combine, "rows_read": n_read,
              "rows_scored": n_read - len(unanswered), "rows_unanswered": len(unanswered),
              "unanswered_by_kind": dict(Counter(u["kind"] for u in unanswered)), "rows_by_split": by_split,
              "max_lost": max_lost,
              "reconstructed": dict(reconstructed), "data": str(data), "split": split,
              "requests": requests_form(canonical), "derived_rows_left_out": derived}
    write_json(out_dir / "remote.json", remote)
    for s, rows in preds.items():
        write_jsonl(view.predictions_path(s), rows)
    write_jsonl(view.eval_dir / "unanswered.jsonl", unanswered)
    cal = preds.get("calibration") or []
    temps, infos = fit_per_type(cal)
    source = _temperature_source(data, by_split.get("calibration"), lost_by_split.get("calibration"))
    write_json(view.temperatures_path, {"temperatures": temps, "calibration": infos, "n_rows": len(cal),
                                        "source": source, "guard": GUARD, "requests": requests_form(canonical)})
    say(f"temperatures: {source}")
    for qtype, info in infos.items():
        if "fitted_temperature" in info:
            say(f"temperatures: {qtype} kept at T = 1: {info['reason']}")
    train_rows = original_records(data, "train")
    # on the rows the model was scored on: a baseline over rows the model never answered compares nothing
    baseline = majority_baseline(train_rows, preds[split]) if train_rows else None
    meta = {"run": f"{name} at {client.base}", "model": name, "remote": remote, "evaluated_on": str(data),
            "data_hashes": data_hashes(data), "calibration": infos, "temperatures_source": source,
            "order_votes": votes, "vote_combine": vote_combine, "requests": requests_form(canonical),
            "majority_baseline_from": str(data / "train.jsonl") if baseline else None,
            "majority_baseline_on": f"the {len(preds[split])} answered {split} rows" if baseline else None}
    if split == "test":
        meta.update(_test_look(view, data, preds, f"remote:{client.base}:{name}", "evaluate --remote",
                               print_fn or (lambda _: None)))
    if unanswered:
        say(f"unanswered: {len(unanswered)} of {n_read} rows ({', '.join(f'{k} {v}' for k, v in remote['unanswered_by_kind'].items())}); "
            f"listed in {view.eval_dir / 'unanswered.jsonl'}")
    if reconstructed:
        say(f"reconstructed: {sum(reconstructed.values())} answers sent no probabilities "
            f"({', '.join(f'{k}: {v}' for k, v in reconstructed.items())})")
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=baseline)
    write_evaluation(view, ev)
    default_gates(view, say)
    write_report(view, ev=ev)
    say(f"report: {view.report_md}, {view.report_html}")
    lost = len(unanswered)
    over = lost > max_lost * n_read
    if over or (stopped is not None and stopped.lost_connection):
        kinds = ", ".join(f"{k} {v}" for k, v in remote["unanswered_by_kind"].items())
        per = ", ".join(f"{s} {c['answered']} of {c['read']}" for s, c in by_split.items())
        why = f"{stopped.why}; " if stopped is not None else ""
        bound = (f"more than --max-lost {max_lost:g} allows" if over else
                 f"within --max-lost {max_lost:g}, but the server stopped answering")
        raise RowsLost(f"--remote {client.base}: {why}{lost} of {n_read} rows ({lost / n_read:.1%}) got no usable "
                       f"answer ({kinds}; answered: {per}), {bound}; {out_dir} is written (eval/unanswered.jsonl "
                       "says why each row was lost)" + (", --max-lost 1 accepts it" if over and stopped is None else ""),
                       ev)
    return ev


def _derived_rows(data: Path, split: str) -> int:
    """How many derived rows (`rlcd data derive`) `split` holds: left out, as `rlcd evaluate` leaves them out."""
    from rlcd.data.io import load_split

    return sum(1 for r in load_split(data, split) if r.derived is not None)


def _temperature_source(data: Path, counts: dict[str, int] | None, lost: Counter | None) -> str:
    """What temperatures.json and the output say the temperatures were fitted on (or why they were not)."""
    cal = data / "calibration.jsonl"
    if counts is None:
        return "none: the data has no calibration split (T = 1)"
    why = ", ".join(f"{k} {v}" for k, v in (lost or {}).items())
    if counts["answered"] == 0:
        return f"none: none of the {counts['read']} rows of {cal} got a usable answer ({why}): T = 1"
    if counts["answered"] < counts["read"]:
        return (f"fitted per type on the remote's answers to {cal} ({counts['answered']} of {counts['read']} rows "
                f"answered; {why})")
    return f"fitted per type on the remote's answers to {cal}"


@dataclass
class Stopped:
    """Why `_send` stopped sending: `why` in words; `lost_connection` when the last failures got no response."""

    why: str
    lost_connection: bool


def _send(client: SystemOneClient, outgoing: list[Outgoing], concurrency: int, progress: bool, total: int, *,
          say: Callable[[str], None], may_lose: float = math.inf, failures_in_a_row: int = FAILURES_IN_A_ROW
          ) -> tuple[list, Stopped | None]:
    """The replies to `outgoing` in order, and why sending stopped early (None when every request went out).
    The first failed request is said in one line. Sending stops once the rows of failed requests exceed
    `may_lose` (the evaluation would fail whatever the rest answer) or after `failures_in_a_row` failed requests
    in a row (a server that is gone: each failure costs its retries' back-off); the requests not sent get a reply
    with ``attempts=0`` saying why. The progress counts answered and failed rows apart."""
    import threading

    from rlcd.progress import Progress
    from rlcd.remote.client import Reply

    state = {"done": 0, "failed_rows": 0, "in_a_row": 0, "said": False, "stopped": None}
    lock = threading.Lock()
    with Progress("remote", total, unit="rows", enabled=progress and bool(outgoing)) as bar:

        def one(out: Outgoing) -> Reply:
            with lock:
                stopped = state["stopped"]
            if stopped is not None:
                return Reply(None, error=f"not sent: {stopped.why}", attempts=0)
            reply = client.decide(out.body)
            with lock:
                state["done"] += len(out.asked)
                if reply.error is None:
                    state["in_a_row"] = 0
                else:
                    state["failed_rows"] += len(out.asked)
                    state["in_a_row"] += 1
                    if not state["said"]:
                        state["said"] = True
                        say(f"remote: requests are failing: {reply.error} (stopping after {failures_in_a_row} "
                            "failed requests in a row, or once more rows are lost than --max-lost allows)")
                    if state["stopped"] is None and state["in_a_row"] >= failures_in_a_row:
                        state["stopped"] = Stopped(f"stopped after {state['in_a_row']} requests in a row failed "
                                                   f"(last: {reply.error})", reply.status is None)
                    elif state["stopped"] is None and state["failed_rows"] > may_lose:
                        state["stopped"] = Stopped(f"stopped sending once failed requests had lost "
                                                   f"{state['failed_rows']} rows (last: {reply.error})",
                                                   reply.status is None)
                failed = state["failed_rows"]
                bar.update(state["done"], info=f"{failed} rows failed" if failed else "")
            return reply

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            replies = list(pool.map(one, outgoing))
    return replies, state["stopped"]


__all__ = ["MAX_LOST", "RowsLost", "build_requests", "check_out_dir", "evaluate_remote", "map_answer", "read_answers"]
