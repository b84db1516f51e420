"""Router credentials (R-10.7) and admin token rotation (R-9.3): which credential opens what, binding
of reports to the router's name, revocation, rotation with a grace, and a squatter on the port of a
plain-http control plane. Real aiohttp servers and the real FeedClient; the clocks are injected."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import tempfile
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.admin.app import build_admin_app
from llmgw.admin.tokens import AdminTokens
from llmgw.contracts import routerauth
from llmgw.contracts.feed import Report, UsageRow, to_wire
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, listen_unix
from llmgw.router.feedclient import FeedClient
from llmgw.routers import RouterRefused, Verifiers, add_router, list_routers, revoke_router, rotate_router
from llmgw.store import Store
from tests.unit.admin_gateway import TOKEN as ADMIN_TOKEN
from tests.unit.admin_gateway import make_gateway
from tests.unit.routerkit import accepting, authorized
from tests.unit.test_feed_wire import FAST, FakePublisher, FakeRouter, make_snapshot, until

EDGE = "llmgw-router.edge1.edge-one-secret-for-tests"
OTHER = "llmgw-router.edge2.edge-two-secret-for-tests"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def place():
    directory = Path(tempfile.mkdtemp(prefix="creds-", dir="/tmp"))  # Unix socket paths are short
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def serving(place):
    """A FeedServer on place/feed.sock; `serving(verifiers)` starts it, and it is stopped after."""
    started = []

    async def start(verifiers, publisher: FakePublisher | None = None) -> tuple[FeedServer, FakePublisher]:
        publisher = publisher or FakePublisher()
        server = FeedServer(publisher, verifiers, keepalive=0.1)
        started.append(await listen_unix(server, place / FEED_SOCKET, shutdown_timeout=0.5))
        return server, publisher

    try:
        yield start
    finally:
        for running in started:
            await running.close()


@pytest.fixture
async def clients():
    started: list[FeedClient] = []

    async def make(router, address: str, credential, state_dir: Path) -> FeedClient:
        client = FeedClient(router, address, credential, state_dir, timing=FAST)
        await client.start()
        started.append(client)
        return client

    try:
        yield make
    finally:
        for client in started:
            if client.slot is not None:
                await client.close()


def unix_session(place: Path) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(place / FEED_SOCKET)))


# -- which credential opens what -----------------------------------------------------------------


async def test_r10_7_the_admin_token_is_refused_on_the_feed(serving, place):
    await serving(accepting(EDGE))
    async with unix_session(place) as session:
        for path, call in (("/v1/feed", session.get), ("/v1/feed/report", session.post)):
            async with call("http://localhost" + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as answer:
                assert answer.status == 401
                assert "not the admin token" in (await answer.json())["error"]["message"]


async def test_r10_7_a_router_credential_is_refused_on_the_admin_api(tmp_path):
    gateway = make_gateway(tmp_path)
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    try:
        for offered in (EDGE, routerauth.verifier(EDGE).hex()):
            answer = await client.get("/api/status", headers={"Authorization": f"Bearer {offered}"})
            assert answer.status == 401
            assert "router credential is for the router feed only" in (await answer.json())["error"]["message"]
        assert (await client.get("/api/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).status == 200
    finally:
        await client.close()
        gateway.store.close()


async def test_r10_7_routers_are_added_listed_rotated_and_revoked_through_the_admin_api(tmp_path):
    gateway = make_gateway(tmp_path)
    gateway.router_credentials = Verifiers()
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        added = await client.post("/api/routers", json={"name": "edge1"}, headers=auth)
        assert added.status == 201
        credential = (await added.json())["credential"]
        assert routerauth.credential_name(credential) == "edge1"
        assert gateway.router_credentials.accepted("edge1") == (routerauth.verifier(credential),)
        again = await client.post("/api/routers", json={"name": "edge1"}, headers=auth)
        assert again.status == 400 and "rotate" in (await again.json())["error"]["message"]
        bad = await client.post("/api/routers", json={"name": "edge 1/x"}, headers=auth)
        assert bad.status == 400 and "letters, digits" in (await bad.json())["error"]["message"]
        listed = await (await client.get("/api/routers", headers=auth)).json()
        (entry,) = listed["routers"]
        assert entry["name"] == "edge1" and entry["state"] == "active"
        assert credential not in json.dumps(listed) and credential.startswith(entry["prefix"])
        rotated = await (await client.post("/api/routers/edge1/rotate", json={"grace": "10m"}, headers=auth)).json()
        assert rotated["credential"] != credential and rotated["router"]["previous_until"] is not None
        assert len(gateway.router_credentials.accepted("edge1")) == 2
        revoked = await (await client.delete("/api/routers/edge1", headers=auth)).json()
        assert revoked["revoked"] is True and revoked["router"]["state"] == "revoked"
        assert gateway.router_credentials.accepted("edge1") == ()
        rows = gateway.store.read_sync(lambda db: list(db["router_credentials"].rows))
        assert credential not in json.dumps(rows) and rotated["credential"] not in json.dumps(rows)
        audit = gateway.store.read_sync(lambda db: [r["action"] for r in db["audit"].rows])
        assert {"router.add", "router.rotate", "router.revoke"} <= set(audit)
    finally:
        await client.close()
        gateway.store.close()


# -- binding, revocation, rotation ----------------------------------------------------------------


async def test_r10_7_a_report_under_another_routers_name_is_refused(serving, place):
    _, publisher = await serving(accepting(EDGE, OTHER))
    async with unix_session(place) as session:
        for router_id, status in (("edge2/host-0-abcd", 403), ("edge2", 403), ("edge1x/host-0", 403),
                                  ("edge1/host-0-abcd", 200)):
            auth, _ = await authorized(session, "http://localhost", EDGE, "POST", "/v1/feed/report")
            report = Report(router=router_id, seq=1, sent_at=1.0, usage=(UsageRow(0, "k1", "m", 1, 2, 3),))
            async with session.post("http://localhost/v1/feed/report", json=to_wire(report), headers=auth) as answer:
                assert answer.status == status, router_id
                if status == 403:
                    assert (await answer.json())["error"]["code"] == "wrong_router"
    assert [r.router for r in publisher.received] == ["edge1/host-0-abcd"]


async def test_r10_7_a_proof_is_good_for_one_request_and_one_path(serving, place):
    _, publisher = await serving(accepting(EDGE))
    async with unix_session(place) as session:
        auth, _ = await authorized(session, "http://localhost", EDGE, "GET", "/v1/feed")
        report = to_wire(Report(router="edge1/h", seq=1, sent_at=1.0))
        async with session.post("http://localhost/v1/feed/report", json=report, headers=auth) as answer:
            assert answer.status == 401  # made for GET /v1/feed
        async with session.get("http://localhost/v1/feed", headers=auth) as answer:
            assert answer.status == 401  # its challenge was used up by the refused one
    assert publisher.received == [] and publisher.listeners == []


async def test_r10_7_the_client_puts_its_router_ids_under_its_name(serving, clients, place):
    _, publisher = await serving(accepting(EDGE))
    router = FakeRouter()
    client = await clients(router, f"unix:{place / FEED_SOCKET}", EDGE, place / "router")
    await until(lambda: router.snapshot is not None, "the first snapshot")
    router.count(2)
    await until(lambda: publisher.requests() == 2, "a report counted")
    assert client.router_id.startswith("edge1/")
    assert {r.router for r in publisher.received} == {client.router_id}


async def test_r10_7_revoking_a_router_ends_its_stream_and_refuses_its_reports(serving, clients, place, tmp_path,
                                                                               caplog):
    store = Store.open(tmp_path / "state.db")
    try:
        credential = store.write_sync(lambda db: add_router(db, "edge1", now=1.0))[1]
        other = store.write_sync(lambda db: add_router(db, "edge2", now=2.0))[1]
        verifiers = Verifiers(store.read_sync(list_routers))
        server, publisher = await serving(verifiers)
        router, bystander = FakeRouter(), FakeRouter()
        await clients(router, f"unix:{place / FEED_SOCKET}", credential, place / "router")
        await clients(bystander, f"unix:{place / FEED_SOCKET}", other, place / "other")
        await until(lambda: router.snapshot is not None and bystander.snapshot is not None, "both fed")
        router.count(1)
        await until(lambda: publisher.requests() == 1, "a report before the revocation")
        caplog.set_level(logging.ERROR, logger="llmgw.router.feedclient")
        store.write_sync(lambda db: revoke_router(db, "edge1"))
        verifiers.load(store.read_sync(list_routers))
        server.recheck()
        await until(lambda: router.feed_status["state"] != "live", "the revoked router's stream ended")
        router.count(5)
        await until(lambda: any("refused" in r.getMessage() and "'edge1' is in force (never added, or revoked)" in r.getMessage()
                                for r in caplog.records), "its report refused")
        assert publisher.requests() == 1
        assert bystander.feed_status["state"] == "live" and len(publisher.listeners) == 1
        assert router.snapshot is not None  # it keeps serving with what it had (last-known-good)
    finally:
        store.close()


async def test_r10_7_a_rotated_credential_works_for_its_grace_then_is_refused(serving, clients, place, tmp_path):
    clock = Clock()
    store = Store.open(tmp_path / "state.db")
    try:
        old = store.write_sync(lambda db: add_router(db, "edge1", now=clock.now))[1]
        new = store.write_sync(lambda db: rotate_router(db, "edge1", 600.0, now=clock.now))[1]
        verifiers = Verifiers(store.read_sync(list_routers), clock=clock)
        server, publisher = await serving(verifiers)
        router = FakeRouter()
        await clients(router, f"unix:{place / FEED_SOCKET}", old, place / "router")
        await until(lambda: router.snapshot is not None and len(publisher.listeners) == 1, "fed with the old one")
        async with unix_session(place) as session:
            for credential in (old, new):  # both within the grace
                auth, _ = await authorized(session, "http://localhost", credential, "POST", "/v1/feed/report")
                report = to_wire(Report(router="edge1/x", seq=1, sent_at=1.0))
                async with session.post("http://localhost/v1/feed/report", json=report, headers=auth) as answer:
                    assert answer.status == 200
            clock.now += 601.0  # the grace is over
            # The stream made with the old credential ends at its next keep-alive.
            await until(lambda: router.feed_status["state"] != "live", "the old credential's stream ended")
            async with session.post("http://localhost" + routerauth.CHALLENGE_PATH,
                                    json={"router": "edge1", "nonce": "n" * 24}) as answer:
                proofs = (await answer.json())["proofs"]
            assert len(proofs) == 1  # only the new credential's verifier is in force
            auth, _ = await authorized(session, "http://localhost", new, "GET", "/v1/feed")
            async with session.get("http://localhost/v1/feed", headers=auth) as answer:
                assert answer.status == 200
        # The old one is refused: the client cannot get back on.
        assert router.feed_status["state"] != "live"
        with pytest.raises(RouterRefused, match="revoked"):
            store.write_sync(lambda db: (revoke_router(db, "edge1"), rotate_router(db, "edge1", 0)))
    finally:
        store.close()


async def test_r10_7_a_router_takes_up_a_replaced_credential_file_without_a_restart(serving, clients, place,
                                                                                    tmp_path):
    from llmgw.router import credential as router_credential

    store = Store.open(tmp_path / "state.db")
    try:
        old = store.write_sync(lambda db: add_router(db, "edge1"))[1]
        verifiers = Verifiers(store.read_sync(list_routers))
        server, publisher = await serving(verifiers)
        path = tmp_path / "credential"
        path.write_text(old + "\n")
        router = FakeRouter()
        await clients(router, f"unix:{place / FEED_SOCKET}", router_credential.source(path), place / "router")
        await until(lambda: router.snapshot is not None, "fed")
        new = store.write_sync(lambda db: rotate_router(db, "edge1", 0))[1]
        verifiers.load(store.read_sync(list_routers))
        server.recheck()
        await until(lambda: router.feed_status["state"] != "live", "the old credential refused at once")
        path.write_text(new + "\n")
        await until(lambda: router.feed_status["state"] == "live", "back on with the new file")
    finally:
        store.close()


async def test_r9_3_a_rotated_admin_token_works_for_its_grace_then_is_refused(tmp_path):
    clock = Clock()
    gateway = make_gateway(tmp_path)
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    gateway.admin_tokens = AdminTokens(ADMIN_TOKEN, token_file, clock=clock)
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()

    async def status(token: str) -> int:
        return (await client.get("/api/status", headers={"Authorization": f"Bearer {token}"})).status

    try:
        answer = await client.post("/api/token/rotate", json={"grace": "5m"},
                                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert answer.status == 200
        rotated = await answer.json()
        new = rotated["token"]
        assert token_file.read_text().strip() == new and token_file.stat().st_mode & 0o777 == 0o600
        assert rotated["previous_until"] == clock.now + 300
        assert await status(ADMIN_TOKEN) == 200 and await status(new) == 200
        clock.now += 301
        assert await status(ADMIN_TOKEN) == 401
        assert await status(new) == 200
        bad = await client.post("/api/token/rotate", json={"grace": "soon"}, headers={"Authorization": f"Bearer {new}"})
        assert bad.status == 400 and token_file.read_text().strip() == new
    finally:
        await client.close()
        gateway.store.close()


# -- the admin listener and the feed take only text tokens ---------------------------------------


async def _raw(port: int, path: str, authorization: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                 + authorization + b"\r\n\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("authorization", [
    pytest.param(b"Bearer \xff\xfe\xfd", id="latin-bytes"),
    pytest.param(b"Bearer tok\xc3\x28en", id="broken-utf8"),
    pytest.param(b"Llmgw-Router edge1:\xff:\xfe", id="router-scheme"),
])
async def test_a_bearer_that_is_not_utf8_is_a_401_on_the_admin_listener_and_the_feed(tmp_path, authorization):
    gateway = make_gateway(tmp_path)
    gateway.feed_server = FeedServer(FakePublisher(), accepting(EDGE))
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    try:
        for path in ("/api/status", "/v1/feed", "/metrics"):
            status, body = await _raw(client.port, path, authorization)
            assert status == 401, (path, body)
            assert b"unauthorized" in body
        status, body = await _raw(client.port, "/api/status", b"Bearer \xff\xfe")
        assert b"not UTF-8" in body
    finally:
        await client.close()
        gateway.store.close()


# -- a squatter on the port of a plain-http control plane ---------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_r10_7_a_squatter_on_the_loopback_port_gets_nothing_reusable_and_cannot_feed_the_router(
        serving, clients, place, tmp_path, caplog):
    """The control plane is away; another local user holds its port and answers like it. It is
    handed nothing that authenticates as the router at the real control plane, and the router
    takes none of its messages."""
    seen: list[dict] = []
    fake = make_snapshot("squatter-epoch")
    line = json.dumps(to_wire(fake)).encode() + b"\n"

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append({"method": request.method, "path": request.path, "headers": dict(request.headers),
                     "body": (await request.read()).decode(errors="replace")})
        if request.path == routerauth.CHALLENGE_PATH:  # plays along with the exchange as best it can
            return web.json_response({"challenge": "c" * 32, "proofs": ["0" * 64, "f" * 64]})
        if request.path == "/v1/feed":
            response = web.StreamResponse(headers={routerauth.PROOF_HEADER: "0" * 64})
            await response.prepare(request)
            await response.write(line)
            return response
        return web.json_response({"type": "ack", "protocol": 1, "router": "edge1/x", "seq": 999})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    caplog.set_level(logging.INFO, logger="llmgw.router.feedclient")
    try:
        router = FakeRouter()
        client = await clients(router, f"http://127.0.0.1:{port}", EDGE, place / "router")
        router.count(3)
        await until(lambda: sum(1 for r in seen if r["path"] == routerauth.CHALLENGE_PATH) >= 3,
                    "the router tried the squatter a few times")
        await until(lambda: any("did not prove" in r.getMessage() for r in caplog.records), "the refusal said")
        assert router.snapshot is None and router.messages == []  # the fake snapshot never reached it
        assert {r["path"] for r in seen} == {routerauth.CHALLENGE_PATH}  # no feed or report request was made
        assert client.unacked == 1  # the report waits for the real control plane
    finally:
        await runner.cleanup()
    received = json.dumps(seen)
    assert EDGE not in received and routerauth.verifier(EDGE).hex() not in received
    assert "Authorization" not in received
    # Whatever it was handed, replayed at the real control plane, authenticates nothing.
    _, publisher = await serving(accepting(EDGE))
    async with unix_session(place) as session:
        for request in seen:
            body = json.loads(request["body"])
            async with session.post("http://localhost" + routerauth.CHALLENGE_PATH, json=body) as answer:
                challenge = (await answer.json())["challenge"]
            forged = routerauth.authorization("edge1", challenge, body["nonce"])
            async with session.get("http://localhost/v1/feed", headers={"Authorization": forged}) as answer:
                assert answer.status == 401
    assert publisher.listeners == [] and publisher.received == []
