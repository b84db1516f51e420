"""The `llmgw` command: one typer app with its groups.

Each group's module is imported only when the command line names it (`app`, the whole command,
is made when asked for: `llmgw --help`, an unknown command, the tests). `llmgw ctl ...`, which
operators and scripts run in loops, then starts without the configuration, SSH and store
libraries the other groups import, about half of its start.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

PRIVATE_UMASK = 0o077
HELP = "One OpenAI-compatible endpoint for a fleet of GPU and CPU machines reached over SSH."


# Each group: the module and attribute of its command (a function) or group (a typer app), in the
# order `llmgw --help` lists them.
GROUPS = {"serve": ("llmgw.cli.serve", "serve"), "check": ("llmgw.cli.check", "check"),
          "helper": ("llmgw.cli.nodes", "helper_app"), "keys": ("llmgw.cli.keys", "keys_app"),
          "ctl": ("llmgw.cli.ctl", "ctl"), "router": ("llmgw.cli.router", "router_app")}


def build(names=GROUPS) -> typer.Typer:
    """The `llmgw` app with the groups `names` (all by default)."""
    app = typer.Typer(name="llmgw", help=HELP, no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """One OpenAI-compatible endpoint for a fleet of GPU and CPU machines reached over SSH."""

    for name in names:
        module, attribute = GROUPS[name]
        target = getattr(importlib.import_module(module), attribute)
        if isinstance(target, typer.Typer):
            app.add_typer(target, name=name)
        else:
            app.command(name)(target)
    return app


def __getattr__(name: str):
    if name == "app":  # the whole command, made once
        app = globals()["app"] = build()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run() -> None:
    """The `llmgw` command. Whatever llmgw creates (state directory, database, token, sockets,
    the local node's files) is its user's alone, whatever the umask it was started with (R-9.3)."""
    os.umask(PRIVATE_UMASK)
    named = sys.argv[1] if len(sys.argv) > 1 else None
    build([named] if named in GROUPS else GROUPS)()


if __name__ == "__main__":  # pragma: no cover
    run()
