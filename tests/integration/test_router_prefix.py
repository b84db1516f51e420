"""Prefix routing through the real router and the official openai client (R-6.5b-e)."""

from __future__ import annotations

import pytest

from llmgw.router.engineload import EnginePoller
from tests.integration.test_router_support import apoll, catalog, engines, model, start_router  # noqa: F401

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
