"""Run a real `llmgw serve` process for tests, and talk to it."""

from __future__ import annotations

import contextlib

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


# A hang guard, not a figure: on a machine whose cores other tests' engines hold, `llmgw serve`
# has taken 19 s before its first log line (imports alone), and its router as long again.
START_GUARD = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # the condition may raise while things come up
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else ""))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class GatewayProcess:
    """`llmgw serve -i INVENTORY` in a subprocess with its own state directory and ports."""

    def __init__(self, inventory: Path | None, state_dir: Path, env: dict | None = None, workers: int | None = None):
        self.inventory = inventory
        self.workers = workers
        self.state_dir = Path(state_dir)
        self.port = free_port()
        self.admin_port = free_port()
        self.env = {**os.environ, **(env or {}), "LLMGW_STATE_DIR": str(self.state_dir)}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir / "serve.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_GUARD) -> GatewayProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "llmgw.cli.main", "serve", "--state-dir", str(self.state_dir),
                "--listen", f"127.0.0.1:{self.port}", "--admin", f"127.0.0.1:{self.admin_port}"]
        if self.inventory is not None:
            argv += ["-i", str(self.inventory)]
        if self.workers is not None:
            argv += ["--workers", str(self.workers)]
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        # The router workers may be serving already (adopted): wait for this serve's own word too.
        try:
            wait_for(lambda: (self.workers == 0 or self._healthy()) and self._started(), timeout,
                     "llmgw serve to start and answer /healthz")
        except BaseException:
            # A start that did not finish leaves no serve and no router behind it: the caller's
            # cleanup never saw this process.
            with contextlib.suppress(Exception):
                self.stop()
            raise
        return self

    def _started(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"llmgw serve exited with {self.proc.returncode}:\n{self.log()}")
        with open(self.log_path, "rb") as log:
            log.seek(self._log_from)
            text = log.read().decode(errors="replace")
        if self.workers == 0:
            return "llmgw serving" in text
        return "router supervisor started" in text or "adopting the running router supervisor" in text

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"llmgw serve exited with {self.proc.returncode}:\n{self.log()}")
        with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
            return response.status == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def create_key(self, name: str = "test", models: str | None = None) -> str:
        argv = [sys.executable, "-m", "llmgw.cli.main", "keys", "create", name, "--state-dir", str(self.state_dir)]
        if models:
            argv += ["--models", models]
        out = subprocess.run(argv, capture_output=True, text=True, env=self.env, check=True, timeout=60).stdout
        return next(word for word in out.split() if word.startswith("sk-"))

    def admin(self, path: str, method: str = "GET", body=None):
        """Call the admin API with the token from the state directory; returns (status, JSON)."""
        import json
        import urllib.error

        token = (self.state_dir / "admin-token").read_text().strip()
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}", data=data, method=method,
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to serve, then stop the router supervisor of its state directory (which outlives
        serve by design) and fail loudly if any of its processes is left."""
        try:
            return self.stop_serve(timeout)
        finally:
            self.stop_router(timeout)

    def stop_serve(self, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"llmgw serve did not stop on SIGTERM within {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL to serve: the router workers are meant to go on serving."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def router_dir(self) -> Path:
        return self.state_dir / "router"

    def router_status(self) -> dict | None:
        import json

        try:
            return json.loads((self.router_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def router_log(self) -> str:
        path = self.state_dir / "router.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_router(self, timeout: float = 30) -> None:
        stop_router_supervisor(self.router_dir, timeout, self.router_log)

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_router_supervisor(router_dir: Path, timeout: float = 30, log=lambda: "") -> None:
    """SIGTERM to the router supervisor running on `router_dir` (if one is), then fail loudly, with
    `log()`, if it or any of its workers is left after `timeout` (those are killed)."""
    import json

    from llmgw.router.supervisor import STATUS_FILE, running_supervisor

    pid = running_supervisor(router_dir)
    if pid is None:
        return
    try:
        status = json.loads((router_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        status = {}
    workers = [worker["pid"] for worker in status.get("workers", []) if worker["pid"]]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in (pid, *workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in (pid, *workers) if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"router processes {left} left after SIGTERM to the supervisor:\n{log()}"
