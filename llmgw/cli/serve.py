"""`llmgw serve`: control plane, router and admin listener in one process (R-9.1, R-9.2)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import typer

from llmgw.config import ConfigError

EXIT_CONFIG = 2
EXIT_START = 1


def serve(
    inventory: Path | None = typer.Option(None, "-i", "--inventory",
                                          help="Inventory file. Without one, this machine is the only node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR",
                                          help="Where SQLite state and the admin token live "
                                               "(default: gateway.state_dir, else ~/.local/state/llmgw)."),
    listen: str | None = typer.Option(None, "--listen", help="Client listener HOST:PORT (default 127.0.0.1:8080)."),
    admin: str | None = typer.Option(None, "--admin", help="Admin listener HOST:PORT (default 127.0.0.1:8081)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the gateway: reach the nodes, keep the models' replicas running, serve the OpenAI API.

    SIGTERM or Ctrl-C stops accepting requests, lets in-flight ones finish, and leaves the
    engines running: the next start adopts them instead of restarting them. One serve runs per
    state directory. Exit code 2: the inventory is invalid; 1: it could not start (a port in
    use, another serve with the same state directory).
    """
    from llmgw.server import StartupError, serve as run

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    try:
        asyncio.run(run(str(inventory) if inventory else None, state_dir=str(state_dir) if state_dir else None,
                        listen=listen, admin=admin))
    except ConfigError as exc:
        for line in exc.lines():
            typer.echo(line, err=True)
        raise typer.Exit(EXIT_CONFIG)
    except StartupError as exc:
        typer.echo(f"llmgw serve: {exc}", err=True)
        raise typer.Exit(EXIT_START)
