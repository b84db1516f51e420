"""The client-facing gateway: its routes, authentication, the one place errors become responses (SPEC §6).

A proxied request is taken in by router/intake.py, which makes its one value (`Exchange`), and
sent on by router/dispatch.py (fair queue, endpoints, fallbacks, on-demand wait, retries) through
the forwarder (router/proxy.py). What the feed sets — snapshot, models, keys, gateway settings,
capacities — and what the router reports are router/feedstate.py's: the router is fed only by the
router feed (R-10.1) and reads no catalog, configuration or database. Until the first snapshot it
answers every API request with a 503, since it cannot authenticate anyone yet.

Every API request gets a trail (router/trail.py) before anything else: its id, which every answer
carries as X-Request-Id (`Trail.dress`: put on where an answer is made, a stream's by the forwarder
before it is prepared), every error body names and the engine is sent; and what happens to it, which
becomes the request log's record when the answer is done (R-6.20).

It is served by aiohttp's low-level server with its own route table (router/listener.py): `runner()`
gives the runner any aiohttp site serves it with.
"""

from __future__ import annotations

import asyncio
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
from llmgw.router.listener import PATH_PARAMS, Listener, ListenerRunner, Match, Routes
from llmgw.router.metrics import NO_MODEL, RouterMetrics
from llmgw.router.proxy import Forwarder
from llmgw.router.routes import ROUTES, Route
from llmgw.router.tracing import Tracing
from llmgw.router.trail import (CLIENT_CLOSED, CLIENT_CLOSED_STATUS, REQUEST_ID_HEADER, Trail, TrailSpan,
                                request_id_of, to_record)
from llmgw.router.usage import UsageMeter

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0  # an engine on the management network answers a connect well within this
UPSTREAM_CONNECTIONS = 8192  # explicit: aiohttp's default silently queues requests past 100
KEEPALIVE_SECONDS = 4.0  # below the 5 s after which uvicorn and llama-server close idle connections


class Router:
    """The OpenAI-compatible gateway: `runner()` serves its client listener (`listener`).

    Its feed is given `feed` (a feedstate.FedRouter); `apply`, `report_fields` and `snapshot`
    are the feed state's, here too for whoever holds the router."""

    __slots__ = ("balancer", "fairqueue", "metrics", "usage", "limiter", "request_log", "feed", "keys", "intake",
                 "dispatch", "tracer", "tracing", "listener", "_routes", "_created", "_tasks", "_session")

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
        # tracer(request, trail, pattern): the span (trail.TrailSpan) a tracer follows the request
        # with, or None; a request's hooks hand it what they note. None: nothing is traced.
        self.tracer: Callable[[web.BaseRequest, Trail, str], TrailSpan | None] | None = None
        # Sets `tracer` while the feed's gateway settings name a collector.
        self.tracing = self.feed.tracing = Tracing(self)
        self._created = int(time.time())
        routes = self._routes = Routes()
        routes.add("GET", "/", self._landing, exempt=True)
        routes.add("GET", "/healthz", self._healthz, exempt=True)
        routes.add("GET", "/v1/models", self._list_models)
        routes.add("GET", "/v1/models/{model}", self._get_model)
        for route in ROUTES:
            routes.add(route.method, route.path, self._proxy_as(route))
        self.listener = Listener(self._handle, self._start, self._stop)
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

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

    def runner(self, shutdown_timeout: float = 60.0) -> ListenerRunner:
        """The runner of the client listener, for aiohttp's sites; made in the event loop. Its
        setup starts the engine session and the background work, its cleanup stops them."""
        return self.listener.runner(shutdown_timeout)

    async def close(self) -> None:
        """The request log's file gets what its writer holds, the collector the spans not exported
        yet (R-6.21). Nothing else is written here: what is still counted goes out with the feed
        client's last report."""
        await asyncio.to_thread(self.request_log.close)
        await self.tracing.close()

    # -- the handler: authentication and the one place errors become responses -----------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        match = self._routes.resolve(request.method, request.rel_url.path_safe)
        if match.exempt:
            return await match.handler(request, None, None)
        at = time.time()
        trail = Trail(*request_id_of(request.headers.get(REQUEST_ID_HEADER)), at, time.monotonic())
        if self.tracer is not None:
            trail.span = self.tracer(request, trail, match.pattern)
        error = None
        try:
            if self.feed.snapshot is None:
                raise NotReady("the gateway is starting: this router has not yet received the control plane's "
                               f"models and keys ({self._not_ready_reason()}); retry in a moment")
            headers = request.headers
            authorization = headers.get("Authorization")
            key = self.keys.authenticate(authorization, None if authorization else headers.get("x-api-key"))
            trail.key = key.name
            self.usage.key_used(key.id, at)
            if match.error is not None:
                raise match.error
            if match.params:
                request[PATH_PARAMS] = match.params
            response = await match.handler(request, key, trail)
        except RouterError as exc:
            error = exc
        except web.HTTPException as exc:
            error = from_http_exception(exc)
        except asyncio.CancelledError:
            # The client left. Its record says so, then the cancellation goes on: a stream it was
            # sent is a 200 whose end (`stream_end`) says whether it was whole; else nothing was.
            if trail.stream:
                self._finish(request, match, trail, 200, None)
            else:
                self._finish(request, match, trail, CLIENT_CLOSED_STATUS, CLIENT_CLOSED)
            raise
        except Exception:
            log.exception("unexpected error answering %s %s (request %s)", request.method, request.path, trail.id)
            error = InternalError("internal error in the router; its log has the details")
        if error is not None:
            response = error_response(error, _anthropic(request), trail.id)
            self._finish(request, match, trail, error.status, error.code)
        else:
            self._finish(request, match, trail, response.status, None)
        if not response.prepared:
            trail.dress(response, time.monotonic())
        self.metrics.request(trail.model or NO_MODEL, response.status)
        return response

    def _finish(self, request: web.BaseRequest, match: Match, trail: Trail, status: int, error: str | None) -> None:
        """The answer is done: the trail finished and, when the request log keeps it, recorded
        under its route's name ("POST /v1/chat/completions"; unmatched: the method and the path)."""
        trail.finish(time.monotonic(), status, error)
        request_log = self.request_log
        if request_log.keeps():
            route = match.name or f"{request.method} {match.pattern}"
            request_log.keep(to_record(trail, route, request.remote))

    # -- routes -----------------------------------------------------------------------------------

    async def _landing(self, request: web.BaseRequest, *_) -> web.Response:
        return landing_page(request)

    async def _healthz(self, request: web.BaseRequest, *_) -> web.Response:
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

    async def _list_models(self, request: web.BaseRequest, key: KeyEntry, *_) -> web.Response:
        models = self.feed.models
        listed = []
        for name in sorted(models):
            model = models[name]
            if allows(key, name) or (model.alias_of is not None and allows(key, model.alias_of)):
                listed.append(self._model_entry(model))
        return web.json_response({"object": "list", "data": listed})

    async def _get_model(self, request: web.BaseRequest, key: KeyEntry, *_) -> web.Response:
        return web.json_response(self._model_entry(self.intake.resolve(request[PATH_PARAMS]["model"], key)))

    def _proxy_as(self, route: Route):
        """The handler of a proxied route."""
        intake, dispatch = self.intake, self.dispatch

        async def proxy(request: web.BaseRequest, key: KeyEntry, trail: Trail) -> web.StreamResponse:
            if not limits.Limiter.applies(key):
                return await dispatch.route(request, await intake.take(request, route, key, None, trail))
            # The key's own place and request are taken before its body is read: a limited key's
            # request is refused without the router reading (up to gateway.max_body of) it.
            held = intake.hold(trail, key)
            try:
                return await dispatch.route(request, await intake.take(request, route, key, held, trail))
            finally:
                held.release()
        return proxy

    # -- background work ----------------------------------------------------------------------------

    async def _start(self) -> None:
        """The listener starts: the engine session, the forwarder and the background work."""
        connector = aiohttp.TCPConnector(limit=UPSTREAM_CONNECTIONS, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_SECONDS)
        # No sock_read: it re-arms a timer on every chunk received. The Forwarder's Watchdog bounds
        # the wait for an attempt's answer and ends streams gone silent after their first byte.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=None)
        session = self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        forwarder = Forwarder(session, self.metrics, self.usage, self.feed.gateway.request_timeout)
        self.feed.attach(forwarder)
        self.dispatch.forwarder = forwarder
        self._tasks = [asyncio.create_task(forwarder.watchdog.run()),
                       asyncio.create_task(EnginePoller(self.balancer, session,
                                                        on_slots=self.feed.set_capacities).run())]

    async def _stop(self) -> None:
        """The listener stopped: what `_start` started ends, then `close`."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.dispatch.forwarder is not None:
            await self.dispatch.forwarder.close()
        await self.close()


def _anthropic(request: web.BaseRequest) -> bool:
    """Anthropic's clients read errors in Anthropic's shape on its Messages routes."""
    return request.path.startswith("/v1/messages")
