"""Streams cut before their usage, answers without usage, and continuous usage (R-6.9, R-6.9a).

The real Router over HTTP, the engine double as vLLM (usage in every chunk when asked) and as
llama-server (usage only at the end), the official openai client closing early a stream that would go on,
as a client that has read enough does.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Limits
from llmgw.keys import KeySettings, create_key, list_keys
from llmgw.router import limits
from llmgw.router.limits import BYTES_PER_TOKEN
from tests.integration.test_router_support import (apoll, catalog, engines, model,  # noqa: F401
                                                   scripted_engine, start_router)

HELLO = [{"role": "user", "content": "one two three"}]  # the double counts 3 prompt tokens
# Tokens the engine would send: at PACE, longer than any test may run, so however slowly the client
# reads its chunks the answer cannot end (usage event included) before the client leaves.
LONG = 1_000_000
READ = 1000  # chunks the client reads before it closes the stream
PACE = 0.001  # seconds between the engine's tokens


@pytest.fixture
def settled(monkeypatch):
    """What each admitted request's reservation settled to (the TPM bucket is charged that)."""
    amounts: list[int] = []
    original = limits.Admission.settle

    def settle(self, used: int) -> None:
        amounts.append(used)
        original(self, used)
    monkeypatch.setattr(limits.Admission, "settle", settle)
    return amounts


@pytest.mark.parametrize("mode,profile,cap,exact", [
    pytest.param("vllm", "p", {"min_tokens": LONG}, True, id="vllm-continuous-usage"),
    pytest.param("llama-server", "llama", {"n_predict": LONG}, False, id="llama-server-estimated"),
])
async def test_r6_9a_a_stream_the_client_cuts_is_recorded_and_settled(engines, start_router, settled,  # noqa: F811
                                                                      mode, profile, cap, exact):
    """The openai client reads 1,000 chunks of an answer that would not end and closes: the request is
    recorded; on vLLM with the exact counts of the last chunk relayed (continuous usage), on
    llama-server with an estimate, marked as such; the key's TPM reservation settles to that."""
    engine = engines.start("m", mode=mode, token_delay=PACE)
    gw = await start_router(catalog(model("m", profile=profile)), {"m": [engine.endpoint()]})
    _, secret = gw.store.write_sync(lambda db: create_key(db, "tight", settings=KeySettings(limits=Limits(tpm=60000))))
    gw.reload_keys()
    async with gw.client(secret) as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True, extra_body=cap)
        seen = 0
        async for chunk in stream:
            assert chunk.usage is None  # the client did not ask for usage
            seen += 1
            if seen == READ:
                break
        await stream.close()
    tight = next(k.id for k in gw.store.read_sync(list_keys) if k.name == "tight")

    async def row():
        await gw.feed.report()
        return next((r for r in await gw.usage_rows() if r["key_id"] == tight), None)
    found = await apoll(row, what="the cut stream's usage row")
    print("row:", found, "settled:", settled)
    assert found["requests"] == 1 and found["unmetered"] == 0
    # The router relayed at least what the client read; the engine's usage event never came.
    assert READ - 2 <= found["completion_tokens"] < LONG
    if exact:
        assert found["prompt_tokens"] == 3 and found["estimated_tokens"] == 0
    else:
        body_size = len(json.dumps({"messages": HELLO, "model": "m", "stream": True, "stream_options": None, **cap}))
        assert abs(found["prompt_tokens"] - body_size // BYTES_PER_TOKEN) <= 20  # the body's bytes / 4
        assert found["estimated_tokens"] == found["prompt_tokens"] + found["completion_tokens"]
    assert settled == [found["prompt_tokens"] + found["completion_tokens"]]


async def _events(gw, body: dict) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {gw.secret}"}) as response:
            raw = (await response.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode,profile", [pytest.param("vllm", "p", id="vllm"),
                                          pytest.param("sglang", "sglang", id="sglang")])
async def test_r6_9a_continuous_usage_reaches_only_a_client_that_asked(engines, start_router, mode, profile):  # noqa: F811
    """The router asks vLLM and SGLang for usage in every chunk; a client that did not ask sees
    its chunks as the engine sends them without it, the usage-only event only if it asked."""
    engine = engines.start("m", mode=mode)
    gw = await start_router(catalog(model("m", profile=profile)), {"m": [engine.endpoint()]})
    base = {"model": "m", "messages": HELLO, "max_tokens": 5, "stream": True}

    plain = await _events(gw, base)
    assert plain and not any("usage" in e for e in plain)
    final = await _events(gw, {**base, "stream_options": {"include_usage": True}})
    assert not any("usage" in e for e in final[:-1])
    assert final[-1]["choices"] == [] and final[-1]["usage"]["completion_tokens"] == 5
    every = await _events(gw, {**base, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all("usage" in e for e in every)
    assert [e["usage"]["completion_tokens"] for e in every if e["choices"]][-1] == 5
    await apoll(lambda: gw.registry.get_sample_value("llmgw_router_tokens_total",
                                                     {"model": "m", "kind": "completion"}) == 15,
                what="every stream counted")


async def test_r6_1_continuous_usage_stats_must_be_a_boolean(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    async with aiohttp.ClientSession() as session, \
            session.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {gw.secret}"},
                         json={"model": "m", "messages": HELLO, "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}) as response:
        document = await response.json()
    assert response.status == 400
    assert document["error"]["param"] == "stream_options.continuous_usage_stats"
    assert engine.counters()["requests"] == 0


async def test_r6_9a_an_answer_without_usage_is_a_request_of_unknown_tokens(start_router):  # noqa: F811
    """An engine whose answer carries no usage: the request counts, its tokens are unknown (null), not 0."""
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]})

    async with scripted_engine(chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        async with gw.client() as client:
            await client.chat.completions.create(model="m", messages=HELLO)

        async def rows():
            await gw.feed.report()
            return await gw.usage_rows() or None
        found = await apoll(rows, what="the usage row")
    assert [(r["requests"], r["unmetered"], r["prompt_tokens"]) for r in found] == [(1, 1, 0)]
    from llmgw.admin.usage import usage_report
    report = gw.store.read_sync(lambda db: usage_report(db, "model", 3600))
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in report["rows"]] == [(1, None, None)]


async def test_r6_9a_a_responses_stream_cut_early_is_counted_from_its_events(engines, start_router):  # noqa: F811
    """A Responses stream (usage only in response.completed) the client leaves early: estimated."""
    engine = engines.start("m", mode="llama-server", token_delay=PACE)
    gw = await start_router(catalog(model("m", profile="llama")), {"m": [engine.endpoint()]})
    async with gw.client() as client:
        stream = await client.responses.create(model="m", input="one two three", max_output_tokens=LONG,
                                               stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == READ:
                break
        await stream.close()

    async def rows():
        await gw.feed.report()
        return await gw.usage_rows() or None
    found = (await apoll(rows, what="the usage row"))[0]
    print("row:", found)
    assert found["requests"] == 1 and READ - 2 <= found["completion_tokens"] < LONG
    assert found["estimated_tokens"] == found["prompt_tokens"] + found["completion_tokens"]


async def test_r6_9b_background_responses_are_refused_unless_the_model_allows_them(engines, start_router):  # noqa: F811
    """`background: true` answers `queued` with no usage, and the later GET counts none: refused
    with a 400 naming the field unless the model sets background_responses: true."""
    import openai

    engine = engines.start("m")
    allowed = engines.start("bg")
    gw = await start_router(catalog(model("m"), model("bg", background_responses=True)),
                            {"m": [engine.endpoint()], "bg": [allowed.endpoint()]})
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="m", input="one two three", background=True)
        answer = await client.responses.create(model="bg", input="one two three", background=True)
        plain = await client.responses.create(model="m", input="one two three", background=False)
    assert refused.value.param == "background" and "background_responses: true" in refused.value.message
    assert engine.counters()["requests"] == 1  # only the request without background reached it
    assert answer.id and plain.id


async def test_sglang_response_store_is_off_unless_the_profile_opts_in(engines, start_router):  # noqa: F811
    """SGLang keeps every stored Response in memory for good: the router sends it `store: false`
    unless the profile sets responses_store: true, as vLLM's store is off unless its env sets it."""
    import openai

    from llmgw.catalog import Catalog
    from llmgw.config import ProfileConfig
    from tests.integration.test_router_support import ENGINES, PROFILES

    plain = engines.start("m", mode="sglang")
    keeps = engines.start("kept", mode="sglang")
    profiles = {**PROFILES, "sglang-store": ProfileConfig(engine="sglang", responses_store=True)}
    cat = Catalog.build(file_models=[model("m", profile="sglang"), model("kept", profile="sglang-store")],
                        profiles=profiles, engines=ENGINES)
    gw = await start_router(cat, {"m": [plain.endpoint()], "kept": [keeps.endpoint()]})
    async with gw.client() as client:
        made = await client.responses.create(model="m", input="one two three")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
        stored = await client.responses.create(model="kept", input="one two three")
        assert (await client.responses.retrieve(stored.id)).id == stored.id


async def test_r6_9a_a_streamed_transcription_asks_vllm_for_usage(engines, start_router):  # noqa: F811
    """A streamed transcription (multipart `stream=true`): vLLM sends usage only when the form has
    `stream_include_usage`; the router adds it and counts it exactly (not estimated)."""
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    async with gw.client() as client:
        stream = await client.audio.transcriptions.create(model="m", file=("a.wav", b"RIFF" + bytes(996), "audio/wav"),
                                                          stream=True)
        events = [event async for event in stream]
    assert events

    async def rows():
        await gw.feed.report()
        return await gw.usage_rows() or None
    found = (await apoll(rows, what="the usage row"))[0]
    assert (found["requests"], found["prompt_tokens"], found["estimated_tokens"]) == (1, 10, 0)
    assert found["completion_tokens"] == 4  # "m heard 1000 bytes", as the double counts it
