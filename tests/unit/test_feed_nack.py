"""A Snapshot or Change a router cannot apply is said back to the control plane (R-10.10), as xDS's
NACK: the router names its epoch and version and why in its reports, the control plane keeps each
router's last one beside the version it routes with, and operators see both in `ctl status`."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from llmgw.admin import render
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.feed import (UNAPPLIED_REASON_KEPT, Change, FeedError, Report, Unapplied, from_wire, read_report,
                                  to_wire)
from llmgw.control.feed import FeedPublisher
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, listen_unix
from llmgw.localfeed import LocalFeed
from llmgw.router import Router
from llmgw.router.feedclient import FeedClient, FeedTiming
from llmgw.store import Store
from tests.unit.routerkit import accepting

TOKEN = "llmgw-router.nack.nack-test-router-secret"  # the router credential
DEADLINE = 20.0  # a guard against hanging, not a timing assertion
FAST = FeedTiming(report_interval=0.05, snapshot_every=0.05, read_timeout=2.0, backoff_base=0.02, backoff_cap=0.1,
                  sweep_every=0.1)
CATALOG = Catalog.build(file_models=[ModelConfig(name="m", profile="p")], profiles={"p": ProfileConfig(engine="vllm")})
EMPTY_STATUS = {"capacity": [], "gpus_unknown": [], "free_whole_nodes": {}, "unplaceable": [], "idle": [],
                "fabrics": [], "nodes": {"total": 0, "by_state": {}, "by_admin": {}},
                "replicas": {"total": 0, "by_state": {}, "failed_recently": 0}, "models": {"total": 0, "by_state": {}}}


async def until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"still not true after {DEADLINE}s: {what}")
        await asyncio.sleep(0.02)


def shown(routers: list[dict]) -> str:
    console = Console(width=200, record=True)
    console.print(render.status({**EMPTY_STATUS, "routers": routers}))
    return console.export_text()


# -- what a router says --------------------------------------------------------------------------


@pytest.mark.parametrize("message,error,expected", [
    pytest.param(Change("e", 7), FeedError("change e/7 does not follow snapshot e/5"),
                 ("e", 7, "change e/7 does not follow snapshot e/5"), id="a-gap"),
    pytest.param({"type": "change", "epoch": "e", "version": 9, "keys": 3}, FeedError("change.keys: expected list"),
                 ("e", 9, "change.keys: expected list"), id="a-document-that-does-not-parse"),
    pytest.param({"type": "change", "epoch": 5, "version": "9"}, FeedError("change.epoch: expected str, got int"),
                 (None, None, "change.epoch: expected str, got int"), id="epoch-and-version-of-the-wrong-type"),
    pytest.param(None, FeedError("a feed line is not JSON (Expecting value)"),
                 (None, None, "a feed line is not JSON (Expecting value)"), id="not-json"),
    pytest.param(Change("e", 3), KeyError("sk-llmgw-secret"), ("e", 3, "KeyError in the router (see its log)"),
                 id="a-fault-of-the-router-says-only-its-kind"),
])
def test_r10_10_a_router_names_the_message_it_could_not_apply_and_why(message, error, expected):
    unapplied = Unapplied.of(message, error, 123.0)
    assert (unapplied.epoch, unapplied.version, unapplied.reason, unapplied.at) == (*expected, 123.0)


def test_r10_10_a_long_reason_is_cut_to_what_the_control_plane_takes():
    unapplied = Unapplied.of(Change("e", 2), FeedError("x" * 5000), 1.0)
    assert len(unapplied.reason) == UNAPPLIED_REASON_KEPT
    assert read_report(to_wire(Report("r", 1, 1.0, unapplied=unapplied))) == (Report("r", 1, 1.0, unapplied=unapplied), ())


def test_r10_10_unapplied_travels_in_a_report_and_is_absent_when_there_is_none():
    unapplied = Unapplied("e", 4, "change e/4 does not follow snapshot e/2", 99.5)
    wire = to_wire(Report("r/h-0", 1, 1.0, unapplied=unapplied))
    assert wire["unapplied"] == {"epoch": "e", "version": 4, "reason": "change e/4 does not follow snapshot e/2",
                                 "at": 99.5}
    assert from_wire(wire).unapplied == unapplied
    plain = to_wire(Report("r/h-0", 1, 1.0))
    assert "unapplied" not in plain  # a control plane from before reads this router's reports as ever
    assert from_wire(plain).unapplied is None


@pytest.mark.parametrize("value,names", [
    pytest.param("version 4", "report.unapplied: expected dict, got str", id="not-an-object"),
    pytest.param({"epoch": "e", "version": 0, "reason": "r", "at": 1.0}, "report.unapplied.version: must be at least 1",
                 id="version"),
    pytest.param({"epoch": "e", "version": 4, "at": 1.0}, "report.unapplied: 'reason' is missing", id="no-reason"),
    pytest.param({"epoch": "e", "version": 4, "reason": "r" * (UNAPPLIED_REASON_KEPT + 1), "at": 1.0},
                 f"report.unapplied.reason: at most {UNAPPLIED_REASON_KEPT} characters", id="reason-too-long"),
])
def test_r10_10_a_bad_unapplied_is_left_out_of_the_report_and_the_rest_taken(value, names):
    document = {**to_wire(Report("r/h-0", 3, 1.0, inflight={"a-r0": 2})), "unapplied": value}
    report, refused = read_report(document)
    assert report.unapplied is None and report.inflight == {"a-r0": 2}
    assert [r.where for r in refused] == ["report.unapplied"] and names in refused[0].message


# -- what the control plane keeps ----------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def publisher(tmp_path):
    store = Store.open(tmp_path / "state.db")
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e", clock=Clock())
    publisher.mark_ready()
    yield publisher
    await publisher.close()
    store.close()


async def test_r10_10_the_control_plane_keeps_each_routers_last_unapplied_beside_its_version(publisher):
    first = Unapplied("e", 4, "change e/4 does not follow snapshot e/2", 50.0)
    await publisher.apply_report(Report("ra", 1, 1.0, snapshot=("e", 1), unapplied=first))
    await publisher.apply_report(Report("rb", 1, 1.0, snapshot=("e", 1)))
    routers = {r["router"]: r for r in publisher.routers()}
    assert routers["ra"]["unapplied"] == {"epoch": "e", "version": 4, "reason": first.reason, "at": 50.0}
    assert routers["ra"]["snapshot"] == {"epoch": "e", "version": 1} and routers["rb"]["unapplied"] is None
    # A later report without one (the router restarted under its id) leaves the last one shown.
    await publisher.apply_report(Report("ra", 2, 2.0, snapshot=("e", 1)))
    assert {r["router"]: r for r in publisher.routers()}["ra"]["unapplied"]["version"] == 4
    later = Unapplied("e", 9, "KeyError in the router (see its log)", 60.0)
    await publisher.apply_report(Report("ra", 3, 3.0, snapshot=("e", 1), unapplied=later))
    await publisher.apply_report(Report("ra", 2, 2.5, unapplied=first))  # a late repeat changes nothing
    assert {r["router"]: r for r in publisher.routers()}["ra"]["unapplied"]["version"] == 9
    publisher.report_refused("rc", "report.seq: expected int, got str")
    assert {r["router"]: r for r in publisher.routers()}["rc"]["unapplied"] is None

    text = shown(publisher.routers())
    print(text)
    assert "ra: could not apply version 9 of epoch e at " in text and "KeyError in the router (see its log)" in text
    assert "rb: could not apply" not in text


# -- end to end: a router fed over the socket loses a change -------------------------------------


class LosingRouter(Router):
    """A router that loses the first Change giving up a replica, as if it never came: the next
    Change does not follow the version it holds."""

    def __init__(self):
        super().__init__()
        self.lost: int | None = None

    def apply(self, message) -> None:
        if isinstance(message, Change) and message.abandon and self.lost is None:
            self.lost = message.version
            return
        super().apply(message)


@pytest.fixture
def place():
    # Unix socket paths are limited to about 100 bytes: keep them short.
    directory = Path(tempfile.mkdtemp(prefix="nack-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_r10_10_a_router_fed_a_change_it_cannot_apply_says_so_and_takes_the_snapshot_again(place):
    store = Store.open(place / "state.db")
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e")
    publisher.mark_ready()
    server = FeedServer(publisher, accepting(TOKEN), keepalive=0.2)
    socket = await listen_unix(server, place / FEED_SOCKET, shutdown_timeout=0.5)
    router = LosingRouter()
    client = FeedClient(router, f"unix:{place / FEED_SOCKET}", TOKEN, place / "router", timing=FAST)
    try:
        await client.start()
        await until(lambda: router.snapshot is not None, "the router's first snapshot")
        publisher.abandon("gone-1")  # version 2: lost on the way
        await until(lambda: router.lost == 2, "the change lost")
        publisher.abandon("gone-2")  # version 3 does not follow the router's version 1
        await until(lambda: router.snapshot.version == 3, "the whole snapshot taken again")

        def listed() -> dict:
            return next((r for r in publisher.routers() if r["router"] == client.router_id), {})

        await until(lambda: listed().get("unapplied") and listed()["current"], "the router's report of it")
        entry = listed()
        assert entry["snapshot"] == {"epoch": "e", "version": 3}
        assert entry["unapplied"]["epoch"] == "e" and entry["unapplied"]["version"] == 3
        assert entry["unapplied"]["reason"] == "change e/3 does not follow snapshot e/1"
        text = shown(publisher.routers())
        print(text)
        assert f"{client.router_id}: could not apply version 3 of epoch e at " in text
        assert "change e/3 does not follow snapshot e/1" in text and "version 3 (current)" in text
    finally:
        await client.close()
        await socket.close()
        await publisher.close()
        store.close()


async def test_r10_10_in_one_process_the_local_feed_reports_it_too(tmp_path):
    store = Store.open(tmp_path / "state.db")
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="e")
    router = LosingRouter()
    feed = LocalFeed(publisher, router, interval=3600)  # reports when asked, in this test
    try:
        publisher.mark_ready()
        feed.pump()
        publisher.abandon("gone-1")
        publisher.abandon("gone-2")
        feed.pump()  # version 2 lost, version 3 refused: the feed starts over from the snapshot
        feed.pump()
        assert router.snapshot.version == 3
        await feed.report()
        (entry,) = publisher.routers()
        assert entry["unapplied"]["version"] == 3 and entry["current"]
        assert entry["unapplied"]["reason"] == "change e/3 does not follow snapshot e/1"
    finally:
        await feed.close()
        await publisher.close()
        store.close()
