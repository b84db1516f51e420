"""Usage per key and model from the engines' answers, written in batches (R-6.9)."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import openai
import pytest

from llmgw.keys import list_keys
from tests.integration.test_router_support import (apoll, catalog, engines, model,  # noqa: F401
                                                   scripted_engine, start_router)

HELLO = [{"role": "user", "content": "one two three"}]  # the double counts 3 prompt tokens


async def test_r6_9_usage_rows_for_plain_and_streamed_requests(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    other = gw.key("other")
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=HELLO, max_tokens=5)
        stream = await client.chat.completions.create(model="m", messages=HELLO, max_tokens=7, stream=True)
        async for _ in stream:
            pass
        stream = await client.completions.create(model="m", prompt="a b", max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True})
        async for _ in stream:
            pass
    async with gw.client(other) as client:
        await client.embeddings.create(model="m", input="four words right here")

    keys = {k.name: k.id for k in gw.store.read_sync(list_keys)}

    async def rows():
        found = {(r["key_id"], r["model"]): r for r in await gw.usage_rows()}
        done = found.get((keys["test-0"], "m"), {}).get("requests") == 3 and (keys["other"], "m") in found
        return found if done else None
    found = await apoll(rows, what="usage rows to be written")
    mine = found[(keys["test-0"], "m")]
    assert (mine["prompt_tokens"], mine["completion_tokens"]) == (3 + 3 + 2, 5 + 7 + 4)
    theirs = found[(keys["other"], "m")]
    assert (theirs["requests"], theirs["prompt_tokens"], theirs["completion_tokens"]) == (1, 4, 0)
    assert mine["bucket"] % 3600 == 0


async def _sse_events(gw, body: dict) -> list:
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {gw.secret}"}) as response:
            raw = (await response.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_r6_9_usage_chunk_stripped_when_the_client_did_not_ask(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    events = await _sse_events(gw, {"model": "m", "messages": HELLO, "stream": True})
    assert events and all(e["choices"] for e in events)
    assert not any("usage" in e for e in events)
    # ... yet the router got it from the engine, which sends it only when asked
    await apoll(lambda: gw.registry.get_sample_value("llmgw_router_tokens_total",
                                                     {"model": "m", "kind": "completion"}) == 8,
                what="tokens counted")


async def test_r6_9_usage_chunk_kept_when_the_client_asked(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    events = await _sse_events(gw, {"model": "m", "messages": HELLO, "stream": True,
                                    "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 3
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 8


async def test_r6_9_explicit_include_usage_false_is_stripped(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    events = await _sse_events(gw, {"model": "m", "messages": HELLO, "stream": True,
                                    "stream_options": {"include_usage": False}})
    assert all(e["choices"] for e in events)
    assert gw.registry.get_sample_value("llmgw_router_tokens_total", {"model": "m", "kind": "prompt"}) == 3


async def test_r6_9_usage_event_cut_between_reads_is_still_stripped(start_router):  # noqa: F811
    """An engine whose usage event arrives in two pieces, with `"choices": []` spelt with a space."""
    import asyncio

    from aiohttp import web

    from llmgw.router import Endpoint

    content = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    usage = b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}\n\n'
    cut = usage.index(b"choices") + 3

    async def chat(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in (content, usage[:cut], usage[cut:], b"data: [DONE]\n\n"):
            await response.write(piece)
            await asyncio.sleep(0.02)  # shapes the fault: each piece is its own read at the router
        return response

    async with scripted_engine(chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        events = await _sse_events(gw, {"model": "m", "messages": HELLO, "stream": True})
        assert events == [{"choices": [{"index": 0, "delta": {"content": "hi"}}]}]
        assert gw.registry.get_sample_value("llmgw_router_tokens_total", {"model": "m", "kind": "completion"}) == 6


async def test_r6_1_a_stream_in_another_format_is_relayed_as_it_comes(start_router):  # noqa: F811
    """Not SSE: passed through untouched, and chunk by chunk (the engine waits for the client)."""
    import asyncio

    from aiohttp import web

    from llmgw.router import Endpoint

    client_has_first = asyncio.Event()

    async def chat(request):
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(b'{"n": 1, "choices": []}\n')
        await client_has_first.wait()  # only a relayed, unbuffered stream lets the client get here
        await response.write(b'{"n": 2}\n')
        return response

    async with scripted_engine(chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                                    headers={"Authorization": f"Bearer {gw.secret}"}) as response:
                assert response.content_type == "application/x-ndjson"
                first = await response.content.readline()
                client_has_first.set()
                rest = await response.read()
        assert first == b'{"n": 1, "choices": []}\n' and rest == b'{"n": 2}\n'


def _tokens(gw, model: str = "m") -> tuple[float | None, float | None]:
    return tuple(gw.registry.get_sample_value("llmgw_router_tokens_total", {"model": model, "kind": kind})
                 for kind in ("prompt", "completion"))


@pytest.mark.parametrize("fields,streamed", [
    pytest.param({"stream": True, "stream_options": None}, True, id="stream-options-null"),
    pytest.param({"stream": True, "stream_options": {}}, True, id="stream-options-empty"),
    pytest.param({"stream": True, "stream_options": {"include_usage": False}}, True, id="include-usage-false"),
    pytest.param({"stream": None}, False, id="stream-null"),
    pytest.param({"stream": False, "stream_options": None}, False, id="not-streamed-options-null"),
])
async def test_r6_9_every_accepted_stream_spelling_is_counted(engines, start_router, fields, streamed):  # noqa: F811
    """Streamed or not, the client's tokens are counted; the usage event reaches it only if it asked."""
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    body = {"model": "m", "messages": HELLO, **fields}
    if streamed:
        events = await _sse_events(gw, body)
        assert events and all(e["choices"] for e in events)
    else:
        async with aiohttp.ClientSession() as session, \
                session.post(gw.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {gw.secret}"}) as response:
            assert response.content_type == "application/json"
            assert (await response.json())["usage"]["completion_tokens"] == 8
    await apoll(lambda: _tokens(gw) == (3, 8), what="tokens counted")
    rows = await apoll(gw.usage_rows, what="usage row written")
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, 3, 8)]


async def test_r6_9_openai_client_with_stream_options_none_is_counted(engines, start_router):  # noqa: F811
    """The official client sends `"stream_options": null` when given None."""
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True,
                                                      stream_options=None)
        chunks = [c async for c in stream]
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    await apoll(lambda: _tokens(gw) == (3, 8), what="tokens counted")


@pytest.mark.parametrize("fields,param,fragment", [
    pytest.param({"stream": 1}, "stream", "got a number", id="stream-number"),
    pytest.param({"stream": "true"}, "stream", "got a string", id="stream-string"),
    pytest.param({"stream": {}}, "stream", "got an object", id="stream-object"),
    pytest.param({"stream": True, "stream_options": "include_usage"}, "stream_options", "got a string",
                 id="stream-options-string"),
    pytest.param({"stream": True, "stream_options": [True]}, "stream_options", "got an array",
                 id="stream-options-array"),
    pytest.param({"stream_options": {"include_usage": True}}, "stream_options", "'stream' is true",
                 id="stream-options-without-stream"),
    pytest.param({"stream": False, "stream_options": {}}, "stream_options", "'stream' is true",
                 id="stream-options-with-stream-false"),
    pytest.param({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage",
                 "got a string", id="include-usage-string"),
    pytest.param({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
                 "got a number", id="include-usage-number"),
    pytest.param({"stream": True, "stream_options": {"include_usage": None}}, "stream_options.include_usage",
                 "got null", id="include-usage-null"),
])
async def test_r6_1_malformed_stream_fields_are_400_naming_the_field(engines, start_router,  # noqa: F811
                                                                     fields, param, fragment):
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    async with aiohttp.ClientSession() as session, \
            session.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": HELLO, **fields},
                         headers={"Authorization": f"Bearer {gw.secret}"}) as response:
        document = await response.json()
    assert response.status == 400
    error = document["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert f"'{param.rpartition('.')[2]}'" in error["message"] and fragment in error["message"]
    assert engine.counters()["requests"] == 0  # refused before any engine saw it


async def test_r6_1_openai_client_sees_the_field_of_a_malformed_stream(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint()]})
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=HELLO, extra_body={"stream": "true"})
        with pytest.raises(openai.BadRequestError) as without_stream:
            await client.chat.completions.create(model="m", messages=HELLO,
                                                 stream_options={"include_usage": True})
    assert (refused.value.param, refused.value.code) == ("stream", "invalid_type")
    assert without_stream.value.param == "stream_options"
    assert engine.counters()["requests"] == 0

# A chat stream that reports usage (4 + 6 tokens), event by event.
USAGE_STREAM = [b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}\n\n',
                b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}\n\n',
                b"data: [DONE]\n\n"]


async def _start_chunked_stream(reader, writer) -> None:
    """Read one request, then answer the head of a chunked event stream (raw HTTP: the tests
    decide how the body ends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")


async def test_r6_9_usage_reported_before_the_engine_drops_the_stream_is_counted(start_router):  # noqa: F811
    """llama-server may close its connection after the last event without ending the chunked body:
    the usage event it sent before is still counted."""
    import asyncio

    from llmgw.router import Endpoint


    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _start_chunked_stream(reader, writer)
        for event in USAGE_STREAM:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.transport.abort()  # no final zero-length chunk

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", f"http://127.0.0.1:{port}", None)]})
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {gw.secret}"},
                                    json={"model": "m", "messages": HELLO, "stream": True,
                                          "stream_options": {"include_usage": True}}) as response:
                body = b""
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for piece in response.content.iter_any():
                        body += piece
        assert b'"completion_tokens": 6' in body
        rows = await apoll(lambda: gw.usage_rows(), what="a usage row")
        assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(4, 6)]
    finally:
        server.close()
        await server.wait_closed()


async def test_r6_9_usage_relayed_before_the_client_leaves_is_counted(start_router):  # noqa: F811
    """The openai client closes its connection right after `data: [DONE]`; an engine that has not
    yet ended its body by then (llama-server, at times) must not make the usage go uncounted."""
    import asyncio

    from llmgw.router import Endpoint


    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _start_chunked_stream(reader, writer)
        for event in USAGE_STREAM:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        await asyncio.sleep(3)  # the body's end comes late
        writer.write(b"0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", f"http://127.0.0.1:{port}", None)]})
        async with gw.client() as client:
            stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage.completion_tokens == 6
        rows = await apoll(lambda: gw.usage_rows(), what="a usage row")
        assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(4, 6)]
    finally:
        server.close()
        await server.wait_closed()
