"""The `llmgw` command: one typer app with its groups."""

from __future__ import annotations

import os

import typer

from llmgw.cli.check import check
from llmgw.cli.ctl import ctl
from llmgw.cli.keys import keys_app
from llmgw.cli.nodes import helper_app
from llmgw.cli.router import router_app
from llmgw.cli.serve import serve

app = typer.Typer(
    name="llmgw",
    help="One OpenAI-compatible endpoint for a fleet of GPU and CPU machines reached over SSH.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


PRIVATE_UMASK = 0o077


@app.callback()
def main() -> None:
    """One OpenAI-compatible endpoint for a fleet of GPU and CPU machines reached over SSH."""


app.command("serve")(serve)
app.command("check")(check)
app.add_typer(helper_app, name="helper")
app.add_typer(keys_app, name="keys")
app.add_typer(ctl, name="ctl")
app.add_typer(router_app, name="router")


def run() -> None:
    """The `llmgw` command. Whatever llmgw creates (state directory, database, token, sockets,
    the local node's files) is its user's alone, whatever the umask it was started with (R-9.3)."""
    os.umask(PRIVATE_UMASK)
    app()


if __name__ == "__main__":  # pragma: no cover
    run()
