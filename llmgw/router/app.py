"""The client-facing listener: routes, authentication, the choice of endpoint, retries (SPEC §6).

The router is fed only by the router feed (llmgw.contracts.feed, R-10.1): `apply()` takes the
control plane's Snapshot and then each Change (models, endpoint lists, keys, gateway settings,
replicas given up), and `report_fields()` gives what the router's next Report carries: usage and
key use counted since the last report (handed over once), and its state as of now (last use per
replica for R-7.1, requests in flight for drains (R-4.2), engine loads (R-6.5), on-demand models
asked for with no replica (R-6.8)). It reads no catalog, configuration or database: whoever feeds
it (in process, or over a socket) decides where those come from. Until the first snapshot it
answers every API request with a 503, since it cannot authenticate anyone yet.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import zlib
from collections.abc import Callable, Mapping

import aiohttp
import prometheus_client
from aiohttp import web

from llmgw.contracts.feed import Change, FeedError, KeyEntry, RoutedModel, Snapshot
from llmgw.router.affinity import affinity_key
from llmgw.router.balancer import PREFIX, Balancer, Upstream
from llmgw.router.engineload import EnginePoller
from llmgw.router.fairqueue import FairQueue, replica_places
from llmgw.router import response_ids
from llmgw.router.errors import (BadRequest, BodyTooLarge, InternalError, InvalidType, ModelLoading,
                                 ModelNotFound, NoCapacity, NotReady, ResponseNotFound, RouteNotServed, RouterError,
                                 UnsupportedEncoding, UpstreamFailed, UploadNotReplayed, error_response,
                                 from_http_exception)
from llmgw.router.keys import KeyRing, allows
from llmgw.router.landing import landing_page
from llmgw.router import limits
from llmgw.router.metrics import NO_MODEL, RouterMetrics
from llmgw.router.proxy import DEFAULT_MAX_ANSWER, Exchange, Forwarder
from llmgw.router.routes import ANTHROPIC, FORM, RESPONSE_ID, RESPONSES, ROUTES, Route, serves
from llmgw.router.streams import CONTINUOUS_USAGE_ENGINES, ask_for_usage, streaming
from llmgw.router.uploads import Upload, read_upload
from llmgw.router.usage import UsageMeter

log = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/", "/healthz"})  # exact paths, never prefixes
MAX_ATTEMPTS = 3  # endpoints tried for one request before it fails
CONNECT_TIMEOUT = 5.0  # an engine on the management network answers a connect well within this
UPSTREAM_CONNECTIONS = 8192  # explicit: aiohttp's default silently queues requests past 100
KEEPALIVE_SECONDS = 4.0  # below the 5 s after which uvicorn and llama-server close idle connections
DEFAULT_REQUEST_TIMEOUT = 600.0  # until the first snapshot says otherwise
# aiohttp's own body limit is set far above any gateway.max_body: the router checks the
# snapshot's limit itself, so a new one applies to the next request without rebuilding the app.
APP_BODY_LIMIT = 1 << 40
# Server settings the router depends on. They travel with the app (handler_args override the
# runner's arguments), so they hold however the app is run.
SERVER_SETTINGS = {
    # Cancel the handler when its client disconnects, so the engine's request is cancelled at
    # once instead of at the next chunk.
    "handler_cancellation": True,
    # Compressed bodies are decoded in `_read_body`, not by aiohttp's parser, whose refusals of
    # a body that does not decode are plain text, or a 500 once the handler reads it.
    "auto_decompress": False,
    "max_field_size": 16384,
}
RUNNER_OPTIONS = {"access_log": None}  # no log line per request on the hot path
# Content-Encoding -> zlib wbits of each way to read it (deflate is zlib-wrapped, or raw from some clients).
BODY_ENCODINGS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
                  "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}

_KEY = web.RequestKey("llmgw_key", KeyEntry)
_MODEL = web.RequestKey("llmgw_model", str)
_LIMITED = web.RequestKey("llmgw_limited", tuple)  # the budgets of a limited key's request, for its headers
ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")  # passed on to engines that read them


class Pinned:
    """A follow-up of a stored response: the replica that holds it and the engine's own id."""

    __slots__ = ("model", "replica_id", "engine_id", "client_id")

    def __init__(self, model: str, replica_id: str, engine_id: str, client_id: str):
        self.model, self.replica_id, self.engine_id, self.client_id = model, replica_id, engine_id, client_id


class Router:
    """The OpenAI-compatible gateway: `web_app()` is the client listener's aiohttp application."""

    def __init__(self, *, registry: prometheus_client.CollectorRegistry | None = None):
        self.keys = KeyRing()
        self.balancer = Balancer()
        self.fairqueue = FairQueue()  # places per model under saturation
        self.metrics = RouterMetrics(registry, self.balancer.outstanding_by_model, self.balancer.upstreams,
                                     self.fairqueue.waiting)
        self.usage = UsageMeter()
        self.limiter = limits.Limiter()
        self.router_id: str | None = None  # set by the feed client: which of the snapshot's leases are this router's
        # Called on the loop when an on-demand model is asked for with no replica: a feed client
        # reports at once rather than at its next tick. None: nobody starts replicas on
        # demand, so a request does not wait for one.
        self.on_demand: Callable[[], None] | None = None
        # Set by the feed client: its state, which /healthz shows only to a request with a valid key
        # (it names this router and host), and the seconds since the snapshot was last confirmed.
        self.feed_status: dict | None = None
        self.snapshot_age: Callable[[], float | None] | None = None
        self._snapshot: Snapshot | None = None
        self._models: Mapping[str, RoutedModel] = {}
        self._max_body = 0
        self._on_demand_wait = 0.0
        self._queue_wait = 0.0
        self._request_timeout = DEFAULT_REQUEST_TIMEOUT
        self._max_answer = DEFAULT_MAX_ANSWER
        self._demand: dict[str, None] = {}  # on-demand models asked for since the last report, in order
        self._arrivals: dict[str, asyncio.Event] = {}  # on-demand models someone is waiting for
        self._forwarder: Forwarder | None = None
        self.response_ids: response_ids.ResponseIds | None = None  # from the snapshot's secret
        self._created = int(time.time())

    # -- the feed -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot | None:
        """The snapshot routed with now, None before the first one."""
        return self._snapshot

    def apply(self, message: Snapshot | Change) -> None:
        """Apply a Snapshot (replaces everything) or the Change that follows the current version.

        A Change that does not follow (a gap, another epoch, none before a snapshot) raises
        FeedError and changes nothing: the caller asks for a snapshot again. Call on the loop."""
        old = self._snapshot
        if isinstance(message, Snapshot):
            new = message
        elif isinstance(message, Change):
            if old is None:
                raise FeedError(f"change {message.epoch}/{message.version} before any snapshot")
            new = old.apply(message)
        else:
            raise TypeError(f"not a snapshot or a change: {type(message).__name__}")
        self._snapshot = new
        if old is None or new.response_secret != old.response_secret:
            self.response_ids = response_ids.ResponseIds(new.response_secret)
            if self._forwarder is not None:
                self._forwarder.response_ids = self.response_ids
        if old is None or new.keys is not old.keys:
            self.keys.replace(new.keys)
            self.limiter.keep({k.id for k in new.keys if k.limits is not None or k.model_limits})
        if old is None or new.gateway is not old.gateway:
            self._set_gateway(new)
        if old is None or new.leases is not old.leases:
            self.limiter.set_leases({router: {key_id: lease.share for key_id, lease in per_key.items()}
                                     for router, per_key in new.leases.items()}, self.router_id, time.monotonic())
        installed = old is None or new.models is not old.models or new.endpoints is not old.endpoints
        if installed:
            self._models = new.models
            self._install(new)
        elif new.leases is not old.leases:  # the routers sharing the replicas changed
            self._set_capacities()
        # The control plane's homes replace this router's own (R-6.5d): all of them with a snapshot
        # or new lists (a pool made anew starts from them), else what the change sets.
        if installed or isinstance(message, Snapshot):
            if new.homes:
                self.balancer.set_homes(new.homes, time.monotonic())
        elif message.homes:
            self.balancer.set_homes(message.homes, time.monotonic())
        if self._forwarder is not None:
            if isinstance(message, Change):
                abandon = message.abandon
            else:  # in place of changes this router missed: those it has not acted on yet
                seen = set(old.abandoned) if old is not None and old.epoch == new.epoch else ()
                abandon = [replica_id for replica_id in new.abandoned if replica_id not in seen]
            for replica_id in abandon:
                self._forwarder.abandon(replica_id)

    def report_fields(self) -> dict:
        """Keyword arguments for a contracts.feed.Report, less router, seq and sent_at.

        Usage, key use and demand are handed over once (the next call has only what came after);
        the rest is the router's state as of now."""
        usage, key_use = self.usage.drain()
        demand, self._demand = tuple(self._demand), {}
        inflight: dict[str, int] = {}
        for up in self.balancer.counted():
            if up.outstanding > 0:
                inflight[up.replica_id] = inflight.get(up.replica_id, 0) + up.outstanding
        loads = {}
        for up in self.balancer.upstreams():
            if up.engine is not None and up.replica_id not in loads:
                loads[up.replica_id] = up.engine
        snapshot = self._snapshot
        return {"usage": usage, "key_use": key_use, "last_used": self.balancer.last_used(), "inflight": inflight,
                "engine_load": loads, "demand": demand,
                "snapshot": None if snapshot is None else (snapshot.epoch, snapshot.version),
                "counters": self.metrics.counters(), "asked": self.limiter.take_asked(),
                "homes": self.balancer.take_homes()}

    def outstanding(self, replica_id: str) -> int:
        """Requests this router has in flight to a replica, still counted after it left the lists."""
        return self.balancer.outstanding(replica_id)

    def engine_load(self, replica_id: str):
        """The replica's engine load as this router last polled it (EngineLoad), None when unknown."""
        return self.balancer.engine_load(replica_id)

    def web_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=APP_BODY_LIMIT,
                              handler_args=SERVER_SETTINGS)
        app.router.add_get("/", self._landing)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{model}", self._get_model)
        for route in ROUTES:
            app.router.add_route(route.method, route.path, functools.partial(self._proxy, route=route))
        app.on_response_prepare.append(self._rate_limit_headers)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def close(self) -> None:
        """Nothing is written here: what is still counted goes out with the feed client's last report."""

    # -- applying a snapshot ----------------------------------------------------------------------

    def _set_gateway(self, snapshot: Snapshot) -> None:
        gateway = snapshot.gateway
        self._max_body = gateway.max_body
        self._on_demand_wait = gateway.on_demand_wait
        self._queue_wait = gateway.queue_wait
        self._request_timeout = gateway.request_timeout
        self.fairqueue.max_waiting_per_key = gateway.max_waiting_per_key
        self._max_answer = gateway.max_answer
        if self._forwarder is not None:
            self._forwarder.set_read_timeout(gateway.request_timeout)
            self._forwarder.max_answer = gateway.max_answer

    def _install(self, snapshot: Snapshot) -> None:
        endpoints = snapshot.endpoints
        self.balancer.replace(endpoints, {name: model.routing for name, model in snapshot.models.items()})
        self._set_capacities()
        for model, members in endpoints.items():
            if members:
                event = self._arrivals.pop(model, None)
                if event is not None:
                    event.set()

    def _set_capacities(self) -> None:
        """This router's places of each model and their headroom (R-6.17). A model's places are
        the sum over its endpoints of replica_places (the profile's `concurrency`, else the slots
        the engine reported, else the default), divided among the routers of the last leases
        (every router the control plane heard recently), so that routers together give a replica
        no more than that. Called with each snapshot, when the routers sharing them change, and
        after a poll in which an engine's slot count changed."""
        snapshot = self._snapshot
        routers = sorted(snapshot.leases) if snapshot is not None else []
        index = routers.index(self.router_id) if self.router_id in routers else None
        capacities, headrooms = {}, {}
        balancer = self.balancer
        for name, model in self._models.items():
            places = headroom = 0
            for up in balancer.endpoints(name):
                more, spare = replica_places(model.concurrency, up.slots)
                places += more
                headroom += spare
            capacities[name] = router_share(places, len(routers), index)
            headrooms[name] = router_share(headroom, len(routers), index, at_least=0)
        self.fairqueue.set_capacities(capacities, headrooms)

    # -- middleware: authentication and the one place errors become responses ---------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in EXEMPT_PATHS and request.match_info.http_exception is None:
            return await handler(request)
        try:
            if self._snapshot is None:
                raise NotReady("the gateway is starting: this router has not yet received the control plane's "
                               f"models and keys ({self._not_ready_reason()}); retry in a moment")
            headers = request.headers
            authorization = headers.get("Authorization")
            key = self.keys.authenticate(authorization, None if authorization else headers.get("x-api-key"))
            request[_KEY] = key
            self.usage.key_used(key.id, time.time())
            response = await handler(request)
        except RouterError as exc:
            response = error_response(exc, _anthropic(request))
        except web.HTTPException as exc:
            response = error_response(from_http_exception(exc), _anthropic(request))
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            response = error_response(InternalError("internal error in the router; its log has the details"),
                                      _anthropic(request))
        self.metrics.request(request.get(_MODEL, NO_MODEL), response.status)
        return response

    # -- routes -----------------------------------------------------------------------------------

    async def _landing(self, request: web.Request) -> web.Response:
        return landing_page(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        """Ready or not, and the snapshot's age, to anyone (a load balancer); the feed's state and
        this router's id only to a request with a valid key (R-10.2)."""
        if self._snapshot is None:  # it cannot authenticate anyone yet
            return web.json_response({"status": "starting", "reason": self._not_ready_reason(),
                                      "snapshot_age_s": None}, status=503)
        age = self.snapshot_age() if self.snapshot_age is not None else None
        body = {"status": "ok", "snapshot_age_s": None if age is None else round(age, 3)}
        authorization = request.headers.get("Authorization")
        if authorization or request.headers.get("x-api-key"):
            try:
                self.keys.authenticate(authorization, None if authorization else request.headers.get("x-api-key"))
            except RouterError:
                pass  # a health check with a wrong key still learns only what anyone may
            else:
                body.update(router_id=self.router_id, feed=self.feed_status)
        return web.json_response(body)

    def _not_ready_reason(self) -> str:
        reason = (self.feed_status or {}).get("reason")
        return reason or "no snapshot from the control plane yet"

    def _model_entry(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "llmgw"}

    async def _list_models(self, request: web.Request) -> web.Response:
        key: KeyEntry = request[_KEY]
        names = sorted(name for name in self._models if allows(key, name))
        return web.json_response({"object": "list", "data": [self._model_entry(n) for n in names]})

    async def _get_model(self, request: web.Request) -> web.Response:
        key: KeyEntry = request[_KEY]
        name = request.match_info["model"]
        self._resolve(name, key)
        return web.json_response(self._model_entry(name))

    def _resolve(self, name: str, key: KeyEntry) -> RoutedModel:
        """The model, when it exists and the key may use it. Both refusals are one answer (R-6.1):
        a key learns nothing of the models it may not use, not even that they exist."""
        model = self._models.get(name)
        if model is None or not allows(key, name):
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the models "
                                "this key may use")
        return model

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self._max_body:
            raise BodyTooLarge(f"request body is {length} bytes; the limit is {self._max_body} "
                               "(gateway.max_body)")
        limit = self._max_body  # the snapshot's, as of this request
        parts = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is over the limit of {limit} bytes (gateway.max_body)")
            parts.append(chunk)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("", "identity"):
            return body
        return self._decompress(body, encoding)

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        ways = BODY_ENCODINGS.get(encoding)
        if ways is None:
            raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported; send the body "
                                      "uncompressed, or as gzip or deflate")
        problem = None
        for wbits in ways:
            decoder = zlib.decompressobj(wbits)
            try:
                # At most one byte past the limit: a small bomb must not expand in memory.
                plain = decoder.decompress(body, self._max_body + 1)
            except zlib.error as exc:
                problem = str(exc)
                continue
            if len(plain) > self._max_body:
                raise BodyTooLarge(f"request body is over the limit of {self._max_body} bytes once "
                                   "decompressed (gateway.max_body)")
            if decoder.eof:
                return plain
            problem = "the data ends early"
        raise BadRequest(f"the request body is not valid {encoding} data ({problem})")

    def _parse_json(self, body: bytes) -> dict:
        try:
            document = json.loads(body)
        except ValueError:
            raise BadRequest("the request body is not valid JSON (send a JSON object with "
                             "Content-Type: application/json)") from None
        except RecursionError:  # the decoder recurses per level: "[[[[..." exhausts the stack
            raise BadRequest("the request body nests JSON arrays or objects too deeply") from None
        if type(document) is not dict:
            raise BadRequest("the request body must be a JSON object")
        return document

    def _pinned(self, response_id: str, key: KeyEntry, param: str | None = None) -> Pinned:
        """The stored response an id names, when this gateway sealed it for this key (R-6.14).

        Any other id, another key's included, gets the same answer: an id says nothing about
        responses the key did not make."""
        found = self.response_ids.open(response_id)
        if found is None or found.key_id != key.id:
            shown = response_id if len(response_id) <= 256 else response_id[:256] + "..."
            raise ResponseNotFound(f"no response {shown!r} was made through this gateway with this API key",
                                   param=param)
        return Pinned(found.model, found.replica_id, found.engine_id, client_id=response_id)

    async def _proxy(self, request: web.Request, route: Route) -> web.StreamResponse:
        key: KeyEntry = request[_KEY]
        if not limits.Limiter.applies(key):
            return await self._forward(request, route, key, None)
        # The key's own place and request are taken before its body is read: a limited key's
        # request is refused without the router reading (up to gateway.max_body of) it.
        held = self._hold(request, key)
        try:
            return await self._forward(request, route, key, held)
        finally:
            held.release()

    async def _forward(self, request: web.Request, route: Route, key: KeyEntry,
                       held: limits.Admission | None) -> web.StreamResponse:
        document: dict | None = None
        body: bytes | Upload | None = None
        pinned: Pinned | None = None
        stream = strip_usage = strip_continuous = False
        if route.model_from == RESPONSE_ID:
            pinned = self._pinned(request.match_info["response_id"], key)
            name = pinned.model
        elif route.model_from == FORM:
            body = await read_upload(request, self._max_body)
            name = body.model
            if not name:
                raise BadRequest("'model' is required: a model name from GET /v1/models", param="model")
        else:
            body = await self._read_body(request)
            document = self._parse_json(body)
            if "priority" in document:  # the engine's queue order is the gateway's to decide, not the client's
                del document["priority"]
                body = json.dumps(document).encode()
            name = document.get("model")
            if type(name) is not str or not name:
                raise BadRequest("'model' is required: a model name from GET /v1/models", param="model")
            how = streaming(document)
            stream = how.stream
            if route.dialect == RESPONSES:
                pinned = self._previous(document, name, key)
        models = self._models
        model = self._resolve(name, key)
        request[_MODEL] = name
        if not serves(route, model.engine):
            served = ", ".join(sorted(route.engines)) or "no built-in engine"
            raise RouteNotServed(f"model {name!r} runs on {model.engine}, which does not serve "
                                 f"{route.name} (served by: {served})")
        if route.dialect == RESPONSES and document is not None and document.get("background") not in (None, False) \
                and not model.background_responses:
            raise BadRequest(f"model {name!r} does not take background responses: send the request without "
                             "'background' (the operator allows it with background_responses: true on the model)",
                             param="background")
        if isinstance(body, Upload) and model.engine == "vllm" and route.path.endswith("transcriptions"):
            body.ask_for_usage()  # a streamed transcription has usage only when its form asks (R-6.9a)
        if route.dialect == RESPONSES and route.model_from != RESPONSE_ID and model.engine == "sglang" \
                and not model.responses_store and document.get("store") is not False:
            # SGLang never empties its response store: kept off unless the profile opts in.
            document["store"] = False
            body = json.dumps(document).encode()
        if stream and route.chat_stream:  # every stream asks for usage; the client sees it only if it asked
            continuous = model.engine in CONTINUOUS_USAGE_ENGINES  # in every chunk, where the engine can (R-6.9a)
            body = ask_for_usage(document, body, continuous)
            strip_usage = not how.client_wants_usage
            strip_continuous = continuous and not how.client_wants_continuous
        admission = None if held is None else self._admit(request, key, name, body, document, held)
        if pinned is not None:  # a stored answer read back is not counted again; a continuation is
            exchange = Exchange(key.id, route.method, route.dialect, stream,
                                inference=route.model_from != RESPONSE_ID, admission=admission)
        else:  # a form's `stream` field is not read: whether its answer streams is the engine's Content-Type
            exchange = Exchange(key.id, route.method, route.dialect, None if route.model_from == FORM else stream,
                                strip_usage, strip_continuous, admission=admission)
        return await self._route(request, route, models, model, key, document, body, exchange, pinned)

    def _hold(self, request: web.Request, key: KeyEntry) -> limits.Admission:
        """The key's own concurrency and requests per minute, which need no body (R-6.16)."""
        try:
            held = self.limiter.hold(key, time.monotonic())
        except limits.RateLimited as exc:
            request[_LIMITED] = exc.budgets
            raise
        request[_LIMITED] = held.budgets
        return held

    def _admit(self, request: web.Request, key: KeyEntry, name: str, body, document: dict | None,
               held: limits.Admission) -> limits.Admission:
        """The key's tokens and its limits for the model admit this request or refuse it with a
        429 (R-6.16, R-6.16a); `held` is what `_hold` took for it."""
        size = len(body) if type(body) is bytes else request.content_length or 0
        try:
            admission = self.limiter.admit(key, name, limits.estimate(size, document), time.monotonic(),
                                           capped=limits.answer_cap(document) is not None, held=held)
        except limits.RateLimited as exc:
            request[_LIMITED] = exc.budgets
            raise
        request[_LIMITED] = admission.budgets
        return admission

    async def _rate_limit_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        budgets = request.get(_LIMITED)
        if budgets:
            response.headers.update(limits.headers(budgets, time.monotonic()))

    def _previous(self, document: dict, name: str, key: KeyEntry) -> Pinned | None:
        """The stored response a Responses request continues, when it names one (previous_response_id)."""
        previous = document.get("previous_response_id")
        if previous is None:
            return None
        if type(previous) is not str:
            raise InvalidType("'previous_response_id' must be a string", param="previous_response_id")
        pinned = self._pinned(previous, key, "previous_response_id")
        if pinned.model != name:
            raise BadRequest(f"previous_response_id {previous!r} was made by model {pinned.model!r}, which "
                             f"holds it; continue it with model {pinned.model!r}", param="previous_response_id")
        document["previous_response_id"] = pinned.engine_id
        return pinned

    # -- choosing an endpoint, retries, fallbacks, on-demand -------------------------------------

    def _upstream_body(self, models: Mapping[str, RoutedModel], up: Upstream, asked: str, document: dict | None,
                       body: bytes | Upload | None, pinned: Pinned | None):
        """The body for this endpoint: `model` rewritten only when the engine knows another name."""
        if body is None:
            return None
        served = models.get(up.model)
        upstream_name = served.upstream_name if served is not None else up.model
        if isinstance(body, Upload):
            return body.chunks(upstream_name)
        if upstream_name == asked and pinned is None:
            return body
        return json.dumps({**document, "model": upstream_name}).encode()

    def _acquire(self, models: Mapping[str, RoutedModel], route: Route, model: RoutedModel, key: KeyEntry,
                 now: float, tried: list[Upstream], include_ejected: bool = False,
                 affinity: bytes | None = None) -> Upstream | None:
        up = self.balancer.acquire(model.name, now, tried, include_ejected, affinity, key.id)
        if up is None and model.fallbacks:
            for fallback in model.fallbacks:
                if not allows(key, fallback):  # skipped: a fallback is no way around the key's limits
                    continue
                served = models.get(fallback)
                if served is not None and not serves(route, served.engine):  # nor one that lacks the route
                    continue
                up = self.balancer.acquire(fallback, now, tried, include_ejected)
                if up is not None:
                    break
        return up

    def _headers(self, request: web.Request, route: Route, up: Upstream, stream: bool, body) -> dict:
        """Headers for the engine: always its key as Bearer (every engine reads that), never the client's."""
        headers = up.stream_headers if stream else up.headers
        if route.dialect == ANTHROPIC:
            passed = {name: request.headers[name] for name in ANTHROPIC_HEADERS if name in request.headers}
            if passed:
                headers = {**headers, **passed}
        elif isinstance(body, Upload):
            headers = {**headers, "Content-Type": body.content_type}
        elif body is None:
            headers = {name: value for name, value in headers.items() if name != "Content-Type"}
        return headers

    async def _pinned_route(self, request: web.Request, route: Route, models: Mapping[str, RoutedModel],
                            model: RoutedModel, document: dict | None, body, exchange: Exchange,
                            pinned: Pinned) -> web.StreamResponse:
        """A follow-up of a stored response goes to the replica that holds it, or nowhere (R-6.6 does not apply)."""
        up = self.balancer.acquire_replica(pinned.replica_id, model.name, time.monotonic())
        if up is None:
            raise ResponseNotFound(f"response {pinned.client_id!r} is held by replica {pinned.replica_id} of "
                                   f"{model.name!r}, which no longer serves (stopped, replaced or its node is "
                                   "gone); the stored response went with it")
        try:
            path = route.upstream_path(model.engine, pinned.engine_id if route.model_from == RESPONSE_ID else None)
            return await self._forwarder.send(
                request, exchange, up, path, self._upstream_body(models, up, model.name, document, body, pinned),
                self._headers(request, route, up, bool(exchange.stream), body))
        except RouterError as exc:
            if not exc.retryable_before_first_byte:
                raise
            raise UpstreamFailed(f"replica {pinned.replica_id}, which holds response {pinned.client_id!r}, could "
                                 f"not answer: {exc.message}") from None
        finally:
            self.balancer.release(up)

    async def _route(self, request: web.Request, route: Route, models: Mapping[str, RoutedModel],
                     model: RoutedModel, key: KeyEntry, document: dict | None, body, exchange: Exchange,
                     pinned: Pinned | None = None) -> web.StreamResponse:
        if pinned is not None:
            return await self._pinned_route(request, route, models, model, document, body, exchange, pinned)
        fixed_path, plain = route.fixed_path, route.plain
        tried: list[Upstream] = []
        waited_since: float | None = None
        last_error: RouterError | None = None
        # Only requests that run the model choose or use a home; tokenizing is balanced by load (R-6.5b).
        affinity = (affinity_key(document, request.headers, key.id)
                    if document is not None and route.inference and self.balancer.policy(model.name) == PREFIX
                    else None)
        fairqueue = self.fairqueue
        while True:
            now = time.monotonic()
            if model.on_demand and waited_since is None and not self.balancer.has_endpoints(model.name):
                self._note_demand(model.name)
                waited_since = now
            if not fairqueue.take(model.name, key.id, key.priority, key.weight):  # every place is taken: wait for one
                await fairqueue.wait(model.name, key.id, key.priority, key.weight, self._queue_wait, bool(tried))
                now = time.monotonic()
            up = self._acquire(models, route, model, key, now, tried, affinity=affinity)
            if up is None:
                if model.on_demand and self.on_demand is not None and not self.balancer.has_endpoints(model.name):
                    fairqueue.leave(model.name, now, key.id)
                    await self._wait_for(model.name, waited_since or now)
                    continue
                # Every endpoint is ejected: a recently failed one beats a certain 503.
                up = self._acquire(models, route, model, key, now, tried, include_ejected=True, affinity=affinity)
            if up is None:
                fairqueue.leave(model.name, now, key.id)
                if last_error is not None:
                    raise UpstreamFailed(f"no engine of {model.name!r} could answer after {len(tried)} "
                                         f"attempts; last: {last_error.message}")
                raise NoCapacity(f"no replica of {model.name!r} is serving; retry later")
            if fixed_path is not None:
                path = fixed_path
            else:
                served = models.get(up.model)
                path = route.upstream_path(served.engine if served is not None else None)
            # The key is homed once the engine has accepted the request (R-6.5b), not when it is sent.
            accepted = (None if affinity is None or up.model != model.name
                        else functools.partial(self.balancer.keep_home, model.name, affinity, key.id, now, up))
            try:
                return await self._forwarder.send(
                    request, exchange, up, path, self._upstream_body(models, up, model.name, document, body, None),
                    None if plain else self._headers(request, route, up, bool(exchange.stream), body), accepted)
            except RouterError as exc:
                if isinstance(body, Upload) and body.problem is not None:
                    raise body.problem from None
                if not exc.retryable_before_first_byte:
                    raise
                if isinstance(body, Upload) and not body.replayable:
                    raise UploadNotReplayed(f"the engine of replica {up.replica_id} failed while the upload was "
                                            f"being sent ({exc.message}); an upload is not resent, send it again") from None
                last_error = exc
                tried.append(up)
                if up.ejected_until <= now:
                    self.balancer.eject(up, time.monotonic())
                    self.metrics.ejection(up.model)
                    log.warning("ejected replica %s of %s for %.0f s: %s", up.replica_id, up.model,
                                self.balancer.eject_seconds, exc.message)
                if len(tried) >= MAX_ATTEMPTS:
                    raise UpstreamFailed(f"no engine of {model.name!r} could answer after {len(tried)} "
                                         f"attempts; last: {exc.message}") from None
                self.metrics.retry(model.name)
            finally:
                self.balancer.release(up)
                fairqueue.leave(model.name, now, key.id)

    def _note_demand(self, model: str) -> None:
        self._demand[model] = None
        if self.on_demand is not None:
            try:
                self.on_demand()
            except Exception:
                log.exception("telling the feed about demand for on-demand model %s failed", model)

    async def _wait_for(self, model: str, since: float) -> None:
        wait = self._on_demand_wait
        remaining = since + wait - time.monotonic()
        event = self._arrivals.get(model)
        if event is None:
            event = self._arrivals[model] = asyncio.Event()
        if remaining > 0:
            try:
                await asyncio.wait_for(event.wait(), remaining)
                return
            except asyncio.TimeoutError:
                pass
        raise ModelLoading(f"model {model!r} is starting on demand and was not ready within "
                           f"{wait:.0f} s; retry later")

    # -- background work ----------------------------------------------------------------------------

    async def _lifecycle(self, app: web.Application):
        connector = aiohttp.TCPConnector(limit=UPSTREAM_CONNECTIONS, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_SECONDS)
        # No sock_read: it re-arms a timer on every chunk received. The Forwarder bounds the wait
        # for the first byte per attempt and its Watchdog ends streams gone silent after that.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=None)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                        skip_auto_headers=("Accept-Encoding", "User-Agent"))
        self._forwarder = Forwarder(session, self.metrics, self.usage, self._request_timeout, self.response_ids)
        self._forwarder.max_answer = self._max_answer
        tasks = [asyncio.create_task(self._forwarder.watchdog.run()),
                 asyncio.create_task(EnginePoller(self.balancer, session, on_slots=self._set_capacities).run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            await self._forwarder.close()
            await self.close()


def router_share(places: int, routers: int, index: int | None, at_least: int = 1) -> int:
    """One router's part of `places` shared by `routers` routers: `index` is its place among them
    in the order of their ids (None: not among them yet, the smaller part). The parts add up to
    `places`, each at least `at_least`: one for a model's places, so every router can serve (with
    more routers than places they together exceed it); none for the headroom, which is room above
    the places. 0 stays 0 (no endpoints: nothing is held back)."""
    if places <= 0 or routers <= 1:
        return places
    part, rest = divmod(places, routers)
    return max(at_least, part + (1 if index is not None and index < rest else 0))


def _anthropic(request: web.Request) -> bool:
    """Anthropic's clients read errors in Anthropic's shape on its Messages routes."""
    return request.path.startswith("/v1/messages")
