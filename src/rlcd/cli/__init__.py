"""`rlcd` command line: a thin table of typer commands over library functions.

Each module here holds the commands of one area (`train`, `evaluate`, `data`, `serve`, `analysis`,
`bench`, `demo`) and imports its library lazily, inside the command, so `rlcd --help` and
`rlcd --version` import neither torch nor transformers. Library modules never import typer.

Streams: stdout carries a command's result (JSON, a summary, a path); stderr carries what happens on
the way -- progress (`rlcd.progress`), the library's INFO log (which model is loaded, from where:
`show_status`) and notices -- so `rlcd predict ... | jq` reads pure JSON and `rlcd evaluate RUN | cat`
still shows the progress.

Error policy (`RlcdGroup.main`): a user's mistake -- a `rlcd.errors.UserError` raised by the library
(missing path, unknown preset, malformed data or request, refused resume, bad value) or a click usage
error (unknown option, bad choice) -- is printed in one or two lines on stderr and exits 2; a full disk
is one line and exit 1 (what was written before stays readable: atomic checkpoints and caches); a bug
keeps its traceback. `python -m rlcd.cli` runs the same app (for `torchrun -m rlcd.cli train ...`).
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer._click import exceptions as cx  # typer vendors click (typer._click) since 0.2x; pinned
from typer.core import TyperGroup

from rlcd.cli import analysis, bench, data, demo, evaluate, features, gate, serve, train
from rlcd.cli._common import quiet_progress_bars, show_status
from rlcd.errors import UserError


def reflow(text: str | None) -> str | None:
    """A help text with each prose paragraph on one line, so the terminal wraps it: typer's rich help keeps a
    docstring's line breaks, which cut sentences at the source's 120 columns. Paragraphs whose later lines
    are indented or list items, and click's `\\b` blocks, keep their breaks."""
    if not text:
        return text
    out = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        keep = para.startswith("\b") or any(ln.startswith((" ", "- ", "* ", "|")) for ln in lines[1:])
        out.append(para if keep else " ".join(ln.strip() for ln in lines))
    return "\n\n".join(out)


def _option_names_whole() -> None:
    """typer's rich help lays options out in a table whose columns rich shrinks to the terminal, cutting an option
    name with an ellipsis at 80 columns (`--max-request-by…`). Its name columns (all but the type and help
    columns) are made no_wrap, so the help text wraps narrower instead and a name is never cut. typer builds the
    table with `rich_utils.Table` and lets `add_row` create the columns: a subclass marks them there."""
    import typer.rich_utils as ru
    from rich.table import Table

    if getattr(ru.Table, "_rlcd_whole_names", False):
        return

    class OptionsTable(Table):
        _rlcd_whole_names = True

        def add_row(self, *cells: Any, **kw: Any) -> None:
            super().add_row(*cells, **kw)
            if len(self.columns) > 2:  # the options panel; the commands panel sets its own columns
                for column in self.columns[:-2]:
                    column.no_wrap = True

    ru.Table = OptionsTable


def _reflow_all(command: Any) -> None:
    command.help = reflow(command.help)
    for sub in getattr(command, "commands", {}).values():
        _reflow_all(sub)


class RlcdGroup(TyperGroup):
    """The root group: user errors in one or two lines, exit 2; bugs with their traceback."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        _reflow_all(self)
        _option_names_whole()
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except cx.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except cx.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "rlcd"
            typer.echo(f"{cmd}: error: {e.format_message()}", err=True)
            typer.echo(f"Try '{cmd} --help'.", err=True)
            sys.exit(2)
        except cx.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            sys.exit(130)
        except UserError as e:
            typer.echo(f"rlcd: error: {e}", err=True)
            sys.exit(e.exit_code)
        except BrokenPipeError:  # `rlcd ... | head`
            sys.exit(1)
        except Exception as e:  # noqa: BLE001 - a full disk is said in one line; anything else keeps its traceback
            if not disk_full(e):
                raise
            typer.echo(f"rlcd: error: the disk is full ({e}); free some space and run the command again: what was "
                       "written before stays readable, and a training run continues with `rlcd train --resume RUN`",
                       err=True)
            sys.exit(1)
        # without standalone mode click returns a command's Exit code instead of exiting
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


def disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that found no room: ENOSPC/EDQUOT, or safetensors' own error that says so."""
    import errno

    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(e).__name__ == "SafetensorError" and "No space left on device" in str(e)


app = typer.Typer(cls=RlcdGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Train, calibrate, evaluate, analyse and serve calibrated typed-decision models.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlcd {version('rlcd')}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print the version and exit.")) -> None:
    """Train, calibrate, evaluate, analyse and serve calibrated typed-decision models."""
    show_status()
    quiet_progress_bars()


# the command table -------------------------------------------------------------------------------
app.add_typer(data.app, name="data")
app.command("train")(train.train)
app.command("features")(features.features)
app.command("calibrate")(evaluate.calibrate)
app.command("evaluate")(evaluate.evaluate)
app.command("report")(evaluate.report)
app.command("export")(evaluate.export)
app.command("ship")(evaluate.ship)
app.command("gate")(gate.gate)
app.command("predict")(serve.predict)
app.command("serve")(serve.serve)
app.command("compare")(analysis.compare)
app.command("sweep")(analysis.sweep)
app.command("sweep-worker", hidden=True)(analysis.sweep_worker)  # one sweep run
app.add_typer(analysis.analyze_app, name="analyze")
app.add_typer(analysis.probe_app, name="probe")
app.add_typer(bench.app, name="bench")
app.command("demo")(demo.demo)


def main() -> None:
    """Console-script entry point (`rlcd`)."""
    app()


__all__ = ["app", "main", "RlcdGroup"]
