"""The request log through a real `llmgw serve` (R-6.20): reports carrying records, sent over the
real feed (the admin listener, each router proving its own credential as a router does) by two
routers, read back through the admin API and `llmgw ctl requests` (text, --json, filters,
--follow), each record taken once however often its report is sent."""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

from llmgw.contracts.feed import REQUEST_RECORD_FIELDS, Report, RequestRecord, to_wire
from tests.integration.gateway import GatewayProcess
from tests.unit.routerkit import authorized

ROUTE = "POST /v1/chat/completions"
GUARD = 60.0  # seconds: a hang guard, not a timing assertion


def ctl_argv(gateway: GatewayProcess, *args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(gateway.state_dir), *args]


def ctl(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(ctl_argv(gateway, *args), capture_output=True, text=True, timeout=GUARD,
                          env={**gateway.env, "COLUMNS": "250"})


def listed(gateway: GatewayProcess, *args: str) -> list[dict]:
    done = ctl(gateway, "requests", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["requests"]


def send(gateway: GatewayProcess, credential: str, report: Report) -> dict:
    """POST a report to the feed as a router does: the challenge exchange, then the report; its ack."""
    async def post() -> dict:
        base = f"http://127.0.0.1:{gateway.admin_port}"
        async with aiohttp.ClientSession() as session:
            headers, _ = await authorized(session, base, credential, "POST", "/v1/feed/report")
            async with session.post(base + "/v1/feed/report", json=to_wire(report), headers=headers) as answer:
                assert answer.status == 200, await answer.text()
                return await answer.json()
    return asyncio.run(post())


class Lines:
    """A running command's stdout, line by line, read on a thread so that a wait has a deadline."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def until(self, condition, what: str) -> str:
        """The first line from now on for which condition(line) holds."""
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"the command ended ({self.proc.returncode}): {self.proc.stderr.read()}"
                continue
            self.seen.append(line)
            if condition(line):
                return line
        raise AssertionError(f"no line {what} within {GUARD:.0f}s; printed so far: {''.join(self.seen)}")

    def end(self, timeout: float = GUARD) -> tuple[int, str]:
        return self.proc.wait(timeout), self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_r6_20_records_from_two_routers_through_the_feed_to_ctl_requests(tmp_path: Path):
    gateway = GatewayProcess(None, tmp_path / "state", workers=0).start()
    followers: list[Lines] = []
    try:
        credentials = {}
        for name in ("edge1", "edge2"):
            added = ctl(gateway, "routers", "add", name)
            assert added.returncode == 0, added.stderr
            credentials[name] = added.stdout.strip()
        now = time.time()

        def record(rid: str, at: float, **fields) -> RequestRecord:
            return RequestRecord(**{"at": at, "id": rid, "route": ROUTE, "status": 200, "duration": 0.4,
                                    "key": "alice", "model": "chat", "attempts": 1, **fields})

        first = Report(router="edge1/host-0-a1", seq=1, sent_at=now, requests=(
            record("req-a1", now - 4, replica="chat-1", node="gpu1", ttfb=0.1, prompt_tokens=12, completion_tokens=5),
            record("req-a2", now - 3, key="bob", model="chat-v2", asked="chat", status=503, error="queue_timeout",
                   attempts=0, queued=30.0, duration=30.5)))
        second = Report(router="edge2/host-0-b1", seq=1, sent_at=now, requests=(
            record("req-b1", now - 2, model="embed", route="POST /v1/embeddings", status=429,
                   error="rate_limit_exceeded", attempts=0, duration=0.002),
            record("req-b2", now - 1, replica="chat-2", node="gpu2", stream=True, prompt_tokens=40,
                   completion_tokens=17, estimated=True, error="upstream_interrupted")))
        for credential, report in ((credentials["edge1"], first), (credentials["edge2"], second),
                                   (credentials["edge1"], first)):  # the last: a resend, its ack lost
            ack = send(gateway, credential, report)
            assert (ack["router"], ack["seq"]) == (report.router, report.seq) and not ack.get("refused")

        everything = listed(gateway)
        assert [r["id"] for r in everything] == ["req-b2", "req-b1", "req-a2", "req-a1"]  # each once, newest first
        assert {r["id"]: r["router"] for r in everything} == {"req-a1": "edge1/host-0-a1", "req-a2": "edge1/host-0-a1",
                                                              "req-b1": "edge2/host-0-b1", "req-b2": "edge2/host-0-b1"}
        refused = everything[1]
        assert set(refused) == {"row", "router", *REQUEST_RECORD_FIELDS}
        assert refused["replica"] is None and refused["ttfb"] is None and refused["prompt_tokens"] is None

        assert [r["id"] for r in listed(gateway, "--key", "bob")] == ["req-a2"]
        assert [r["id"] for r in listed(gateway, "--model", "chat")] == ["req-b2", "req-a2", "req-a1"]
        assert [r["id"] for r in listed(gateway, "--status", "5xx")] == ["req-a2"]
        assert [r["id"] for r in listed(gateway, "--status", "429")] == ["req-b1"]
        assert [r["id"] for r in listed(gateway, "--slower-than", "30s")] == ["req-a2"]
        assert [r["id"] for r in listed(gateway, "--slower-than", "250ms", "--key", "alice")] == ["req-b2", "req-a1"]
        assert [r["id"] for r in listed(gateway, "-n", "2")] == ["req-b2", "req-b1"]
        assert gateway.admin("/api/requests?n=1&model=embed")[1]["requests"][0]["id"] == "req-b1"

        shown = ctl(gateway, "requests")
        assert shown.returncode == 0, shown.stderr
        print(shown.stdout)
        rows = {line.split()[1]: line for line in shown.stdout.splitlines()[1:]}
        assert " chat-v2 via chat " in rows["req-a2"] and " 503 queue_timeout " in rows["req-a2"]
        assert " ~40/~17" in rows["req-b2"] and " chat-2@gpu2 " in rows["req-b2"]
        assert " 12/5" in rows["req-a1"] and " chat-1@gpu1 " in rows["req-a1"]
        assert " 0 " in rows["req-b1"] and " - " in rows["req-b1"] and " 0/" not in rows["req-b1"]

        text = Lines(ctl_argv(gateway, "requests", "--follow", "-n", "1"), {**gateway.env, "COLUMNS": "250"})
        errors = Lines(ctl_argv(gateway, "requests", "--follow", "--json", "--status", "5xx"), gateway.env)
        followers += [text, errors]
        text.until(lambda line: "req-b2" in line, "with the latest record")
        start = json.loads(errors.until(lambda line: line.startswith("{"), "with the first document"))
        assert [r["id"] for r in start["requests"]] == ["req-a2"]

        later = time.time()
        send(gateway, credentials["edge2"], Report(router="edge2/host-0-b1", seq=2, sent_at=later, requests=(
            record("req-b3", later, status=500, error="upstream_error"), record("req-b4", later))))
        send(gateway, credentials["edge1"], Report(router="edge1/host-0-a1", seq=2, sent_at=later, requests=(
            record("req-a3", later, status=502, error="upstream_unreachable"),)))
        text.until(lambda line: "req-a3" in line, "with a record that arrived after it started")
        assert sum("req-b3" in line or "req-b4" in line for line in text.seen) == 2
        assert not any("req-a1" in line for line in text.seen)  # -n 1: only the latest before it started
        new = []
        while {"req-b3", "req-a3"} - set(new):
            document = json.loads(errors.until(lambda line: line.startswith("{"), "with the new 5xx records"))
            new += [r["id"] for r in document["requests"]]
        assert new == ["req-b3", "req-a3"]  # oldest first, the 200 filtered out, nothing twice

        text.proc.send_signal(signal.SIGINT)  # an operator's Ctrl-C ends a follow quietly
        assert text.end()[0] == 0
        assert gateway.stop_serve() == 0
        code, said = errors.end()  # the gateway gone: a clear error, not a silent wait
        print(said)
        assert code == 1 and said.startswith("error: ") and "is `llmgw serve` running" in said
    finally:
        for follower in followers:
            follower.kill()
        gateway.stop()
