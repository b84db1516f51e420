"""An OTLP/HTTP traces receiver for tests (R-6.21): what a collector would be sent, kept for asserts.

`OtlpReceiver` is an aiohttp server taking `POST /v1/traces` as OpenTelemetry's exporters send it:
protobuf (`application/x-protobuf`, as the router's exporter and vLLM's send; decoded with
opentelemetry-proto's `ExportTraceServiceRequest`) or OTLP's JSON encoding (`application/json`, as
the testbed's engine double sends it, standard library only), gzip-compressed or not. Every span
is kept as a `Span`: ids in hex, its parent, name, kind, attributes, status and the `service.name`
of its resource. `ThreadedReceiver` runs one on a thread of its own for tests that are not async
(the real-engine modules). Neither sleeps to wait: `wait` polls a condition up to a deadline.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TRACES_PATH = "/v1/traces"
DEADLINE = 30.0
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class Span:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str | None  # None: a root span of this trace as far as its exporter knew
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    attributes: dict[str, Any]
    service: str | None  # its resource's service.name
    status: str = "UNSET"  # UNSET, OK, ERROR
    start_ns: int = 0
    end_ns: int = 0
    resource: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        parent = self.parent_id or "-"
        return f"Span({self.service}: {self.name!r} {self.kind} {self.trace_id}/{self.span_id} parent {parent} {self.status})"


class OtlpReceiver:
    """POST /v1/traces on host:port (0: a free one); the spans received, in order of arrival."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.posts: list[tuple[str, str | None]] = []  # (Content-Type, Content-Encoding) of each export
        self._spans: list[Span] = []
        self._lock = threading.Lock()  # a ThreadedReceiver's loop writes while the test's thread reads
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The collector's address as gateway.tracing.otlp_endpoint takes it (no /v1/traces)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> OtlpReceiver:
        # The body is decompressed here, as a collector does, not by aiohttp's parser.
        app = web.Application(client_max_size=64 * 1024**2, handler_args={"auto_decompress": False})
        app.router.add_post(TRACES_PATH, self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str, service: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.name == name and (service is None or s.service == service)]

    def children(self, span: Span) -> list[Span]:
        return [s for s in self.spans if s.trace_id == span.trace_id and s.parent_id == span.span_id]

    async def wait(self, condition: Callable[[], Any], timeout: float = DEADLINE, what: str = "spans") -> Any:
        deadline = time.monotonic() + timeout
        while not (value := condition()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; received: {self.spans}")
            await asyncio.sleep(0.02)
        return value

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        encoding = request.headers.get("Content-Encoding")
        self.posts.append((request.content_type, encoding))
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding not in (None, "identity"):
            return web.Response(status=415, text=f"Content-Encoding {encoding} is not taken here")
        if request.content_type == "application/x-protobuf":
            spans = _from_protobuf(body)
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

            answer = web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                                  content_type="application/x-protobuf")
        elif request.content_type == "application/json":
            spans = _from_json(json.loads(body))
            answer = web.json_response({})
        else:
            return web.Response(status=415, text=f"Content-Type {request.content_type} is not OTLP")
        with self._lock:
            self._spans.extend(spans)
        return answer


class ThreadedReceiver(OtlpReceiver):
    """An OtlpReceiver on an event loop of its own thread, for tests that are not async."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> ThreadedReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), self._loop).result(DEADLINE)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.close(), self._loop).result(DEADLINE)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(DEADLINE)
        self._loop.close()

    def wait_sync(self, condition: Callable[[], Any], timeout: float = DEADLINE, what: str = "spans") -> Any:
        deadline = time.monotonic() + timeout
        while not (value := condition()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; received: {self.spans}")
            time.sleep(0.05)
        return value


def _from_protobuf(body: bytes) -> list[Span]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(Span(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                  parent_id=s.parent_span_id.hex() or None, name=s.name, kind=_KINDS.get(s.kind, str(s.kind)),
                                  attributes={kv.key: _any_value(kv.value) for kv in s.attributes},
                                  service=resource.get("service.name"), status=_STATUS.get(s.status.code, str(s.status.code)),
                                  start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, resource=resource))
    return spans


def _any_value(value) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _from_json(document: dict) -> list[Span]:
    """OTLP/JSON: ids in hex, 64-bit integers as strings, kinds and codes as numbers."""
    spans = []
    for resource_spans in document.get("resourceSpans", ()):
        resource = _json_attributes(resource_spans.get("resource", {}).get("attributes", ()))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for s in scope_spans.get("spans", ()):
                spans.append(Span(trace_id=s["traceId"].lower(), span_id=s["spanId"].lower(),
                                  parent_id=(s.get("parentSpanId") or "").lower() or None, name=s["name"],
                                  kind=_KINDS.get(s.get("kind", 0), str(s.get("kind"))),
                                  attributes=_json_attributes(s.get("attributes", ())), service=resource.get("service.name"),
                                  status=_STATUS.get(s.get("status", {}).get("code", 0), "UNSET"),
                                  start_ns=int(s.get("startTimeUnixNano", 0)), end_ns=int(s.get("endTimeUnixNano", 0)),
                                  resource=resource))
    return spans


def _json_attributes(items) -> dict[str, Any]:
    return {item["key"]: _json_value(item.get("value", {})) for item in items}


def _json_value(value: dict) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return value["boolValue"]
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(_json_value(v) for v in value["arrayValue"].get("values", ()))
    if "kvlistValue" in value:
        return _json_attributes(value["kvlistValue"].get("values", ()))
    return None
