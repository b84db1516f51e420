"""The client-facing listener: routes, authentication, the one place errors become responses (SPEC §6).

A proxied request is taken in by router/intake.py, which makes its one value (`Exchange`), and
sent on by router/dispatch.py (fair queue, endpoints, fallbacks, on-demand wait, retries) through
the forwarder (router/proxy.py). What the feed sets — snapshot, models, keys, gateway settings,
capacities — and what the router reports are router/feedstate.py's: the router is fed only by the
router feed (R-10.1) and reads no catalog, configuration or database. Until the first snapshot it
answers every API request with a 503, since it cannot authenticate anyone yet.

Every API request gets a trail (router/trail.py) before anything else: its id, which every answer
carries as X-Request-Id (set as the response is prepared, streams included), every error body names
and the engine is sent; and what happens to it, which becomes the request log's record when the
answer is done (R-6.20).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import aiohttp
import prometheus_client
from aiohttp import web

from llmgw.contracts.feed import Change, KeyEntry, RoutedModel, Snapshot
from llmgw.router.balancer import Balancer
from llmgw.router.dispatch import Dispatch
from llmgw.router.engineload import EnginePoller
from llmgw.router.errors import InternalError, NotReady, RouterError, error_response, from_http_exception
from llmgw.router.fairqueue import FairQueue
from llmgw.router.feedstate import FeedState
from llmgw.router.intake import Intake
from llmgw.router.keys import allows
from llmgw.router.landing import landing_page
from llmgw.router import limits
from llmgw.router.metrics import NO_MODEL, RouterMetrics
from llmgw.router.proxy import Forwarder
from llmgw.router.routes import ROUTES, Route
from llmgw.router.tracing import Tracing
from llmgw.router.trail import (CLIENT_CLOSED, CLIENT_CLOSED_STATUS, REQUEST_ID_HEADER, TRAIL, Trail, TrailSpan,
                                request_id_of, to_record)
from llmgw.router.usage import UsageMeter

log = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/", "/healthz"})  # exact paths, never prefixes
CONNECT_TIMEOUT = 5.0  # an engine on the management network answers a connect well within this
UPSTREAM_CONNECTIONS = 8192  # explicit: aiohttp's default silently queues requests past 100
KEEPALIVE_SECONDS = 4.0  # below the 5 s after which uvicorn and llama-server close idle connections
# aiohttp's own body limit is set far above any gateway.max_body: the router checks the
# snapshot's limit itself, so a new one applies to the next request without rebuilding the app.
APP_BODY_LIMIT = 1 << 40
# Server settings the router depends on. They travel with the app (handler_args override the
# runner's arguments), so they hold however the app is run.
SERVER_SETTINGS = {
    # Cancel the handler when its client disconnects, so the engine's request is cancelled at
    # once instead of at the next chunk.
    "handler_cancellation": True,
    # Compressed bodies are decoded by the intake (intake.read_body), not by aiohttp's parser,
    # whose refusals of a body that does not decode are plain text, or a 500 once the handler
    # reads it.
    "auto_decompress": False,
    "max_field_size": 16384,
}
RUNNER_OPTIONS = {"access_log": None}  # no log line per request on the hot path
UNMATCHED_PATH_CHARS = 200  # of a path no route matches, as the request log names its route

_KEY = web.RequestKey("llmgw_key", KeyEntry)


class Router:
    """The OpenAI-compatible gateway: `web_app()` is the client listener's aiohttp application.

    Its feed is given `feed` (a feedstate.FedRouter); `apply`, `report_fields` and `snapshot`
    are the feed state's, here too for whoever holds the router."""

    __slots__ = ("balancer", "fairqueue", "metrics", "usage", "limiter", "request_log", "feed", "keys", "intake",
                 "dispatch", "tracer", "tracing", "_created", "_route_names")

    def __init__(self, *, registry: prometheus_client.CollectorRegistry | None = None):
        self.balancer = Balancer()
        self.fairqueue = FairQueue()  # places per model under saturation
        self.metrics = RouterMetrics(registry, self.balancer.outstanding_by_model, self.balancer.upstreams,
                                     self.fairqueue.waiting)
        self.usage = UsageMeter()
        self.limiter = limits.Limiter()
        self.feed = FeedState(balancer=self.balancer, fairqueue=self.fairqueue, limiter=self.limiter,
                              usage=self.usage, metrics=self.metrics)
        self.request_log = self.feed.request_log  # kept as the feed's settings say, drained into reports
        self.keys = self.feed.keys  # the keys in force, which the feed replaces
        self.intake = Intake(self.feed, self.limiter, self.balancer)
        self.dispatch = Dispatch(self.feed, self.balancer, self.fairqueue, self.metrics)
        # tracer(request, trail): the span (trail.TrailSpan) a tracer follows the request with, or
        # None; a request's hooks hand it what they note. None: nothing is traced.
        self.tracer: Callable[[web.Request, Trail], TrailSpan | None] | None = None
        # Sets `tracer` while the feed's gateway settings name a collector.
        self.tracing = self.feed.tracing = Tracing(self)
        self._created = int(time.time())
        self._route_names: dict[web.AbstractRoute, str] = {}  # "POST /v1/chat/completions", per route

    # -- the feed -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot | None:
        """The snapshot routed with now, None before the first one."""
        return self.feed.snapshot

    def apply(self, message: Snapshot | Change) -> None:
        """FeedState.apply: a Snapshot, or the Change that follows the current version."""
        self.feed.apply(message)

    def report_fields(self) -> dict:
        """FeedState.report_fields: what the router's next Report carries."""
        return self.feed.report_fields()

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
        app.on_response_prepare.append(self._answer_headers)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def close(self) -> None:
        """The request log's file gets what its writer holds, the collector the spans not exported
        yet (R-6.21). Nothing else is written here: what is still counted goes out with the feed
        client's last report."""
        await asyncio.to_thread(self.request_log.close)
        await self.tracing.close()

    # -- middleware: authentication and the one place errors become responses ---------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in EXEMPT_PATHS and request.match_info.http_exception is None:
            return await handler(request)
        at = time.time()
        trail = Trail(*request_id_of(request.headers.get(REQUEST_ID_HEADER)), at, time.monotonic())
        request[TRAIL] = trail
        if self.tracer is not None:
            trail.span = self.tracer(request, trail)
        error = None
        try:
            if self.feed.snapshot is None:
                raise NotReady("the gateway is starting: this router has not yet received the control plane's "
                               f"models and keys ({self._not_ready_reason()}); retry in a moment")
            headers = request.headers
            authorization = headers.get("Authorization")
            key = self.keys.authenticate(authorization, None if authorization else headers.get("x-api-key"))
            request[_KEY] = key
            trail.key = key.name
            self.usage.key_used(key.id, at)
            response = await handler(request)
        except RouterError as exc:
            error = exc
        except web.HTTPException as exc:
            error = from_http_exception(exc)
        except asyncio.CancelledError:
            # The client left. Its record says so, then the cancellation goes on: a stream it was
            # sent is a 200 whose end (`stream_end`) says whether it was whole; else nothing was.
            if trail.stream:
                self._finish(request, trail, 200, None)
            else:
                self._finish(request, trail, CLIENT_CLOSED_STATUS, CLIENT_CLOSED)
            raise
        except Exception:
            log.exception("unexpected error answering %s %s (request %s)", request.method, request.path, trail.id)
            error = InternalError("internal error in the router; its log has the details")
        if error is not None:
            response = error_response(error, _anthropic(request), trail.id)
            self._finish(request, trail, error.status, error.code)
        else:
            self._finish(request, trail, response.status, None)
        self.metrics.request(trail.model or NO_MODEL, response.status)
        return response

    def _finish(self, request: web.Request, trail: Trail, status: int, error: str | None) -> None:
        """The answer is done: the trail finished and, when the request log keeps it, recorded."""
        trail.finish(time.monotonic(), status, error)
        request_log = self.request_log
        if request_log.keeps():
            request_log.keep(to_record(trail, self._route_name(request), request.remote))

    def _route_name(self, request: web.Request) -> str:
        """The method and the route's path pattern ("POST /v1/chat/completions"); for a path no
        route matches, the method and the path itself, cut short."""
        match = request.match_info
        if match.http_exception is not None:
            return f"{request.method} {request.path[:UNMATCHED_PATH_CHARS]}"
        route = match.route
        name = self._route_names.get(route)
        if name is None:
            name = self._route_names[route] = f"{route.method} {route.resource.canonical}"
        return name

    async def _answer_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every API answer names its request (R-6.20); a limited key's carries its x-ratelimit-* headers."""
        trail = request.get(TRAIL)
        if trail is None:  # "/" and "/healthz"
            return
        response.headers[REQUEST_ID_HEADER] = trail.id
        budgets = trail.budgets
        if budgets:
            response.headers.update(limits.headers(budgets, time.monotonic()))

    # -- routes -----------------------------------------------------------------------------------

    async def _landing(self, request: web.Request) -> web.Response:
        return landing_page(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        """Ready or not, and the snapshot's age, to anyone (a load balancer); the feed's state and
        this router's id only to a request with a valid key (R-10.2)."""
        feed = self.feed
        if feed.snapshot is None:  # it cannot authenticate anyone yet
            return web.json_response({"status": "starting", "reason": self._not_ready_reason(),
                                      "snapshot_age_s": None}, status=503)
        age = feed.snapshot_age() if feed.snapshot_age is not None else None
        body = {"status": "ok", "snapshot_age_s": None if age is None else round(age, 3)}
        authorization = request.headers.get("Authorization")
        if authorization or request.headers.get("x-api-key"):
            try:
                self.keys.authenticate(authorization, None if authorization else request.headers.get("x-api-key"))
            except RouterError:
                pass  # a health check with a wrong key still learns only what anyone may
            else:
                body.update(router_id=feed.router_id, feed=feed.feed_status)
        return web.json_response(body)

    def _not_ready_reason(self) -> str:
        reason = (self.feed.feed_status or {}).get("reason")
        return reason or "no snapshot from the control plane yet"

    def _model_entry(self, model: RoutedModel) -> dict:
        entry = {"id": model.name, "object": "model", "created": self._created, "owned_by": "llmgw"}
        if model.alias_of is not None:
            entry["alias_for"] = model.alias_of
        if model.adapter_of is not None:  # its base, as vLLM lists an adapter (its path, `root`, is the node's)
            entry["parent"] = model.adapter_of
        return entry

    async def _list_models(self, request: web.Request) -> web.Response:
        key: KeyEntry = request[_KEY]
        models = self.feed.models
        listed = []
        for name in sorted(models):
            model = models[name]
            if allows(key, name) or (model.alias_of is not None and allows(key, model.alias_of)):
                listed.append(self._model_entry(model))
        return web.json_response({"object": "list", "data": listed})

    async def _get_model(self, request: web.Request) -> web.Response:
        key: KeyEntry = request[_KEY]
        return web.json_response(self._model_entry(self.intake.resolve(request.match_info["model"], key)))

    async def _proxy(self, request: web.Request, route: Route) -> web.StreamResponse:
        key: KeyEntry = request[_KEY]
        intake = self.intake
        trail = request[TRAIL]
        if not limits.Limiter.applies(key):
            return await self.dispatch.route(request, await intake.take(request, route, key, None, trail))
        # The key's own place and request are taken before its body is read: a limited key's
        # request is refused without the router reading (up to gateway.max_body of) it.
        held = intake.hold(trail, key)
        try:
            return await self.dispatch.route(request, await intake.take(request, route, key, held, trail))
        finally:
            held.release()

    # -- background work ----------------------------------------------------------------------------

    async def _lifecycle(self, app: web.Application):
        connector = aiohttp.TCPConnector(limit=UPSTREAM_CONNECTIONS, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_SECONDS)
        # No sock_read: it re-arms a timer on every chunk received. The Forwarder's Watchdog bounds
        # the wait for an attempt's answer and ends streams gone silent after their first byte.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=None)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        forwarder = Forwarder(session, self.metrics, self.usage, self.feed.gateway.request_timeout)
        self.feed.attach(forwarder)
        self.dispatch.forwarder = forwarder
        tasks = [asyncio.create_task(forwarder.watchdog.run()),
                 asyncio.create_task(EnginePoller(self.balancer, session, on_slots=self.feed.set_capacities).run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            await forwarder.close()
            await self.close()


def _anthropic(request: web.Request) -> bool:
    """Anthropic's clients read errors in Anthropic's shape on its Messages routes."""
    return request.path.startswith("/v1/messages")
