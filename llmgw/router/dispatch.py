"""An Exchange sent on its way: a place in its model's fair queue (R-6.17), an endpoint of the
model or of its fallbacks (R-6.7), a wait for an on-demand model's first replica (R-6.8),
another endpoint after a failure before the first byte and the failed one ejected (R-6.6); a
follow-up of a stored response to the one replica that holds it, or nowhere (R-6.14).
"""

from __future__ import annotations

import functools
import logging
import time

from aiohttp import web

from llmgw.router.balancer import Balancer, Upstream
from llmgw.router.errors import (AdapterNotLoaded, NoCapacity, ResponseNotFound, RouterError, UploadNotReplayed,
                                 UpstreamFailed)
from llmgw.router.exchange import Exchange
from llmgw.router.fairqueue import FairQueue
from llmgw.router.feedstate import FeedState
from llmgw.router.keys import allows
from llmgw.router.metrics import RouterMetrics
from llmgw.router.proxy import Forwarder
from llmgw.router.routes import serves
from llmgw.router.uploads import Upload

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # endpoints tried for one request before it fails


class Dispatch:
    """Chooses the endpoints an Exchange is sent to and has the forwarder send it."""

    def __init__(self, feed: FeedState, balancer: Balancer, fairqueue: FairQueue, metrics: RouterMetrics):
        self.feed = feed
        self.balancer = balancer
        self.fairqueue = fairqueue
        self.metrics = metrics
        self.forwarder: Forwarder | None = None  # the running app's, set when it starts

    async def route(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        if exchange.pinned is not None:
            return await self._pinned_route(request, exchange)
        model, key, affinity, trail = exchange.model, exchange.key, exchange.affinity, exchange.trail
        name = model.name
        # Whose replicas serve it, whose places it takes and whose start it waits for: a LoRA
        # adapter's base's; the balancer gives it only the replicas that hold it.
        home = name
        on_demand = model.on_demand
        if model.adapter_of is not None:
            home = model.adapter_of
            base = exchange.models.get(home)
            on_demand = base is not None and base.on_demand
        feed, balancer, fairqueue = self.feed, self.balancer, self.fairqueue
        tried: list[Upstream] = []
        waited_since: float | None = None
        last_error: RouterError | None = None
        while True:
            now = time.monotonic()
            if model.loadable and not tried and balancer.has_endpoints(home):
                await self._loaded_somewhere(exchange, home)  # held by a replica, or loaded on one
            if on_demand and waited_since is None and not balancer.has_endpoints(home):
                feed.note_demand(home)
                waited_since = now
            if not fairqueue.take(home, key.id, key.priority, key.weight):  # every place is taken: wait for one
                trail.queue_start(now)
                try:
                    await fairqueue.wait(home, key.id, key.priority, key.weight, feed.gateway.queue_wait, bool(tried))
                finally:
                    trail.queue_end(time.monotonic())
                now = time.monotonic()
            up = self._acquire(exchange, now, tried)
            if up is None:
                if on_demand and feed.on_demand is not None and not balancer.has_endpoints(home):
                    fairqueue.leave(home, now, key.id)
                    trail.queue_start(now, "on_demand")
                    try:
                        await feed.await_arrival(home, waited_since or now)
                    finally:
                        trail.queue_end(time.monotonic())
                    continue
                # Every endpoint is ejected: a recently failed one beats a certain 503.
                up = self._acquire(exchange, now, tried, include_ejected=True)
            if up is None:
                fairqueue.leave(home, now, key.id)
                if last_error is not None:
                    raise UpstreamFailed(f"no engine of {name!r} could answer after {len(tried)} "
                                         f"attempts; last: {last_error.message}")
                if home is not name:
                    raise NoCapacity(f"no replica of {home!r} holding its adapter {name!r} is serving; retry later")
                raise NoCapacity(f"no replica of {name!r} is serving; retry later")
            # The key is homed once the engine has accepted the request (R-6.5b), not when it is sent.
            accepted = (None if affinity is None or up.model != home
                        else functools.partial(balancer.keep_home, name, affinity, key.id, now, up))
            use = None
            if home is not name:  # a LoRA adapter's request: what the control plane unloads by
                uses = up.adapter_use
                if uses is None:
                    uses = up.adapter_use = {}
                use = uses.get(name)
                if use is None:
                    use = uses[name] = [0, 0.0]
                use[0] += 1
                use[1] = time.time()
            try:
                response = await self.forwarder.send(request, exchange, up, accepted)
                self.metrics.answered(up.replica_id, response.status)
                trail.attempt_end(response.status)
                if up.model != home:
                    trail.fallback = up.model  # the fallback that served
                return response
            except RouterError as exc:
                self.metrics.answered(up.replica_id, exc.status)
                trail.attempt_end(exc.status, exc.code)
                body = exchange.body
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
                    balancer.eject(up, time.monotonic())
                    self.metrics.ejection(up.model)
                    log.warning("ejected replica %s of %s for %.0f s: %s (request %s)", up.replica_id, up.model,
                                balancer.eject_seconds, exc.message, trail.id)
                if len(tried) >= MAX_ATTEMPTS:
                    raise UpstreamFailed(f"no engine of {name!r} could answer after {len(tried)} "
                                         f"attempts; last: {exc.message}") from None
                self.metrics.retry(name)
            finally:
                balancer.release(up)
                fairqueue.leave(home, now, key.id)
                if use is not None:
                    use[0] -= 1

    async def _loaded_somewhere(self, exchange: Exchange, base: str) -> None:
        """A LoRA adapter its base's replicas load on demand (R-8.8): when none holds it, the
        control plane is asked for a load (the next report, sent now) and the request waits for
        it, or fails at once with the reason a load failed; when every holder is over the load
        bound, another load is asked for and the request goes to a holder meanwhile."""
        name, balancer, feed = exchange.model.name, self.balancer, self.feed
        if balancer.has_endpoints(name):
            if balancer.adapter_pressed(name, base):
                feed.note_demand(name)
            return
        since = time.monotonic()
        trail = exchange.trail
        while not balancer.has_endpoints(name):
            error = balancer.adapter_error(name)
            if error is not None:
                raise AdapterNotLoaded(f"adapter {name!r} could not be loaded on a replica of {base!r}: {error}")
            feed.note_demand(name)
            trail.queue_start(time.monotonic(), "adapter_load")
            try:
                await feed.await_arrival(name, since, f"is a LoRA adapter of {base!r} being loaded")
            finally:
                trail.queue_end(time.monotonic())

    def _acquire(self, exchange: Exchange, now: float, tried: list[Upstream],
                 include_ejected: bool = False) -> Upstream | None:
        model, key = exchange.model, exchange.key
        up = self.balancer.acquire(model.name, now, tried, include_ejected, exchange.affinity, key.id)
        if up is None and model.fallbacks and model.adapter_of is None:  # an adapter has none
            route, models = exchange.route, exchange.models
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

    async def _pinned_route(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        """A follow-up of a stored response goes to the replica that holds it, or nowhere (R-6.6 does not apply)."""
        pinned, model = exchange.pinned, exchange.model
        up = self.balancer.acquire_replica(pinned.replica_id, model.adapter_of or model.name, time.monotonic())
        if up is None:
            raise ResponseNotFound(f"response {pinned.client_id!r} is held by replica {pinned.replica_id} of "
                                   f"{model.name!r}, which no longer serves (stopped, replaced or its node is "
                                   "gone); the stored response went with it")
        trail = exchange.trail
        try:
            response = await self.forwarder.send(request, exchange, up)
            trail.attempt_end(response.status)
            return response
        except RouterError as exc:
            trail.attempt_end(exc.status, exc.code)
            if not exc.retryable_before_first_byte:
                raise
            raise UpstreamFailed(f"replica {pinned.replica_id}, which holds response {pinned.client_id!r}, could "
                                 f"not answer: {exc.message}") from None
        finally:
            self.balancer.release(up)
