"""Prefix routing through the real router and the official openai client (R-6.5b-e)."""

from __future__ import annotations

import aiohttp
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
    await EnginePoller(gw.router.balancer, gw.router._forwarder.session).poll_once()
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
