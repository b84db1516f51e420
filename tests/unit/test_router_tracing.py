"""The router's traces (R-6.21), driven through llmgw.router.tracing and the trail's hooks
(router/trail.py), exported over OTLP/HTTP to the test receiver on loopback: the span tree of a
request, the client's trace continued, the context an engine is given, the exporter reconfigured
and flushed, and OpenTelemetry left unimported while tracing is off.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
import time

import aiohttp
import pytest

from llmgw.contracts.endpoints import Endpoint
from llmgw.router.balancer import Upstream
from llmgw.router.tracing import SERVICE_NAME, Tracing
from llmgw.router.trail import Trail
from tests.otlp_receiver import OtlpReceiver

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CHAT = "POST /v1/chat/completions"


class Traced:
    """What Tracing switches on and off: a router's `tracer`."""

    tracer = None


@pytest.fixture
async def receiver():
    made = await OtlpReceiver().start()
    yield made
    await made.close()


@pytest.fixture
def router():
    return Traced()


@pytest.fixture
def tracing(router):
    return Tracing(router)


def upstream(replica: str = "chat-1a2b", port: int = 20001) -> Upstream:
    return Upstream(Endpoint(replica, "chat", f"http://10.213.7.10:{port}", "engine-key", revision="3f2a9c1d0e4b",
                             node="gpu03"))


def trail(request_id: str = "req-42") -> Trail:
    return Trail(request_id, None, time.time(), time.monotonic())


def traced(tracing: Tracing, headers: dict | None = None, path: str = "/v1/chat/completions") -> Trail:
    """A trail followed by a span, as the middleware makes them."""
    made = trail()
    made.span = tracing.request("POST", path, headers or {}, made.id)
    return made


def stream_tail(model: str = "chat-served", reason: str = "length") -> bytes:
    return (b'data: {"id":"c1","object":"chat.completion.chunk","model":"' + model.encode()
            + b'","choices":[{"index":0,"delta":{},"finish_reason":"' + reason.encode() + b'"}]}\n\n'
            b'data: {"id":"c1","model":"' + model.encode() + b'","choices":[],"usage":{"prompt_tokens":5,'
            b'"completion_tokens":8}}\n\ndata: [DONE]\n\n')


async def test_a_retried_stream_makes_a_tree_under_the_clients_trace(receiver, tracing, router):
    """Request (SERVER, the client's trace and parent) → queue, two attempts (the first failed),
    the stream; GenAI attributes; the engine gets the attempt's context; the resource names the
    router; close() flushes."""
    tracing.configure(receiver.url, "local/host-0-abc")
    assert router.tracer == tracing.start  # the middleware asks it for each request's span
    t = traced(tracing, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=opaque"})
    t.key, t.model, t.asked = "alice", "chat", "chat-latest"
    t.queue_start(time.monotonic())
    t.queue_end(time.monotonic())
    first = t.attempt_start(upstream("chat-1a2b"))
    t.attempt_end(502, "upstream_unavailable")
    second = t.attempt_start(upstream("chat-9f8e", 20002))
    t.first_byte(time.monotonic())
    t.span.answered(stream_tail())
    t.stream_end(time.monotonic())
    t.attempt_end(200)
    t.tokens(5, 8, False)
    t.finish(time.monotonic(), 200, None)
    await tracing.close()
    assert router.tracer is None

    spans = await receiver.wait(lambda: len(receiver.spans) == 5 and receiver.spans, what="five spans")
    request = next(s for s in spans if s.name == CHAT)
    assert (request.kind, request.trace_id, request.parent_id) == ("SERVER", CLIENT_TRACE, CLIENT_SPAN)
    assert request.service == SERVICE_NAME and request.resource["llmgw.router.id"] == "local/host-0-abc"
    assert request.resource["service.instance.id"] == "local/host-0-abc"
    assert request.attributes == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "gen_ai.operation.name": "chat",
        "llmgw.request_id": "req-42", "llmgw.key": "alice", "gen_ai.request.model": "chat",
        "llmgw.asked_model": "chat-latest", "http.response.status_code": 200, "gen_ai.response.model": "chat-served",
        "gen_ai.response.finish_reasons": ("length",), "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 8}
    assert request.status == "UNSET"
    children = receiver.children(request)
    assert sorted(s.name for s in children) == ["POST chat-1a2b", "POST chat-9f8e", "queue", "stream"]
    assert all(s.trace_id == CLIENT_TRACE for s in spans)
    failed, served = (next(s for s in children if s.name == f"POST {r}") for r in ("chat-1a2b", "chat-9f8e"))
    assert (failed.kind, failed.status, failed.attributes["error.type"]) == ("CLIENT", "ERROR", "upstream_unavailable")
    assert "http.response.status_code" not in failed.attributes  # the router's 502 is not the engine's status
    assert failed.attributes["llmgw.attempt"] == 1
    assert (served.kind, served.status, served.attributes["llmgw.attempt"]) == ("CLIENT", "UNSET", 2)
    assert served.attributes["http.response.status_code"] == 200
    assert served.attributes["llmgw.replica"] == "chat-9f8e" and served.attributes["server.port"] == 20002
    assert served.attributes["server.address"] == "10.213.7.10" and served.attributes["llmgw.revision"] == "3f2a9c1d0e4b"
    assert served.attributes["llmgw.node"] == "gpu03"
    # Each engine is told the context of its own attempt, the client's tracestate kept.
    for headers, attempt in ((first, failed), (second, served)):
        assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"
        assert headers["tracestate"] == "vendor=opaque"
    stream = next(s for s in children if s.name == "stream")
    assert stream.kind == "INTERNAL" and stream.status == "UNSET"
    assert served.start_ns <= stream.start_ns <= stream.end_ns <= served.end_ns <= request.end_ns
    queue = next(s for s in children if s.name == "queue")
    assert queue.attributes == {"llmgw.queue": "places"} and queue.end_ns <= failed.start_ns
    assert "engine-key" not in json.dumps([s.attributes for s in spans])  # the engine's key never


async def test_without_a_traceparent_a_trace_starts(receiver, tracing):
    tracing.configure(receiver.url, None)
    made = [traced(tracing, path="/v1/embeddings"), traced(tracing, {"traceparent": "00-not-a-trace-01"}, "/v1/embeddings")]
    for t in made:
        t.finish(time.monotonic(), 200, None)
    await tracing.close()
    spans = await receiver.wait(lambda: len(receiver.spans) == 2 and receiver.spans, what="two spans")
    assert [s.parent_id for s in spans] == [None, None]  # a malformed traceparent starts a trace too
    assert len({s.trace_id for s in spans}) == 2
    assert {s.trace_id for s in spans} == {t.span.trace_id for t in made}
    assert all(s.attributes["gen_ai.operation.name"] == "embeddings" for s in spans)
    assert "llmgw.router.id" not in spans[0].resource  # a router not fed yet has no id


@pytest.mark.parametrize("status, error, expected", [
    pytest.param(503, "queue_timeout", "ERROR", id="5xx"),
    pytest.param(429, "rate_limit_exceeded", "UNSET", id="4xx-is-the-clients"),
    pytest.param(200, "upstream_interrupted", "ERROR", id="stream-cut-after-200"),
])
async def test_the_request_span_is_an_error_when_the_router_failed(receiver, tracing, status, error, expected):
    tracing.configure(receiver.url, None)
    t = traced(tracing)
    t.queue_start(time.monotonic(), "on_demand")  # still waiting when it ends: the queue span ends with it
    t.finish(time.monotonic(), status, error)
    await tracing.close()
    spans = await receiver.wait(lambda: len(receiver.spans) == 2 and receiver.spans, what="two spans")
    request = next(s for s in spans if s.name == CHAT)
    assert (request.status, request.attributes["error.type"]) == (expected, error)
    [queue] = receiver.children(request)
    assert queue.attributes == {"llmgw.queue": "on_demand"}


async def test_a_stream_its_client_left_ends_as_cut(receiver, tracing):
    tracing.configure(receiver.url, None)
    t = traced(tracing)
    t.attempt_start(upstream())
    t.first_byte(time.monotonic())
    t.stream_end(time.monotonic(), "client_closed")
    t.finish(time.monotonic(), 200, None)  # the middleware's own end: no error of its own
    await tracing.close()
    spans = await receiver.wait(lambda: len(receiver.spans) == 3 and receiver.spans, what="three spans")
    stream, attempt, request = (next(s for s in spans if s.name == n) for n in ("stream", "POST chat-1a2b", CHAT))
    assert (stream.status, stream.attributes["error.type"]) == ("ERROR", "client_closed")
    assert request.attributes["error.type"] == "client_closed" and request.status == "ERROR"
    assert attempt.status == "ERROR"  # left open by the attempt: ended with the request


def test_while_off_there_is_no_span(tracing, router):
    assert tracing.request("POST", "/v1/chat/completions", {}) is None
    tracing.configure(None, "r")
    assert not tracing.on and router.tracer is None


async def test_a_new_endpoint_flushes_the_old_exporter_and_none_stops(tracing, router):
    first, second = await OtlpReceiver().start(), await OtlpReceiver().start()
    try:
        tracing.configure(first.url, "r1")
        traced(tracing).finish(time.monotonic(), 200, None)
        tracing.configure(second.url, "r1")  # the span made before goes to the first, flushed now
        traced(tracing, path="/v1/completions").finish(time.monotonic(), 200, None)
        await first.wait(lambda: [s.name for s in first.spans] == [CHAT], what="the first collector's span")
        tracing.configure(None, "r1")  # off: the second one's span is flushed, nothing more is made
        await second.wait(lambda: [s.name for s in second.spans] == ["POST /v1/completions"], what="the second's span")
        assert tracing.request("POST", "/v1/chat/completions", {}) is None and router.tracer is None
    finally:
        await tracing.close()
        await first.close()
        await second.close()


async def test_the_exporters_gzip_is_read(receiver, tracing, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    tracing.configure(receiver.url, None)
    traced(tracing, path="/v1/messages").finish(time.monotonic(), 200, None)
    await tracing.close()
    await receiver.wait(lambda: receiver.spans, what="a span")
    assert receiver.posts == [("application/x-protobuf", "gzip")]


async def test_otlp_json_is_read_as_the_engine_double_sends_it(receiver):
    document = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
                                   "scopeSpans": [{"spans": [{
                                       "traceId": CLIENT_TRACE.upper(), "spanId": "00f067aa0ba902b7",
                                       "parentSpanId": CLIENT_SPAN, "name": "llm_request", "kind": 2,
                                       "startTimeUnixNano": "1", "endTimeUnixNano": "2",
                                       "attributes": [{"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "5"}}]}]}]}]}
    async with aiohttp.ClientSession() as session:
        body = gzip.compress(json.dumps(document).encode())
        async with session.post(receiver.url + "/v1/traces", data=body,
                                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as answer:
            assert answer.status == 200
    [span] = receiver.spans
    assert (span.service, span.name, span.kind, span.trace_id, span.parent_id) == ("vllm", "llm_request", "SERVER",
                                                                                   CLIENT_TRACE, CLIENT_SPAN)
    assert span.attributes == {"gen_ai.usage.prompt_tokens": 5}


def test_opentelemetry_is_imported_only_once_tracing_is_on():
    """A router fed gateway settings without a collector imports nothing of OpenTelemetry; the
    same router told of one does (so the check could fail)."""
    script = textwrap.dedent("""
        import sys
        from prometheus_client import CollectorRegistry
        from llmgw.contracts.feed import GatewaySettings, Snapshot
        from llmgw.router import worker  # what a router process imports
        from llmgw.router.app import Router

        def loaded():
            return sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")

        router = Router(registry=CollectorRegistry())
        router.feed.router_id = "local/test"
        off = GatewaySettings(max_body=1024, request_timeout=60.0, on_demand_wait=5.0)
        router.apply(Snapshot("e", 1, {}, {}, (), off))
        print("off", len(loaded()), loaded()[:3])
        on = GatewaySettings(max_body=1024, request_timeout=60.0, on_demand_wait=5.0, otlp_endpoint="http://127.0.0.1:9")
        router.apply(Snapshot("e", 2, {}, {}, (), on))
        print("on", len(loaded()) > 0, router.tracing.on, router.tracer == router.tracing.start)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines() == ["off 0 []", "on True True True"]


def test_without_the_extra_a_router_says_why_and_serves_untraced():
    script = textwrap.dedent("""
        import logging, sys

        class NoOpenTelemetry:  # as on a host where llmgw[tracing] is not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "opentelemetry":
                    raise ImportError(f"No module named {name!r}")

        sys.meta_path.insert(0, NoOpenTelemetry())
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
        from llmgw.router.tracing import Tracing

        class Traced:
            tracer = None

        tracing = Tracing(Traced())
        tracing.configure("http://127.0.0.1:9", "r1")
        tracing.configure("http://127.0.0.1:10", "r1")  # said once, not tried again
        print("span", tracing.request("POST", "/v1/chat/completions", {}), tracing.on)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "install llmgw[tracing]" in errors[0], out
    assert out.splitlines()[-1] == "span None False"
