"""`llmgw serve`: the control plane and admin listener, and the router workers it spawns or adopts (R-9.1, R-10.4)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import typer

from llmgw.cli.exits import bad_config, fail
from llmgw.config import ConfigError


def serve(
    inventory: Path | None = typer.Option(None, "-i", "--inventory",
                                          help="Inventory file. Without one, this machine is the only node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR",
                                          help="Where SQLite state and the admin token live "
                                               "(default: gateway.state_dir, else ~/.local/state/llmgw)."),
    listen: str | None = typer.Option(None, "--listen", help="Client listener HOST:PORT (default 127.0.0.1:8080)."),
    admin: str | None = typer.Option(None, "--admin", help="Admin listener HOST:PORT (default 127.0.0.1:8081)."),
    workers: int = typer.Option(1, "--workers", min=0,
                                help="Router worker processes on the client port; 0: the control plane only "
                                     "(routers run elsewhere as `llmgw router`)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the gateway: reach the nodes, keep the models' replicas running, serve the OpenAI API.

    The router workers run under a supervisor of their own (`llmgw router`, its log in
    STATE/router.log). Ctrl-C (SIGINT) stops them too, once their requests in flight end. SIGTERM
    (systemd, a restart) or a crash of serve stops the control plane only: the workers keep serving
    with what they were last told, and the next serve adopts them; `llmgw router stop --state-dir
    STATE/router` stops them. Engines keep running either way, and the next serve adopts them.
    One serve runs per state directory. Exit code 2: the inventory is invalid; 1: it could not
    start (a port in use, another serve with the same state directory, a router that cannot start).
    """
    from llmgw.server import serve as run
    from llmgw.state_dir import StartupError

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    try:
        asyncio.run(run(str(inventory) if inventory else None, state_dir=str(state_dir) if state_dir else None,
                        listen=listen, admin=admin, workers=workers))
    except ConfigError as exc:
        bad_config(exc)
    except StartupError as exc:
        fail(f"llmgw serve: {exc}")
