"""`rlcd data import|synth|prepare|validate|derive`: records in, isolated splits out."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Import, generate, validate and split typed-decision records.", no_args_is_help=True)


class Kind(str, Enum):
    typed_decisions = "typed-decisions"
    vqav2 = "vqav2"
    text = "text"
    easy_vqa = "easy-vqa"
    jsonl = "jsonl"


ReorderOpt = Annotated[bool, typer.Option(
    "--reorder", help="also the order-and-wording forms: score levels listed high-to-low, noul false/true wording "
    "swapped (the pinned recipe keeps these orders fixed)")]
TEXT_QUESTION = "Which label fits this text?"  # the default of importers.import_text, spelled here for --help
StrictOpt = Annotated[bool, typer.Option("--strict", help="exit 1 when any row is excluded (or a split is empty)")]
MAX_TOKENS = 8192  # rlcd.model.prompt.DEFAULT_MAX_TOKENS, spelled here so --help imports no torch (a test checks)
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", metavar="M", help="render every row with backbone M's prompt encoder (a preset, a local directory, a "
    ".gguf file or a hub id, as `rlcd train --model`) and exclude rows over --max-tokens (too_long) or breaking "
    "another rule of that tokenizer (unrenderable); without it no backbone is loaded and token limits are not "
    "checked (`rlcd train` checks them at its start)")]
MaxTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-tokens", help=f"with --model: the most tokens a rendered row may have, image tokens included "
    f"(default and upper bound: the encoder's {MAX_TOKENS:,}, what training uses)", show_default=False)]


@app.command("import")
def import_cmd(
    kind: Annotated[Kind, typer.Option("--kind", help="input format")],
    out: Annotated[Path, typer.Option("--out", help="records file to write (JSONL)")],
    input_: Annotated[Optional[str], typer.Option(
        "--input", help="input file (.jsonl/.csv/.parquet) or hub id owner/name (needs the hub extra); not for easy-vqa")] = None,
    split: Annotated[Optional[str], typer.Option(help="official split of every row (train/dev/calibration/test)")] = None,
    images: Annotated[Optional[Path], typer.Option(help="vqav2: directory the image column is relative to")] = None,
    text_column: Annotated[str, typer.Option(help="text: column holding the text")] = "text",
    label_column: Annotated[str, typer.Option(help="text: column holding the label")] = "label",
    labels: Annotated[Optional[str], typer.Option(help="text: comma-separated label set (default: inferred)")] = None,
    question: Annotated[str, typer.Option(help="text: the question every record asks about its text")] = TEXT_QUESTION,
    task: Annotated[Optional[str], typer.Option(help="text: task name (default: the input file's stem)")] = None,
    limit: Annotated[Optional[int], typer.Option(help="easy-vqa: keep this many questions in total")] = None,
    strict: StrictOpt = False,
) -> None:
    """Convert an outside data set into records; exclusions go to `<out stem>.excluded.jsonl`."""
    from rlcd.data import importers
    from rlcd.data.io import excluded_path, write_jsonl
    from rlcd.data.summary import console, exclusions_table, records_table

    if kind is not Kind.easy_vqa and not input_:
        raise typer.BadParameter("--input is required for this kind", param_hint="--input")
    if input_ and not importers.is_hub_id(input_) and not Path(input_).is_file():
        raise typer.BadParameter(f"{input_}: no such file", param_hint="--input")
    out_dir = out.parent
    if kind is Kind.typed_decisions:
        records, excluded = importers.import_typed_decisions(input_, split=split)
    elif kind is Kind.vqav2:
        if images is None:
            raise typer.BadParameter("--images is required for vqav2", param_hint="--images")
        records, excluded = importers.import_vqav2(input_, images, out_dir, split=split)
    elif kind is Kind.text:
        label_set = [x.strip() for x in labels.split(",")] if labels else None
        if not question.strip():
            raise typer.BadParameter("the question is empty", param_hint="--question")
        records, excluded = importers.import_text(input_, text_column=text_column, label_column=label_column,
                                                  labels=label_set, task=task, split=split, instructions=question)
    elif kind is Kind.easy_vqa:
        records, excluded = importers.import_easy_vqa(out_dir, limit=limit)
    else:
        records, excluded = importers.import_jsonl(Path(input_), out_dir)
    if not records:
        _nothing_imported(excluded, out)
    write_jsonl(out, records)
    write_jsonl(excluded_path(out), excluded)
    console.print(records_table(records, f"imported {len(records)} records -> {out}"))
    if excluded:
        console.print(exclusions_table(excluded, f"excluded -> {excluded_path(out)}"))
        if strict:
            raise typer.Exit(1)


def _nothing_imported(excluded: list[dict], out: Path) -> None:
    """An import that keeps no row is a failure: exit 1 with the exclusion reasons on stderr (no records file)."""
    from collections import Counter

    from rlcd.data.io import excluded_path, write_jsonl

    reasons = Counter(e.get("reason", "?") for e in excluded)
    why = ", ".join(f"{n} {r}" for r, n in reasons.most_common()) or "the input holds no rows"
    first = next((e.get("detail") for e in excluded if e.get("detail")), None)
    if excluded:
        write_jsonl(excluded_path(out), excluded)
    typer.echo(f"error: imported 0 records ({why}); nothing written to {out}"
               + (f"\n  first exclusion: {first} (all: {excluded_path(out)})" if first else ""), err=True)
    raise typer.Exit(1)


@app.command("synth")
def synth_cmd(
    out: Annotated[Path, typer.Option("--out", help="records file to write (JSONL)")],
    cases: Annotated[int, typer.Option(min=1, help="number of cases (six questions each)")] = 400,
    seed: Annotated[int, typer.Option()] = 0,
    votes: Annotated[Optional[int], typer.Option(min=1, help="target = mean of this many votes (default: the posterior)")] = None,
    forms: Annotated[Optional[str], typer.Option(
        "--forms", help="`derived`: also write every derived question form (`rlcd data derive`) after its base row; "
        "or a comma-separated list of forms or families")] = None,
    reorder: ReorderOpt = False,
) -> None:
    """Generate known-posterior typed-decision cases (with --forms, also their derived question forms)."""
    from rlcd.data import synth
    from rlcd.data.io import write_jsonl
    from rlcd.data.summary import console, records_table

    chosen = _forms(forms, reorder) if forms is not None or reorder else None
    records = synth.generate(cases, seed, votes=votes)
    if chosen is not None:
        from rlcd.data.derive import derive_records

        records, excluded = derive_records(records, chosen)
        if excluded:
            from collections import Counter

            console.print(f"derived forms not written: {dict(Counter(e['reason'] for e in excluded))}")
    write_jsonl(out, records)
    console.print(records_table(records, f"{cases} cases, {len(records)} records -> {out}"))


def _verdict(manifest: dict, strict: bool) -> None:
    """Warn on empty splits (stderr); with --strict, exit 1 when rows were excluded or a split is empty."""
    from rlcd.data.summary import notices as console

    empty = [s for s, n in manifest["splits"].items() if n == 0]
    for split in empty:
        console.print(f"warning: the {split} split is empty (no rows were placed there); "
                      f"{'training needs train and dev rows' if split in ('train', 'dev') else 'its metrics will be missing'}",
                      style="yellow", highlight=False)
    if strict and (manifest["excluded"] or empty):
        why = [f"{manifest['excluded']} row(s) excluded"] if manifest["excluded"] else []
        why += [f"empty split(s): {', '.join(empty)}"] if empty else []
        console.print(f"--strict: {'; '.join(why)}", style="red", highlight=False)
        raise typer.Exit(1)


def _inputs_exist(inputs: list[Path]) -> None:
    for p in inputs:
        if not p.is_file():
            raise typer.BadParameter(f"{p}: no such file", param_hint="INPUTS")


def _render_check(model: str | None, max_tokens: int | None):
    """(check, checked_with) for `prepare`/`plan` from --model/--max-tokens: the backbone is loaded here, after
    the cheap checks; (None, None) without --model."""
    if model is None:
        if max_tokens is not None:
            raise typer.BadParameter("goes with --model M: token counts depend on the tokenizer", param_hint="--max-tokens")
        return None, None
    if max_tokens is not None and not 1 <= max_tokens <= MAX_TOKENS:
        raise typer.BadParameter(f"{max_tokens}: give 1..{MAX_TOKENS} (training renders rows up to {MAX_TOKENS:,} "
                                 "tokens)", param_hint="--max-tokens")
    from rlcd.model.backbone import check_backbone_spec
    from rlcd.row_check import RowCheck

    check_backbone_spec(model)
    rows = RowCheck.for_backbone(model, max_tokens=max_tokens)

    def check(record, image):
        found = rows.problem(record, image)
        return None if found is None else (found.reason, found.detail)

    return check, {"model": model, "max_tokens": rows.max_tokens}


def _out_is_a_directory(out: Path) -> None:
    """--out names a directory to write; a file there (or above it) is refused before anything is read."""
    from rlcd.data.io import suggest_processed_dir

    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise typer.BadParameter(f"{path} is a file, not a directory; give a directory to write the splits "
                                         f"to, e.g. --out {suggest_processed_dir(path)}", param_hint="--out")
            return


@app.command("prepare")
def prepare_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="record files (JSONL)")],
    out: Annotated[Path, typer.Option("--out", help="processed directory to write")],
    seed: Annotated[int, typer.Option(help="seed of the hash that places groups without official splits")] = 0,
    strict: StrictOpt = False,
    splits: Annotated[Optional[str], typer.Option(
        "--splits", metavar="TRAIN,DEV,CAL,TEST", help="shares of the hash-placed groups, e.g. 0.8,0.05,0.05,0.1 "
        "(the default); recorded in the manifest")] = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite a non-empty --out directory")] = False,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
) -> None:
    """Validate, isolate and split records into a processed directory with a manifest.

    Backbone-free unless --model M: then every row is rendered with M's prompt encoder first, and rows over
    the token limit (too_long, with their token count) or breaking another rule of that tokenizer
    (unrenderable) are excluded with the reason, so `rlcd train` never meets them mid-run.
    """
    from rlcd.data.prepare import parse_fractions, prepare
    from rlcd.data.summary import console, print_manifest

    _inputs_exist(inputs)
    try:
        fractions = parse_fractions(splits) if splits is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--splits") from None
    _out_is_a_directory(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise typer.BadParameter(f"{out} already exists and is not empty (runs may have been trained on it); "
                                 "choose a new directory or pass --force to overwrite it", param_hint="--out")
    check, checked_with = _render_check(model, max_tokens)
    manifest = prepare(inputs, out, seed=seed, fractions=fractions, check=check, checked_with=checked_with)
    print_manifest(manifest)
    console.print(f"wrote {out}")
    _verdict(manifest, strict)


@app.command("validate")
def validate_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="record files (JSONL)")],
    seed: Annotated[int, typer.Option()] = 0,
    strict: StrictOpt = False,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
) -> None:
    """Dry run of `prepare`: the same counts and exclusion reasons, nothing written."""
    from rlcd.data.prepare import manifest_of, plan
    from rlcd.data.summary import print_details, print_manifest

    _inputs_exist(inputs)
    check, checked_with = _render_check(model, max_tokens)
    result = plan(inputs, seed, check=check, checked_with=checked_with)
    manifest = manifest_of(result)
    print_manifest(manifest)
    print_details(result.excluded)
    _verdict(manifest, strict)


def _forms(forms: str | None, reorder: bool) -> tuple[str, ...]:
    from rlcd.data.derive import parse_forms

    return parse_forms(forms, reorder=reorder)


@app.command("derive")
def derive_cmd(
    src: Annotated[Path, typer.Argument(help="processed data directory (`rlcd data prepare`)")],
    out: Annotated[Path, typer.Option("--out", help="processed directory to write: the base rows and their forms")],
    forms: Annotated[Optional[str], typer.Option(
        "--forms", help="comma-separated forms or families (equivalence, complement, merge, marginal, submenu, "
        "order); default all but order")] = None,
    reorder: ReorderOpt = False,
    per_option: Annotated[int, typer.Option(
        "--per-option", help="instances per row of a per-option form (options, levels, pairs drawn per row)")] = 2,
    force: Annotated[bool, typer.Option("--force", help="overwrite a non-empty --out directory")] = False,
) -> None:
    """Add derived question forms with exact targets to every split of a processed directory.

    Each row keeps its split and case; each form's target (and posterior) is a fixed map of the base row's
    (docs/DATA.md, "Derived forms"). The manifest counts rows per form; instances that cannot be written are in
    derive-excluded.jsonl with the reason."""
    from rlcd.data.derive import derive_dir
    from rlcd.data.summary import console
    from rlcd.errors import UserError

    chosen = _forms(forms, reorder)
    if per_option < 1:
        raise UserError(f"--per-option {per_option}: give 1 or more")
    if not (src / "train.jsonl").is_file() and not (src / "test.jsonl").is_file():
        raise UserError(f"{src}: not a processed data directory (no train.jsonl or test.jsonl); make one with "
                        "`rlcd data prepare FILES --out DIR`")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UserError(f"--out {out} already exists and is not empty; choose a new directory or pass --force")
    if out.resolve() == src.resolve():
        raise UserError("--out is the source directory; write the derived data to a new directory")
    manifest = derive_dir(src, out, chosen, per_option=per_option)
    d = manifest["derive"]
    console.print(f"{d['base_rows']} base rows, {d['derived_written']} derived rows written, {d['excluded']} "
                  f"instances excluded {_counts_said(d['exclusions'])}-> {out}", highlight=False)
    for form, by_split in d["per_form"].items():
        console.print(f"  {form:16s} " + "  ".join(f"{s} {n}" for s, n in by_split.items()), highlight=False)


def _counts_said(counts: dict | None) -> str:
    """{'removed_all_mass': 3, 'label_clash': 1} as "(removed_all_mass 3, label_clash 1) ", nothing when empty."""
    return f"({', '.join(f'{k} {v}' for k, v in counts.items())}) " if counts else ""
