"""The sweep's plan: `--grid KEY=V1,V2` -> arms -> one `RunSpec` (full resolved recipe) per arm x seed.

Arms are the Cartesian product of the grid. The ``ce`` objective's loss reads none of the RLCD
fields (`CE_IGNORES`: the noise, the reward weights, G, the advantage normalisation, ``ce_weight``),
so those keys are dropped from ``ce`` arms and the grid points that then coincide collapse into one
arm, run once per seed and summarised once (said in the notes); repeated values in a list collapse
too. Any recipe field is a grid key, booleans included (``--grid head_only=true,false``: typed by
`coerce_value`, named ``head_onlytrue`` / ``head_onlyfalse``). ``steps`` and ``seed`` are the
sweep's own options, never grid keys.

A run's recipe is ``Recipe(**scaled cadence, **overrides, **arm params, steps, seed)``: with a
budget of S < 3,600 updates the cadence fields are scaled by S / 3600 (at least 1), so a short
run still evaluates about 9 times and selects a best checkpoint the way the full recipe does;
explicit overrides win. Values are typed by `rlcd.recipe.coerce_value`, the parser `rlcd train
--recipe` uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlcd.device import DTYPE_CHOICES
from rlcd.errors import OptionError
from rlcd.recipe import Recipe, coerce_value
from rlcd.run import Run

CADENCE = ("eval_every", "checkpoint_every", "log_every", "diagnostics_every")
NOT_GRID_KEYS = ("steps", "seed")
# the ce objective's loss reads none of these (w_log: the log score's weight, where the recipe has it)
CE_IGNORES = ("sigma", "sigma_end", "ce_weight", "n_perturbations", "w_spherical", "w_rps", "w_log",
              "advantage_norm")


class SweepError(OptionError):
    """A sweep that cannot be planned or resumed as asked (one line, exit 2 from the CLI)."""


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["sigma=0.25,1,4", "objective=rlcd,ce"]`` -> ``{"sigma": [0.25, 1.0, 4.0], "objective": [...]}``."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        if "=" not in spec:
            raise SweepError(f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. --grid sigma=0.25,1,4)")
        key, _, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not items:
            raise SweepError(f"--grid {spec!r}: no values")
        if key in grid:
            raise SweepError(f"--grid {key} given twice; list all its values once (KEY=V1,V2,...)")
        grid[key] = [coerce_value(key, v, flag="--grid") for v in items]
    return grid


def parse_seeds(value: int | str | Sequence[int]) -> list[int]:
    """``3`` -> [0, 1, 2]; ``"0,5,7"`` -> [0, 5, 7]; a list stays as it is."""
    try:
        if isinstance(value, str):
            text = value.strip()
            seeds = [int(x) for x in text.split(",") if x.strip()] if "," in text else list(range(int(text)))
        elif isinstance(value, int):
            seeds = list(range(value))
        else:
            seeds = [int(x) for x in value]
    except ValueError:
        raise SweepError(f"--seeds {value!r}: expected N (seeds 0..N-1) or a comma-separated list of integers") from None
    if not seeds:
        raise SweepError("--seeds: need at least one seed")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds: seeds repeat: {seeds}")
    return seeds


def fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"  # as `--grid KEY=true,false` spells it
    return f"{v:g}" if isinstance(v, float) else str(v)


def arm_name(params: Mapping[str, Any]) -> str:
    """Directory-safe arm name: the objective's value, then ``<key><value>`` per other key."""
    parts = [fmt_value(v) if k == "objective" else f"{k}{fmt_value(v)}"
             for k, v in sorted(params.items(), key=lambda kv: kv[0] != "objective")]
    name = "-".join(parts) or "base"
    return "".join(c if (c.isalnum() or c in "._-+") else "_" for c in name)


@dataclass
class Arm:
    name: str
    params: dict[str, Any]                                      # the grid values that define the arm
    merged: list[dict[str, Any]] = field(default_factory=list)  # grid points it stands for
    objective: str = "rlcd"                                     # effective objective (grid, else override)


def expand_grid(grid: Mapping[str, Sequence[Any]], recipe_overrides: Mapping[str, Any] | None = None,
                ) -> tuple[list[Arm], list[str]]:
    """Arms of the grid (Cartesian product, ce arms deduplicated) and human-readable notes."""
    overrides = dict(recipe_overrides or {})
    notes: list[str] = []
    clean: dict[str, list[Any]] = {}
    for key, values in grid.items():
        if key in NOT_GRID_KEYS:
            raise SweepError(f"{key!r} cannot be a grid key; use the sweep's --{key}s/--steps option")
        typed = [coerce_value(key, v, flag="--grid") for v in values]
        uniq = list(dict.fromkeys(typed))
        if not uniq:
            raise SweepError(f"grid key {key!r} has no values")
        if len(uniq) < len(typed):
            notes.append(f"grid {key}: repeated values dropped ({len(typed)} -> {len(uniq)})")
        clean[key] = uniq
    keys = list(clean)
    arms: dict[str, Arm] = {}
    for combo in itertools.product(*(clean[k] for k in keys)):
        point = dict(zip(keys, combo))
        params = dict(point)
        objective = params.get("objective", overrides.get("objective", "rlcd"))
        if objective == "ce":
            for k in CE_IGNORES:
                params.pop(k, None)
        name = arm_name(params)
        arm = arms.setdefault(name, Arm(name=name, params=params, objective=str(objective)))
        arm.merged.append(point)
    for arm in arms.values():
        dropped = sorted({k for p in arm.merged for k in p if k not in arm.params})
        if dropped:
            n = len(arm.merged)
            notes.append(f"arm {arm.name!r}: objective=ce does not read {', '.join(dropped)}; "
                         + (f"its {n} grid points are run once per seed and shown once in the summary" if n > 1
                            else "the value is ignored"))
    return list(arms.values()), notes


def scaled_cadence(steps: int) -> dict[str, int]:
    """Cadence fields scaled to a budget below the recipe's (empty at or above it)."""
    base = Recipe()
    if steps >= base.steps:
        return {}
    return {f: max(1, round(getattr(base, f) * steps / base.steps)) for f in CADENCE}


@dataclass
class RunSpec:
    """One run of the sweep: its name, arm, seed, directory and the worker's JSON config.

    ``config`` = ``{"run_dir", "data_dir", "model", "model_seed", "dtype", "export", "recipe": full Recipe
    dict}`` (``export``: whether the run's evaluation writes export/).
    """

    name: str
    arm: str
    seed: int
    run_dir: Path
    config: dict[str, Any]

    @property
    def run(self) -> Run:
        return Run(self.run_dir)

    @property
    def evaluation_path(self) -> Path:
        return self.run.evaluation_path


def plan_runs(data: Path, model: str, arms: Sequence[Arm], seeds: Sequence[int], steps: int, out: Path, *,
              recipe_overrides: Mapping[str, Any] | None = None, scale_cadence: bool = True,
              model_seed: int = 0, dtype: str = "auto", export: bool = False) -> list[RunSpec]:
    """One RunSpec per arm x seed, with its full resolved recipe (validated here, before any run)."""
    overrides = {k: coerce_value(k, v) for k, v in (recipe_overrides or {}).items()}
    for k in NOT_GRID_KEYS:
        if k in overrides:
            raise SweepError(f"{k!r} is set by the sweep (--{'steps' if k == 'steps' else 'seeds'}), not an override")
    if dtype not in DTYPE_CHOICES:
        raise SweepError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    base = scaled_cadence(steps) if scale_cadence else {}
    specs = []
    for arm in arms:
        for seed in seeds:
            kw = {**base, **overrides, **arm.params, "steps": int(steps), "seed": int(seed)}
            try:
                recipe = Recipe(**kw)
            except (TypeError, ValueError) as e:
                raise SweepError(f"arm {arm.name!r}: {e}") from None
            name = f"{arm.name}-s{seed}"
            run_dir = (Path(out) / "runs" / name).resolve()
            config = {"run_dir": str(run_dir), "data_dir": str(Path(data).resolve()), "model": model,
                      "model_seed": model_seed, "dtype": dtype, "export": bool(export), "recipe": recipe.to_dict()}
            specs.append(RunSpec(name=name, arm=arm.name, seed=int(seed), run_dir=run_dir, config=config))
    return specs
