"""The request log on the control plane (R-6.20): records taken once per (router, seq) with the
report's usage, their node filled in from the stored replica, pruned by age and by count, and
read back through `GET /api/requests` and `llmgw ctl requests` with filters and a cursor."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import time

import pytest
import sqlite_utils
from aiohttp.test_utils import TestClient
from typer.testing import CliRunner

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.cli.main import app
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.feed import (REQUEST_RECORD_FIELDS, FeedError, Report, RequestRecord, UsageRow, read_report,
                                  request_record_from_wire, request_record_to_wire, to_wire)
from llmgw.control.feed import FeedPublisher
from llmgw import requestlog
from llmgw.requestlog import (MOST_SHOWN, RequestQuery, add_requests, find_requests, parse_status,
                              prune_requests)
from llmgw.store import MIGRATIONS, Store, migrate, schema_version
from tests.unit.admin_gateway import TOKEN, make_gateway, served_admin

NOW = 1_800_000_000.0
ROUTE = "POST /v1/chat/completions"
CATALOG = Catalog.build(file_models=[ModelConfig(name="chat", profile="p")], profiles={"p": ProfileConfig(engine="vllm")},
                        engines={})


def record(i: int, **fields) -> RequestRecord:
    """The i-th request, arriving i seconds after NOW."""
    return RequestRecord(**{"at": NOW + i, "id": f"req-{i}", "route": ROUTE, "status": 200, "duration": 0.5,
                            "key": "alice", "model": "chat", **fields})


def ids(answer: dict) -> list[str]:
    return [r["id"] for r in answer["requests"]]


@pytest.fixture
def store(tmp_path):
    opened = Store.open(tmp_path / "state.db")
    try:
        yield opened
    finally:
        opened.close()


def find(store: Store, **query) -> dict:
    return store.read_sync(lambda db: find_requests(db, RequestQuery(**query)))


def add(store: Store, router: str, records) -> None:
    store.write_sync(lambda db: add_requests(db, router, records))


# -- storage --------------------------------------------------------------------------------------


def test_r6_20_a_version_8_database_gets_the_request_log_indexed_for_its_queries(tmp_path):
    db = sqlite_utils.Database(tmp_path / "v8.db")
    for version in range(1, 9):
        MIGRATIONS[version](db)
    db.execute("PRAGMA user_version = 8")
    db["aliases"].insert({"name": "chat", "target": "chat-v2"})
    migrate(db)
    assert schema_version(db) == 9 and db["aliases"].count == 1
    indexed = {tuple(i.columns) for i in db["requests"].indexes}
    assert {("at",), ("key", "at"), ("model", "at"), ("asked", "at"), ("status", "at")} <= indexed


def test_r6_20_every_field_is_kept_and_the_router_named(store):
    full = RequestRecord(at=NOW, id="req-full", route=ROUTE, status=503, duration=2.5, key="alice", model="chat-v2",
                         asked="chat", replica="chat-v2-1", node="gpu3", error="queue_timeout", attempts=2,
                         fallback="small", queued=1.25, ttfb=0.125, prompt_tokens=12, completion_tokens=34,
                         estimated=True, stream=True, client="10.0.0.7", client_request_id="x" * 128)
    bare = RequestRecord(at=NOW + 1, id="req-401", route=ROUTE, status=401, duration=0.001)
    add(store, "edge1/a", [full, bare])
    newest, oldest = find(store)["requests"]
    assert oldest == {"row": 1, "router": "edge1/a", **{name: getattr(full, name) for name in REQUEST_RECORD_FIELDS}}
    # What nobody knew stays unknown (None), never 0; the attempts of a request refused before any are 0.
    assert newest["router"] == "edge1/a" and newest["id"] == "req-401" and newest["attempts"] == 0
    assert [name for name in REQUEST_RECORD_FIELDS if newest[name] is None] == [
        "key", "model", "asked", "replica", "node", "error", "fallback", "queued", "ttfb", "prompt_tokens",
        "completion_tokens", "client", "client_request_id"]


def test_r6_20_a_record_without_a_node_gets_its_replicas_head_node_as_stored(store, monkeypatch):
    def replica(db):
        db["replicas"].insert({"id": "big-1", "model": "big", "api_key": "k", "state": "serving"})
        db["shards"].insert_all([{"id": "big-1-1", "replica_id": "big-1", "rank": 1, "node": "gpu4", "state": "serving"},
                                 {"id": "big-1-0", "replica_id": "big-1", "rank": 0, "node": "gpu3", "state": "serving"}])
        db["replicas"].insert({"id": "small-1", "model": "small", "api_key": "k", "state": "serving"})
        db["shards"].insert({"id": "small-1-0", "replica_id": "small-1", "rank": 0, "node": "cpu1", "state": "serving"})
    store.write_sync(replica)
    monkeypatch.setattr(requestlog, "_LOOKED_UP", 1)  # one replica per lookup: several lookups
    add(store, "r/1", [record(1, replica="big-1"), record(2, replica="big-1", node="gpu9"),
                       record(3, replica="gone-1"), record(4), record(5, replica="small-1")])
    nodes = {r["id"]: r["node"] for r in find(store)["requests"]}
    assert nodes == {"req-1": "gpu3", "req-2": "gpu9", "req-3": None, "req-4": None, "req-5": "cpu1"}


# -- pruning --------------------------------------------------------------------------------------


def test_r6_20_records_older_than_the_age_go(store):
    add(store, "r/1", [record(i) for i in range(10)])
    gone = store.write_sync(lambda db: prune_requests(db, now=NOW + 10, age=4.5, keep=100))
    assert gone == 6  # arrived at NOW+0 … NOW+5: older than 4.5 s at NOW+10
    assert ids(find(store)) == ["req-9", "req-8", "req-7", "req-6"]


def test_r6_20_records_beyond_the_newest_count_go(store):
    add(store, "r/1", [record(i) for i in range(10)])
    add(store, "r/2", [record(i, id=f"late-{i}", at=NOW - 100) for i in range(2)])  # taken in last, arrived first
    assert store.write_sync(lambda db: prune_requests(db, now=NOW, age=3600, keep=3)) == 9
    assert sorted(ids(find(store))) == ["late-0", "late-1", "req-9"]  # the newest taken in stay


def test_r6_20_pruning_deletes_a_chunk_at_a_time_and_both_bounds_count(store):
    add(store, "r/1", [record(i) for i in range(10)])
    prune = lambda db: prune_requests(db, now=NOW + 10, age=2.5, keep=8, chunk=3)  # noqa: E731
    assert store.write_sync(prune) == 3  # the 2 past the count, then 1 of those past the age
    assert store.write_sync(prune) == 3
    assert store.write_sync(prune) == 2
    assert store.write_sync(prune) == 0
    assert ids(find(store)) == ["req-9", "req-8"]  # arrived within 2.5 s of NOW+10


def test_r6_20_row_numbers_are_never_given_again_even_once_everything_was_pruned(store):
    add(store, "r/1", [record(i) for i in range(3)])
    cursor = find(store)["cursor"]
    assert store.write_sync(lambda db: prune_requests(db, now=NOW + 1e6, age=1, keep=10)) == 3
    add(store, "r/1", [record(9)])
    assert ids(find(store, after=cursor)) == ["req-9"]  # a follower at the old cursor sees the new record


async def test_r6_20_the_publisher_prunes_with_the_keep_in_force_and_a_reload_changes_it(store):
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e")
    try:
        add(store, "r/1", [record(i, at=time.time() - 2 * 86400) for i in range(5)])
        assert await publisher.prune_request_log() == 5  # older than the default day
        add(store, "r/1", [record(i, at=time.time()) for i in range(5)])
        assert await publisher.prune_request_log() == 0
        publisher.set_gateway(GatewayConfig(request_log={"keep": {"records": 2}}))
        assert await publisher.prune_request_log() == 3
        assert len(find(store)["requests"]) == 2
    finally:
        await publisher.close()


# -- taken once per (router, seq) ------------------------------------------------------------------


async def test_r6_20_a_report_sent_again_is_taken_once_also_after_a_restart(tmp_path):
    records = (record(1), record(2, status=503, error="queue_timeout"))
    report = Report(router="edge1/a", seq=7, sent_at=NOW, requests=records,
                    usage=(UsageRow(3600, "k1", "chat", 2, 10, 5),))
    store = Store.open(tmp_path / "state.db")
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e")
    try:
        for _ in range(2):  # a resend: the ack was lost
            ack = await publisher.apply_report(report)
            assert (ack.router, ack.seq) == ("edge1/a", 7)
        await publisher.apply_report(Report(router="edge1/a", seq=6, sent_at=NOW, requests=(record(3),)))  # older
        # Another router's seq is its own: the same numbers count.
        await publisher.apply_report(Report(router="edge2/b", seq=7, sent_at=NOW, requests=(record(4),)))
        assert sorted(ids(find(store))) == ["req-1", "req-2", "req-4"]
    finally:
        await publisher.close()
        store.close()
    store = Store.open(tmp_path / "state.db")  # the control plane restarted; the router sends it again
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e2")
    try:
        await publisher.apply_report(report)
        await publisher.apply_report(Report(router="edge1/a", seq=8, sent_at=NOW, requests=(record(5),)))
        listed = find(store)["requests"]
        assert sorted(r["id"] for r in listed) == ["req-1", "req-2", "req-4", "req-5"]
        assert {r["id"]: r["router"] for r in listed}["req-4"] == "edge2/b"
        usage = store.read_sync(lambda db: db.execute("SELECT SUM(requests) FROM usage").fetchone()[0])
        assert usage == 2  # counted with its records, once
    finally:
        await publisher.close()
        store.close()


def test_r6_20_a_record_counted_with_its_report_fails_and_rolls_back_with_it(store):
    """The records are written in the report's transaction: a write that fails takes none of it."""
    from llmgw.control.feed import apply_counted

    def broken(db):
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON requests WHEN NEW.request_id = 'bad' "
                   "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    store.write_sync(broken)
    report = Report(router="r/1", seq=1, sent_at=NOW, requests=(record(1), record(2, id="bad")),
                    usage=(UsageRow(3600, "k1", "chat", 2, 10, 5),))
    with pytest.raises(sqlite3.IntegrityError):
        store.write_sync(lambda db: apply_counted(db, report, NOW))
    assert find(store)["requests"] == []
    assert store.read_sync(lambda db: db["usage"].count + db["router_seq"].count) == 0  # not counted: sent again later


def test_r6_20_records_travel_in_a_report_and_a_bad_one_is_left_out_named():
    document = to_wire(Report(router="r/1", seq=1, sent_at=NOW, requests=(record(1), record(2))))
    document["requests"][1]["at"] = math.nan  # JSON as Python reads it has NaN
    report, refused = read_report(json.loads(json.dumps(document)))
    assert [r.id for r in report.requests] == ["req-1"]
    assert [r.where for r in refused] == ["report.requests[1]"]
    with pytest.raises(FeedError, match="r.at: expected int or float"):  # never a time the log cannot order
        request_record_from_wire({**request_record_to_wire(record(1)), "at": math.inf}, "r")


# -- filters and the cursor ----------------------------------------------------------------------------


@pytest.fixture
def logged(store):
    add(store, "edge1/a", [
        record(1, status=200, duration=0.2),
        record(2, key="bob", status=503, error="queue_timeout", duration=30.5),
        record(3, model="chat-v2", asked="chat-latest", status=404, duration=1.6),
        record(4, key="bob", model="embed", status=502, duration=2.0)])
    add(store, "edge2/b", [record(5, status=429, duration=0.01), record(0, id="req-early", duration=1.0)])
    return store


@pytest.mark.parametrize("query, expected", [
    pytest.param({}, ["req-5", "req-4", "req-3", "req-2", "req-1", "req-early"], id="newest-first-by-arrival"),
    pytest.param({"key": "bob"}, ["req-4", "req-2"], id="key"),
    pytest.param({"model": "chat"}, ["req-5", "req-2", "req-1", "req-early"], id="model"),
    pytest.param({"model": "chat-latest"}, ["req-3"], id="the-name-asked"),
    pytest.param({"model": "chat-v2"}, ["req-3"], id="the-model-an-alias-served"),
    pytest.param({"status": (503, 503)}, ["req-2"], id="status"),
    pytest.param({"status": (500, 599)}, ["req-4", "req-2"], id="status-class"),
    pytest.param({"status": (400, 499), "model": "chat"}, ["req-5"], id="class-and-model"),
    pytest.param({"slower_than": 1.5}, ["req-4", "req-3", "req-2"], id="slower-than"),
    pytest.param({"slower_than": 1.0, "key": "alice"}, ["req-3"], id="slower-than-and-key"),
    pytest.param({"n": 2}, ["req-5", "req-4"], id="n"),
    pytest.param({"model": "chat", "n": 2}, ["req-5", "req-2"], id="model-and-n"),
    pytest.param({"key": "nobody"}, [], id="none"),
])
@pytest.mark.parametrize("dense", [5000, 1], ids=["class-sorted", "class-read-by-time"])
def test_r6_20_filters(logged, query, expected, dense, monkeypatch):
    monkeypatch.setattr(requestlog, "DENSE", dense)  # 1: every class holds "many" records
    assert ids(find(logged, **query)) == expected


@pytest.mark.parametrize("text, statuses", [("503", (503, 503)), ("5xx", (500, 599)), ("4XX", (400, 499)),
                                            (" 200 ", (200, 200))])
def test_r6_20_a_status_or_a_class(text, statuses):
    assert parse_status(text) == statuses


@pytest.mark.parametrize("text", ["600", "99", "6xx", "5x", "ok", "", "50"])
def test_r6_20_what_is_no_status_is_refused(text):
    with pytest.raises(ValueError, match="give one .503. or a class .5xx, 4xx."):
        parse_status(text)


def test_r6_20_n_is_capped(store):
    add(store, "r/1", [record(i) for i in range(MOST_SHOWN + 5)])
    assert len(find(store, n=MOST_SHOWN * 10)["requests"]) == MOST_SHOWN


def test_r6_20_a_cursor_gives_what_came_after_it_oldest_first(logged):
    start = find(logged, n=1)
    assert start["cursor"] == 6  # the newest row taken in, whatever was listed
    assert find(logged, after=start["cursor"]) == {"requests": [], "cursor": 6}
    add(logged, "edge2/b", [record(10, key="bob", status=500), record(11), record(12, key="bob", status=200)])
    later = find(logged, after=6)
    assert ids(later) == ["req-10", "req-11", "req-12"] and later["cursor"] == 9
    # With filters: only what matches, and the cursor passes what did not, so it is not read again.
    bob = find(logged, after=6, key="bob", status=(500, 599))
    assert ids(bob) == ["req-10"] and bob["cursor"] == 9
    # More than n: the cursor stops at the last one listed, and the next call goes on from there.
    first = find(logged, after=6, n=2)
    assert ids(first) == ["req-10", "req-11"] and first["cursor"] == 8
    assert ids(find(logged, after=first["cursor"], n=2)) == ["req-12"]
    assert ids(find(logged, after=0, model="chat-latest")) == ["req-3"]


# -- the admin API and ctl ---------------------------------------------------------------------------


@pytest.fixture
async def admin(tmp_path):
    gateway = make_gateway(tmp_path)
    async with served_admin(gateway) as client:
        yield client, gateway


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_r6_20_the_admin_api_lists_filters_and_follows(admin):
    client, gateway = admin
    add(gateway.store, "edge1/a", [record(1), record(2, key="bob", status=503, duration=4.0), record(3, status=404)])
    answer = await (await client.get("/api/requests", headers=AUTH)).json()
    assert ids(answer) == ["req-3", "req-2", "req-1"] and answer["cursor"] == 3
    assert set(answer["requests"][0]) == {"row", "router", *REQUEST_RECORD_FIELDS}
    query = {"key": "bob", "status": "5xx", "slower_than": "1.5s", "n": "10"}
    assert ids(await (await client.get("/api/requests", params=query, headers=AUTH)).json()) == ["req-2"]
    assert ids(await (await client.get("/api/requests", params={"model": "chat", "status": "404"},
                                       headers=AUTH)).json()) == ["req-3"]
    assert ids(await (await client.get("/api/requests", params={"after": "1"}, headers=AUTH)).json()) == [
        "req-2", "req-3"]
    assert (await client.get("/api/requests")).status == 401


@pytest.mark.parametrize("params, said", [
    pytest.param({"status": "5x"}, "status: '5x' is not a status", id="status"),
    pytest.param({"slower_than": "soon"}, "slower_than: 'soon' is not a duration", id="slower-than"),
    pytest.param({"n": "0"}, "n must be a whole number of at least 1", id="n"),
    pytest.param({"after": "-1"}, "after must be a whole number of at least 0", id="after"),
])
async def test_r6_20_the_admin_api_refuses_what_it_cannot_read(admin, params, said):
    client, _ = admin
    response = await client.get("/api/requests", params=params, headers=AUTH)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "bad_argument" and said in error["message"]


async def ctl(client: TestClient, *args: str, code: int = 0) -> str:
    runner = CliRunner(env={"COLUMNS": "400", "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None, "LLMGW_STATE_DIR": None})
    address = f"{client.server.host}:{client.server.port}"
    result = await asyncio.to_thread(runner.invoke, app, ["ctl", "--admin", address, "--token", TOKEN, *args])
    assert result.exit_code == code, result.output
    return result.stdout if code == 0 else result.stderr


async def test_r6_20_ctl_requests_shows_unknown_as_a_dash_and_estimates_marked(admin):
    client, gateway = admin
    add(gateway.store, "edge1/a", [
        RequestRecord(at=NOW, id="req-refused", route=ROUTE, status=401, duration=0.0015, error="invalid_api_key"),
        record(1, model="chat-v2", asked="chat", replica="chat-v2-1", node="gpu3", attempts=2, fallback="small",
               queued=0.25, ttfb=1.5, duration=12.25, prompt_tokens=123, completion_tokens=0, estimated=True),
        record(2, replica="chat-1", attempts=1, prompt_tokens=7, completion_tokens=None)])
    out = await ctl(client, "requests")
    lines = [line.split("  ") for line in out.splitlines()]
    print(out)
    header, partial, cut, refused = ([cell.strip() for cell in line if cell.strip()] for line in lines)
    assert header == ["TIME", "ID", "KEY", "MODEL", "STATUS", "REPLICA@NODE", "ATTEMPTS", "QUEUE", "TTFB", "DURATION",
                      "TOKENS IN/OUT"]
    assert cut[1:] == ["req-1", "alice", "chat-v2 via chat", "200", "chat-v2-1@gpu3", "2 → small", "250ms", "1.50s",
                       "12.2s", "~123/~0"]
    assert partial[1:] == ["req-2", "alice", "chat", "200", "chat-1@-", "1", "-", "-", "500ms", "7/-"]
    assert refused[1:] == ["req-refused", "-", "-", "401 invalid_api_key", "-", "0", "-", "-", "2ms", "-"]
    document = json.loads(await ctl(client, "requests", "--json", "--status", "401"))
    (only,) = document["requests"]
    assert only["id"] == "req-refused" and only["key"] is None and only["prompt_tokens"] is None


async def test_r6_20_ctl_requests_says_what_it_cannot_read_and_exits_1(admin):
    client, _ = admin
    said = await ctl(client, "requests", "--slower-than", "a while", code=1)
    assert said.startswith("error: slower_than: 'a while' is not a duration")
