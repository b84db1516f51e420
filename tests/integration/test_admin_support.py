"""Support for the admin tests: a real `llmgw serve` subprocess and `llmgw ctl` run against it.

`ctl` runs in-process through typer's test runner (a subprocess costs ~0.6 s of imports per
command); the few tests that need a separate process (`--watch`, `logs -f`, exit codes seen by
a shell) start one with `ctl_process`. No tests here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from llmgw.cli.main import app

REPO = Path(__file__).resolve().parents[2]
DOUBLES = REPO / "tests" / "testbed" / "doubles"
WIDTH = "250"  # wide enough that no table cell wraps


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.1):
    """Poll `condition()` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - reported if the deadline passes
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}"
                                 + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval)


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str


class Serve:
    """`llmgw serve -i INVENTORY` in a subprocess with its own state directory."""

    def __init__(self, inventory: Path, state_dir: Path, env: dict | None = None):
        self.inventory = inventory
        self.state_dir = state_dir
        self.router_port = free_port()
        self.log_path = state_dir.parent / "serve.log"
        self.env = {**os.environ, "COLUMNS": WIDTH, **(env or {})}
        self.env.pop("LLMGW_STATE_DIR", None)
        self.env.pop("LLMGW_ADMIN_TOKEN", None)
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> Serve:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "llmgw.cli.main", "serve", "-i", str(self.inventory), "--state-dir",
                 str(self.state_dir), "--listen", f"127.0.0.1:{self.router_port}", "--admin", "127.0.0.1:0"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        wait_for(lambda: self._alive() and (self.state_dir / "admin-address").exists(), timeout,
                 "the admin listener to write its address")
        return self

    def _alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"llmgw serve exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def admin_url(self) -> str:
        return "http://" + (self.state_dir / "admin-address").read_text().strip()

    @property
    def token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def api(self, path: str, token: str | None = "default", method: str = "GET", body=None):
        """(status, parsed JSON or text) of an admin request; `token=None` sends none."""
        request = urllib.request.Request(self.admin_url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None)
        if token is not None:
            request.add_header("Authorization", f"Bearer {self.token if token == 'default' else token}")
        if body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, data, ctype = response.status, response.read(), response.headers.get_content_type()
        except urllib.error.HTTPError as exc:
            status, data, ctype = exc.code, exc.read(), exc.headers.get_content_type()
        return status, json.loads(data) if ctype == "application/json" else data.decode()

    def ctl(self, *args: str) -> Result:
        """`llmgw ctl --state-dir STATE ARGS...`, in-process."""
        runner = CliRunner(env={"COLUMNS": WIDTH, "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None,
                                "LLMGW_STATE_DIR": None})
        result = runner.invoke(app, ["ctl", "--state-dir", str(self.state_dir), *args])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Result(result.exit_code, result.stdout, result.stderr)

    def ctl_json(self, *args: str):
        result = self.ctl(*args, "--json")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    def ctl_process(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(self.state_dir),
                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                                cwd=REPO, start_new_session=True)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, as an operator would; the engines it started keep running (R-4.5)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"llmgw serve did not stop within {timeout:.0f}s of SIGTERM")


def kill_processes_mentioning(marker: str) -> list[int]:
    """SIGKILL this machine's processes whose command line contains `marker` (a test's own temp
    path): the engines and supervisors a local node started, which outlive the gateway by design."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def read_until(stream, predicate, timeout: float, what: str) -> str:
    """Read a subprocess pipe (binary) until `predicate(text so far)` holds, or fail at the deadline."""
    import select

    seen = b""
    deadline = time.monotonic() + timeout
    while not predicate(seen.decode(errors="replace")):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {what}; got:\n{seen.decode(errors='replace')[-3000:]}")
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the stream ended before {what}; got:\n"
                                     f"{seen.decode(errors='replace')[-3000:]}")
            seen += chunk
    return seen.decode(errors="replace")
