"""Caps that keep one client or one engine from growing the router's memory or jumping a queue:
a key's waiting requests (R-6.17a), a non-streamed answer's size (R-6.18), a client's `priority` (R-6.19)."""

from __future__ import annotations

import asyncio

import openai
from aiohttp import web

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, ProfileConfig
from llmgw.contracts.endpoints import Endpoint
from tests.integration.test_router_support import (DEADLINE, ENGINES, apoll, catalog, model,  # noqa: F401
                                                   scripted_engine, start_router)

HELLO = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def completion(text: str = "ok") -> dict:
    return {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "usage": USAGE,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


async def test_r6_17a_a_keys_waiting_requests_are_capped_with_a_429(start_router):  # noqa: F811
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(completion())

    one_place = Catalog.build(file_models=[model("m", profile="narrow")],
                              profiles={"narrow": ProfileConfig(engine="vllm", concurrency=1)}, engines=ENGINES)
    async with scripted_engine(chat) as url:
        gw = await start_router(one_place, {"m": [Endpoint("r", "m", url, None)]},
                                gateway=GatewayConfig(max_waiting_per_key=2))
        fairqueue = gw.router.fairqueue
        async with gw.client() as client:
            first = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
            await apoll(lambda: fairqueue.models["m"].held == 1, what="the only place taken")
            waiting = [asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
                       for _ in range(2)]
            await apoll(lambda: fairqueue.waiting().get("m") == 2, what="two requests of the key waiting")
            try:
                await asyncio.wait_for(client.chat.completions.create(model="m", messages=HELLO), DEADLINE)
            except openai.RateLimitError as exc:
                refused = exc
            else:
                raise AssertionError("a third waiting request was queued past gateway.max_waiting_per_key")
            print("past the cap:", refused.message, refused.response.headers.get("retry-after"))
            assert refused.body["code"] == "rate_limit_exceeded"
            assert "2 requests waiting" in refused.message and "gateway.max_waiting_per_key" in refused.message
            assert int(refused.response.headers["retry-after"]) >= 1
            assert fairqueue.waiting().get("m") == 2  # nothing more was held
            release.set()
            answers = await asyncio.gather(first, *waiting)
            assert [a.choices[0].message.content for a in answers] == ["ok"] * 3
            assert fairqueue._waiting_by_key == {}


async def test_r6_18_a_non_streamed_answer_past_max_answer_is_a_502(start_router):  # noqa: F811
    sent = {"bytes": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        document = await request.json()
        size = document["messages"][0]["content"]
        if size == "small":
            return web.json_response(completion("x" * 500))
        if size == "long":  # a Content-Length past the cap: refused before a byte of it is read
            return web.json_response(completion("x" * 5000))
        # Chunked, with no end: the router must stop reading it, not wait to hold all of it.
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while True:
            await response.write(b" " * 65536)
            sent["bytes"] += 65536

    async with scripted_engine(chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]},
                                gateway=GatewayConfig(max_answer=2000))
        async with gw.client() as client:
            answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "small"}])
            assert len(answer.choices[0].message.content) == 500
            for size in ("long", "endless"):
                try:
                    await asyncio.wait_for(
                        client.chat.completions.create(model="m", messages=[{"role": "user", "content": size}]),
                        DEADLINE)
                except openai.APIStatusError as exc:
                    failed = exc
                else:
                    raise AssertionError(f"a {size} answer past gateway.max_answer was relayed")
                print(size, "answer:", failed.status_code, failed.message)
                assert failed.status_code == 502 and failed.body["code"] == "upstream_answer_too_large"
                assert "more than 2000 bytes (gateway.max_answer)" in failed.message
        print("the endless answer had sent", sent["bytes"], "bytes when the router stopped reading")


async def test_r6_19_a_clients_priority_never_reaches_the_engine(start_router):  # noqa: F811
    seen = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(completion())

    async with scripted_engine(chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        async with gw.client() as client:
            await client.chat.completions.create(model="m", messages=HELLO, extra_body={"priority": -1000})
            stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True,
                                                          extra_body={"priority": -1000})
            async for _ in stream:
                pass
    print("the engine saw:", seen)
    assert len(seen) == 2 and all("priority" not in body for body in seen)
    # The rest of the body is as the router makes it for a vLLM stream: usage at the end and in every chunk (R-6.9a).
    assert seen[1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
