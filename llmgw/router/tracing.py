"""OpenTelemetry traces of the requests a router serves (R-6.21).

Off until the feed's gateway settings name a collector (`gateway.tracing.otlp_endpoint`): then
`Tracing` holds a TracerProvider of its own (never the process's global one) whose
BatchSpanProcessor exports over OTLP/HTTP to `<endpoint>/v1/traces`, with `service.name`
llmgw-router and the router's id as `service.instance.id` and `llmgw.router.id`, and sets the
router's `tracer`, which its handler asks for each request's span (`Trail.span`). A new
endpoint replaces the provider (the old one is flushed on a thread of its own, so the loop never
waits for a collector), none unsets the tracer, and `close()` flushes the last spans when the
router stops. While tracing is off a request costs nothing more than the trail's `span is None`
checks, and nothing of OpenTelemetry is imported: the SDK is the optional extra
`llmgw[tracing]`, and a router without it logs why once and serves untraced.

A request's spans, made by `RequestSpan` from the hooks of its trail (router/trail.py):

    POST /v1/chat/completions   SERVER    the client's traceparent continued, else a new trace
    ├── queue                   INTERNAL  each wait for a place or an on-demand replica
    ├── POST <replica>          CLIENT    each attempt; ERROR on failure; its context is the
    │                                     `traceparent` the engine gets, so vLLM's span joins
    └── stream                  INTERNAL  the relayed stream, first byte to its end

with the GenAI semantic conventions' attributes where they exist (gen_ai.operation.name,
gen_ai.request.model, gen_ai.response.model, gen_ai.usage.input_tokens and output_tokens,
gen_ai.response.finish_reasons read from the answer's tail) and llmgw's own (llmgw.request_id,
llmgw.key — the key's name, never the key —, llmgw.replica). Times are taken as the hooks are
called; a span that cost nothing to know (a queue nobody waited in) is not made.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from llmgw.router.balancer import Upstream
    from llmgw.router.trail import Trail

log = logging.getLogger(__name__)

SERVICE_NAME = "llmgw-router"
TRACES_PATH = "/v1/traces"  # appended to gateway.tracing.otlp_endpoint, as OTLP/HTTP names it
SCOPE = "llmgw.router"
FLUSH_SECONDS = 10.0  # the most a stopping router waits for its last spans to leave
TAIL_BYTES = 4096  # of an answer's end, read for its model and finish reasons

# gen_ai.operation.name per route (the GenAI semantic conventions' values); absent: none fits.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}

_FINISH = re.compile(rb'"(?:finish_reason|stop_reason)"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')


class _Otel:
    """What a traced router uses of OpenTelemetry, imported once tracing is first switched on."""

    def __init__(self):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.SERVER, self.CLIENT, self.INTERNAL = trace.SpanKind.SERVER, trace.SpanKind.CLIENT, trace.SpanKind.INTERNAL
        self.Status, self.ERROR = trace.Status, trace.StatusCode.ERROR
        self.in_context = trace.set_span_in_context
        self.propagator = TraceContextTextMapPropagator()
        self.Exporter, self.Resource, self.Provider, self.Batch = OTLPSpanExporter, Resource, TracerProvider, BatchSpanProcessor


def _load() -> _Otel | None:
    try:
        return _Otel()
    except ImportError as exc:
        log.error("gateway.tracing.otlp_endpoint is set but OpenTelemetry's SDK is not installed here (%s): "
                  "this router serves without traces; install llmgw[tracing] on its host", exc)
        return None


class Traced(Protocol):
    """What Tracing switches: the router's `tracer`, asked for each request's span."""

    tracer: Any


class Tracing:
    """A router's traces: off, or a TracerProvider exporting to one collector (R-6.21)."""

    __slots__ = ("endpoint", "_traced", "_otel", "_provider", "_tracer", "_missing")

    def __init__(self, traced: Traced):
        self.endpoint: str | None = None  # the collector traces go to; None: off
        self._traced = traced
        self._otel: _Otel | None = None
        self._provider = None
        self._tracer = None
        self._missing = False  # the SDK could not be imported: said once, not tried again

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def configure(self, endpoint: str | None, router_id: str | None) -> None:
        """Export to `endpoint` (gateway.tracing.otlp_endpoint) from now on; None: stop tracing.
        The previous provider's spans are flushed on a thread of their own."""
        if endpoint == self.endpoint:
            return
        old, self._provider, self._tracer, self.endpoint = self._provider, None, None, endpoint
        self._traced.tracer = None
        if old is not None:
            threading.Thread(target=_shut_down, args=(old,), name="tracing-flush", daemon=True).start()
        if endpoint is None:
            log.info("tracing off")
            return
        if self._otel is None:
            if self._missing:
                return
            self._otel = _load()
            if self._otel is None:
                self._missing = True
                return
        otel = self._otel
        attributes = {"service.name": SERVICE_NAME}
        if router_id is not None:  # else the SDK makes up a service.instance.id
            attributes["service.instance.id"] = attributes["llmgw.router.id"] = router_id
        provider = otel.Provider(resource=otel.Resource.create(attributes))
        provider.add_span_processor(otel.Batch(otel.Exporter(endpoint=endpoint + TRACES_PATH)))
        self._provider, self._tracer = provider, provider.get_tracer(SCOPE)
        self._traced.tracer = self.start
        log.info("tracing: spans go to %s%s", endpoint, TRACES_PATH)

    def start(self, request: web.BaseRequest, trail: Trail, pattern: str) -> RequestSpan | None:
        """The router's tracer while on: the span of `request`, begun now, named for its route's
        path `pattern` (for a path no route matches, the path, cut short)."""
        return self.request(request.method, pattern, request.headers, trail.id)

    def request(self, method: str, path: str, headers: Mapping[str, str], request_id: str | None = None
                ) -> RequestSpan | None:
        """The span of one client request, begun now; None while tracing is off. `path` is the
        route's pattern (`/v1/responses/{response_id}`), `headers` the client's (its
        traceparent and tracestate are continued)."""
        tracer = self._tracer
        if tracer is None:
            return None
        return RequestSpan(self._otel, tracer, method, path, headers, request_id)

    async def close(self) -> None:
        """Flush the spans not sent yet and stop exporting (the router stops): waits at most
        FLUSH_SECONDS for a collector that does not answer."""
        provider, self._provider, self._tracer, self.endpoint = self._provider, None, None, None
        self._traced.tracer = None
        if provider is None:
            return
        done = asyncio.get_running_loop().create_future()

        def flush() -> None:
            _shut_down(provider)
            if not done.done():
                done.get_loop().call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        # A daemon thread rather than the loop's executor: a collector that never answers must not
        # keep the process from exiting once FLUSH_SECONDS are over.
        threading.Thread(target=flush, name="tracing-flush", daemon=True).start()
        try:
            await asyncio.wait_for(done, FLUSH_SECONDS)
        except TimeoutError:
            log.warning("tracing: the collector took more than %.0f s; the last spans may be lost", FLUSH_SECONDS)


@functools.lru_cache(maxsize=4096)
def _server(url: str) -> dict[str, Any]:
    """An engine's server.address and server.port, worked out once per endpoint URL."""
    parsed = urllib.parse.urlsplit(url)
    return {name: value for name, value in (("server.address", parsed.hostname), ("server.port", parsed.port)) if value}


def _shut_down(provider) -> None:
    try:
        provider.shutdown()
    except Exception:
        log.exception("tracing: flushing spans failed")


class RequestSpan:
    """One request's spans (R-6.21): a trail.TrailSpan, told each step by the request's trail.

    The hooks' `now` (time.monotonic()) is not a time a collector can place: each hook takes the
    wall clock itself as it is called. `queue_start`/`queue_end` bracket a wait (a `queue` span
    each), `attempt_start` begins an attempt on an endpoint and returns the headers its engine
    gets (`traceparent`, `tracestate`), `attempt_end` ends it, `first_byte` and `stream_end`
    bracket a relayed stream, `answered` reads the answer's end, and `finish` ends the request's
    span with what the trail noted (and whatever its hooks left open)."""

    __slots__ = ("_otel", "_tracer", "span", "_context", "_queued", "_attempt", "_first_byte", "_model",
                 "_finish_reasons")

    def __init__(self, otel: _Otel, tracer, method: str, path: str, headers: Mapping[str, str],
                 request_id: str | None):
        self._otel = otel
        self._tracer = tracer
        parent = None
        traceparent = headers.get("traceparent")
        if traceparent is not None:
            carrier = {"traceparent": traceparent}
            tracestate = headers.get("tracestate")
            if tracestate is not None:
                carrier["tracestate"] = tracestate
            parent = otel.propagator.extract(carrier)  # a malformed one starts a new trace
        attributes: dict[str, Any] = {"http.request.method": method, "http.route": path}
        operation = OPERATIONS.get(path)
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        if request_id is not None:
            attributes["llmgw.request_id"] = request_id
        self.span = tracer.start_span(f"{method} {path}", context=parent, kind=otel.SERVER, attributes=attributes)
        self._context = otel.in_context(self.span)
        self._queued: tuple[int, str] | None = None  # (when, what for) of the wait under way
        self._attempt = None  # the attempt span open now
        self._first_byte: int | None = None
        self._model: str | None = None  # gen_ai.response.model, from the answer
        self._finish_reasons: tuple[str, ...] = ()

    @property
    def trace_id(self) -> str:
        """The request's trace id, 32 hex digits."""
        return f"{self.span.get_span_context().trace_id:032x}"

    def queue_start(self, now: float, reason: str = "places") -> None:
        """A wait begins: for a place of the model (`places`, R-6.17) or an on-demand replica (`on_demand`, R-6.8)."""
        self._queued = (time.time_ns(), reason)

    def queue_end(self, now: float) -> None:
        queued, self._queued = self._queued, None
        if queued is None:
            return
        began, reason = queued
        span = self._tracer.start_span("queue", context=self._context, kind=self._otel.INTERNAL, start_time=began,
                                       attributes={"llmgw.queue": reason})
        span.end()

    def attempt_start(self, up: Upstream, trail: Trail) -> dict[str, str]:
        """An attempt on `up` begins (an open one is ended first); the headers its engine gets."""
        if self._attempt is not None:
            self.attempt_end(0, "unfinished")
        attributes: dict[str, Any] = {"llmgw.replica": up.replica_id, "gen_ai.request.model": up.model,
                                      "llmgw.attempt": trail.attempts, **_server(up.endpoint.url)}
        if up.node is not None:
            attributes["llmgw.node"] = up.node
        revision = up.endpoint.revision
        if revision is not None:
            attributes["llmgw.revision"] = revision
        span = self._attempt = self._tracer.start_span(f"POST {up.replica_id}", context=self._context,
                                                       kind=self._otel.CLIENT, attributes=attributes)
        context = span.get_span_context()
        headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"}
        if context.trace_state:
            headers["tracestate"] = context.trace_state.to_header()
        return headers

    def attempt_end(self, status: int, error: str | None = None) -> None:
        """The open attempt is over: the engine's HTTP status when it answered (`error` None), or
        the router's error code for the failure (its status is the router's, not the engine's)."""
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if error is None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or status >= 400:
            why = error or str(status)
            span.set_attribute("error.type", why)
            span.set_status(self._otel.Status(self._otel.ERROR, why))
        span.end()

    def first_byte(self, now: float) -> None:
        """A relayed stream's first byte goes to the client."""
        if self._first_byte is None:
            self._first_byte = time.time_ns()

    def stream_end(self, now: float, error: str | None = None) -> None:
        """The relayed stream ended, cut with `error` (or its client left) when it did not end whole."""
        began = self._first_byte
        if began is None:
            return
        span = self._tracer.start_span("stream", context=self._context, kind=self._otel.INTERNAL, start_time=began)
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(self._otel.Status(self._otel.ERROR, error))
        span.end()

    def answered(self, tail: bytes) -> None:
        """The answer's end (a whole answer, or a stream's last chunks): its model and finish
        reasons, where it names them."""
        tail = tail[-TAIL_BYTES:]
        models = _MODEL.findall(tail)
        if models:
            self._model = models[-1].decode(errors="replace")
        reasons = _FINISH.findall(tail)
        if reasons:
            self._finish_reasons = tuple(dict.fromkeys(r.decode() for r in reasons))

    def finish(self, trail: Trail) -> None:
        """The request is over: the status the client got, the error's code (a stream cut after
        its status, too), who asked for which model and the tokens counted, from its trail."""
        if self._queued is not None:
            self.queue_end(0.0)
        status, error = trail.status, trail.error
        if self._attempt is not None:
            self.attempt_end(status, error or "unfinished")
        attributes: dict[str, Any] = {"http.response.status_code": status}
        for name, value in (("llmgw.key", trail.key), ("gen_ai.request.model", trail.model),
                            ("llmgw.asked_model", trail.asked), ("llmgw.fallback", trail.fallback),
                            ("gen_ai.response.model", self._model), ("error.type", error),
                            ("gen_ai.usage.input_tokens", trail.prompt_tokens),
                            ("gen_ai.usage.output_tokens", trail.completion_tokens)):
            if value is not None:
                attributes[name] = value
        if self._finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = self._finish_reasons
        if trail.estimated:
            attributes["llmgw.usage.estimated"] = True
        span = self.span
        span.set_attributes(attributes)
        # A server's 4xx is the client's mistake, not the server's (the semantic conventions):
        # an error status for 5xx, and for an answer cut after a success status.
        if status >= 500 or (error is not None and status < 400):
            span.set_status(self._otel.Status(self._otel.ERROR, error or str(status)))
        span.end()
