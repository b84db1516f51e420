"""The router feed in one process (R-10.1): LocalFeed between a FeedPublisher and a Router."""

from __future__ import annotations

import asyncio

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.control.feed import FeedPublisher
from llmgw.keys import create_key
from llmgw.localfeed import LocalFeed
from llmgw.router import Router
from llmgw.store import Store

CATALOG = Catalog.build(file_models=[ModelConfig(name="m", profile="p")], profiles={"p": ProfileConfig(engine="vllm")})


async def test_r10_1_changes_reach_the_router_and_the_last_counts_are_written_on_close(tmp_path):
    store = Store.open(tmp_path / "state.db")
    key, _ = store.write_sync(lambda db: create_key(db, "alice"))
    asked = asyncio.Queue()
    publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), note_demand=asked.put_nowait)
    router = Router()
    feed = LocalFeed(publisher, router.feed, interval=3600)  # no periodic report during the test
    try:
        publisher.mark_ready()
        feed.start()
        publisher.set_endpoints({"m": [Endpoint(replica_id="r1", model="m", url="http://127.0.0.1:9", api_key=None)]})
        for _ in range(100):  # the follower applies the snapshot, then the change, on the loop
            if router.snapshot is not None and router.snapshot.version == 2:
                break
            await asyncio.sleep(0)
        assert router.snapshot.version == 2 and router.balancer.endpoints("m")[0].replica_id == "r1"
        assert router.feed.feed_status["version"] == 2 and router.feed.feed_status["transport"] == "in-process"

        router.feed.note_demand("m")  # what a request for an on-demand model with no replica does
        assert await asyncio.wait_for(asked.get(), 10) == "m"  # reported at once, not at the next tick
        assert feed.seq == 1

        router.usage.add(key.id, "m", 5, 7)
        router.usage.key_used(key.id, 1234.0)
    finally:
        await feed.close()  # the last report: counted before the store closes
        await publisher.close()
    rows = store.read_sync(lambda db: list(db["usage"].rows))
    assert [(r["key_id"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == \
        [(key.id, 1, 5, 7)]
    assert store.read_sync(lambda db: db["api_keys"].get(key.id)["last_used_at"]) == 1234.0
    assert store.read_sync(lambda db: db["router_seq"].get(feed.router_id)["seq"]) == 2
    store.close()
