"""The router feed over sockets (R-10.1, R-10.2): the control plane's server, the router's client and
its disk state, with a fake publisher and a fake router behind real aiohttp on a Unix socket and TCP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import MappingProxyType

import aiohttp
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import (Ack, Change, FeedError, GatewaySettings, KeyEntry, Report, RoutedModel, Snapshot,
                                  UsageRow, from_wire, to_wire)
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, listen_unix
from llmgw.router.feedclient import FeedClient, FeedClientError, FeedTiming, parse_control
from llmgw.router.spool import Spool, merge_reports
from llmgw.router.statedir import SNAPSHOT_FILE
from tests.unit.routerkit import accepting, authorized

TOKEN = "llmgw-router.test.feed-test-router-secret"  # the router credential
ENGINE_KEY = "engine-key-never-logged"
KEY_HASH = "f" * 64
DEADLINE = 20.0  # a guard against hanging, not a timing assertion
FAST = FeedTiming(report_interval=0.05, snapshot_every=0.05, read_timeout=2.0, backoff_base=0.02, backoff_cap=0.1,
                  sweep_every=0.1)


def make_snapshot(epoch: str, version: int = 1) -> Snapshot:
    model = RoutedModel(name="m", engine="vllm", served_name=None, routing="least-outstanding", on_demand=False)
    endpoint = Endpoint(replica_id="r1", model="m", url="http://10.0.0.1:8000", api_key=ENGINE_KEY)
    return Snapshot(epoch=epoch, version=version, models=MappingProxyType({"m": model}),
                    endpoints=MappingProxyType({"m": (endpoint,)}),
                    keys=(KeyEntry(id="k1", name="alice", hash=KEY_HASH, prefix="sk-ab", models=None),),
                    gateway=GatewaySettings(max_body=1000, request_timeout=60.0, on_demand_wait=10.0))


class FakeListener:
    def __init__(self, publisher: FakePublisher):
        self.publisher = publisher
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(publisher.snapshot)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()

    def close(self) -> None:
        if self in self.publisher.listeners:
            self.publisher.listeners.remove(self)


class FakePublisher:
    """The control plane's publisher as FeedServer uses it; counts each (router, seq) once."""

    def __init__(self, epoch: str = "epoch-1"):
        self.snapshot = make_snapshot(epoch)
        self.listeners: list[FakeListener] = []
        self.received: list[Report] = []
        self.refused: list[tuple] = []
        self.counted: dict[tuple[str, int], Report] = {}

    async def ready(self) -> None:
        pass

    def current(self) -> Snapshot:
        return self.snapshot

    def listen(self) -> FakeListener:
        listener = FakeListener(self)
        self.listeners.append(listener)
        return listener

    def publish(self, replicas: int = 1) -> Change:
        members = tuple(Endpoint(replica_id=f"r{i}", model="m", url=f"http://10.0.0.{i}:8000", api_key=ENGINE_KEY)
                        for i in range(1, replicas + 1))
        change = Change(epoch=self.snapshot.epoch, version=self.snapshot.version + 1,
                        endpoints=MappingProxyType({"m": members}))
        self.snapshot = self.snapshot.apply(change)
        for listener in self.listeners:
            listener.queue.put_nowait(change)
        return change

    async def apply_report(self, report: Report, refused=()) -> Ack:
        self.received.append(report)
        self.counted.setdefault((report.router, report.seq), report)
        return Ack(router=report.router, seq=report.seq, refused=refused)

    def report_refused(self, router, reason) -> None:
        self.refused.append((router, reason))

    def requests(self, router: str | None = None) -> int:
        return sum(row.requests for (r, _), report in self.counted.items() if router in (None, r)
                   for row in report.usage)


class FakeRouter:
    """The router as FeedClient uses it: applies messages, drains counted parts into report fields."""

    def __init__(self):
        self.snapshot: Snapshot | None = None
        self.messages: list[Snapshot | Change] = []
        self.on_demand = None
        self.feed_status: dict | None = None
        self.snapshot_age = None
        self.usage: list[UsageRow] = []

    def apply(self, message) -> None:
        if isinstance(message, Snapshot):
            self.snapshot = message
        elif self.snapshot is None:
            raise FeedError(f"change {message.version} before any snapshot")
        else:
            self.snapshot = self.snapshot.apply(message)
        self.messages.append(message)

    def report_fields(self) -> dict:
        usage, self.usage = tuple(self.usage), []
        snapshot = None if self.snapshot is None else (self.snapshot.epoch, self.snapshot.version)
        return {"usage": usage, "key_use": {"k1": 1.0} if usage else {}, "snapshot": snapshot}

    def count(self, requests: int = 1) -> None:
        self.usage.append(UsageRow(bucket=3600, key_id="k1", model="m", requests=requests, prompt_tokens=10,
                                   completion_tokens=5))
        if self.on_demand is not None:
            self.on_demand()


async def until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"still not true after {DEADLINE}s: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def place():
    # Unix socket paths are limited to about 100 bytes: keep them short.
    directory = Path(tempfile.mkdtemp(prefix="feed-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class Control:
    """A FeedServer on `place/feed.sock` that can be stopped and started again."""

    def __init__(self, place: Path, publisher: FakePublisher | None = None, shutdown_timeout: float = 0.5,
                 **options):
        self.path = place / FEED_SOCKET
        self.publisher = publisher or FakePublisher()
        self.shutdown_timeout = shutdown_timeout
        self.options = {"keepalive": 0.2, **options}
        self.socket = None

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    async def start(self, publisher: FakePublisher | None = None) -> Control:
        if publisher is not None:
            self.publisher = publisher
        self.server = FeedServer(self.publisher, accepting(TOKEN), **self.options)
        self.socket = await listen_unix(self.server, self.path, shutdown_timeout=self.shutdown_timeout)
        return self

    async def stop(self) -> None:
        if self.socket is not None:
            await self.socket.close()
            self.socket = None


@pytest.fixture
async def control(place):
    running = await Control(place).start()
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def clients():
    started: list[FeedClient] = []

    async def make(router, address: str, state_dir: Path, ca: str | None = None, **timing) -> FeedClient:
        client = FeedClient(router, address, TOKEN, state_dir, ca=ca, timing=dataclasses.replace(FAST, **timing))
        await client.start()
        started.append(client)
        return client

    try:
        yield make
    finally:
        for client in started:
            if client.slot is not None:
                await client.close()


def spooled(state_dir: Path, client: FeedClient) -> list[Report]:
    """What the client's spool file holds, read back as a new process would."""
    spool = Spool(state_dir / "slots" / client.slot.directory.name, client.router_id)
    copy = Path(tempfile.mkdtemp(dir="/tmp"))
    shutil.copy(spool.path, copy / spool.path.name)
    spool.path = copy / spool.path.name
    spool.load()
    shutil.rmtree(copy)
    return [entry.report for entry in spool.pending]


# -- the feed ----------------------------------------------------------------------------------


async def test_snapshot_then_changes_arrive_in_order(control, clients, place):
    router = FakeRouter()
    client = await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    for replicas in (2, 3, 1, 4, 2):
        control.publisher.publish(replicas)
    await until(lambda: router.snapshot.version == 6, "five changes")
    assert [type(m).__name__ for m in router.messages] == ["Snapshot"] + ["Change"] * 5
    assert [m.version for m in router.messages] == [1, 2, 3, 4, 5, 6]
    assert [e.replica_id for e in router.snapshot.endpoints["m"]] == ["r1", "r2"]
    assert router.feed_status["state"] == "live"
    assert router.feed_status["snapshot"]["version"] == 6
    assert client.router_id in router.feed_status["router_id"]


async def test_feed_over_tcp_mounted_on_an_application(clients, place):
    publisher = FakePublisher()
    app = web.Application()
    FeedServer(publisher, accepting(TOKEN), keepalive=0.2).mount(app)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        router = FakeRouter()
        await clients(router, f"http://127.0.0.1:{port}", place / "router")
        await until(lambda: router.snapshot is not None, "the snapshot over TCP")
        publisher.publish(3)
        await until(lambda: router.snapshot.version == 2, "a change over TCP")
        router.count(2)
        await until(lambda: publisher.requests() == 2, "a report over TCP")
    finally:
        await runner.cleanup()


async def test_admin_app_mounts_the_feed(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from llmgw.admin.app import build_admin_app
    from tests.unit.admin_gateway import TOKEN as ADMIN_TOKEN
    from tests.unit.admin_gateway import make_gateway

    gateway = make_gateway(tmp_path)
    publisher = FakePublisher()
    gateway.feed_server = FeedServer(publisher, accepting(TOKEN), keepalive=0.2)
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    try:
        base = str(client.make_url(""))
        auth, _ = await authorized(client.session, base, TOKEN, "POST", "/v1/feed/report")
        report = Report(router="test/r", seq=1, sent_at=1.0, usage=(UsageRow(0, "k1", "m", 1, 2, 3),))
        # A report over the admin listener's 1 MB body limit still fits the feed's own.
        body = json.dumps({**to_wire(report), "pad": "x" * (2 * 1024 * 1024)})
        answer = await client.post("/v1/feed/report", data=body, headers=auth)
        assert answer.status == 200, await answer.text()
        assert await answer.json() == to_wire(Ack("test/r", 1))
        auth, _ = await authorized(client.session, base, TOKEN, "GET", "/v1/feed")
        async with client.get("/v1/feed", headers=auth) as stream:
            first = json.loads(await stream.content.readline())
        assert first["type"] == "snapshot" and first["version"] == 1
        assert (await client.get("/v1/feed")).status == 401
        # The admin token opens the admin API, never the feed.
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert (await client.get("/api/status", headers=admin)).status == 200
        refused = await client.get("/v1/feed", headers=admin)
        assert refused.status == 401 and "not the admin token" in (await refused.json())["error"]["message"]
    finally:
        await client.close()
        gateway.store.close()


async def test_a_change_that_does_not_follow_makes_the_client_take_a_snapshot_again(control, clients, place):
    router = FakeRouter()
    await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    (listener,) = control.publisher.listeners
    listener.queue.put_nowait(Change(epoch="epoch-1", version=7))  # a gap: 1 -> 7
    await until(lambda: sum(isinstance(m, Snapshot) for m in router.messages) == 2, "a second snapshot")
    await until(lambda: len(control.publisher.listeners) == 1, "the old stream closed")
    assert listener not in control.publisher.listeners
    assert router.snapshot.version == 1


async def test_a_quiet_feed_carries_keep_alive_lines(control):
    connector = aiohttp.UnixConnector(path=str(control.path))
    async with aiohttp.ClientSession(connector=connector) as session:
        auth, _ = await authorized(session, "http://localhost", TOKEN, "GET", "/v1/feed")
        async with session.get("http://localhost/v1/feed", headers=auth) as answer:
            assert answer.headers["Content-Type"] == "application/x-ndjson"
            assert json.loads(await answer.content.readline())["type"] == "snapshot"
            assert await answer.content.readline() == b"\n"  # nothing published: a keep-alive
            assert await answer.content.readline() == b"\n"


async def test_a_control_plane_that_accepts_but_never_answers_is_left_and_tried_again(place, clients):
    connections = []

    async def silent(reader, writer):
        connections.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_unix_server(silent, str(place / "silent.sock"))
    try:
        router = FakeRouter()
        await clients(router, f"unix:{place}/silent.sock", place / "router", read_timeout=0.2)
        await until(lambda: len(connections) >= 3, "reconnections")
        assert router.feed_status["state"] == "no-snapshot"
    finally:
        server.close()
        for writer in connections:
            writer.close()


@pytest.mark.parametrize("headers", [
    pytest.param({}, id="no-token"),
    pytest.param({"Authorization": "Bearer wrong-token"}, id="wrong-token"),
    pytest.param({"Authorization": f"Bearer {TOKEN}"}, id="credential-as-bearer"),
    pytest.param({"Authorization": f"Basic {TOKEN}"}, id="not-bearer"),
    pytest.param({"Authorization": "Llmgw-Router test:made-up-challenge:" + "0" * 64}, id="unissued-challenge"),
])
async def test_feed_and_reports_refuse_without_the_token(control, headers):
    connector = aiohttp.UnixConnector(path=str(control.path))
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get("http://localhost/v1/feed", headers=headers) as answer:
            assert answer.status == 401
            assert (await answer.json())["error"]["code"] == "unauthorized"
        report = to_wire(Report(router="r", seq=1, sent_at=1.0))
        async with session.post("http://localhost/v1/feed/report", json=report, headers=headers) as answer:
            assert answer.status == 401
    assert control.publisher.received == []
    assert control.publisher.listeners == []


@pytest.mark.parametrize("body,status,names", [
    pytest.param(json.dumps({**to_wire(Report(router="r", seq=1, sent_at=1.0)), "seq": "one"}), 400, "report.seq",
                 id="seq-not-a-number"),
    pytest.param(json.dumps({**to_wire(Report(router="r", seq=1, sent_at=1.0)), "usage": {"k": 1}}),
                 400, "report.usage: expected list", id="usage-not-a-list"),
    pytest.param(json.dumps(to_wire(Ack("r", 1))), 400, "expected a report", id="not-a-report"),
    pytest.param("{not json", 400, "not JSON", id="not-json"),
    pytest.param(json.dumps({**to_wire(Report(router="r", seq=1, sent_at=1.0)), "pad": "x" * 5000}), 413,
                 "at most 4096 bytes", id="too-large"),
])
async def test_a_bad_report_is_refused_naming_what_is_wrong(place, body, status, names):
    control = await Control(place, max_report=4096).start()
    try:
        connector = aiohttp.UnixConnector(path=str(control.path))
        async with aiohttp.ClientSession(connector=connector) as session:
            auth, _ = await authorized(session, "http://localhost", TOKEN, "POST", "/v1/feed/report")
            async with session.post("http://localhost/v1/feed/report", data=body, headers=auth) as answer:
                assert answer.status == status
                assert names in (await answer.json())["error"]["message"]
        assert control.publisher.received == []
        if status == 400:  # counted for the router it names, for `ctl status`
            # Recorded under the router that sent it, whatever the report claims.
            assert [router for router, _ in control.publisher.refused] == ["test"]
    finally:
        await control.stop()


async def test_r10_8_a_report_with_bad_rows_is_applied_without_them_and_the_ack_names_them(control):
    good = [3600, "k1", "m", 2, 10, 5]
    document = {**to_wire(Report(router="test/r", seq=1, sent_at=1.0)),
                "usage": [[3600, "k1", "m", 1, -5, 0], good, [3600, "k2", "m", 1, 2**64, 0]],
                "inflight": {"r1": 2, "r2": -1}, "key_use": {"k1": 5.0, "k2": "soon"},
                "engine_load": {"r1": {"source": "vllm", "waiting": 2**60}}}
    connector = aiohttp.UnixConnector(path=str(control.path))
    async with aiohttp.ClientSession(connector=connector) as session:
        auth, _ = await authorized(session, "http://localhost", TOKEN, "POST", "/v1/feed/report")
        async with session.post("http://localhost/v1/feed/report", json=document, headers=auth) as answer:
            assert answer.status == 200
            ack = await answer.json()
    (report,) = control.publisher.received
    assert report.usage == (UsageRow(*good),)  # the rest of the report is applied
    assert report.inflight == {"r1": 2} and report.key_use == {"k1": 5.0} and report.engine_load == {}
    refused = {r["where"]: r for r in ack["refused"]}
    assert set(refused) == {"report.usage[0]", "report.usage[2]", "report.inflight['r2']", "report.key_use['k2']",
                            "report.engine_load['r1']"}
    assert {r["status"] for r in ack["refused"]} == {400}
    assert "must be at least 0, got -5" in refused["report.usage[0]"]["message"]
    assert f"must be at most {2**53}" in refused["report.usage[2]"]["message"]
    assert from_wire(ack).refused[0].where == "report.usage[0]"


# -- reports -----------------------------------------------------------------------------------


async def test_reports_are_acknowledged_and_leave_the_spool(control, clients, place):
    router = FakeRouter()
    client = await clients(router, control.address, place / "router")
    router.count(1)
    router.count(2)
    await until(lambda: control.publisher.requests() == 3, "the usage counted")
    await until(lambda: client.unacked == 0, "every report acknowledged")
    acked = client.slot.spool.acked
    assert acked >= 1
    # Gone from the file once acknowledged (the file says so just after the client's memory does);
    # only the next period's report, made since, may be there.
    await until(lambda: [r.seq for r in spooled(place / "router", client) if r.seq <= acked] == [],
                "the acknowledged reports gone from the spool file")
    assert {r for r, _ in control.publisher.counted} == {client.router_id}


async def test_a_report_made_while_the_control_plane_is_down_is_delivered_once_when_it_returns(place, clients):
    control = Control(place)
    router = FakeRouter()
    client = await clients(router, control.address, place / "router")
    for _ in range(3):
        router.count(1)
        await asyncio.sleep(0.06)  # let a report period pass between them
    await until(lambda: sum(row.requests for r in spooled(place / "router", client) for row in r.usage) == 3,
                "the counts on disk")
    # Never sent, so merged into one report rather than one per period.
    assert len(spooled(place / "router", client)) == 1
    assert router.feed_status["unacked_reports"] == 1
    await control.start()
    try:
        await until(lambda: control.publisher.requests() == 3, "the spooled report delivered")
        await until(lambda: client.unacked == 0, "the report acknowledged")
        router_id = client.router_id
        await client.close()
        again = await clients(FakeRouter(), control.address, place / "router")
        assert again.router_id == router_id
        await until(lambda: again.unacked == 0 and len(control.publisher.received) > 2, "reports of the restart")
        print(f"reports received {len(control.publisher.received)}, counted {len(control.publisher.counted)}")
        assert control.publisher.requests() == 3  # once, not again after the restart
        seqs = [seq for _, seq in control.publisher.counted]
        assert seqs == sorted(set(seqs))  # a restarted client goes on from its seq, never reuses one
    finally:
        await control.stop()


async def test_a_report_that_may_have_been_counted_keeps_its_seq_and_is_resent(place, clients):
    # The control plane takes the report but its answer never arrives: the client must resend
    # that very report (same seq, same counts), not merge it with newer ones.
    class Lossy(FakePublisher):
        lose = 1

        async def apply_report(self, report, refused=()):
            ack = await super().apply_report(report, refused)
            if self.lose and report.usage:
                self.lose -= 1
                raise ConnectionResetError("answer lost")
            return ack

    control = await Control(place, Lossy()).start()
    try:
        router = FakeRouter()
        client = await clients(router, control.address, place / "router")
        router.count(5)
        await until(lambda: control.publisher.lose == 0, "the lost answer")
        router.count(7)
        await until(lambda: control.publisher.requests() == 12 and client.unacked == 0, "both delivered")
        with_usage = [r for r in control.publisher.received if r.usage]
        first = with_usage[0]
        resent = [r for r in with_usage if r.seq == first.seq]
        assert len(resent) >= 2 and all(r.usage == first.usage for r in resent)
        assert control.publisher.requests() == 12
    finally:
        await control.stop()


def test_merging_adds_counted_parts_and_keeps_the_newest_state():
    older = Report(router="r", seq=4, sent_at=1.0, usage=(UsageRow(0, "k", "m", 1, 10, 5),), key_use={"k": 1.0},
                   last_used={"a": 5.0}, inflight={"a": 3}, demand=("x",), snapshot=("e", 1))
    newer = Report(router="r", seq=5, sent_at=2.0, usage=(UsageRow(0, "k", "m", 2, 20, 10),
                                                          UsageRow(3600, "k", "m", 1, 1, 1)),
                   key_use={"k": 0.5, "j": 2.0}, last_used={"a": 4.0, "b": 6.0}, inflight={"b": 1},
                   demand=("y", "x"), snapshot=("e", 2))
    merged = merge_reports(older, newer)
    assert merged.seq == 4 and merged.sent_at == 2.0
    assert sorted(merged.usage, key=lambda row: row.bucket) == [UsageRow(0, "k", "m", 3, 30, 15), UsageRow(3600, "k", "m", 1, 1, 1)]
    assert merged.key_use == {"k": 1.0, "j": 2.0}
    assert merged.last_used == {"a": 5.0, "b": 6.0}
    assert merged.inflight == {"b": 1} and merged.snapshot == ("e", 2)
    assert merged.demand == ("x", "y")


# -- last-known-good ---------------------------------------------------------------------------


async def test_a_server_restart_is_followed_by_a_new_snapshot(control, clients, place, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.router.feedclient")
    router = FakeRouter()
    await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    control.publisher.publish(2)
    await until(lambda: router.snapshot.version == 2, "a change")
    await control.stop()
    await until(lambda: router.feed_status["state"] == "last-known-good", "last-known-good")
    status = router.feed_status
    assert status["snapshot"]["epoch"] == "epoch-1" and status["snapshot"]["version"] == 2
    assert status["since"] is not None and "control" not in status  # the address is in the log, not in /healthz
    assert router.snapshot.version == 2  # still serving with it
    await control.start(FakePublisher("epoch-2"))
    await until(lambda: router.snapshot.epoch == "epoch-2", "the new run's snapshot")
    assert isinstance(router.messages[-1], Snapshot)
    await until(lambda: router.feed_status["state"] == "live", "live again")
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    back = [r for r in caplog.records if "is back" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert len(back) == 1


async def test_the_last_snapshot_on_disk_is_served_while_the_control_plane_is_down(control, clients, place):
    router = FakeRouter()
    first = await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    control.publisher.publish(3)
    await until(lambda: router.snapshot.version == 2, "a change")
    await first.close()
    await control.stop()
    later = FakeRouter()
    await clients(later, control.address, place / "router")
    assert later.snapshot is not None, "given to the router before any connection"
    assert later.snapshot.version == 2 and [e.replica_id for e in later.snapshot.endpoints["m"]] == ["r1", "r2", "r3"]
    assert later.snapshot.endpoints["m"][0].api_key == ENGINE_KEY
    await until(lambda: later.feed_status["since"] is not None, "a failed connection")
    status = later.feed_status
    assert status["state"] == "last-known-good"
    assert status["snapshot"]["version"] == 2 and status["snapshot"]["age_s"] is not None
    assert isinstance(status["unacked_reports"], int)


@pytest.mark.parametrize("content,names", [
    pytest.param(b'{"type": "snapshot", "protocol": 1, "epoch": "e"', "not usable", id="cut-short"),
    pytest.param(json.dumps({**to_wire(make_snapshot("e")), "version": "2"}).encode(), "snapshot.version",
                 id="wrong-field"),
    pytest.param(json.dumps(to_wire(Change(epoch="e", version=2))).encode(), "expected a snapshot", id="a-change"),
])
async def test_a_snapshot_file_that_does_not_parse_is_set_aside(place, clients, caplog, content, names):
    state_dir = place / "router"
    state_dir.mkdir()
    (state_dir / SNAPSHOT_FILE).write_bytes(content)
    router = FakeRouter()
    await clients(router, f"unix:{place}/nothing.sock", state_dir)
    assert router.snapshot is None
    assert not (state_dir / SNAPSHOT_FILE).exists()
    assert (state_dir / (SNAPSHOT_FILE + ".bad")).read_bytes() == content
    (message,) = [r.getMessage() for r in caplog.records if "last-known-good snapshot" in r.getMessage()]
    assert names in message and ".bad" in message
    await until(lambda: router.feed_status["since"] is not None, "a failed connection")
    assert router.feed_status["state"] == "no-snapshot"
    # What /healthz may show says why without naming the control plane.
    await until(lambda: router.feed_status["reason"] == "the control plane is unreachable", "the reason")
    assert "nothing.sock" not in json.dumps(router.feed_status)


async def test_state_files_and_sockets_are_private(control, clients, place):
    router = FakeRouter()
    client = await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    router.count()
    await until(lambda: (place / "router" / SNAPSHOT_FILE).exists() and control.publisher.requests() == 1,
                "files written")
    slot = client.slot.directory

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(control.path) == 0o600
    assert mode(place / "router") == 0o700 and mode(slot) == 0o700
    for path in (place / "router" / SNAPSHOT_FILE, slot / "spool.ndjson", slot / "router-id", slot / "lock"):
        assert mode(path) == 0o600, path


async def test_secrets_never_reach_the_log(control, clients, place, caplog):
    caplog.set_level(logging.DEBUG)
    router = FakeRouter()
    await clients(router, control.address, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    control.publisher.publish(2)
    router.count()
    await until(lambda: control.publisher.requests() == 1, "a report")
    await control.stop()
    await until(lambda: router.feed_status["state"] == "last-known-good", "last-known-good")
    text = caplog.text
    assert "router feed" in text  # something was logged
    for secret in (TOKEN, ENGINE_KEY, KEY_HASH):
        assert secret not in text


# -- slots -------------------------------------------------------------------------------------


async def test_processes_on_one_state_dir_take_different_slots(control, clients, place):
    state_dir = place / "router"
    calm = dict(sweep_every=3600.0)  # no sweep holding a free slot for a moment
    one = await clients(FakeRouter(), control.address, state_dir, **calm)
    two = await clients(FakeRouter(), control.address, state_dir, **calm)
    assert one.slot.directory != two.slot.directory
    assert one.router_id != two.router_id
    first_slot, first_id = one.slot.directory, one.router_id
    await one.close()
    three = await clients(FakeRouter(), control.address, state_dir, **calm)
    assert three.slot.directory == first_slot and three.router_id == first_id  # the free slot, its id kept
    await three.close()
    (first_slot / "spool.ndjson").unlink()  # what its seqs had reached is gone: so is the id
    four = await clients(FakeRouter(), control.address, state_dir, **calm)
    assert four.slot.directory == first_slot and four.router_id != first_id


ORPHAN = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from tests.unit.test_feed_wire import FAST, TOKEN, FakeRouter
    from llmgw.router.feedclient import FeedClient

    async def main():
        router = FakeRouter()
        client = FeedClient(router, sys.argv[1], TOKEN, Path(sys.argv[2]), timing=FAST)
        await client.start()
        router.count(4)
        while not client.unacked:
            await asyncio.sleep(0.01)
        print(client.router_id, flush=True)
        await asyncio.sleep(3600)  # killed here, its report unsent

    asyncio.run(main())
""")


async def test_the_spool_of_a_killed_process_is_delivered_by_another(place, clients):
    control = Control(place)
    state_dir = place / "router"
    survivor = await clients(FakeRouter(), control.address, state_dir)  # holds slot 0 throughout
    root = Path(__file__).resolve().parents[2]
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", ORPHAN, control.address, str(state_dir),
                                                   cwd=root, stdout=subprocess.PIPE)
    try:
        orphan_id = (await asyncio.wait_for(process.stdout.readline(), DEADLINE)).decode().strip()
    finally:
        process.kill()
        await process.wait()
    assert orphan_id and orphan_id != survivor.router_id
    orphan_slot = next(p for p in (state_dir / "slots").iterdir() if (p / "router-id").read_text().strip() == orphan_id)
    await control.start()
    try:
        await until(lambda: control.publisher.requests(orphan_id) == 4, "the orphan's report delivered")

        def left_on_disk() -> list:
            left = Spool(orphan_slot, orphan_id)
            left.load()
            return left.pending

        # The ack reaches the spool on disk just after the control plane counted the report.
        await until(lambda: left_on_disk() == [], "the orphan's spool acknowledged on disk")
        assert left_on_disk() == []  # acknowledged on disk: no sweep sends it again
        assert control.publisher.requests(orphan_id) == 4
        assert all(r.router == orphan_id for r in control.publisher.received if r.usage)
    finally:
        await control.stop()


# -- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("address,why", [
    pytest.param("http://10.1.2.3:8081", "in clear", id="http-off-host"),
    pytest.param("http://gateway.example:8081", "in clear", id="http-by-name"),
    pytest.param("ftp://host:1", "unix:/path/feed.sock", id="other-scheme"),
    pytest.param("https://host:8081/api", "address only", id="with-a-path"),
    pytest.param("unix:", "unix:/path", id="empty-socket"),
])
def test_control_addresses_that_are_refused(address, why):
    with pytest.raises(FeedClientError, match=why):
        parse_control(address)


def test_a_ca_file_that_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(FeedClientError, match="cannot use --ca"):
        FeedClient(FakeRouter(), "https://gw.example:8443", TOKEN, tmp_path, ca=str(tmp_path / "missing.pem"))


def test_control_addresses_that_are_accepted():
    assert parse_control("unix:/run/llmgw/feed.sock").socket_path == "/run/llmgw/feed.sock"
    assert parse_control("http://127.0.0.1:8081").base_url == "http://127.0.0.1:8081"
    assert parse_control("http://[::1]:8081").base_url == "http://[::1]:8081"
    assert parse_control("https://gw.example:8443").tls


# -- TLS on the admin listener -----------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate():
    directory = Path(tempfile.mkdtemp(prefix="feed-tls-", dir="/tmp"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(directory / "key.pem"), "-out", str(directory / "cert.pem"), "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    os.chmod(directory / "key.pem", 0o600)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _inventory_with_tls(cert: str, key: str) -> str:
    return f"nodes:\n  - name: a\n    connection: local\ngateway:\n  admin_tls:\n    cert: {cert}\n    key: {key}\n"


@pytest.mark.parametrize("cert,key,line,names", [
    pytest.param("{d}/missing.pem", "{d}/key.pem", 6, "gateway.admin_tls.cert: '{d}/missing.pem': no such file",
                 id="missing-cert"),
    pytest.param("{d}/cert.pem", "{d}/gone.pem", 7, "gateway.admin_tls.key: '{d}/gone.pem': no such file",
                 id="missing-key"),
    pytest.param("{d}/key.pem", "{d}/key.pem", 5, "gateway.admin_tls: cannot use {d}/key.pem", id="not-a-certificate"),
])
def test_admin_tls_files_are_checked_when_the_inventory_loads(certificate, cert, key, line, names):
    from llmgw.config import ConfigError, load_inventory_text

    d = str(certificate)
    with pytest.raises(ConfigError) as info:
        load_inventory_text(_inventory_with_tls(cert.format(d=d), key.format(d=d)), "inventory.yaml")
    assert str(info.value).startswith(f"inventory.yaml:{line}: {names.format(d=d)}"), str(info.value)


async def _https_app(certificate, app: web.Application):
    from llmgw.config import load_inventory_text

    inventory, _ = load_inventory_text(_inventory_with_tls(certificate / "cert.pem", certificate / "key.pem"))
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=inventory.gateway.admin_tls.server_context())
    await site.start()
    return runner, runner.addresses[0][1]


async def test_the_feed_over_https_checks_the_certificate(certificate, clients, place, caplog):
    publisher = FakePublisher()
    app = web.Application()
    FeedServer(publisher, accepting(TOKEN), keepalive=0.2).mount(app)
    runner, port = await _https_app(certificate, app)
    try:
        trusting = FakeRouter()
        await clients(trusting, f"https://127.0.0.1:{port}", place / "a", ca=str(certificate / "cert.pem"))
        await until(lambda: trusting.snapshot is not None, "the snapshot over https")
        trusting.count(3)
        await until(lambda: publisher.requests() == 3, "a report over https")
        doubting = FakeRouter()
        await clients(doubting, f"https://127.0.0.1:{port}", place / "b")  # the system's authorities only
        await until(lambda: any("certificate" in r.getMessage() for r in caplog.records), "a refused certificate")
        assert doubting.snapshot is None and doubting.feed_status["state"] == "no-snapshot"
        assert len(publisher.listeners) == 1
    finally:
        await runner.cleanup()


async def test_ctl_reaches_an_https_admin_listener_with_its_ca(certificate):
    from llmgw.admin.client import AdminClient, AdminError

    async def status(request):
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.get("/api/status", status)])
    runner, port = await _https_app(certificate, app)
    try:
        client = AdminClient.discover(admin=f"https://127.0.0.1:{port}", token=TOKEN, ca=str(certificate / "cert.pem"))
        assert await asyncio.to_thread(client.get, "/api/status") == {"ok": True}
        doubting = AdminClient.discover(admin=f"https://127.0.0.1:{port}", token=TOKEN)
        with pytest.raises(AdminError, match="--ca FILE"):
            await asyncio.to_thread(doubting.get, "/api/status")
    finally:
        await runner.cleanup()


def test_a_spool_read_back_skips_a_torn_line_and_never_reuses_a_seq(tmp_path, caplog):
    def line(seq, requests):
        report = Report(router="r-0", seq=seq, sent_at=1.0, usage=(UsageRow(0, "k", "m", requests, 1, 1),))
        return json.dumps(to_wire(report))

    (tmp_path / "spool.ndjson").write_text("\n".join([
        json.dumps({"acked": 3}), line(4, 1), line(5, 1), line(5, 2),  # a later line of a seq replaces it
        json.dumps({"acked": 4}), line(6, 9)[:40]]))  # cut short by a crash
    spool = Spool(tmp_path, "r-0")
    spool.load()
    assert [(e.report.seq, e.report.usage[0].requests) for e in spool.pending] == [(5, 2)]
    assert all(e.sent for e in spool.pending)  # it may have been counted: sent again as it is
    assert spool.next_seq == 6
    assert "line 6 is incomplete" in caplog.text
    spool.acknowledge(5)
    again = Spool(tmp_path, "r-0")
    again.load()
    assert again.pending == [] and again.next_seq == 6  # above every seq the file named


def test_a_spool_that_cannot_send_stays_small_on_disk(tmp_path):
    from llmgw.router.spool import SPOOL_COMPACT

    spool = Spool(tmp_path, "r-0")
    for _ in range(3 * SPOOL_COMPACT):
        spool.add({"usage": (UsageRow(0, "k", "m", 1, 1, 1),)}, 1.0)
    lines = spool.path.read_text().splitlines()
    print(f"{3 * SPOOL_COMPACT} periods unsent: {len(lines)} lines on disk, {len(spool.pending)} report(s)")
    assert len(spool.pending) == 1 and len(lines) <= SPOOL_COMPACT + 2
    again = Spool(tmp_path, "r-0")
    again.load()
    assert [e.report.usage[0].requests for e in again.pending] == [3 * SPOOL_COMPACT]


async def test_shutdown_ends_the_feed_streams_instead_of_waiting_for_them(place, clients):
    control = await Control(place, shutdown_timeout=3600.0).start()  # would wait this long for a stream left open
    router = FakeRouter()
    await clients(router, control.address, place / "router")
    await until(lambda: control.server.streams == 1, "a connected router")
    await asyncio.wait_for(control.stop(), DEADLINE)
    assert control.server.streams == 0


# -- state files another user could have written (R-10.9) ----------------------------------------

OTHER_UID = 65534  # nobody: a user that is not this process's
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")


def foreign(path: Path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID)


def open_to_others(path: Path) -> None:
    os.chmod(path, 0o666)


@pytest.mark.parametrize("spoil, says", [
    pytest.param(foreign, f"owned by uid {OTHER_UID}", id="another-users", marks=needs_root),
    pytest.param(open_to_others, "writable by its group and others (mode 0666)", id="writable-by-others"),
])
async def test_r10_9_a_snapshot_file_another_user_could_have_written_is_not_used(place, clients, caplog, spoil,
                                                                                 says):
    state_dir = place / "router"
    state_dir.mkdir(mode=0o700)
    path = state_dir / SNAPSHOT_FILE
    path.write_text(json.dumps(to_wire(make_snapshot("planted"))))
    os.chmod(path, 0o600)
    spoil(path)
    router = FakeRouter()
    await clients(router, f"unix:{place}/nothing.sock", state_dir)
    assert router.snapshot is None  # not routed with: it starts as if it had none
    (message,) = [r.getMessage() for r in caplog.records if "not using the last-known-good snapshot" in r.getMessage()]
    assert says in message and str(path) in message, message
    assert path.exists()  # left where it is, for the operator to look at


def spoil_state_dir(state_dir: Path) -> Path:
    state_dir.mkdir(mode=0o700)
    os.chmod(state_dir, 0o777)
    return state_dir


def spoil_slots(state_dir: Path) -> Path:
    (state_dir / "slots").mkdir(parents=True, mode=0o700)
    os.chmod(state_dir / "slots", 0o770)
    return state_dir / "slots"


def spoil_spool(state_dir: Path) -> Path:
    slot = state_dir / "slots" / "0"
    slot.mkdir(parents=True, mode=0o700)
    (slot / "spool.ndjson").write_text('{"acked": 0}\n')
    foreign(slot / "spool.ndjson")
    return slot / "spool.ndjson"


@pytest.mark.parametrize("spoil, says", [
    pytest.param(spoil_state_dir, "writable by its group and others (mode 0777)", id="state-dir-open"),
    pytest.param(spoil_slots, "writable by its group (mode 0770)", id="slots-dir-open-to-group"),
    pytest.param(spoil_spool, f"owned by uid {OTHER_UID}", id="spool-of-another-user", marks=needs_root),
])
async def test_r10_9_a_state_directory_or_slot_another_user_could_have_written_is_refused(place, spoil, says):
    state_dir = place / "router"
    spoiled = spoil(state_dir)
    client = FeedClient(FakeRouter(), f"unix:{place}/nothing.sock", TOKEN, state_dir, timing=FAST)
    with pytest.raises(FeedClientError) as refused:
        await client.start()
    assert says in str(refused.value) and str(spoiled) in str(refused.value), refused.value
    assert not (state_dir / SNAPSHOT_FILE).exists()


@needs_root
async def test_r10_9_reports_planted_in_a_slot_of_another_user_are_never_delivered(place, clients, caplog):
    control = await Control(place).start()
    try:
        state_dir = place / "router"
        planted = state_dir / "slots" / "7"
        planted.mkdir(parents=True, mode=0o700)
        (planted / "router-id").write_text("forged-router\n")
        spool = Spool(planted, "forged-router")
        spool.add({"usage": (UsageRow(bucket=3600, key_id="k1", model="m", requests=1000, prompt_tokens=1,
                                      completion_tokens=1),)}, 1.0)
        for path in (planted / "router-id", planted / "spool.ndjson"):
            foreign(path)
        client = await clients(FakeRouter(), control.address, state_dir)
        await until(lambda: any("its reports are not delivered" in r.getMessage() for r in caplog.records),
                    "the sweep to refuse the planted slot")
        client.router.count(2)  # this router's own reports still go through
        await until(lambda: control.publisher.requests(client.router_id) == 2, "this router's report")
        assert control.publisher.requests("forged-router") == 0
        (message,) = {r.getMessage() for r in caplog.records if "its reports are not delivered" in r.getMessage()}
        assert f"owned by uid {OTHER_UID}" in message and str(planted) in message
    finally:
        await control.stop()
