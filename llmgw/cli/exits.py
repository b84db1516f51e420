"""How an `llmgw` command ends when it fails: its exit codes, and the one way errors are printed.

Exit codes: 0, done; 1 (`FAILED`), refused, could not start or stop, or a node could not be
reached; 2 (`BAD_CONFIG`), the inventory file is invalid or does not name what was asked for.
Commands print a failure with `fail`, and an invalid inventory with `bad_config`, never by hand.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:  # the configuration's libraries are not loaded for commands that read none (`ctl`)
    from llmgw.config import ConfigError


class ExitCode(IntEnum):
    FAILED = 1
    BAD_CONFIG = 2


def fail(*lines: str, code: ExitCode = ExitCode.FAILED) -> NoReturn:
    """Print `lines` on stderr, then end the command with `code`."""
    for line in lines:
        typer.echo(line, err=True)
    raise typer.Exit(int(code))


def bad_config(error: ConfigError) -> NoReturn:
    """An invalid inventory file: each problem on a line of its own (file, line, field); exit 2."""
    fail(*error.lines(), code=ExitCode.BAD_CONFIG)
