"""`rlcd predict RUN --input FILE --output FILE` (and `--data DIR --split S`, `--ray`): the batch job's checks and
run. Every option is checked, and the output's state (new, finished, unfinished) read, before a model loads or a
file is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer


def _bad(message: str, hint: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=hint)


def check_batch_options(*, input: Optional[Path], data: Optional[Path], split: Optional[str], output: Optional[Path],
                        single: list[str], resume: bool, ray: bool, ray_opts: list[str],
                        batch_opts: list[str]) -> bool:
    """Whether this `rlcd predict` is a batch job; a mistake in combining the options is a BadParameter (exit 2).
    `single`: the one-request options given; `ray_opts`: the Ray options given without --ray; `batch_opts`: the
    batch options given (they need --input or --data)."""
    batch = input is not None or data is not None
    if not batch:
        if output is not None or resume or ray or split is not None or batch_opts:
            hint = ("--output" if output is not None else "--resume" if resume else "--ray" if ray
                    else "--split" if split is not None else batch_opts[0])
            raise _bad("a batch option: give --input FILE (or --data DIR --split S) with it", hint)
        return False
    if input is not None and data is not None:
        raise _bad("give --input FILE or --data DIR --split S, not both", "--data")
    if single:
        raise _bad(f"a batch job reads its requests from --input/--data; {single[0]} asks one request", single[0])
    if data is not None:
        if split is None:
            raise _bad("--data DIR needs --split S (train, dev, calibration or test)", "--split")
        if not (data / f"{split}.jsonl").is_file():
            raise _bad(f"{data}: no {split}.jsonl (a processed data directory, `rlcd data prepare`)", "--data")
    elif split is not None:
        raise _bad("--split goes with --data DIR", "--split")
    elif not input.is_file():
        raise _bad(f"{input}: no such file", "--input")
    if output is None:
        raise _bad("a batch job needs --output FILE (.jsonl or .parquet)", "--output")
    if input is not None and output.resolve() == input.resolve():
        raise _bad("--output would overwrite the input; choose another file", "--output")
    if ray_opts and not ray:
        raise _bad(f"{ray_opts[0]} goes with --ray", ray_opts[0])
    return True


def predict_batch(*, run: Optional[Path], export: Optional[Path], input: Optional[Path], data: Optional[Path],
                  split: Optional[str], output: Path, resume: bool, batch_size: int, chunk_rows: int,
                  threads: Optional[int], image_root: Optional[Path], order_votes: int, state_cache_mb: float,
                  device: str, dtype: str, ray: bool, ray_address: Optional[str], num_actors: int,
                  cpus_per_actor: float, gpus_per_actor: float, quiet: bool, canonical: bool = True,
                  vote_combine: str = "logmean", attention: str = "sdpa") -> dict[str, Any]:
    """Run the job (options already checked) and return its summary."""
    from rlcd.batch.io import PartWriter, count_rows, file_format, input_identity, scan, scan_split
    from rlcd.batch.local import PredictorSpec
    from rlcd.progress import Progress

    if input is not None:
        file_format(input, "--input")
    file_format(output, "--output")
    if ray:
        from rlcd.batch.ray import check_address, require_ray

        require_ray()
        check_address(ray_address)  # bounded, before anything is written
        file_format(Path("todo.parquet"), "--ray")  # its todo file is Parquet: pyarrow
    if image_root is not None and not image_root.is_dir():
        raise typer.BadParameter(f"{image_root}: not a directory", param_hint="--image-root")
    if data is not None:
        image_root = image_root or data
    spec = PredictorSpec(run=None if export is not None else str(run), export=str(export) if export else None,
                         device=device, dtype=dtype, threads=threads, order_votes=order_votes,
                         state_cache_mb=state_cache_mb, canonical=canonical, vote_combine=vote_combine,
                         attention=attention).resolved()
    source = input if input is not None else data / f"{split}.jsonl"
    job = {"input": input_identity(source), **spec.identity()}
    writer = PartWriter.check(output, job, resume=resume)
    if not quiet and spec.export is None:  # the start-up line: where the model runs, and why that dtype
        from rlcd.progress import echo

        why = f" ({spec.reason})" if spec.reason else " (as --device / --dtype ask)"
        att = f", {spec.attention} attention" if spec.attention != "sdpa" else ""
        echo(f"predict: the model runs on {spec.device} {spec.dtype}{att}{why}")
    skip = writer.next_line - 1
    rows = (scan(input, skip_through=skip, seen=writer.seen) if input is not None
            else scan_split(data, split, skip_through=skip, seen=writer.seen))
    total = count_rows(input) if input is not None else count_rows(source)
    done = writer.answered + writer.rejected
    with Progress("predict", total, start=done, enabled=not quiet) as progress:
        if ray:
            from rlcd.batch.ray import run_ray

            return run_ray(spec, rows, writer, address=ray_address, num_actors=num_actors,
                           cpus_per_actor=cpus_per_actor, gpus_per_actor=gpus_per_actor, batch_size=batch_size,
                           chunk_rows=chunk_rows, image_root=image_root, progress=progress,
                           num_cpus=None if ray_address else int(num_actors * cpus_per_actor + 0.999) + 1)  # + the read
        from rlcd.batch.local import run_local

        return run_local(spec.load(), rows, writer, batch_size=batch_size, chunk_rows=chunk_rows,
                         image_root=image_root, progress=progress)
