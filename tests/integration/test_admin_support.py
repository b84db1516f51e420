"""Support for the admin tests: a real `llmgw serve` subprocess and `llmgw ctl` run against it.

`ctl` runs in-process through typer's test runner (a subprocess costs ~0.6 s of imports per
command); the few tests that need a separate process (`--watch`, `logs -f`, exit codes seen by
a shell) start one with `ctl_process`. No tests here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from llmgw.cli.main import app
from tests.integration.gateway import free_port, wait_for  # noqa: F401 - re-exported for the admin tests

REPO = Path(__file__).resolve().parents[2]
DOUBLES = REPO / "tests" / "testbed" / "doubles"
WIDTH = "400"  # wide enough that no table cell wraps, even with testbed paths


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
        wait_for(lambda: self._alive() and (self.state_dir / "admin-address").exists()
                 and ("router supervisor started" in self.log() or "adopting the running router" in self.log()),
                 timeout, "the admin listener to write its address and the router to serve")
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
        finally:
            stop_router(self.state_dir, timeout)


def stop_router(state_dir: Path, timeout: float = 30.0) -> None:
    """Stop the router supervisor serve left running on its state directory (it outlives serve)."""
    from llmgw.router.supervisor import running_supervisor

    pid = running_supervisor(state_dir / "router")
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running_supervisor(state_dir / "router") is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the router supervisor (pid {pid}) did not stop within {timeout:.0f}s of SIGTERM")
        time.sleep(0.1)


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


# -- a headless browser ------------------------------------------------------------------------------

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    import shutil

    return next((found for name in CHROMIUM if (found := shutil.which(name))), None)


@dataclass
class PageLoad:
    """What loading one address did: every response's status, failed requests, the final DOM."""

    url: str
    responses: list[tuple[str, int, str]]  # (url, status, resource type)
    failures: list[tuple[str, str]]  # (url, error text)
    html: str
    scripts: int  # <script> elements in the DOM


class Browser:
    """Headless Chromium driven over the DevTools protocol (no page JavaScript is involved).

        with Browser(tmp_path) as browser:
            load = browser.load("http://127.0.0.1:8081/?token=...")
    """

    def __init__(self, profile_dir: Path):
        self.profile_dir = profile_dir
        self.process: subprocess.Popen | None = None
        self._ws = None
        self._session = None
        self._ids = 0
        self._events: list[dict] = []

    def __enter__(self) -> Browser:
        import asyncio

        self._loop = asyncio.new_event_loop()
        binary = chromium_path()
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            active = self.profile_dir / "DevToolsActivePort"
            wait_for(lambda: active.exists() and len(active.read_text().split()) >= 2, 30, "Chromium to start")
            port = active.read_text().split()[0]
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(t for t in targets if t["type"] == "page")
            self._loop.run_until_complete(self._connect(page["webSocketDebuggerUrl"]))
            for method in ("Page.enable", "Network.enable", "DOM.enable"):
                self.send(method)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    async def _connect(self, url: str) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0)

    def __exit__(self, *exc) -> None:
        try:
            if self._ws is not None:
                self._loop.run_until_complete(self._ws.close())
            if self._session is not None:
                self._loop.run_until_complete(self._session.close())
        finally:
            self._loop.close()
            if self.process is not None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()

    def send(self, method: str, timeout: float = 30.0, **params) -> dict:
        return self._loop.run_until_complete(self._send(method, params, timeout))

    async def _send(self, method: str, params: dict, timeout: float) -> dict:
        import asyncio

        self._ids += 1
        ident = self._ids
        await self._ws.send_json({"id": ident, "method": method, "params": params})
        async with asyncio.timeout(timeout):
            while True:
                message = await self._ws.receive_json()
                if message.get("id") == ident:
                    if "error" in message:
                        raise AssertionError(f"{method}: {message['error']}")
                    return message.get("result", {})
                self._events.append(message)

    def _until_event(self, name: str, timeout: float) -> None:
        import asyncio

        async def wait() -> None:
            async with asyncio.timeout(timeout):
                while not any(e.get("method") == name for e in self._events):
                    self._events.append(await self._ws.receive_json())
        self._loop.run_until_complete(wait())

    def load(self, url: str, timeout: float = 30.0) -> PageLoad:
        self._events.clear()
        self.send("Page.navigate", url=url)
        self._until_event("Page.loadEventFired", timeout)
        self.send("Runtime.runIfWaitingForDebugger")  # a no-op round trip: flushes late events
        responses, failures = [], []
        for event in self._events:
            params = event.get("params", {})
            if event.get("method") == "Network.responseReceived":
                responses.append((params["response"]["url"], params["response"]["status"], params.get("type", "")))
            elif event.get("method") == "Network.loadingFailed":
                failures.append((params.get("requestId"), params.get("errorText", "")))
            elif event.get("method") == "Network.requestWillBeSent" and params.get("redirectResponse"):
                redirect = params["redirectResponse"]
                responses.append((redirect["url"], redirect["status"], params.get("type", "")))
        root = self.send("DOM.getDocument", depth=-1)["root"]["nodeId"]
        html = self.send("DOM.getOuterHTML", nodeId=root)["outerHTML"]
        scripts = len(self.send("DOM.querySelectorAll", nodeId=root, selector="script")["nodeIds"])
        return PageLoad(url, responses, failures, html, scripts)

    def clear_cookies(self) -> None:
        self.send("Network.clearBrowserCookies")
