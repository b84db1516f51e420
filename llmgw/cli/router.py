"""`llmgw router`: router workers fed by a control plane, without one in their process (R-10.2, R-10.3).

`llmgw router --control ... --listen HOST:PORT --workers N` runs the supervisor in the
foreground; `llmgw router restart` and `llmgw router stop` act on the one running on a state
directory (the pid in its lock file).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import typer

from llmgw.cli.exits import fail
from llmgw.contracts.statedir import default_state_dir

STOP_TIMEOUT = 60.0
RESTART_TIMEOUT_PER_WORKER = 150.0

router_app = typer.Typer(
    name="router",
    invoke_without_command=True,
)


def default_router_state_dir() -> Path:
    return default_state_dir().parent / "llmgw-router"


StateDir = typer.Option(None, "--state-dir", help="The router's state directory (default: ~/.local/state/llmgw-router).")


@router_app.callback()
def router(
    ctx: typer.Context,
    control: str | None = typer.Option(None, "--control",
                                       help="The control plane: unix:PATH (its feed.sock) or https://HOST:PORT "
                                            "(its admin listener)."),
    credential_file: Path | None = typer.Option(None, "--credential-file",
                                                help="File holding this router's credential (`llmgw ctl routers "
                                                     "add NAME`). Default: LLMGW_ROUTER_CREDENTIAL when set, else "
                                                     "the credential file of the state directory."),
    listen: str = typer.Option("127.0.0.1:8080", "--listen", help="Client listener HOST:PORT."),
    workers: int = typer.Option(1, "--workers", min=1, help="Worker processes sharing the client port."),
    state_dir: Path | None = StateDir,
    ca: Path | None = typer.Option(None, "--ca", help="CA certificate to verify an https control plane with."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    ready_fd: int | None = typer.Option(None, "--ready-fd", hidden=True),
    worker_module: str = typer.Option("llmgw.router.worker", "--worker-module", hidden=True),
) -> None:
    """Serve the OpenAI API with N worker processes on one port, fed by a control plane (`llmgw serve`).

    Workers that die are restarted; SIGHUP (or `llmgw router restart`) restarts them one by one
    without refusing a connection; SIGTERM stops them after their requests in flight. One router
    runs per state directory, and a port another process holds ends the start at once.
    """
    if ctx.invoked_subcommand is not None:
        return
    from llmgw.router.supervisor import SupervisorConfig, SupervisorError, run_supervisor
    from llmgw.router.worker import LOG_FORMAT

    if control is None:
        fail("llmgw router: --control unix:PATH or --control https://HOST:PORT is required")
    from llmgw.router import credential

    state_dir = state_dir or default_router_state_dir()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    os.environ["LLMGW_LOG_LEVEL"] = log_level  # the workers log at the same level
    config = SupervisorConfig(listen=listen, workers=workers, state_dir=state_dir, control=control,
                              credential_file=credential.resolve(credential_file, state_dir), ca=ca,
                              worker_module=worker_module)
    try:
        code = run_supervisor(config, ready_fd)
    except SupervisorError as exc:
        if ready_fd is not None:
            try:
                os.write(ready_fd, f"error: {exc}\n".encode())
            except OSError:
                pass
        fail(f"llmgw router: {exc}")
    raise typer.Exit(code)


def _running(state_dir: Path) -> int:
    from llmgw.router.supervisor import running_supervisor

    pid = running_supervisor(state_dir)
    if pid is None or pid <= 0:
        fail(f"llmgw router: no router runs with the state directory {state_dir}")
    return pid


@router_app.command("stop")
def stop(state_dir: Path | None = StateDir) -> None:
    """Stop the router of a state directory: its workers finish their requests in flight, then exit."""
    from llmgw.router.supervisor import running_supervisor

    state_dir = state_dir or default_router_state_dir()
    pid = _running(state_dir)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while running_supervisor(state_dir) is not None:
        if time.monotonic() > deadline:
            fail(f"llmgw router: pid {pid} did not stop within {STOP_TIMEOUT:.0f}s")
        time.sleep(0.1)
    typer.echo(f"router (pid {pid}) stopped")


@router_app.command("restart")
def restart(state_dir: Path | None = StateDir) -> None:
    """Restart the workers one by one (an upgrade): each new one serves before the old one drains."""
    from llmgw.router.supervisor import read_status

    state_dir = state_dir or default_router_state_dir()
    pid = _running(state_dir)
    before = read_status(state_dir) or {}
    rolls, failures = before.get("rolls", 0), before.get("roll_failures", 0)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RESTART_TIMEOUT_PER_WORKER * max(1, len(before.get("workers", [])))
    while time.monotonic() < deadline:
        status = read_status(state_dir) or {}
        if status.get("rolls", 0) > rolls and status.get("state") == "serving":
            pids = ", ".join(str(worker["pid"]) for worker in status.get("workers", []))
            typer.echo(f"router (pid {pid}) restarted its workers: {pids}")
            return
        if status.get("roll_failures", 0) > failures:
            fail(f"llmgw router: restart stopped: {status.get('last_roll_error')}; the running workers keep serving")
        time.sleep(0.1)
    fail(f"llmgw router: pid {pid} did not finish the restart in time")
