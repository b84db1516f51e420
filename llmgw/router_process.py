"""The router supervisor of `llmgw serve`, a process of its own (R-10.4): found and adopted, or
spawned detached once its port is known free, and stopped on an interactive stop of serve.

The supervisor (`llmgw router`, llmgw.router.supervisor) keeps its state in STATE/router and logs
to STATE/router.log; serve finds it by the lock it holds there, tells an adopted one the worker
count wanted through desired.json and SIGUSR1, and waits for a spawned one's readiness line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.aio import in_daemon_thread
from llmgw.contracts.addresses import split_address
from llmgw.control.feedserver import FEED_SOCKET
from llmgw.router.credential import CREDENTIAL_FILE
from llmgw.router.supervisor import (DESIRED_FILE, SupervisorError, probe_port, read_status, running_supervisor,
                                     write_private_json)
from llmgw.state_dir import ROUTER_DIR, ROUTER_LOG, StartupError

log = logging.getLogger(__name__)

ROUTER_START_TIMEOUT = 180.0  # its workers wait for the first snapshot before they say ready
ROUTER_STOP_TIMEOUT = 40.0  # its workers' requests in flight get SHUTDOWN_GRACE, then the supervisor kills them


@dataclass(frozen=True)
class RunningRouter:
    """A router supervisor found running on serve's state directory (R-10.4)."""

    pid: int
    listen: str | None
    workers: int | None


def running_router(state_dir: Path) -> RunningRouter | None:
    """The supervisor holding serve's router state directory, with what its status.json says."""
    pid = running_supervisor(state_dir / ROUTER_DIR)
    if pid is None:
        return None
    status = read_status(state_dir / ROUTER_DIR) or {}
    workers = status.get("workers")
    return RunningRouter(pid, status.get("listen"), len(workers) if workers else None)


def router_to_adopt(state_dir: Path, listen: str) -> RunningRouter | None:
    """The supervisor running on serve's state directory, to adopt; else None, once the client
    address `listen` is known free for the one serve will spawn: probed before anything starts,
    so a port in use ends the start at once, naming it."""
    running = running_router(state_dir)
    if running is None:
        try:
            probe_port(listen, "--listen")
        except SupervisorError as exc:
            raise StartupError(str(exc)) from None
    return running


def same_listen(running: str | None, wanted: str) -> bool:
    """Whether the address a supervisor listens on is the one asked for (`wanted` resolved)."""
    try:
        (have_host, have_port), (want_host, want_port) = split_address(running or ""), split_address(wanted)
    except ValueError:
        return False
    if have_port != want_port:
        return False
    try:
        wanted_hosts = {info[4][0] for info in socket.getaddrinfo(want_host, want_port, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return have_host in wanted_hosts


def adopt_router(state_dir: Path, running: RunningRouter, listen: str, workers: int) -> None:
    """Leave the running supervisor serving; tell it the worker count wanted (desired.json, SIGUSR1)."""
    log.info("adopting the running router supervisor: pid %d, listening on %s, %s workers", running.pid,
             running.listen or "-", running.workers if running.workers is not None else "-")
    if not same_listen(running.listen, listen):
        log.warning("the running router listens on %s, not on %s as asked: it keeps its address until it is "
                    "restarted (`llmgw router stop --state-dir %s`, then start llmgw serve again)",
                    running.listen or "-", listen, state_dir / ROUTER_DIR)
    if running.workers != workers:
        log.info("asking the router supervisor for %d workers instead of %s", workers,
                 running.workers if running.workers is not None else "-")
        write_private_json(state_dir / ROUTER_DIR / DESIRED_FILE, {"workers": workers})
        os.kill(running.pid, signal.SIGUSR1)


async def spawn_router(state_dir: Path, listen: str, workers: int) -> int:
    """Start `llmgw router` for this state directory, detached, and wait until it serves; its pid.

    It runs in a session of its own with stdin on /dev/null and its log appended to router.log,
    so it outlives serve, however serve ends, and holds none of serve's output open (R-10.4). One
    that has not said ready when serve is stopped has served nothing and is killed: left to start
    on its own, it would wait for a control plane that is gone, and the next serve would find it
    half-started."""
    log_path = state_dir / ROUTER_LOG
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(log_fd, 0o600)
    ready_r, ready_w = os.pipe()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    argv = [sys.executable, "-m", "llmgw.cli.main", "router", "--control", f"unix:{state_dir / FEED_SOCKET}",
            "--credential-file", str(state_dir / ROUTER_DIR / CREDENTIAL_FILE), "--state-dir", str(state_dir / ROUTER_DIR),
            "--listen", listen, "--workers", str(workers), "--ready-fd", str(ready_w), "--log-level", level]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, pass_fds=(ready_w,),
                                start_new_session=True)
    finally:
        os.close(ready_w)
        os.close(log_fd)
    try:
        line = await in_daemon_thread(lambda: _first_line(ready_r, ROUTER_START_TIMEOUT))
    except asyncio.CancelledError:  # serve stopped during its start: a router that never served goes too
        proc.kill()
        raise
    if line is not None and line.startswith("ready"):
        said = dict(word.partition("=")[::2] for word in line.split()[1:])
        log.info("router supervisor started: pid %d, listening on %s, %s workers", proc.pid, said.get("listen", "-"),
                 said.get("workers", "-"))
        return proc.pid
    if line is None:
        proc.kill()
        raise StartupError(f"the router (pid {proc.pid}) did not serve within {ROUTER_START_TIMEOUT:.0f}s; "
                           f"see {log_path}")
    if line.startswith("error: "):
        raise StartupError(line.removeprefix("error: "))
    code = proc.wait()
    raise StartupError(f"the router exited (code {code}) before it served; see {log_path}")


async def stop_router(state_dir: Path) -> None:
    """SIGTERM to the router supervisor of this state directory, and wait until it is gone (its
    workers finish their requests in flight first): an interactive stop of serve (R-10.4)."""
    pid = running_supervisor(state_dir / ROUTER_DIR)
    if pid is None or pid <= 0:
        return
    log.info("stopping the router supervisor (pid %d): its workers finish their requests in flight first", pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + ROUTER_STOP_TIMEOUT
    # Its lock is released a moment before the process ends: wait for the process itself.
    while running_supervisor(state_dir / ROUTER_DIR) is not None or not _process_gone(pid):
        if time.monotonic() > deadline:
            log.warning("the router supervisor (pid %d) did not stop within %.0fs; stop it with `llmgw router stop "
                        "--state-dir %s`", pid, ROUTER_STOP_TIMEOUT, state_dir / ROUTER_DIR)
            return
        await asyncio.sleep(0.1)
    log.info("router stopped (pid %d); the client port is free", pid)


def _process_gone(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # spawned by this serve: reaped here
            return True
    except ChildProcessError:  # another's child (adopted): gone once it is no process or a zombie
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _first_line(fd: int, timeout: float) -> str | None:
    with os.fdopen(fd, "rb", 0) as pipe, selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        data = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").split("\n", 1)[0].strip()
