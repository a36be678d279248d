"""The rich consoles of the command line: results on stdout, notices on stderr.

On a terminal rich fits a table to the window. In a pipe or a file it would cut it to 80 columns (or
to the width of a terminal on stderr), leaving `accu…` and `1.…` in `rlcd sweep ... | cat` or
`> summary.txt`: `ResultConsole` then lays every table out at its full width instead, so nothing a
command prints as its result is lost. Whether stdout is a terminal is decided at each print, so a
module-level console follows a test runner's swapped stdout.
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions

PIPE_WIDTH = 10_000  # columns a table may take off a terminal: no real table reaches it


class ResultConsole(Console):
    """A stdout Console that never truncates or wraps a table when stdout is not a terminal."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        return size if self.is_terminal else ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def result_console() -> Console:
    """The console a command prints its result on (stdout)."""
    return ResultConsole()


def notice_console() -> Console:
    """The console of warnings and notices (stderr), so a pipe reads the result alone."""
    return Console(stderr=True)


__all__ = ["PIPE_WIDTH", "ResultConsole", "notice_console", "result_console"]
