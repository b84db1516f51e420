"""`llmgw serve` start-up: one serve per state directory and port; a failed or interrupted start
ends the process, having taken down what it started (R-9.1, R-4.5).

These run `llmgw serve` with the embedded default (this machine as its one local node), so a
start really reaches a node. Timeouts here are hang checks, generous on a shared machine."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import server
from llmgw.state_dir import LOCK_FILE, hold_instance_lock
from tests.integration.gateway import GatewayProcess, free_port, wait_for

HANG = 60.0


def serve_argv(state_dir: Path, port: int, admin_port: int) -> list[str]:
    return [sys.executable, "-m", "llmgw.cli.main", "serve", "--state-dir", str(state_dir),
            "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin_port}"]


@pytest.fixture
def first(tmp_path):
    gateway = GatewayProcess(None, tmp_path / "first").start()
    try:
        yield gateway
    finally:
        gateway.stop()


def test_a_second_serve_on_the_same_state_directory_exits_naming_the_first(first):
    second = subprocess.run(serve_argv(first.state_dir, free_port(), free_port()), capture_output=True,
                            text=True, timeout=HANG, env=first.env)
    print(second.stderr)
    assert second.returncode == 1
    assert (f"another llmgw serve (pid {first.proc.pid}) is already running with the state directory "
            f"{first.state_dir}") in second.stderr
    assert "Traceback" not in second.stderr
    assert first._healthy()  # the first one goes on, its files untouched
    assert (first.state_dir / "admin-address").read_text().strip() == f"127.0.0.1:{first.admin_port}"


@pytest.mark.parametrize("which,option", [pytest.param("router", "--listen", id="router-port"),
                                          pytest.param("admin listener", "--admin", id="admin-port")])
def test_a_second_serve_on_a_port_in_use_exits_naming_the_address(first, tmp_path, which, option):
    port, admin_port = (first.port, free_port()) if which == "router" else (free_port(), first.admin_port)
    taken = port if which == "router" else admin_port
    second = subprocess.run(serve_argv(tmp_path / "second", port, admin_port), capture_output=True, text=True,
                            timeout=HANG, env=first.env)
    print(second.stderr)
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{taken} for the {which}: the address is already in use" in second.stderr
    assert option in second.stderr and "Traceback" not in second.stderr
    # Nothing was started: no node was reached from the second state directory.
    assert not (tmp_path / "second" / "node").exists()
    assert first._healthy()


def _has_open(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(fd) == str(path.resolve()) for fd in fds.iterdir())


def test_sigterm_stops_a_serve_that_is_still_starting(tmp_path):
    """Its start waits for the state database (another command holds the write lock)."""
    state = tmp_path / "state"
    state.mkdir()
    database = state / "state.db"
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")
    holder.execute("BEGIN IMMEDIATE")  # a fresh database, its migration blocked behind this
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(serve_argv(state, port, free_port()), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "LLMGW_STATE_DIR": str(state)})
    try:
        wait_for(lambda: proc.poll() is None and _has_open(proc.pid, database), HANG, "serve to open the database")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(HANG)
        output = (tmp_path / "serve.log").read_text()
        print(output)
        assert code == 0, output
        assert "stopping during start-up" in output and "Traceback" not in output
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it never listened
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        holder.execute("ROLLBACK")
        holder.close()
        log.close()


async def test_a_start_that_fails_half_way_takes_down_what_it_started(tmp_path, monkeypatch):
    """The local node's link was already connecting when the start failed: it is closed, and no
    task is left behind for the event loop to wait on when the process ends."""
    links = []
    original = server.Fleet.start

    async def start_and_keep(fleet):
        await original(fleet)
        links.extend(fleet.links.values())

    def broken_admin(gateway):
        raise RuntimeError("the admin app cannot be built")

    monkeypatch.setattr(server.Fleet, "start", start_and_keep)
    monkeypatch.setattr(server.Gateway, "_admin_app", broken_admin)
    with pytest.raises(RuntimeError, match="admin app cannot be built"):
        await asyncio.wait_for(server.serve(None, state_dir=str(tmp_path / "state"),
                                            listen=f"127.0.0.1:{free_port()}", admin=f"127.0.0.1:{free_port()}"), HANG)
    assert links and all(link._closed for link in links)
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    assert left == [], left
    # The state directory is free again: a new start takes its lock.
    fd = hold_instance_lock(tmp_path / "state")
    os.close(fd)


def test_a_symlink_in_place_of_the_lock_file_is_refused_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    target = tmp_path / "elsewhere"
    (state / LOCK_FILE).symlink_to(target)
    result = subprocess.run(serve_argv(state, free_port(), free_port()), capture_output=True, text=True,
                            timeout=HANG, env={**os.environ, "LLMGW_STATE_DIR": str(state)})
    assert result.returncode == 1, result.stderr
    assert f"cannot open the lock file {state / LOCK_FILE}" in result.stderr
    assert "Traceback" not in result.stderr and not target.exists()
