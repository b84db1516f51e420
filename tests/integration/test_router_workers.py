"""`llmgw router`'s supervisor and workers: one port, sockets that outlive workers (R-10.3, R-10.4).

The workers here are tests/integration/sleep_worker.py: the real worker's mechanics (inherited
socket, readiness line, lifeline, drain on SIGTERM) around a trivial app, so what is tested is
the process tree and the socket hand-over on their own.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from llmgw.router.supervisor import read_status
from tests.integration.gateway import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
SLEEP_WORKER = "tests.integration.sleep_worker"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RouterProcess:
    """`llmgw router` with the stand-in worker, its own state directory and port."""

    def __init__(self, tmp_path: Path, workers: int = 1, port: int | None = None, env: dict | None = None,
                 worker_module: str = SLEEP_WORKER):
        self.base = tmp_path
        self.worker_module = worker_module
        self.state_dir = tmp_path / "router"
        self.port = port or free_port()
        self.workers = workers
        self.log_path = tmp_path / f"router-{self.port}.log"
        # The stand-in worker never connects; the supervisor still checks that there is a credential.
        self.env = {**os.environ, "PYTHONPATH": str(ROOT),
                    "LLMGW_ROUTER_CREDENTIAL": "llmgw-router.test.not-used-by-the-stand-in", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def argv(self, state_dir: Path | None = None, port: int | None = None) -> list[str]:
        return [sys.executable, "-m", "llmgw.cli.main", "router", "--control", f"unix:{self.base}/feed.sock",
                "--listen", f"127.0.0.1:{port or self.port}", "--workers", str(self.workers),
                "--state-dir", str(state_dir or self.state_dir), "--worker-module", self.worker_module]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        wait_for(self._serving, 60, "the router's workers to serve")
        return self

    def _serving(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"llmgw router exited with {self.proc.returncode}:\n{self.log()}")
        status = self.status()
        return bool(status and status["pid"] == self.proc.pid and status["state"] == "serving"
                    and all(worker["pid"] for worker in status["workers"]))

    def status(self) -> dict | None:
        try:
            return json.loads((self.state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def worker_pids(self) -> list[int]:
        return [worker["pid"] for worker in self.status()["workers"]]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmgw.cli.main", "router", *args,
                               "--state-dir", str(self.state_dir)],
                              capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout)

    def close(self) -> None:
        """Stop it and fail loudly if any of its processes is left."""
        pids = []
        if self.proc is not None and self.proc.poll() is None:
            status = self.status() or {}
            pids = [worker["pid"] for worker in status.get("workers", []) if worker["pid"]]
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"llmgw router did not stop on SIGTERM:\n{self.log()}")
        left = [pid for pid in pids if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"workers {left} outlived their supervisor:\n{self.log()}"


@pytest.fixture
def routers(tmp_path):
    made: list[RouterProcess] = []

    def make(**kwargs) -> RouterProcess:
        router = RouterProcess(tmp_path, **kwargs)
        made.append(router)
        return router.start()

    yield make
    for router in reversed(made):
        router.close()


def test_r10_2_a_router_with_no_snapshot_and_no_control_plane_answers_at_once_with_503s(routers):
    # The real worker, an empty state directory and a feed socket nobody listens on: the router
    # has nothing to route with, and says so instead of holding connections in the socket's queue.
    router = routers(workers=1, worker_module="llmgw.router.worker")
    assert not (router.state_dir / "snapshot.json").exists()
    assert [worker["snapshot"] for worker in router.status()["workers"]] == [False]
    with httpx.Client(timeout=60) as http:
        health = http.get(router.url + "/healthz")
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "starting" and body["snapshot_age_s"] is None
    assert body["reason"] in ("waiting for the control plane's first snapshot", "the control plane is unreachable")
    assert "feed.sock" not in health.text  # the control plane's address is for the log, not for anyone asking
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-llmgw-any", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"].isdigit()
    assert refused.value.body["code"] == "not_ready" and "retry" in refused.value.body["message"]


def get_pid(url: str) -> int:
    """One request on a connection of its own."""
    with httpx.Client(timeout=30) as client:
        response = client.get(url + "/pid")
        response.raise_for_status()
        return int(response.text)


def test_workers_share_one_port_and_the_kernel_spreads_connections(routers):
    router = routers(workers=2)
    pids = router.worker_pids()
    with ThreadPoolExecutor(16) as pool:
        answered = Counter(pool.map(lambda _: get_pid(router.url), range(64)))
    print(f"\n64 connections over 2 workers: {dict(answered)}")
    assert set(answered) == set(pids)  # every answer came from a worker of the status file, both served
    assert sum(answered.values()) == 64


def test_a_killed_worker_is_restarted_and_the_connections_queued_meanwhile_are_served(routers):
    router = routers(workers=1)
    [old] = router.worker_pids()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not alive(old), 10, "the killed worker to be gone")
    # Nothing accepts on the port now: these connections wait in the socket's queue, which the
    # supervisor keeps open, for the next worker.
    with ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda _: get_pid(router.url), range(8)))
    # The new worker accepts as soon as it listens; the supervisor records it once it says ready.
    [new] = wait_for(lambda: (pids := router.worker_pids()) != [old] and pids, 10, "the restarted worker in the status")
    print(f"\nworker {old} killed; 8 queued connections answered by {Counter(answered)}")
    assert new != old
    assert answered == [new] * 8
    assert router.status()["restarts"] == 1
    assert "killed by SIGKILL" in router.log()


class Traffic:
    """Steady requests on keep-alive connections (as SDK clients make them), counting every outcome."""

    def __init__(self, url: str, clients: int = 4):
        self.url = url
        self.answered: Counter = Counter()
        self.failures: list[str] = []
        self.closed = 0  # answers that carried `Connection: close`
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=30, transport=httpx.HTTPTransport(retries=0)) as client:
            while not self._stop.is_set():
                try:
                    response = client.get(self.url + "/pid")
                    response.raise_for_status()
                    self.answered[int(response.text)] += 1
                    self.closed += response.headers.get("connection") == "close"
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def test_rolling_restart_under_traffic_refuses_nothing_and_lets_streams_finish(routers):
    router = routers(workers=2)
    before = router.worker_pids()
    with Traffic(router.url, clients=16) as traffic, httpx.Client(timeout=60) as streaming:
        wait_for(lambda: sum(traffic.answered.values()) >= 20, 30, "traffic to flow")
        with streaming.stream("GET", router.url + "/stream", params={"chunks": 15, "every": 0.2}) as stream:
            lines = iter(stream.iter_lines())
            first = next(lines)  # the stream is in flight on one of the old workers
            restarted = router.cli("restart")
            rest = list(lines)
        after = router.worker_pids()
        during = sum(traffic.answered.values())
        wait_for(lambda: sum(traffic.answered.values()) >= during + 20, 30, "traffic to flow after the restart")
    print(f"\nrolling restart: {sum(traffic.answered.values())} requests answered, by worker {dict(traffic.answered)}; "
          f"{traffic.closed} answers with Connection: close; failures {len(traffic.failures)}; "
          f"workers {before} -> {after}")
    assert restarted.returncode == 0, restarted.stderr
    assert traffic.failures == []
    assert traffic.closed >= 1  # a draining worker's keep-alive connections are closed after an answer
    assert not set(after) & set(before)  # every worker replaced
    assert set(after) <= set(traffic.answered)  # and the new ones serve
    streamed_by = int(first.split()[0])
    assert streamed_by in before
    assert [first, *rest] == [f"{streamed_by} {index}" for index in range(15)]  # finished, whole, on its worker
    assert router.status()["rolls"] == 1


def test_a_second_router_on_the_same_state_directory_exits_at_once_naming_the_pid(routers):
    router = routers(workers=1)
    second = subprocess.run(router.argv(port=free_port()), capture_output=True, text=True, env=router.env, cwd=ROOT,
                            timeout=60)
    assert second.returncode == 1
    assert f"another llmgw router (pid {router.proc.pid}) is already running" in second.stderr
    assert router.worker_pids()  # the first one is untouched


@pytest.mark.parametrize("reuse_port", [pytest.param(False, id="plain"), pytest.param(True, id="so_reuseport")])
def test_a_router_on_a_port_another_process_holds_exits_at_once_naming_the_address(tmp_path, reuse_port):
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # alone, the option would let the router share the port silently
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    router = RouterProcess(tmp_path, port=port)
    try:
        refused = subprocess.run(router.argv(), capture_output=True, text=True, env=router.env, cwd=ROOT, timeout=60)
    finally:
        holder.close()
    assert refused.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} for the router: the address is already in use by pid {os.getpid()}" \
        in refused.stderr
    assert not (router.state_dir / "status.json").exists()  # no worker was started


def test_r10_9_a_router_state_directory_others_may_write_ends_the_start_naming_it(tmp_path):
    router = RouterProcess(tmp_path)
    router.state_dir.mkdir(mode=0o700)
    os.chmod(router.state_dir, 0o777)
    refused = subprocess.run(router.argv(), capture_output=True, text=True, env=router.env, cwd=ROOT, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert f"refusing the router state directory: {router.state_dir} is writable by its group and others " \
           "(mode 0777)" in refused.stderr, refused.stderr
    assert not (router.state_dir / "supervisor.lock").exists()  # nothing was taken or started


def test_r10_9_a_status_file_others_may_write_is_not_read(tmp_path, caplog):
    (tmp_path / "status.json").write_text('{"pid": 1, "state": "serving", "listen": "0.0.0.0:80", "workers": []}')
    os.chmod(tmp_path / "status.json", 0o600)
    assert read_status(tmp_path)["listen"] == "0.0.0.0:80"
    os.chmod(tmp_path / "status.json", 0o622)
    assert read_status(tmp_path) is None
    assert "not reading the router status" in caplog.text and "writable by its group and others" in caplog.text


def test_r10_9_a_desired_count_others_may_write_is_not_applied(routers):
    router = routers(workers=1)
    desired = router.state_dir / "desired.json"
    desired.write_text('{"workers": 3}')
    os.chmod(desired, 0o666)
    os.kill(router.proc.pid, signal.SIGUSR1)
    wait_for(lambda: "not reading desired.json" in router.log(), 30, "the supervisor to refuse desired.json")
    assert "writable by its group and others (mode 0666)" in router.log()
    assert len(router.worker_pids()) == 1  # the count it was started with


def test_a_worker_that_cannot_start_fails_the_start_with_its_reason(tmp_path):
    router = RouterProcess(tmp_path, env={"SLEEP_WORKER_FAIL": "no snapshot yet"})
    refused = subprocess.run(router.argv(), capture_output=True, text=True, env=router.env, cwd=ROOT, timeout=120)
    assert refused.returncode == 1
    assert "worker 0" in refused.stderr and "cannot start: no snapshot yet" in refused.stderr


def test_workers_stop_when_their_supervisor_is_killed(routers):
    router = routers(workers=2)
    pids = router.worker_pids()
    router.proc.kill()
    router.proc.wait()
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "the workers to follow their supervisor")
    assert "the router supervisor is gone: this worker stops" in router.log()
    # The state directory is free again: a new supervisor starts on it and on the port.
    again = RouterProcess(router.base, workers=1, port=router.port).start()
    try:
        assert get_pid(again.url) in again.worker_pids()
    finally:
        again.close()


def test_stop_waits_for_the_supervisor_and_its_workers(routers):
    router = routers(workers=2)
    pids = router.worker_pids()
    stopped = router.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert f"router (pid {router.proc.pid}) stopped" in stopped.stdout
    assert router.proc.wait(10) == 0
    assert not any(alive(pid) for pid in pids)
    assert router.cli("stop").returncode == 1  # nothing runs there any more


def test_the_supervisor_imports_only_the_stdlib_and_the_router():
    tree = ast.parse((ROOT / "llmgw" / "router" / "supervisor.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    outside = {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names
               and name != "__future__" and not name.startswith(("llmgw.router", "llmgw.contracts"))}
    assert outside == set()
