"""Following one request (R-6.20), the router's side: X-Request-Id on every answer, in error bodies
and sent to the engine; the record each request leaves in the router's reports and request-log file.

The real Router over HTTP, engine doubles as local processes (their `request_ids` knob notes each
X-Request-Id they were sent), scripted aiohttp engines where a test needs an engine to cut a
stream or show every header it got. Records are read as the control plane gets them: from the
reports the in-process feed hands to the publisher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, ProfileConfig, RequestLogConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Limits, RequestRecord, request_record_from_wire
from llmgw.keys import KeySettings, create_key
from tests.integration.test_router_support import (ENGINES, PROFILES, apoll, catalog, model,  # noqa: F401
                                                   scripted_engine, shared_engines, start_router)

HELLO = [{"role": "user", "content": "one two three"}]  # the double counts 3 prompt tokens
CHAT = "/v1/chat/completions"
ID = "X-Request-Id"


class Reported:
    """The request-log records this router's reports carried to the publisher, by id."""

    def __init__(self, gw):
        self.gw = gw
        self.records: list[RequestRecord] = []
        apply = gw.publisher.apply_report

        async def taking(report, *args):
            self.records.extend(report.requests)
            return await apply(report, *args)
        gw.publisher.apply_report = taking

    async def by_id(self) -> dict[str, RequestRecord]:
        await self.gw.feed.report()
        return {r.id: r for r in self.records}


@pytest.fixture(scope="module")
def doubles(shared_engines):  # noqa: F811
    """Engine doubles for the module: `m` (two of them, one answering 503 to everything), `small`."""
    noted = shared_engines.directory

    def start(name: str, **knobs):
        return shared_engines.start(name, request_ids=str(noted / f"ids-{name}-{len(shared_engines.started)}"),
                                    **knobs)
    return {"m": start("m"), "failing": start("m", fail_requests=True), "small": start("small"),
            "slow": start("slow", token_delay=0.05)}


def ids_seen(engine) -> list[str]:
    """The X-Request-Id of each request the double was sent, in order."""
    path = Path(engine.knobs["request_ids"])
    return [line.split(" ", 2)[2] for line in path.read_text().splitlines()] if path.exists() else []


def with_node(endpoint: Endpoint, node: str) -> Endpoint:
    return dataclasses.replace(endpoint, node=node)


def auth(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


# -- the id on every answer ----------------------------------------------------------------------


async def _cut_stream(request: web.Request) -> web.StreamResponse:
    """An engine that sends the head of a stream and one event, then drops the connection."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"cut",'
                         b'"choices":[{"index":0,"delta":{"content":"par"},"finish_reason":null}]}\n\n')
    request.transport.close()
    return response


async def test_r6_20_every_answer_names_its_request_in_header_body_and_record(doubles, start_router):  # noqa: F811
    async with scripted_engine(_cut_stream) as cut_url:
        gw = await start_router(catalog(model("m"), model("down"), model("cut", profile="custom")),
                                {"m": [with_node(doubles["m"].endpoint("m-r0"), "gpu-a")],
                                 "cut": [Endpoint("cut-r0", "cut", cut_url, None)]})
        reported = Reported(gw)
        _, tight = gw.store.write_sync(lambda db: create_key(db, "tight", settings=KeySettings(limits=Limits(rpm=1))))
        gw.reload_keys()
        answers = {}  # kind -> (status, X-Request-Id, body)
        async with aiohttp.ClientSession() as session:
            async def ask(kind, method, path, secret=gw.secret, **kw):
                async with session.request(method, gw.url + path, headers=auth(secret), **kw) as response:
                    body = b""
                    try:
                        while chunk := await response.content.readany():
                            body += chunk
                    except aiohttp.ClientPayloadError:  # a stream cut mid-way ends so
                        pass
                    answers[kind] = (response.status, response.headers.get(ID), body)

            await ask("plain", "POST", CHAT, json={"model": "m", "messages": HELLO})
            await ask("stream", "POST", CHAT, json={"model": "m", "messages": HELLO, "stream": True})
            await ask("models", "GET", "/v1/models")
            await ask("bad-json", "POST", CHAT, data=b"{not json")
            await ask("wrong-key", "POST", CHAT, secret="sk-llmgw-wrong", json={"model": "m", "messages": HELLO})
            await ask("no-model", "POST", CHAT, json={"model": "nope", "messages": HELLO})
            await ask("no-route", "GET", "/v1/nothing-here")
            await ask("anthropic", "POST", "/v1/messages", json={"model": "nope", "max_tokens": 3, "messages": HELLO})
            await ask("first", "POST", CHAT, secret=tight, json={"model": "m", "messages": HELLO})
            await ask("limited", "POST", CHAT, secret=tight, json={"model": "m", "messages": HELLO})
            await ask("no-capacity", "POST", CHAT, json={"model": "down", "messages": HELLO})
            await ask("cut", "POST", CHAT, json={"model": "cut", "messages": HELLO, "stream": True})
        records = await reported.by_id()

    expected = {"plain": (200, None), "stream": (200, None), "models": (200, None), "first": (200, None),
                "bad-json": (400, "invalid_request"), "wrong-key": (401, "invalid_api_key"),
                "no-model": (404, "model_not_found"), "no-route": (404, "not_found"),
                "anthropic": (404, "model_not_found"), "limited": (429, "rate_limit_exceeded"),
                "no-capacity": (503, "no_capacity"), "cut": (200, "upstream_interrupted")}
    assert {kind: (status, records[rid].error) for kind, (status, rid, _) in answers.items()} == expected
    assert len({rid for _, rid, _ in answers.values()}) == len(answers)  # one id each
    for kind, (status, rid, body) in answers.items():
        assert records[rid].status == status, kind
        if status >= 400 and kind != "anthropic":
            assert json.loads(body)["error"]["request_id"] == rid, kind  # OpenAI's shape
    assert json.loads(answers["anthropic"][2])["request_id"] == answers["anthropic"][1]  # Anthropic's: top level
    cut = answers["cut"]
    assert b'"code": "upstream_interrupted"' in cut[2] and cut[1].encode() in cut[2]  # the cut's event names it
    assert records[cut[1]].stream and records[cut[1]].replica == "cut-r0"
    assert records[answers["wrong-key"][1]].key is None and records[answers["plain"][1]].key == "test-0"
    assert records[answers["no-route"][1]].route == "GET /v1/nothing-here"
    assert records[answers["models"][1]].route == "GET /v1/models" and records[answers["models"][1]].model is None
    assert records[answers["no-capacity"][1]].model == "down" and records[answers["no-capacity"][1]].replica is None
    unknown = records[answers["no-model"][1]]
    assert unknown.model is None and unknown.asked == "nope"  # a name no model has: what was asked, never resolved


async def test_r6_20_the_clients_id_goes_to_the_engine_unchanged_and_an_unusable_one_is_replaced(
        doubles, start_router):  # noqa: F811
    engine = doubles["m"]
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint("m-r0")]})
    reported = Reported(gw)
    usable = "Client_id-1.2:3"
    unusable = {"spaces": "not usable here", "too-long": "a" * 129, "empty": ""}
    answered = {}
    async with aiohttp.ClientSession() as session:
        for kind, sent in [("usable", usable), *unusable.items()]:
            async with session.post(gw.url + CHAT, json={"model": "m", "messages": HELLO},
                                    headers={**auth(gw.secret), ID: sent}) as response:
                assert response.status == 200
                answered[kind] = response.headers[ID]
    records = await reported.by_id()
    assert answered["usable"] == usable and usable in ids_seen(engine)
    assert records[usable].client_request_id is None
    for kind, sent in unusable.items():
        made = answered[kind]
        assert made != sent and made in ids_seen(engine), kind  # the router's own id went to the engine
        assert records[made].client_request_id == sent[:128], kind
    assert not any(sent in ids_seen(engine) for sent in unusable.values() if sent)


# -- what a record says ------------------------------------------------------------------------------


async def test_r6_20_records_of_a_plain_request_and_a_stream(doubles, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": [with_node(doubles["m"].endpoint("m-r0"), "gpu-a")]})
    reported = Reported(gw)
    async with gw.client() as client:
        plain = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO)
        stream = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO, stream=True)
        async for _ in stream.parse():
            pass
    records = await reported.by_id()
    first, second = records[plain.headers[ID]], records[stream.headers[ID]]
    common = dict(route="POST /v1/chat/completions", status=200, key="test-0", model="m", asked=None,
                  replica="m-r0", node="gpu-a", error=None, attempts=1, fallback=None, queued=None,
                  prompt_tokens=3, client="127.0.0.1", client_request_id=None)
    for record in (first, second):
        assert {name: getattr(record, name) for name in common} == common
        assert 0 < record.ttfb <= record.duration
    assert (first.stream, first.completion_tokens, first.estimated) == (False, 8, False)
    assert (second.stream, second.completion_tokens, second.estimated) == (True, 8, False)
    assert first.at <= second.at and first.ttfb == first.duration  # a whole answer goes at once


async def test_r6_20_record_of_a_request_retried_elsewhere_names_both_attempts(doubles, start_router):  # noqa: F811
    """Two requests over a failing engine and a live one: round-robin tries the failing one first
    for one of them, which the live one then answers; both engines were sent that request's id."""
    failing, live = doubles["failing"], doubles["m"]
    gw = await start_router(catalog(model("m")), {"m": [failing.endpoint("m-failing"),
                                                        with_node(live.endpoint("m-live"), "gpu-b")]})
    gw.router.balancer.eject_seconds = 3600
    reported = Reported(gw)
    async with gw.client() as client:
        answers = [await client.chat.completions.with_raw_response.create(model="m", messages=HELLO) for _ in range(2)]
    records = await reported.by_id()
    ours = [records[a.headers[ID]] for a in answers]
    retried = [r for r in ours if r.attempts == 2]
    assert len(retried) == 1 and all(r.attempts == 1 for r in ours if r not in retried)
    assert (retried[0].status, retried[0].replica, retried[0].node, retried[0].error) == (200, "m-live", "gpu-b", None)
    assert retried[0].id in ids_seen(failing) and retried[0].id in ids_seen(live)  # the same id, every attempt


async def test_r6_20_record_of_a_fallback_and_of_an_alias(doubles, start_router):  # noqa: F811
    from llmgw.catalog import Alias

    cat = Catalog.build(file_models=[model("big", fallback="small"), model("small")], profiles=PROFILES,
                        engines=ENGINES, aliases=[Alias("chat", "big", "file")])
    gw = await start_router(cat, {"small": [doubles["small"].endpoint("small-r0")]})
    reported = Reported(gw)
    async with gw.client() as client:
        answer = await client.chat.completions.with_raw_response.create(model="chat", messages=HELLO)
    record = (await reported.by_id())[answer.headers[ID]]
    assert (record.model, record.asked, record.fallback, record.replica, record.attempts) == \
        ("big", "chat", "small", "small-r0", 1)


async def test_r6_20_a_request_that_waited_for_a_place_says_how_long(doubles, start_router):  # noqa: F811
    profiles = {**PROFILES, "one": ProfileConfig(engine="vllm", concurrency=1)}
    cat = Catalog.build(file_models=[model("slow", profile="one")], profiles=profiles, engines=ENGINES)
    gw = await start_router(cat, {"slow": [doubles["slow"].endpoint("slow-r0")]})
    reported = Reported(gw)
    async with gw.client() as client:
        # The first holds the one place, streaming, while the second is sent: it must wait for it.
        async with client.chat.completions.with_streaming_response.create(
                model="slow", messages=HELLO, max_tokens=10, stream=True) as first:
            lines = first.iter_lines()
            await anext(lines)  # its first event: it runs on the engine now
            second = asyncio.ensure_future(client.chat.completions.with_raw_response.create(
                model="slow", messages=HELLO, max_tokens=10))
            await asyncio.sleep(0.2)
            async for _ in lines:
                pass
        ids = [first.headers[ID], (await second).headers[ID]]
    records = await reported.by_id()
    assert records[ids[0]].queued is None and records[ids[1]].queued > 0  # the second waited for the place


# -- how much is kept, and where ---------------------------------------------------------------------


async def test_r6_20_sampling_and_turning_off_apply_as_the_feed_changes_them(doubles, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": [doubles["m"].endpoint("m-r0")]},
                            gateway=GatewayConfig(request_log=RequestLogConfig(sample=0.0)))
    reported = Reported(gw)

    async def some(n: int) -> list[str]:
        async with gw.client() as client:
            return [(await client.chat.completions.with_raw_response.create(model="m", messages=HELLO)).headers[ID]
                    for _ in range(n)]

    unsampled = await some(5)
    gw.publisher.set_gateway(GatewayConfig(request_log=RequestLogConfig(enabled=False)))
    gw.feed.pump()
    off = await some(3)
    gw.publisher.set_gateway(GatewayConfig())
    gw.feed.pump()
    on = await some(2)
    records = await reported.by_id()
    assert all(unsampled) and all(off)  # the ids are there, records or not
    assert set(records) == set(on)


async def test_r6_20_records_are_appended_to_the_file_as_json_lines(doubles, start_router, tmp_path):  # noqa: F811
    path = tmp_path / "logs" / "requests.jsonl"
    path.parent.mkdir()
    gw = await start_router(catalog(model("m")), {"m": [doubles["m"].endpoint("m-r0")]},
                            gateway=GatewayConfig(request_log=RequestLogConfig(path=str(path))))
    reported = Reported(gw)
    async with gw.client() as client:
        ids = [(await client.chat.completions.with_raw_response.create(model="m", messages=HELLO)).headers[ID]
               for _ in range(3)]

    def lines():
        return path.read_text().splitlines() if path.exists() else []
    await apoll(lambda: len(lines()) == 3, what="three lines in the request log's file")
    written = [request_record_from_wire(json.loads(line), "line") for line in lines()]
    assert [r.id for r in written] == ids
    records = await reported.by_id()
    assert written == [records[i] for i in ids]  # the same records the control plane gets
    assert path.stat().st_mode & 0o077 == 0  # records name keys and clients: the file is private


async def test_r6_20_a_file_that_cannot_be_opened_is_logged_once_and_nothing_else_fails(doubles, start_router,  # noqa: F811
                                                                                          tmp_path, caplog):
    caplog.set_level(logging.WARNING, "llmgw.router.requestlog")
    path = tmp_path / "no-such-directory" / "requests.jsonl"
    gw = await start_router(catalog(model("m")), {"m": [doubles["m"].endpoint("m-r0")]},
                            gateway=GatewayConfig(request_log=RequestLogConfig(path=str(path))))
    reported = Reported(gw)
    async with gw.client() as client:
        ids = []
        for _ in range(2):
            ids.append((await client.chat.completions.with_raw_response.create(model="m", messages=HELLO)).headers[ID])
            await apoll(lambda: "cannot open it" in caplog.text, what="the file's failure in the log")
    warned = [r for r in caplog.records if "cannot open it" in r.getMessage()]
    assert len(warned) == 1 and "No such file or directory" in warned[0].getMessage()
    assert str(path) in warned[0].getMessage()
    assert set(ids) <= set(await reported.by_id())  # the reports go on


# -- the hooks a tracer hangs its spans on ---------------------------------------------------------


class RecordingSpan:
    def __init__(self):
        self.calls = []

    def __getattr__(self, hook):
        def note(*args):
            self.calls.append(hook)
            return {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"} \
                if hook == "attempt_start" else None
        return note


async def test_r6_20_a_tracers_span_is_told_each_step_and_its_headers_reach_the_engine(start_router):  # noqa: F811
    seen = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.copy())
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
                             b"data: [DONE]\n\n")
        return response

    async with scripted_engine(answer) as url:
        gw = await start_router(catalog(model("m", profile="custom")), {"m": [Endpoint("r", "m", url, None)]})
        spans = []
        gw.router.tracer = lambda request, trail, pattern: spans.append(RecordingSpan()) or spans[-1]
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + CHAT, headers={**auth(gw.secret), ID: "traced-1"},
                                    json={"model": "m", "messages": HELLO, "stream": True}) as response:
                assert response.status == 200
                await response.read()
    assert spans[0].calls == ["attempt_start", "first_byte", "answered", "stream_end", "attempt_end", "finish"]
    assert seen[0]["traceparent"].startswith("00-0af7") and seen[0][ID] == "traced-1"


async def test_r6_20_a_client_that_leaves_is_recorded_so(doubles, start_router):  # noqa: F811
    """Before its answer: 499 (nothing was sent), `client_closed`; in the middle of a stream: 200,
    `client_closed`, with its first byte's time."""
    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    async with scripted_engine(stuck) as url:
        gw = await start_router(catalog(model("slow"), model("stuck", profile="custom")),
                                {"slow": [doubles["slow"].endpoint("slow-r0")], "stuck": [Endpoint("s", "stuck", url, None)]})
        reported = Reported(gw)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(gw.url + CHAT, json={"model": "stuck", "messages": HELLO},
                                   headers={**auth(gw.secret), ID: "leaves-early"},
                                   timeout=aiohttp.ClientTimeout(total=0.5))
            async with session.post(gw.url + CHAT, json={"model": "slow", "messages": HELLO, "stream": True,
                                                         "max_tokens": 400},
                                    headers={**auth(gw.secret), ID: "leaves-midway"}) as response:
                assert await response.content.readany()
                response.close()

        async def both():
            records = await reported.by_id()
            return records if {"leaves-early", "leaves-midway"} <= set(records) else None
        records = await apoll(both, what="the records of both requests")
        release.set()
    early, midway = records["leaves-early"], records["leaves-midway"]
    assert (early.status, early.error, early.ttfb, early.replica, early.stream) == (499, "client_closed", None, "s", False)
    assert (midway.status, midway.error, midway.stream) == (200, "client_closed", True)
    assert 0 < midway.ttfb < midway.duration
