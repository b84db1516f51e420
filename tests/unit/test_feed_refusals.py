"""Reports that no engine figure and no bad report can stop (R-10.8): a real Router behind its FeedClient,
fed by a real FeedPublisher through its FeedServer on a Unix socket, with engine doubles over HTTP."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import tempfile
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import MAX_COUNT, Report, UsageRow, to_wire
from llmgw.control.feed import FeedPublisher
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, listen_unix
from llmgw.keys import create_key
from llmgw.router import Router
from llmgw.router.feedclient import FeedClient, FeedTiming
from llmgw.router.spool import REFUSED_DIR
from tests.unit.routerkit import RouterTestServer, accepting, authorized
from llmgw.store import Store

TOKEN = "llmgw-router.refusals.refusals-test-router-secret"  # the router credential
DEADLINE = 20.0  # a guard against hanging, not a timing assertion
FAST = FeedTiming(report_interval=0.05, snapshot_every=0.05, read_timeout=2.0, backoff_base=0.02, backoff_cap=0.1,
                  sweep_every=0.1)
# What each engine double says it used: (prompt_tokens, completion_tokens).
ENGINES = {"negative": (-5, 3), "huge": (2**64, 2**64), "sane": (7, 11)}
CATALOG = Catalog.build(file_models=[ModelConfig(name=name, profile="p") for name in ENGINES],
                        profiles={"p": ProfileConfig(engine="vllm")}, engines={})


async def until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"still not true after {DEADLINE}s: {what}")
        await asyncio.sleep(0.02)


def usage(store: Store) -> dict[str, tuple[int, int, int]]:
    """model -> (requests, prompt tokens, completion tokens) as the control plane recorded them."""
    rows = store.read_sync(lambda db: list(db["usage"].rows))
    out: dict[str, list[int]] = {}
    for row in rows:
        counts = out.setdefault(row["model"], [0, 0, 0])
        counts[0] += row["requests"]
        counts[1] += row["prompt_tokens"]
        counts[2] += row["completion_tokens"]
    return {model: tuple(c) for model, c in out.items()}


class Gateway:
    """Store, publisher and feed server of a control plane; a Router with its FeedClient; engine doubles."""

    def __init__(self, place: Path, max_report: int | None = None):
        self.place = place
        self.max_report = max_report

    async def __aenter__(self) -> Gateway:
        self.store = Store.open(self.place / "state.db")
        _, self.secret = self.store.write_sync(lambda db: create_key(db, f"alice-{secrets.token_hex(3)}"))
        self.publisher = FeedPublisher(CatalogHolder(CATALOG), self.store, GatewayConfig(), epoch="e")
        self.engines = []
        endpoints = {}
        for model, (prompt, completion) in ENGINES.items():
            async def answer(request, prompt=prompt, completion=completion):
                return web.json_response({"id": "x", "object": "chat.completion", "choices": [],
                                          "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})
            app = web.Application()
            app.router.add_post("/v1/chat/completions", answer)
            engine = TestServer(app)
            await engine.start_server()
            self.engines.append(engine)
            endpoints[model] = [Endpoint(replica_id=f"{model}-1", model=model,
                                         url=str(engine.make_url("")).rstrip("/"), api_key="engine-key")]
        self.publisher.set_endpoints(endpoints)
        self.publisher.mark_ready()
        options = {} if self.max_report is None else {"max_report": self.max_report}
        self.server = FeedServer(self.publisher, accepting(TOKEN), keepalive=0.2, **options)
        self.socket = await listen_unix(self.server, self.place / FEED_SOCKET, shutdown_timeout=0.5)
        self.router = Router()
        self.client = TestClient(RouterTestServer(self.router))
        await self.client.start_server()
        self.feed = FeedClient(self.router.feed, f"unix:{self.place / FEED_SOCKET}", TOKEN, self.place / "router",
                               timing=FAST)
        await self.feed.start()
        await until(lambda: self.router.snapshot is not None, "the router's first snapshot")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.feed.close()
        await self.client.close()
        await self.socket.close()
        for engine in self.engines:
            await engine.close()
        await self.publisher.close()
        self.store.close()

    async def ask(self, model: str) -> None:
        answer = await self.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {self.secret}"},
                                        json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status == 200, await answer.text()


@pytest.fixture
def place():
    # Unix socket paths are limited to about 100 bytes: keep them short.
    directory = Path(tempfile.mkdtemp(prefix="refuse-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_r10_8_engine_token_counts_out_of_range_are_clamped_and_usage_keeps_flowing(place, caplog):
    async with Gateway(place) as gateway:
        await gateway.ask("negative")
        await gateway.ask("huge")
        await until(lambda: set(usage(gateway.store)) == {"negative", "huge"}, "both answers counted")
        await gateway.ask("sane")  # a later report is counted too
        await until(lambda: "sane" in usage(gateway.store), "a later answer counted")
        counted = usage(gateway.store)
        assert counted["negative"] == (1, 0, 3)  # below 0 counts 0
        assert counted["huge"] == (1, MAX_COUNT, MAX_COUNT)  # above the maximum counts the maximum
        assert counted["sane"] == (1, 7, 11)
        await until(lambda: gateway.feed.unacked == 0, "every report acknowledged")
        assert gateway.router.feed.feed_status["refused_reports"] == 0
    said = [r.getMessage() for r in caplog.records if "counted as" in r.getMessage()]
    assert any("usage.prompt_tokens = -5; counted as 0" in line for line in said), said
    assert any(f"usage.completion_tokens = {2**64}; counted as {MAX_COUNT}" in line for line in said), said
    # Rate-limited: the second clamp of prompt_tokens within the minute is not logged again.
    assert sum("usage.prompt_tokens" in line for line in said) == 1


async def test_r10_8_a_report_refused_whole_is_set_aside_and_the_next_ones_go_on(place, caplog):
    async with Gateway(place, max_report=4096) as gateway:
        # A report too large for this control plane (many keys' rows at once): refused as a whole.
        for i in range(200):
            gateway.router.usage.add(f"key-{i:03}", "sane", 1, 1)
        await until(lambda: gateway.router.feed.feed_status["refused_reports"] == 1, "the big report set aside")
        await gateway.ask("sane")
        await until(lambda: "sane" in usage(gateway.store), "the next report counted")
        assert usage(gateway.store)["sane"] == (1, 7, 11)  # the request, not the refused rows
        (kept,) = (place / "router" / REFUSED_DIR).iterdir()
        document = json.loads(kept.read_text())
        assert document["reason"].startswith("413: a report is at most 4096 bytes")
        assert len(document["report"]["usage"]) == 200 and kept.stat().st_mode & 0o777 == 0o600
        status = gateway.router.feed.feed_status
        assert status["last_refusal"]["seq"] == document["report"]["seq"]
        # The feed's state shows on /healthz to a request with a valid key.
        health = await (await gateway.client.get("/healthz", headers={"Authorization": f"Bearer {gateway.secret}"})).json()
        assert health["feed"]["refused_reports"] == 1
        assert any("set aside" in r.getMessage() for r in caplog.records)
    # A restarted router still says what it keeps set aside.
    async with Gateway(place) as again:
        assert again.router.feed.feed_status["refused_reports"] == 1


async def test_r10_8_a_report_with_a_bad_row_gets_the_rest_applied_and_operators_see_it(place):
    async with Gateway(place) as gateway:
        document = {**to_wire(Report(router="refusals/old-router", seq=1, sent_at=1.0,
                                     usage=(UsageRow(3600, "k1", "sane", 2, 10, 5),))),
                    }
        document["usage"].append([3600, "k2", "sane", 1, -5, 0])
        connector = aiohttp.UnixConnector(path=str(place / FEED_SOCKET))
        async with aiohttp.ClientSession(connector=connector) as session:
            auth, _ = await authorized(session, "http://localhost", TOKEN, "POST", "/v1/feed/report")
            async with session.post("http://localhost/v1/feed/report", json=document, headers=auth) as answer:
                assert answer.status == 200
                ack = await answer.json()
            bad = {**document, "seq": 2, "sent_at": "noon"}
            auth, _ = await authorized(session, "http://localhost", TOKEN, "POST", "/v1/feed/report")
            async with session.post("http://localhost/v1/feed/report", json=bad, headers=auth) as answer:
                assert answer.status == 400
                assert "report.sent_at" in (await answer.json())["error"]["message"]
        assert [r["where"] for r in ack["refused"]] == ["report.usage[1]"]
        assert usage(gateway.store)["sane"] == (2, 10, 5)
        (listed,) = [r for r in gateway.publisher.routers() if r["router"] == "refusals/old-router"]
        assert listed["refused"]["reports"] == 1 and listed["refused"]["rows"] == 1
        assert "report.sent_at" in listed["refused"]["last"]


async def test_r10_8_recorded_usage_saturates_at_the_maximum(place):
    async with Gateway(place) as gateway:
        for seq in (1, 2):
            await gateway.publisher.apply_report(Report(router="r", seq=seq, sent_at=1.0,
                                                        usage=(UsageRow(3600, "k", "sane", 1, MAX_COUNT, 1),)))
        assert usage(gateway.store)["sane"] == (2, MAX_COUNT, 2)  # not a float past 2^63
