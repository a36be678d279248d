"""The one exception a user's mistake raises, so the CLI can tell it from a bug.

A `UserError` (a missing or wrong path, an unknown preset, a malformed request or data file, a
refused resume, a bad option value) is printed by the CLI in one or two lines on stderr and ends the
command with exit status 2; anything else is a bug and keeps its traceback. Library code raises the
most specific subclass it has (`RecordError`, `ResumeRefused`, `DeviceError`, ...), always with a
message that names the thing at fault and the fix.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message names what is wrong and how to fix it."""

    exit_code = 2


class RunError(UserError, FileNotFoundError):
    """A run directory (or a part of it a command needs) is missing or not a run."""


class DeviceError(UserError, ValueError):
    """A --device / --dtype request this machine cannot satisfy."""


class OptionError(UserError, ValueError):
    """An option value that breaks a rule (unknown recipe field, refused flag on resume, ...)."""


class BackboneError(UserError, ValueError, RuntimeError):
    """A backbone that cannot be found or loaded as named (unknown preset, missing dir or package, hub offline)."""


class DataChanged(UserError, ValueError):
    """A run's data files no longer match the sha256s frozen at its start (`rlcd evaluate` / `calibrate`)."""


class DiskSpaceError(UserError, OSError):
    """Too little free disk for a file rlcd is about to write; what was already done is kept for a re-run."""
