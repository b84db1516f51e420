"""Prefix routing through the real router and the official openai client (R-6.5b-e)."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgw.router import Endpoint, balancer
from llmgw.router.engineload import EnginePoller
from tests.integration.test_router_support import (apoll, catalog, engines, model, scripted_engine,  # noqa: F401
                                                   start_router)

SYSTEM = "You answer questions about the tax code of a small country. " * 30  # 1,830 bytes: a long one
SHORT_SYSTEM = "You answer questions about the tax code of a small country. " * 10  # 610 bytes


def served_by(doubles, before) -> str:
    after = {d.name + str(d.port): d.counters()["requests"] for d in doubles}
    moved = [name for name, count in after.items() if count != before[name]]
    assert len(moved) == 1, after
    return moved[0]


def counts(doubles) -> dict[str, int]:
    return {d.name + str(d.port): d.counters()["requests"] for d in doubles}


@pytest.fixture
async def prefix_gateway(engines, start_router):  # noqa: F811
    doubles = [engines.start("m") for _ in range(3)]
    endpoints = {"m": [d.endpoint(replica_id=f"m-{i}") for i, d in enumerate(doubles)]}
    gw = await start_router(catalog(model("m", routing="prefix")), endpoints)
    return gw, doubles


async def _homes(client, doubles, system: str) -> dict[int, str]:
    """conversation -> the engine all its turns reached (each conversation must stay on one)."""
    homes = {}
    for conversation in range(6):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"question {conversation}: what is the VAT rate?"}]
        seen = set()
        for turn in range(3):
            before = counts(doubles)
            answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            seen.add(served_by(doubles, before))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"and turn {turn}?"}]
        assert len(seen) == 1, f"conversation {conversation} went to {seen}"
        homes[conversation] = seen.pop()
    print("conversation -> engine:", homes)
    return homes


async def test_r6_5b_turns_of_a_conversation_reach_one_engine(prefix_gateway):
    gw, doubles = prefix_gateway
    homes = await _homes(gw.client(), doubles, SHORT_SYSTEM)
    assert len(set(homes.values())) > 1  # conversations are spread over the replicas


async def test_r6_5c_conversations_sharing_a_long_system_prompt_reach_one_engine(prefix_gateway):
    gw, doubles = prefix_gateway
    homes = await _homes(gw.client(), doubles, SYSTEM)
    assert len(set(homes.values())) == 1  # where that prompt is cached


async def test_r6_5c_explicit_key_wins_over_content(prefix_gateway):
    gw, doubles = prefix_gateway
    client = gw.client()
    seen = set()
    for i in range(5):
        before = counts(doubles)
        await client.chat.completions.create(model="m", max_tokens=2, extra_headers={"X-Session-ID": "s-42"},
                                             messages=[{"role": "user", "content": f"unrelated {i}"}])
        seen.add(served_by(doubles, before))
    assert len(seen) == 1


async def test_r6_5c_prompt_cache_key_from_the_openai_client_keeps_a_tenant_on_one_engine(prefix_gateway):
    """The client's `prompt_cache_key`, as its own argument or in extra_body, reaches the key rule."""
    gw, doubles = prefix_gateway
    client = gw.client()
    homes = {}
    for tenant in range(6):
        seen = set()
        for i in range(4):
            before = counts(doubles)
            messages = [{"role": "user", "content": f"tenant {tenant}, unrelated question {i}"}]
            if i % 2:
                await client.chat.completions.create(model="m", max_tokens=2, messages=messages,
                                                     prompt_cache_key=f"tenant-{tenant}")
            else:
                await client.chat.completions.create(model="m", max_tokens=2, messages=messages,
                                                     extra_body={"prompt_cache_key": f"tenant-{tenant}"})
            seen.add(served_by(doubles, before))
        assert len(seen) == 1, f"tenant {tenant} went to {seen}"
        homes[tenant] = seen.pop()
    print("tenant -> engine:", homes)
    assert len(set(homes.values())) > 1  # the tenants are spread over the replicas


async def test_r6_5e_router_polls_engine_load_with_the_key(prefix_gateway):
    gw, doubles = prefix_gateway
    # The background poll runs once a second; one poll by hand makes the test independent of it.
    await EnginePoller(gw.router.balancer, gw.router.dispatch.forwarder.session).poll_once()
    for i in range(3):
        load = gw.router.engine_load(f"m-{i}")
        assert load is not None and load.source == "vllm"
        assert load.running == 0 and load.waiting is None and load.kv_cache is None  # the double says no more


# -- the live-key table: whose keys, which requests, how many (R-6.5b, R-6.5c) ---------------------

async def test_r6_5b_a_key_is_homed_only_by_an_inference_request_its_engine_accepted(start_router, monkeypatch):  # noqa: F811
    async def answer(request: web.Request) -> web.Response:
        document = await request.json()
        if document.get("max_tokens") == 0:  # the engine refuses this one
            return web.json_response({"error": {"message": "max_tokens must be at least 1"}}, status=400)
        return web.json_response({"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    monkeypatch.setattr(balancer, "KEYS_PER_API_KEY", 3)
    async with scripted_engine(answer, "/{tail:.*}") as one, scripted_engine(answer, "/{tail:.*}") as two:
        gw = await start_router(catalog(model("m", profile="custom", routing="prefix")),
                                {"m": [Endpoint("m-0", "m", one, None), Endpoint("m-1", "m", two, None)]})
        other = gw.key("other-tenant", ["m"])

        async def send(path: str, body: dict, secret: str | None = None) -> int:
            async with aiohttp.ClientSession() as session, \
                    session.post(gw.url + path, json={"model": "m", **body},
                                 headers={"Authorization": f"Bearer {secret or gw.secret}"}) as response:
                return response.status

        def live() -> int:
            return sum(gw.router.balancer.live_keys("m").values())

        # refused by the engine, or a route that does not run the model: no home
        assert await send("/v1/chat/completions", {"prompt_cache_key": "c", "max_tokens": 0, "messages": []}) == 400
        assert await send("/tokenize", {"prompt_cache_key": "t", "prompt": "x"}) == 200
        assert await send("/v1/messages/count_tokens", {"user": "u", "messages": []}) == 200
        assert live() == 0
        # accepted: homed; the same string of another tenant is another key
        assert await send("/v1/chat/completions", {"prompt_cache_key": "c", "messages": []}) == 200
        assert live() == 1
        assert await send("/v1/chat/completions", {"prompt_cache_key": "c", "messages": []}, other) == 200
        assert live() == 2
        # one API key homes at most KEYS_PER_API_KEY keys; past it, served all the same, homing nothing
        for n in range(5):
            assert await send("/v1/chat/completions", {"prompt_cache_key": f"many-{n}", "messages": []}) == 200
        assert live() == 2 + 2  # its "c" and two of the five
        assert await send("/v1/chat/completions", {"prompt_cache_key": "c2", "messages": []}, other) == 200
        assert live() == 5  # the other tenant still has room


async def test_r6_5d_turns_alternating_between_two_routers_reach_one_engine(engines):  # noqa: F811
    """Two routers fed by one control plane, each conversation's turns sent to them in turn. Each
    router alone would place the keys it saw first by its own counts, so some conversations would
    reach both engines; with the homes table shared, the second router sends a key where the first
    homed it, once the feed version carrying that home has reached it (the test waits for it)."""
    import tempfile

    from llmgw.catalog import CatalogHolder
    from llmgw.config import GatewayConfig
    from llmgw.control.feed import FeedPublisher
    from llmgw.keys import create_key
    from llmgw.localfeed import LocalFeed
    from llmgw.router import Router
    from llmgw.store import Store

    doubles = [engines.start("m") for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(f"{tmp}/state.db")
        _, secret = store.write_sync(lambda db: create_key(db, "two-routers"))
        publisher = FeedPublisher(CatalogHolder(catalog(model("m", routing="prefix"))), store, GatewayConfig())
        publisher.set_endpoints({"m": [d.endpoint(replica_id=f"m-{i}") for i, d in enumerate(doubles)]})
        publisher.mark_ready()
        routers, feeds, runners, clients = [], [], [], []
        try:
            for _ in range(2):
                router = Router()
                feed = LocalFeed(publisher, router.feed)
                feed.pump()
                feed.start()
                runner = router.runner()
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                routers.append(router)
                feeds.append(feed)
                runners.append(runner)
                clients.append(openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                                                  api_key=secret, max_retries=0))
            # Router 1 alone has homed five keys (3 / 2): on its own counts it would place a new
            # key off a full ring owner where router 0, knowing none of them, would not.
            for warm in range(5):
                await clients[1].chat.completions.create(model="m", max_tokens=4, messages=[
                    {"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": f"earlier {warm}"}])
            await apoll(lambda: len((routers[0].snapshot.homes or {}).get("m", {})) == 5, 10,
                        "router 1's homes to reach router 0")
            reached: dict[int, set[str]] = {}
            for conversation in range(12):
                messages = [{"role": "system", "content": SHORT_SYSTEM},
                            {"role": "user", "content": f"question {conversation}: what is the VAT rate?"}]
                seen = reached[conversation] = set()
                for turn in range(4):
                    at = (conversation + turn) % 2  # the first turn at router 0 or 1, then each in turn
                    before = counts(doubles)
                    answer = await clients[at].chat.completions.create(model="m", messages=messages, max_tokens=4)
                    seen.add(served_by(doubles, before))
                    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                                 {"role": "user", "content": f"and turn {turn}?"}]
                    if turn == 0:  # the home the first router reported, in the other router's snapshot
                        other = routers[1 - at]
                        await apoll(lambda: len((other.snapshot.homes or {}).get("m", {})) == 5 + conversation + 1,
                                    10, "the home to reach the other router through the feed")
            print("conversation -> engines:", reached)
            assert all(len(seen) == 1 for seen in reached.values()), reached
            assert len({next(iter(seen)) for seen in reached.values()}) == 2  # both engines have homes
            table = publisher.current().homes["m"]
            for router in routers:  # every router's table is the control plane's
                mine = {point: entry[0].replica_id for point, entry in router.balancer._pools["m"].homes.items()}
                assert mine == dict(table)
        finally:
            for runner in runners:
                await runner.cleanup()
            for feed in feeds:
                await feed.close()
            await publisher.close()
            for router in routers:
                await router.close()
            store.close()


async def test_r6_5c_completions_sharing_a_prefix_shorter_than_the_old_key_reach_one_engine(prefix_gateway):
    """The shape of vLLM's `prefix_repetition` bench on a small vocabulary: prompts of a shared
    prefix of about 1.9 KB and a suffix of their own, through the router with the openai client.
    With a 2 KiB key each prompt had a key of its own and every prefix reached every engine."""
    import random

    gw, doubles = prefix_gateway
    client = gw.client()
    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghij") for _ in range(2)) for _ in range(512)]
    prefixes = ["".join(rng.choice(words) for _ in range(950)) for _ in range(4)]
    reached: dict[int, set[str]] = {i: set() for i in range(len(prefixes))}
    for _ in range(4):
        for i, prefix in enumerate(prefixes):
            before = counts(doubles)
            await client.completions.create(model="m", max_tokens=2,
                                            prompt=prefix + "".join(rng.choice(words) for _ in range(64)))
            reached[i].add(served_by(doubles, before))
    print("prefix -> engines:", reached)
    assert all(len(engines_) == 1 for engines_ in reached.values()), reached
