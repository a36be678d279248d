"""Final evaluation of a run: merged best model -> raw predictions -> temperatures -> metrics.

Writes `eval/predictions-{dev,calibration,test}.jsonl` (raw logits, enough to regenerate every
number), fits one temperature per type on the calibration split only, writes
`eval/evaluation.json` (raw and calibrated side by side, with bootstrap intervals), `export/`,
`eval/report.md` and `eval/report.html`. `evaluate_on_data` scores the same model on another processed
data set into `eval-NAME/` (same files, no export).

Order votes (`order_votes` N > 1, `rlcd evaluate --order-votes N`; `rlcd.order_votes`): every choice row is also
scored with its options in N-1 other orders, as more rows of its case (its state runs once), and its prediction
row's `logits` are the voted ones; temperatures, metrics, gates and the report are those of the voted answers, and
evaluation.json's meta and eval/temperatures.json record `order_votes`. The feature and cut-state caches hold each
row in its own order only, so a voted evaluation runs the backbone live. `vote_combine` (`--vote-combine`, default
logmean; `order_votes.combine`) is how the orders are combined, recorded beside `order_votes`. It writes no export/: export/ and
export/hf/ carry plain answers, whose temperatures a voted calibration does not fit.

Scoring a split is the long part (thousands of rows through the backbone): with `progress` on (the
default) each split shows rows done / total, rows per second and the time left on stderr
(`rlcd.progress`: a bar on a terminal, plain lines in a pipe or log); `progress=False` is silent.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from rlcd import checkpoint as ckpt
from rlcd.calibrate import GUARD, MIN_ROWS, fit_per_type
from rlcd.device import Placement, resolve_placement
from rlcd.export import checkpoint_identity, load_checkpoint_model, write_export
from rlcd.progress import Progress, echo
from rlcd.run import Run, write_json
from rlcd.order_votes import DEFAULT_COMBINE
from rlcd.schema import Record, text_of

SPLITS = ("dev", "calibration", "test")
STATE_EXCERPT = 240  # characters of the state kept in a prediction row (the report's error analysis)


def state_excerpt(rec: Record) -> str:
    """The first STATE_EXCERPT characters of the state's prompt text (+ its image file, if any)."""
    text = " ".join(text_of(rec.state).split())
    text = text if len(text) <= STATE_EXCERPT else text[: STATE_EXCERPT - 1] + "…"
    return f"{text} [image {rec.image}]" if rec.image else text


@torch.no_grad()
def predict_rows(model, records: list[Record], collator, *, device="cpu", batch_size: int = 32,
                 split: str | None = None, progress: bool = False, shared: bool = True,
                 features=None, source=None, order_votes: int = 1,
                 vote_combine: str = DEFAULT_COMBINE) -> list[dict[str, Any]]:
    """One prediction row per record: id, group, type, labels, target, posterior, raw logits, and for
    reading the errors the question's ``instructions`` and a ``state_excerpt`` (older prediction files
    lack these two; every reader treats them as optional). Rows come back in the order of `records`.

    `shared` (default): each case's state runs once and its questions as suffixes on its cache, several
    cases per call of at most max(`batch_size`, 64) rows (`rlcd.model.case_scoring.score_records`; logits
    equal the full-row ones up to float32 noise); `shared=False`: every record as a full row,
    `batch_size` rows per forward (the reference). `features`: a `rlcd.features.FeatureCache` whose key
    matches this model, read instead of running the backbone; `source`: any `rlcd.train.sources` source
    (the cut-state cache of a `lora_layers` run: only the layers above the cut run). `progress`: show rows done / total
    ("score <split>") on stderr while scoring.

    `order_votes` N > 1: each choice record is also scored in the other orders of `order_votes.vote_orders(K, N)`
    (more rows of its case, so its state runs once; live only: the caches hold one order, so `features` and
    `source` are refused) and its row's `logits` are `order_votes.combine(..., vote_combine)`; noul and score rows as
    they are.
    """
    from rlcd.model.case_scoring import full_row_logits
    from rlcd.order_votes import check_votes
    from rlcd.train.sources import CachedFeatures, LiveSource

    given = None  # with order votes: the records as given (`records` becomes the records as asked)
    if check_votes(order_votes) > 1:
        if source is not None or features is not None:
            raise ValueError("order votes score other option orders, which no feature or cut-state cache holds: "
                             "score them live (features=None, source=None)")
        records, given = _asked_records(records, order_votes), records
    with Progress(f"score {split or 'rows'}", len(records), enabled=progress and bool(records)) as bar:
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            bar.update(done[0])

        if source is None and features is not None:
            source = CachedFeatures(features, device)
        if source is not None:
            logits = source.logits(model, split, records, on_rows=advance)
        elif shared:
            logits = LiveSource(collator, device, max_rows=max(batch_size, 64)).logits(model, split, records,
                                                                                       on_rows=advance)
        else:
            logits = full_row_logits(model, collator, records, batch_size=batch_size, device=device, on_rows=advance)
    if given is not None:
        records, logits = given, _voted_logits(given, logits, order_votes, vote_combine)
    rows = []
    for rec, lg in zip(records, logits):
        row = {"id": rec.id, "group": rec.group, "type": rec.question.type, "labels": rec.question.labels,
               "target": rec.target, "posterior": rec.posterior, "logits": lg.tolist(),
               "instructions": rec.question.instructions, "state_excerpt": state_excerpt(rec)}
        if split is not None:
            row["split"] = split
        if rec.case_id is not None:
            row["case_id"] = rec.case_id
        rows.append(row)
    # round-trip through JSON so in-memory rows equal what the files hold, bit for bit
    return json.loads(json.dumps(rows))


VOTE_CASE = "order-votes/"  # the case id of a voted record without one (its orders must share a case)


def _asked_records(records: list[Record], n: int) -> list[Record]:
    """`records`, then each choice record's other orders as records of its case (question, target and posterior
    permuted; id `ID#order-J`). A voted record without a case_id gets one (`VOTE_CASE` + id) here, so that its
    orders share its state's prefix."""
    from rlcd.order_votes import permute_question, vote_orders

    own, extra = [], []
    for rec in records:
        orders = vote_orders(rec.question.k, n) if rec.question.type == "choice" else [None]
        if len(orders) > 1 and rec.case_id is None:
            rec = rec.model_copy(update={"case_id": VOTE_CASE + rec.id})
        own.append(rec)
        for j, perm in enumerate(orders[1:], 1):
            extra.append(rec.model_copy(update={
                "id": f"{rec.id}#order-{j}", "question": permute_question(rec.question, perm),
                "target": [rec.target[i] for i in perm],
                "posterior": None if rec.posterior is None else [rec.posterior[i] for i in perm]}))
    return own + extra


def _voted_logits(records: list[Record], logits: list[Any], n: int, how: str = DEFAULT_COMBINE) -> list[Any]:
    """The logits of `_asked_records(records, n)` -> one vector per record (`order_votes.voted`, record by record)."""
    from rlcd.order_votes import vote_plan, voted

    plan = vote_plan([r.question for r in records], n)
    return voted(logits, plan, how)


def _collator(model, data_dir: Path):
    return model.collator(image_root=data_dir)


def original_records(data_dir: Path, split: str) -> list[Record]:
    """The split's original rows: derived question forms (`rlcd data derive`) are for training and for
    `rlcd probe coherence`, never calibrated on or scored as originals ([] when the split has no file)."""
    from rlcd.data.io import load_split

    data_dir = Path(data_dir)
    rows = load_split(data_dir, split) if (data_dir / f"{split}.jsonl").is_file() else []
    return [r for r in rows if r.derived is None]


def scored_records(data_dir: Path, split: str, *, canonical: bool = True) -> list[Record]:
    """The rows an evaluation of `split` scores, on every path (`rlcd evaluate` and its temperature fit, `rlcd
    calibrate`, `evaluate --remote`, the bf16 and ONNX parity gates): the original rows (`original_records`), each
    in the canonical form `rlcd serve` asks it by default (`serving.canonical.canonical_record`: options in
    canonical order, duplicates once with their targets summed, a yes/no choice or score as a noul); with
    `canonical` False (`--as-asked`) as the data writes them."""
    from rlcd.serving.canonical import canonical_records

    return canonical_records(original_records(data_dir, split), canonical)


def requests_form(canonical: bool) -> str:
    """What evaluation.json, temperatures.json and the gates record as the form the rows were asked in."""
    return "canonical" if canonical else "as_asked"


def _records(config: dict, split: str, canonical: bool = False) -> list[Record]:
    return scored_records(Path(config["data_dir"]), split, canonical=canonical)


def _form(q) -> tuple:
    """A question's form, option order included (pydantic's == on a mapping of criteria ignores its order)."""
    return q.type, q.instructions, tuple(q.labels), tuple(q.descriptions())


def _score(model, config: dict, split: str, records: list[Record], placement: Placement,
           progress: bool, source=None, order_votes: int = 1, vote_combine: str = DEFAULT_COMBINE) -> list[dict]:
    """Prediction rows of `records`; `source` (a feature or cut-state cache) serves the rows it holds in the form
    they are asked, the rest (rows asked in a canonical form other than the written one: the caches hold each
    row as written) run live."""
    collator = _collator(model, Path(config["data_dir"]))
    usable = source is not None and source.cache.has(split, (r.id for r in records))
    if usable:
        written = {r.id: _form(r.question) for r in original_records(Path(config["data_dir"]), split)}
        live = [r for r in records if written.get(r.id) != _form(r.question)]
        if live:
            held = [r for r in records if written.get(r.id) == _form(r.question)]
            rows = {row["id"]: row for row in
                    predict_rows(model, held, collator, split=split, device=placement.torch_device,
                                 progress=progress, source=source, order_votes=order_votes,
                                 vote_combine=vote_combine)
                    + predict_rows(model, live, collator, split=split, device=placement.torch_device,
                                   progress=progress, order_votes=order_votes, vote_combine=vote_combine)}
            return [rows[r.id] for r in records]
    return predict_rows(model, records, collator, split=split,
                        device=placement.torch_device, progress=progress, source=source if usable else None,
                        order_votes=order_votes, vote_combine=vote_combine)


def _features(model, config: dict, use: bool, say: Callable[[str], None] | None = None):
    """Where the merged model's features come from, as a `rlcd.train.sources` source: the data directory's
    feature cache when its key matches (a head-only run, whose LoRA merges to the base weights), else its
    cut-state cache (a `lora_layers` run: the layers below the cut are untouched by the merge), else None
    (the backbone runs)."""
    if not use:
        return None
    from rlcd.cut_cache import find_cut_states
    from rlcd.features import find_features
    from rlcd.train.sources import CachedFeatures, CutStates

    data_dir, device = Path(config["data_dir"]), model.device
    found = find_features(model, data_dir)
    if found is not None:
        if say:
            say(f"features: reading the cached frozen features {found.root} (--no-cache runs the backbone)")
        return CachedFeatures(found, device)
    cut = find_cut_states(model, data_dir)
    if cut is not None:
        if say:
            say(f"cut states: reading {cut.root}; layers {model.cut_layer}..{model.num_layers - 1} run "
                "(--no-cache runs the backbone)")
        return CutStates(cut, device)
    return None


def _calibration_key(run: Run, placement: Placement, which: str = "best", order_votes: int = 1,
                     vote_combine: str = DEFAULT_COMBINE, canonical: bool = True) -> dict[str, Any]:
    """What the temperatures depend on: the evaluated checkpoint, the calibration data, the placement, the order
    votes and their combination (recorded only when > 1: a file without the key was fitted on plain answers), the
    form the rows were asked in (`requests`: canonical or as_asked; a file without it was fitted as asked, so it is
    refitted) and the fit's guard (`rlcd.calibrate.GUARD`: a file fitted before the held-out guard has none, so it
    is refitted)."""
    from rlcd.data.io import sha256_file

    cal = run.data_dir / "calibration.jsonl"
    return {"checkpoint_sha256": ckpt.weights_sha256(run.require_checkpoint(which)),
            "calibration_sha256": sha256_file(cal) if cal.is_file() else None, **placement.to_dict(),
            **({"order_votes": order_votes, "vote_combine": vote_combine} if order_votes > 1 else {}), "guard": GUARD,
            "requests": requests_form(canonical)}


def fit_temperatures(run: Run, calibration_rows: list[dict], placement: Placement,
                     which: str = "best", order_votes: int = 1, vote_combine: str = DEFAULT_COMBINE,
                     canonical: bool = True) -> dict[str, Any]:
    """Fit the per-type temperatures on the calibration predictions and store them in eval/temperatures.json.

    The one calibration path: `rlcd calibrate RUN` ends here, and `rlcd evaluate RUN` reuses the stored
    temperatures when they were fitted on the same checkpoint, calibration data and placement (else it
    fits them here and stores them); the export carries the same numbers.
    """
    temps, infos = fit_per_type(calibration_rows)
    out = {"temperatures": temps, "calibration": infos, "n_rows": len(calibration_rows),
           **_calibration_key(run, placement, which, order_votes, vote_combine, canonical)}
    write_json(run.temperatures_path, out)
    return out


def stored_temperatures(run: Run, placement: Placement, which: str = "best",
                        order_votes: int = 1, vote_combine: str = DEFAULT_COMBINE,
                        canonical: bool = True) -> dict[str, Any] | None:
    """eval/temperatures.json when it matches this checkpoint, calibration data, placement, order votes and the form
    the rows are asked in."""
    if not run.temperatures_path.is_file():
        return None
    stored = json.loads(run.temperatures_path.read_text())
    key = _calibration_key(run, placement, which, order_votes, vote_combine, canonical)
    same = all(stored.get(k) == v for k, v in key.items()) and stored.get("order_votes", 1) == order_votes
    return stored if same else None


def frozen_data_changes(run: Run, allow: bool = False, say: Callable[[str], None] | None = None) -> list[str]:
    """The data files (train/dev/calibration/test) whose sha256 differs from what the run froze at its start.

    Scoring a run on data it was not trained, selected and calibrated with silently mixes two data
    sets (rows may even have moved between splits), so a change is refused (`DataChanged`, exit 2)
    unless `allow` (`--allow-data-change`); then it is only reported through `say` and recorded.
    """
    from rlcd.errors import DataChanged
    from rlcd.train import data_hashes

    frozen = run.samples().get("files") if run.samples_path.is_file() else None
    if frozen is None:  # no hashes were frozen (an incomplete or hand-made run): nothing to compare with
        return []
    now = data_hashes(run.data_dir)
    changed = sorted(k for k in set(now) | set(frozen) if now.get(k) != frozen.get(k))
    if changed and not allow:
        raise DataChanged(f"{run.root}: data files changed since the run started ({', '.join(changed)} in "
                          f"{run.data_dir}); restore them, or pass --allow-data-change to score on the new data")
    if changed and say is not None:
        say(f"warning: data files changed since the run started ({', '.join(changed)}); scoring on the new data "
            "as --allow-data-change asks (recorded in evaluation.json)")
    return changed


def calibrate_run(run: Run | Path, *, placement: Placement | None = None, which: str = "best",
                  progress: bool = True, allow_data_change: bool = False,
                  feature_cache: bool = True, canonical: bool = True) -> dict[str, Any]:
    """Fit per-type temperatures on the calibration partition with the merged `which` checkpoint
    (holding the run's lock; refused when the run's frozen data changed, unless `allow_data_change`); each row
    asked in its canonical form (`scored_records`) unless `canonical` is False (`--as-asked`)."""
    run = run if isinstance(run, Run) else Run.open(run)
    run.require_checkpoint(which)
    changed = frozen_data_changes(run, allow_data_change, echo)
    with run.lock("calibrate"):
        out = _calibrate_run(run, placement=placement, which=which, progress=progress, feature_cache=feature_cache,
                             canonical=canonical)
        if changed:
            out["data_changed"] = changed
            write_json(run.temperatures_path, out)
        return out


def _calibrate_run(run: Run, *, placement: Placement | None, which: str, progress: bool,
                   feature_cache: bool = True, canonical: bool = True) -> dict[str, Any]:
    placement = placement or resolve_placement("cpu")
    model, config, _ = load_checkpoint_model(run, which, placement=placement)
    rows = _score(model, config, "calibration", _records(config, "calibration", canonical), placement, progress,
                  _features(model, config, feature_cache))
    return fit_temperatures(run, rows, placement, which, canonical=canonical)


def evaluate_run(run: Run | Path, *, placement: Placement | None = None,
                 print_fn: Callable[[str], None] | None = None, which: str = "best",
                 progress: bool = True, allow_data_change: bool = False,
                 feature_cache: bool = True, export: bool = True, command: str = "evaluate",
                 order_votes: int = 1, vote_combine: str = DEFAULT_COMBINE, canonical: bool = True) -> dict[str, Any]:
    """Score every held-out split, calibrate, write eval/ and export/, and render the report (see
    `_evaluate_run`), holding the run's lock; each row asked in the canonical form `rlcd serve` asks it
    (`scored_records`; `canonical` False: as the data writes it, `--as-asked`), recorded as meta.requests;
    refused when the data the run froze at its start changed,
    unless `allow_data_change` (then the changed files are recorded in evaluation.json's meta).
    `order_votes` N > 1: the voted answers are evaluated (module docstring; no export/ is written).
    `export=False` writes no export/ (a sweep's runs: `rlcd export RUN` writes it later). The test split's
    scoring is recorded beside it as one look (`rlcd.data.looks`; `command` names who looked), and earlier
    looks are said on stderr (`print_fn`, else stderr) and in the report."""
    from rlcd.order_votes import check_combine, check_votes

    check_votes(order_votes)
    check_combine(vote_combine)
    run = run if isinstance(run, Run) else Run.open(run)
    run.require_checkpoint(which)
    changed = frozen_data_changes(run, allow_data_change, print_fn or echo)
    with run.lock("evaluate"):
        return _evaluate_run(run, placement=placement, print_fn=print_fn, which=which, progress=progress,
                             data_changed=changed, feature_cache=feature_cache, export=export, command=command,
                             order_votes=order_votes, vote_combine=vote_combine, canonical=canonical)


def _evaluate_run(run: Run, *, placement: Placement | None, print_fn: Callable[[str], None] | None,
                  which: str, progress: bool, data_changed: list[str],
                  feature_cache: bool = True, export: bool = True, command: str = "evaluate",
                  order_votes: int = 1, vote_combine: str = DEFAULT_COMBINE, canonical: bool = True) -> dict[str, Any]:
    """Score every held-out split, calibrate, write eval/ and export/, and render the report.

    `which`: the dev-selected checkpoint ("best", the recipe) or the "last" one (what the final
    update left, e.g. when no evaluation beat the untrained step 0). `print_fn` receives the status
    lines (none by default); `progress` shows each split's scoring. `feature_cache`: read the data
    directory's cached features when they match the merged model (a head-only run), else run the backbone.
    """
    from rlcd.data.io import write_jsonl
    from rlcd.metrics import majority_baseline
    from rlcd.report import evaluation_from_predictions, write_evaluation, write_report
    from rlcd.train import data_hashes

    run = run if isinstance(run, Run) else Run.open(run)
    placement = placement or resolve_placement("cpu")
    say = print_fn or (lambda _: None)
    model, config, state = load_checkpoint_model(run, which, placement=placement)
    records = {split: _records(config, split, canonical) for split in SPLITS}
    if order_votes > 1:
        say(f"order votes: each choice question in {order_votes} option orders, combined by {vote_combine}, scored "
            "live (the feature and "
            "cut-state caches hold one order)")
    features = _features(model, config, feature_cache and order_votes == 1, say)
    preds = {split: _score(model, config, split, records[split], placement, progress, features, order_votes,
                           vote_combine)
             for split in SPLITS}
    for split, rows in preds.items():
        write_jsonl(run.predictions_path(split), rows)
    stored = stored_temperatures(run, placement, which, order_votes, vote_combine, canonical)
    if stored is not None:
        say(f"temperatures: {run.temperatures_path} (fitted by `rlcd calibrate` on this checkpoint)")
    else:
        say(f"temperatures: fitting one per type on {len(preds['calibration'])} calibration rows -> "
            f"{run.temperatures_path}")
    cal = stored or fit_temperatures(run, preds["calibration"], placement, which, order_votes, vote_combine, canonical)
    temps, infos = cal["temperatures"], cal["calibration"]
    data_dir = Path(config["data_dir"])
    baseline = majority_baseline(_records(config, "train"), _records(config, "test")) if records["test"] else None
    meta = {
        **_run_meta(run, config, state, which),
        "data_hashes": data_hashes(data_dir),
        "calibration": infos,
        "temperatures_source": str(run.temperatures_path.relative_to(run.root)),
        "placement": placement.to_dict(),
        "requests": requests_form(canonical),
        "training_progress": run.training_progress(),
        **({"data_changed": {"files": data_changed, "allowed": True}} if data_changed else {}),
        **({"order_votes": order_votes, "vote_combine": vote_combine} if order_votes > 1 else {}),
    }
    meta.update(_test_look(run, data_dir, preds, meta["checkpoint_sha256"], command, print_fn or echo))
    for line in small_data_warnings(preds, infos):
        say(line)
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=baseline)
    write_evaluation(run, ev)
    if export and order_votes > 1:
        say("export: not written with --order-votes (export/ and export/hf/ carry plain answers, which these "
            f"temperatures do not fit; `rlcd evaluate {run.root}` writes them)")
    elif export:
        write_export(run, temperatures=temps, model=model, config=config, state=state, which=which)
        cpu_fp32 = placement.to_dict() == {"device": "cpu", "dtype": "float32"}
        say(f"export: {run.export_dir} and {run.hf_export_dir} (transformers)")
        write_hf(run, model=model if cpu_fp32 else None, evaluation=ev)
    else:
        say(f"export: not written (`rlcd export {run.root}` writes export/ and export/hf/)")
    from rlcd.gate import default_gates  # eval/thresholds.json at the default target, before the report shows it
    default_gates(run, say)
    say(f"report: {run.report_md}, {run.report_md.with_suffix('.html')} and their plots")
    write_report(run, ev=ev)
    return ev


def _test_look(run: Run, data_dir: Path, preds: dict[str, list[dict]], checkpoint_sha256: str, command: str,
               warn: Callable[[str], None]) -> dict[str, Any]:
    """Record this evaluation's look at `data_dir`'s test split (`rlcd.data.looks`) and say on stderr how many came
    before; meta.test_looks for the report ({} when no test split was scored)."""
    from rlcd.data.looks import record_look

    if not preds.get("test"):
        return {}
    looks = record_look(data_dir, run=run.root, eval_name=run.eval_name, rows=len(preds["test"]), command=command,
                        checkpoint_sha256=checkpoint_sha256)
    if looks.error:
        warn(f"warning: could not record this look at the test split ({looks.error}); it is not counted")
    if looks.note():
        warn(f"note: {looks.note()}")
    return {"test_looks": looks.meta()}


def _run_meta(run: Run, config: dict, state: dict, which: str) -> dict[str, Any]:
    """Which run and checkpoint an evaluation.json scores (its meta block's first keys, eval/ and eval-NAME/ alike)."""
    recipe = config["recipe"]
    return {"run": str(run.root), "model": config["model"], "objective": recipe["objective"],
            "sigma": recipe["sigma"], "ce_weight": recipe["ce_weight"], "seed": recipe["seed"],
            "steps": recipe["steps"], "recipe_deviations": config.get("recipe_deviations", {}),
            **checkpoint_identity(state, which),
            "checkpoint_sha256": ckpt.weights_sha256(run.require_checkpoint(which))}


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_other_data(data_dir: Path, *, recalibrate: bool) -> Path:
    """A processed data directory to score (at least one of dev/calibration/test), else a one-line RunError."""
    from rlcd.errors import RunError

    p = Path(data_dir).expanduser()
    hint = f"make one with `rlcd data prepare FILES --out {p}`"
    if not p.is_dir():
        raise RunError(f"--data {p}: no such directory; {hint}")
    if (p / Run.CONFIG).is_file():
        raise RunError(f"--data {p} is a run directory, not processed data; give a directory made by `rlcd data prepare`")
    if not any((p / f"{split}.jsonl").is_file() for split in SPLITS):
        raise RunError(f"--data {p}: not a processed data directory (no dev.jsonl, calibration.jsonl or test.jsonl); "
                       f"{hint}")
    if recalibrate and not (p / "calibration.jsonl").is_file():
        raise RunError(f"--recalibrate: {p} has no calibration.jsonl to fit the temperatures on")
    return p.resolve()


def other_data_name(data_dir: Path, name: str | None) -> str:
    """`--out NAME` (default: the data directory's name), checked: it names RUN/eval-NAME/."""
    from rlcd.errors import OptionError

    name = name if name is not None else Path(data_dir).resolve().name
    if not _NAME.fullmatch(name or ""):
        raise OptionError(f"--out {name!r}: use letters, digits, '.', '_' or '-' (it names the directory eval-NAME)")
    return name


def evaluate_on_data(run: Run | Path, data_dir: Path, *, name: str | None = None, recalibrate: bool = False,
                     placement: Placement | None = None, which: str = "best", progress: bool = True,
                     print_fn: Callable[[str], None] | None = None, order_votes: int = 1,
                     vote_combine: str = DEFAULT_COMBINE, canonical: bool = True) -> dict[str, Any]:
    """Score the run's model on another processed data set; write RUN/eval-NAME/ (and nothing else). Rows are
    OTHER's original ones, each asked in its canonical form unless `canonical` is False (`scored_records`).

    Temperatures: the run's own (eval/temperatures.json when fitted on this checkpoint and placement,
    else fitted here on the run's calibration split without writing eval/), or with `recalibrate` fitted
    on OTHER's calibration split. The majority baseline comes from OTHER's train split. The report is the
    usual one, built from the files under eval-NAME/. Holds the run's lock (`RunBusy` beside another writer),
    taken once the inputs are checked. Scoring OTHER's test split is recorded beside it as one look
    (`rlcd.data.looks`), and earlier looks are said on stderr and in the report. `order_votes` N > 1: the voted
    answers (module docstring; the run's temperatures only when fitted on answers voted alike).
    """
    from rlcd.data.io import load_split
    from rlcd.errors import RunError
    from rlcd.order_votes import check_combine, check_votes

    check_votes(order_votes)
    check_combine(vote_combine)
    run = run if isinstance(run, Run) else Run.open(run)
    other = check_other_data(data_dir, recalibrate=recalibrate)
    view = run.on_data(other_data_name(other, name))
    run.require_checkpoint(which)
    placement = placement or resolve_placement("cpu")
    records = {split: scored_records(other, split, canonical=canonical) for split in SPLITS}
    records = {split: rows for split, rows in records.items() if rows}
    if not records or (recalibrate and not records.get("calibration")):
        raise RunError(f"--data {other}: " + ("calibration.jsonl has no rows to fit on" if records
                                              else "dev, calibration and test hold no rows"))
    with run.lock("evaluate --data"):  # eval-NAME/ and eval/temperatures.json's reader: one writer, as evaluate
        return _evaluate_on_data(run, view, other, records, recalibrate=recalibrate, placement=placement,
                                 which=which, progress=progress, print_fn=print_fn, order_votes=order_votes,
                                 vote_combine=vote_combine, canonical=canonical)


def _evaluate_on_data(run: Run, view: Run, other: Path, records: dict[str, list[Record]], *, recalibrate: bool,
                      placement: Placement, which: str, progress: bool,
                      print_fn: Callable[[str], None] | None, order_votes: int = 1,
                      vote_combine: str = DEFAULT_COMBINE, canonical: bool = True) -> dict[str, Any]:
    from rlcd.data.io import load_split, sha256_file, write_jsonl
    from rlcd.metrics import majority_baseline
    from rlcd.report import evaluation_from_predictions, write_evaluation, write_report
    from rlcd.train import data_hashes

    say, warn = print_fn or (lambda _: None), print_fn or echo
    model, config, state = load_checkpoint_model(run, which, placement=placement)
    collator = _collator(model, other)
    preds = {split: predict_rows(model, rows, collator, split=split, device=placement.torch_device,
                                 progress=progress, order_votes=order_votes, vote_combine=vote_combine)
             for split, rows in records.items()}
    if recalibrate:
        temps, infos = fit_per_type(preds["calibration"])
        source = {"source": f"fitted on {other / 'calibration.jsonl'} (--recalibrate)", "n_rows": len(preds["calibration"]),
                  "calibration_sha256": sha256_file(other / "calibration.jsonl"), "guard": GUARD,
                  "requests": requests_form(canonical)}
    else:
        stored = stored_temperatures(run, placement, which, order_votes, vote_combine, canonical)
        if stored is not None:
            temps, infos = stored["temperatures"], stored["calibration"]
            source = {"source": str(run.temperatures_path.relative_to(run.root)), "n_rows": stored.get("n_rows"),
                      "calibration_sha256": stored.get("calibration_sha256"), "guard": stored.get("guard"),
                      "requests": stored.get("requests")}
        else:
            own = _score(model, config, "calibration", _records(config, "calibration", canonical), placement, progress,
                         order_votes=order_votes, vote_combine=vote_combine)
            temps, infos = fit_per_type(own)
            source = {"source": "fitted here on the run's own calibration split (no matching eval/temperatures.json)",
                      "n_rows": len(own), "guard": GUARD,
                      "calibration_sha256": _calibration_key(run, placement, which)["calibration_sha256"],
                      "requests": requests_form(canonical)}
    say(f"temperatures: {source['source']}")
    for split, rows in preds.items():
        write_jsonl(view.predictions_path(split), rows)
    write_json(view.temperatures_path, {"temperatures": temps, "calibration": infos, **source,
                                        "checkpoint_sha256": ckpt.weights_sha256(run.require_checkpoint(which)),
                                        **placement.to_dict(),
                                        **({"order_votes": order_votes, "vote_combine": vote_combine}
                                           if order_votes > 1 else {})})
    train_rows = load_split(other, "train") if (other / "train.jsonl").is_file() else []
    baseline = (majority_baseline(train_rows, original_records(other, "test"))
                if records.get("test") and train_rows else None)
    meta = {
        **_run_meta(run, config, state, which),
        "trained_on": str(config["data_dir"]),
        "evaluated_on": str(other),
        "data_hashes": data_hashes(other),
        "calibration": infos,
        "recalibrated": recalibrate,
        "temperatures_source": source["source"],
        "majority_baseline_from": str(other / "train.jsonl") if baseline is not None else None,
        "placement": placement.to_dict(),
        "requests": requests_form(canonical),
        **({"order_votes": order_votes, "vote_combine": vote_combine} if order_votes > 1 else {}),
    }
    meta.update(_test_look(view, other, preds, meta["checkpoint_sha256"], "evaluate --data", warn))
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=baseline)
    write_evaluation(view, ev)
    say(f"report: {view.report_md}, {view.report_html} and their plots")
    write_report(view, ev=ev)
    return ev


def write_hf(run: Run, *, model=None, evaluation: dict | None = None) -> Path:
    """export/hf/ from export/ (rebuilt on the CPU in float32 unless `model` is that already)."""
    from rlcd.export import load_export, read_export_meta
    from rlcd.hf.writer import write_hf_export

    run.require_export()
    model, meta = load_export(run.export_dir) if model is None else (model, read_export_meta(run.export_dir))
    if evaluation is None and run.evaluation_path.is_file():
        evaluation = json.loads(run.evaluation_path.read_text())
    return write_hf_export(model, meta, run.hf_export_dir, evaluation=evaluation, run_name=run.name)


def export_run(run: Run | Path, *, placement: Placement | None = None) -> Path:
    """`rlcd export RUN`: export/ from the checkpoint the stored temperatures were fitted on (best, or
    last after `--checkpoint last`), then export/hf/. Temperatures fitted for weights the run no longer
    holds are refused: they would calibrate a different model."""
    run = run if isinstance(run, Run) else Run.open(run)
    with run.lock("export"):
        return _export_run(run, placement=placement)


def _export_run(run: Run, *, placement: Placement | None) -> Path:
    from rlcd.errors import RunError

    placement = placement or resolve_placement("cpu")
    if not (run.export_dir / "model.json").is_file():
        if not run.temperatures_path.is_file():
            raise RunError(f"{run.root} has no temperatures yet; run `rlcd calibrate {run.root}` (or `rlcd evaluate "
                           f"{run.root}`) first")
        stored = json.loads(run.temperatures_path.read_text())
        if stored.get("order_votes", 1) > 1:
            raise RunError(f"{run.temperatures_path} was fitted on answers voted over {stored['order_votes']} option "
                           f"orders (`rlcd evaluate --order-votes`); the export gives plain ones: run `rlcd calibrate "
                           f"{run.root}` first")
        found = {w: ckpt.resolve(run.checkpoint(w)) for w in ("best", "last")}
        which = next((w for w, path in found.items() if path is not None
                      and stored.get("checkpoint_sha256") == ckpt.weights_sha256(path)), None)
        if which is None:
            raise RunError(f"{run.temperatures_path} was fitted on weights neither checkpoints/best nor "
                           f"checkpoints/last holds; run `rlcd calibrate {run.root}` again")
        model, config, state = load_checkpoint_model(run, which, placement=placement)
        write_export(run, temperatures=stored["temperatures"], model=model, config=config, state=state, which=which)
    return write_hf(run)


MIN_TEST_ROWS = 30  # below this a split's metrics and intervals say little
MIN_CALIBRATION_ROWS = 30  # per fitted type: below this a temperature is a noisy estimate


def small_data_warnings(preds: dict[str, list[dict]], infos: dict[str, dict]) -> list[str]:
    """Warnings for sizes too small to trust: a test split below MIN_TEST_ROWS rows, a type fitted on
    fewer than MIN_CALIBRATION_ROWS calibration rows (or left at T = 1 for lack of rows, or because its fit
    did not beat T = 1 on held-out cases: `rlcd.calibrate`)."""
    out = []
    n_test = len(preds.get("test") or [])
    if n_test < MIN_TEST_ROWS:
        out.append(f"warning: the test split has {n_test} rows (< {MIN_TEST_ROWS}); its metrics and intervals "
                   "say little; prepare more data or larger --splits fractions")
    n_cal = {t: 0 for t in infos}
    for r in preds.get("calibration") or []:
        n_cal[r["type"]] = n_cal.get(r["type"], 0) + 1
    for t, n in n_cal.items():
        if 0 < n < MIN_CALIBRATION_ROWS:
            info = infos.get(t) or {}
            if info.get("reason") is None:
                out.append(f"warning: {t}: {n} calibration rows (< {MIN_CALIBRATION_ROWS}); its temperature is noisy")
            elif "fitted_temperature" in info:
                out.append(f"warning: {t}: {n} calibration rows (< {MIN_CALIBRATION_ROWS}); its fit (T = "
                           f"{info['fitted_temperature']:.3g}) did not beat T = 1 on held-out cases, so T = 1 is kept")
            else:
                out.append(f"warning: {t}: {n} calibration rows (a fit takes {MIN_ROWS}); its temperature stays T = 1")
    if not preds.get("calibration"):
        out.append("warning: no calibration rows: every temperature stays T = 1")
    return out


def print_summary(ev: dict[str, Any]) -> None:
    from rlcd.report import format_summary

    print(format_summary(ev))
