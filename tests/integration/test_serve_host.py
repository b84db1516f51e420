"""The control host keeps its secrets: a real `llmgw serve` and `llmgw ctl` (R-9.3).

The state directory is 0700 and the database (with its -wal and -shm), the admin token and the
other files 0600 on every start, whatever they were before and whatever umask serve was started
with; local ctl goes through the 0600 Unix socket of the state directory, so the TCP address
file may be stale or lie; an admin listener bound beyond loopback is warned about.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_admin_support import (
    REPO,
    Result,
    free_port,
    kill_processes_mentioning,
    stop_router,
    wait_for,
)

SECRET_FILES = ("state.db", "state.db-wal", "state.db-shm", "admin-token", "admin-address")


class Gateway:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.state = tmp / "state"
        self.inventory = tmp / "inventory.yaml"
        self.inventory.write_text(yaml.safe_dump({"nodes": [{"name": "local", "connection": "local"}]}))
        self.log = tmp / "serve.log"
        self.process: subprocess.Popen | None = None

    def start(self, admin: str = "127.0.0.1:0") -> None:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "llmgw.cli.main", "serve", "-i", str(self.inventory), "--state-dir",
                 str(self.state), "--listen", f"127.0.0.1:{free_port()}", "--admin", admin],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, umask=0o022,
                env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")})
        wait_for(self.started, 60, "serve to listen on its admin socket and start its router")

    def started(self) -> bool:
        """Serve's start is done: its admin socket, the fleet settled and its router up. The router
        comes last; a serve stopped before it leaves the router starting on its own (it outlives
        serve), and the next serve, not seeing it yet, would start a second one that fails."""
        if not (self.alive() and (self.state / "admin.sock").exists()):
            return False
        log = self.log.read_text()
        return "fleet settled" in log and ("router supervisor started" in log
                                           or "adopting the running router supervisor" in log)

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"llmgw serve exited with {self.process.returncode}:\n{self.log.read_text()}")
        return True

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)
        stop_router(self.state)

    def ctl(self, *args: str) -> Result:
        done = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(self.state), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
                                   "COLUMNS": "300"})
        return Result(done.returncode, done.stdout, done.stderr)

    def modes(self) -> dict[str, int]:
        found = {name: stat.S_IMODE(os.lstat(self.state / name).st_mode) for name in (*SECRET_FILES, "admin.sock")
                 if (self.state / name).exists()}
        return {"state dir": stat.S_IMODE(os.stat(self.state).st_mode), **found}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-host")
    gw = Gateway(tmp)
    try:
        yield gw
    finally:
        gw.stop()
        kill_processes_mentioning(str(tmp))


PRIVATE = {"state dir": 0o700, **{name: 0o600 for name in (*SECRET_FILES, "admin.sock")}}


def test_a_fresh_state_directory_is_private_whatever_the_umask(gateway):
    gateway.start()
    try:
        modes = gateway.modes()
        print({name: oct(mode) for name, mode in modes.items()})
        assert modes == PRIVATE
    finally:
        gateway.stop()
    assert not (gateway.state / "admin.sock").exists(), "a clean stop removes its socket"


def test_a_loose_state_directory_is_closed_up_on_start_and_ctl_uses_the_socket(gateway):
    os.chmod(gateway.state, 0o755)
    for name in SECRET_FILES:
        if (gateway.state / name).exists():
            os.chmod(gateway.state / name, 0o644)
    (gateway.state / "admin-token").write_text("a-token-others-could-read\n")
    gateway.start()
    try:
        modes = gateway.modes()
        print({name: oct(mode) for name, mode in modes.items()})
        assert modes == PRIVATE
        # The TCP address file no longer matters to local ctl: the socket is asked.
        real = (gateway.state / "admin-address").read_text().strip()
        (gateway.state / "admin-address").write_text(f"127.0.0.1:{free_port()}\n")
        status = gateway.ctl("status")
        assert status.exit_code == 0, status.stderr
        assert "nodes: 1 (1 ready; 1 active)" in status.stdout
        dashboard = gateway.ctl("dashboard")
        assert dashboard.stdout.startswith(f"http://127.0.0.1:{real.rsplit(':', 1)[1]}/?token=")
        assert "a-token-others-could-read" in dashboard.stdout  # the token file was kept, only closed up
    finally:
        gateway.stop()


def test_an_admin_listener_beyond_loopback_is_warned_about(gateway):
    loopback = gateway.log.read_text()
    assert "not a loopback address" not in loopback, "127.0.0.1 is not warned about"
    gateway.start(admin="0.0.0.0:0")
    gateway.stop()
    log = gateway.log.read_text()  # serve's stderr: logging goes there
    warning = next((line for line in log.splitlines() if "not a loopback address" in line), None)
    assert warning is not None, log
    assert " WARNING llmgw.server: the admin listener is bound to 0.0.0.0:" in warning
