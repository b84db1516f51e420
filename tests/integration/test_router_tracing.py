"""A request's spans as the router makes them (R-6.21): the real router, fed by the in-process feed
with gateway.tracing pointed at the test's OTLP/HTTP receiver, engine doubles as vLLM on loopback
(exporting their own `llm_request` span, as vLLM launched with --otlp-traces-endpoint does), and
the official openai client.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from llmgw.config import GatewayConfig, ProfileConfig, TracingConfig
from tests.integration.test_router_support import (ENGINES, PROFILES, Catalog, catalog, engines,  # noqa: F401
                                                   model, start_router)
from tests.otlp_receiver import OtlpReceiver

HELLO = [{"role": "user", "content": "hello"}]
CHAT = "POST /v1/chat/completions"
TRACED_ENGINE = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}


@pytest.fixture
async def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the router's exporter sends within 50 ms, not 5 s
    made = await OtlpReceiver().start()
    yield made
    await made.close()


def traced(receiver: OtlpReceiver) -> GatewayConfig:
    return GatewayConfig(tracing=TracingConfig(otlp_endpoint=receiver.url))


def engine_args(receiver: OtlpReceiver) -> list[str]:
    return ["--otlp-traces-endpoint", receiver.url + "/v1/traces"]


def context(trace_id: str | None = None) -> tuple[str, str, dict]:
    trace_id, parent = trace_id or secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent, {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "client=kept"}


async def test_a_stream_is_a_server_span_with_its_attempt_stream_and_the_engines_span(engines, start_router,  # noqa: F811
                                                                                       receiver):
    engine = engines.start("m", args=engine_args(receiver), env=TRACED_ENGINE)
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint("r-m")]}, gateway=traced(receiver))
    trace_id, parent, headers = context()
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=5,
                                                      stream_options={"include_usage": True}, extra_headers=headers)
        chunks = [c async for c in stream]
    usage = chunks[-1].usage
    spans = await receiver.wait(lambda: {s.name for s in receiver.trace(trace_id)} >= {CHAT, "llm_request", "stream"}
                                and receiver.trace(trace_id), what="the request's spans")
    [request] = [s for s in spans if s.name == CHAT]
    assert (request.kind, request.parent_id, request.service) == ("SERVER", parent, "llmgw-router")
    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "m"
    assert attributes["gen_ai.response.model"] == "m" and attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert attributes["http.response.status_code"] == 200 and attributes["llmgw.key"] == "test-0"
    assert attributes["llmgw.request_id"]
    children = {s.name: s for s in receiver.children(request)}
    assert set(children) == {"POST r-m", "stream"}  # nobody waited: no queue span
    attempt = children["POST r-m"]
    assert (attempt.kind, attempt.status, attempt.attributes["llmgw.replica"]) == ("CLIENT", "UNSET", "r-m")
    [engine_span] = [s for s in spans if s.service == "vllm"]
    assert (engine_span.name, engine_span.parent_id) == ("llm_request", attempt.span_id)


async def test_a_retried_request_has_two_attempts_the_first_an_error(engines, start_router, receiver):  # noqa: F811
    failing = engines.start("m", fail_requests=1, args=engine_args(receiver), env=TRACED_ENGINE)
    live = engines.start("m", args=engine_args(receiver), env=TRACED_ENGINE)
    gw = await start_router(catalog(model("m")), {"m": [failing.endpoint("failing"), live.endpoint("live")]},
                            gateway=traced(receiver))
    gw.router.balancer.eject_seconds = 3600
    trace_id, _, headers = context()
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="m", messages=HELLO, extra_headers=headers)
    assert answer.choices[0].finish_reason
    spans = await receiver.wait(lambda: {s.name for s in receiver.trace(trace_id)} >= {CHAT, "llm_request"}
                                and receiver.trace(trace_id), what="the request's spans")
    [request] = [s for s in spans if s.name == CHAT]
    attempts = sorted((s for s in receiver.children(request) if s.kind == "CLIENT"), key=lambda s: s.start_ns)
    assert [(a.name, a.status, a.attributes.get("error.type")) for a in attempts] == [
        ("POST failing", "ERROR", "upstream_unavailable"), ("POST live", "UNSET", None)]
    assert attempts[1].attributes["http.response.status_code"] == 200
    assert request.status == "UNSET" and "stream" not in {s.name for s in spans}
    [engine_span] = [s for s in spans if s.service == "vllm"]  # the failing engine answered 503 before any work
    assert engine_span.parent_id == attempts[1].span_id


async def test_a_wait_for_a_place_is_a_queue_span(engines, start_router, receiver):  # noqa: F811
    engine = engines.start("m", token_delay=0.05)
    one_place = Catalog.build(file_models=[model("m", profile="one")], profiles={**PROFILES, "one": ProfileConfig(
        engine="vllm", concurrency=1)}, engines=ENGINES)
    gw = await start_router(one_place, {"m": [engine.endpoint("r-m")]}, gateway=traced(receiver))
    first, second = context(), context()
    async with gw.client() as client:
        async def ask(headers):
            stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=10,
                                                          extra_headers=headers)
            return [c async for c in stream]
        await asyncio.gather(ask(first[2]), ask(second[2]))
    await receiver.wait(lambda: len([s for s in receiver.spans if s.name == CHAT]) == 2, what="two requests")
    queued = [s for s in receiver.spans if s.name == "queue"]
    assert len(queued) == 1 and queued[0].trace_id in (first[0], second[0])
    [request] = [s for s in receiver.trace(queued[0].trace_id) if s.name == CHAT]
    assert queued[0].parent_id == request.span_id and queued[0].attributes == {"llmgw.queue": "places"}
    [attempt] = [s for s in receiver.children(request) if s.kind == "CLIENT"]
    assert queued[0].end_ns <= attempt.start_ns


async def test_a_refused_request_is_traced_without_attempts(start_router, receiver):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": []}, gateway=traced(receiver))
    trace_id, parent, headers = context()
    async with gw.client() as client:
        with pytest.raises(Exception):
            await client.chat.completions.create(model="m", messages=HELLO, extra_headers=headers)
    [request] = await receiver.wait(lambda: receiver.trace(trace_id), what="the refused request's span")
    assert request.parent_id == parent and request.attributes["http.response.status_code"] == 503
    assert request.status == "ERROR" and request.attributes["error.type"]
    assert not receiver.children(request)


async def test_tracing_off_sends_the_engine_no_traceparent_of_the_routers(engines, start_router, receiver):  # noqa: F811
    engine = engines.start("m", args=engine_args(receiver), env=TRACED_ENGINE)
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint("r-m")]})  # no gateway.tracing
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=HELLO)
    [engine_span] = await receiver.wait(lambda: receiver.spans, what="the engine's span")
    assert engine_span.parent_id is None  # the engine's own trace: the router sent it no context
    assert not gw.router.tracing.on
