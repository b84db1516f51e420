"""A request's trail (R-6.20): its id, and what happened to it on its way, noted as it goes.

The router's handler (router/app.py) makes a `Trail` for every API request, before anything can
fail, and hands it to the route's handler; the intake puts it in the request's `Exchange`, so
the dispatch and the forwarder note on it what they do: the key's name, the model and the name the
client asked for, each wait for a place or an on-demand replica, each attempt (its replica and
node, how it ended), the first byte of a relayed stream and how that stream ended, the tokens
counted. When the answer is done the handler finishes the trail and, when the request log keeps
this request, makes it a `RequestRecord` (`to_record`). `dress` puts the headers every answer
carries on an answer before it is prepared.

The hooks (`queue_start`, `queue_end`, `attempt_start`, `attempt_end`, `first_byte`,
`stream_end`, `finish`) are where a tracer hangs its spans (router/tracing.py, R-6.21): one that
traces the request sets `span` when the trail is made, and each hook hands the span what it
noted (`TrailSpan`). Without a
span a hook is a few attribute stores; nothing on the trail logs, formats or allocates.

Request ids: the client's own `X-Request-Id` when it is 1 to 128 characters of `A-Z a-z 0-9 . _ :
-`; else this process's random prefix and a counter (`new_request_id`), unique across routers and
restarts without a random draw per request. An id the client sent that is not usable is kept, cut
to 128 characters, as the record's `client_request_id`; it is never logged, sent on or answered.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web

from llmgw.contracts.feed import RequestRecord
from llmgw.router import limits

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_CHARS = 128
_USABLE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}").fullmatch
CLIENT_CLOSED = "client_closed"  # the error of a request whose client left before its answer ended
CLIENT_CLOSED_STATUS = 499  # the status of one that left before any answer (nginx's "client closed request")


def _new_prefix() -> str:
    # 64 random bits per process: two routers (or one restarted) share a prefix with odds of
    # about n² / 2^65 over n process starts.
    return secrets.token_hex(8) + "-"


_prefix = _new_prefix()
_counter = itertools.count(1)


def _after_fork() -> None:
    global _prefix, _counter
    _prefix, _counter = _new_prefix(), itertools.count(1)


os.register_at_fork(after_in_child=_after_fork)  # a forked child must not repeat its parent's ids


def new_request_id() -> str:
    """A router-made request id: this process's prefix and the next number, in hex."""
    return "%s%x" % (_prefix, next(_counter))


def request_id_of(sent: str | None) -> tuple[str, str | None]:
    """(the request's id, the client's id kept for the record when it is not usable)."""
    if sent is None:
        return new_request_id(), None
    if _USABLE_ID(sent):
        return sent, None
    # Header values are decoded with surrogateescape: a byte that is not UTF-8 becomes '?'.
    return new_request_id(), sent[:REQUEST_ID_CHARS].encode("utf-8", "replace").decode("utf-8")


class TrailSpan(Protocol):
    """What a tracer's span of one request is told, hook by hook (`Trail.span`)."""

    def queue_start(self, now: float, reason: str) -> None:
        """A wait begins: `places` (the model's fair queue) or `on_demand` (a replica starting)."""

    def queue_end(self, now: float) -> None: ...

    def attempt_start(self, upstream, trail: Trail) -> Mapping[str, str] | None:
        """An attempt at `upstream` (a balancer.Upstream) begins; headers to send the engine with it."""

    def attempt_end(self, status: int, error: str | None) -> None: ...

    def first_byte(self, now: float) -> None: ...

    def stream_end(self, now: float, error: str | None) -> None: ...

    def answered(self, tail: bytes) -> None:
        """The answer's end as relayed (a whole answer, or a stream's last chunks). The forwarder
        calls it on `Trail.span` itself, only when there is one: the tail is not put together for
        a request nobody traces."""

    def finish(self, trail: Trail) -> None:
        """The answer is done: `trail` holds everything the record would."""


class Trail:
    """One request as it goes. Times are time.monotonic() unless said otherwise."""

    __slots__ = ("id", "client_request_id", "at", "started", "key", "model", "asked", "budgets", "attempts",
                 "replica", "node", "fallback", "queued", "_queue_since", "ttfb", "stream", "prompt_tokens",
                 "completion_tokens", "estimated", "status", "error", "duration", "span")

    def __init__(self, request_id: str, client_request_id: str | None, at: float, started: float):
        self.id = request_id
        self.client_request_id = client_request_id
        self.at = at  # time.time() at arrival: the record's `at`
        self.started = started  # time.monotonic() at arrival: durations are taken from it
        self.key = self.model = self.asked = self.budgets = self.replica = self.node = self.fallback = None
        self.queued = self._queue_since = self.ttfb = self.prompt_tokens = self.completion_tokens = None
        self.status = self.error = self.duration = self.span = None
        self.attempts = 0
        self.stream = self.estimated = False

    # -- hooks ----------------------------------------------------------------------------------

    def queue_start(self, now: float, reason: str = "places") -> None:
        """The request begins to wait: for a place of its model (R-6.17, `places`) or an on-demand
        replica (R-6.8, `on_demand`)."""
        self._queue_since = now
        if self.span is not None:
            self.span.queue_start(now, reason)

    def queue_end(self, now: float) -> None:
        since = self._queue_since
        if since is not None:
            self._queue_since = None
            self.queued = (self.queued or 0.0) + (now - since)
        if self.span is not None:
            self.span.queue_end(now)

    def attempt_start(self, upstream) -> Mapping[str, str] | None:
        """An attempt at `upstream` begins; returns headers to add to the engine's (a tracer's), or None."""
        self.attempts += 1
        self.replica = upstream.replica_id
        self.node = upstream.node
        if self.span is not None:
            return self.span.attempt_start(upstream, self)
        return None

    def attempt_end(self, status: int, error: str | None = None) -> None:
        """The attempt ended with the status the engine (or the router, for a failure) gave it."""
        if self.span is not None:
            self.span.attempt_end(status, error)

    def first_byte(self, now: float) -> None:
        """A relayed stream's first byte goes to the client."""
        self.stream = True
        self.ttfb = now - self.started
        if self.span is not None:
            self.span.first_byte(now)

    def stream_end(self, now: float, error: str | None = None) -> None:
        """The relayed stream ended: whole (None), cut (the code the client was sent), or its client left."""
        if error is not None:
            self.error = error
        if self.span is not None:
            self.span.stream_end(now, error)

    def tokens(self, prompt: int, completion: int, estimated: bool) -> None:
        self.prompt_tokens, self.completion_tokens, self.estimated = prompt, completion, estimated

    def dress(self, response: web.StreamResponse, now: float) -> None:
        """The headers every API answer carries, put on before it is prepared: the request's id
        (R-6.20), and a limited key's x-ratelimit-* headers (R-6.16)."""
        headers = response.headers
        headers[REQUEST_ID_HEADER] = self.id
        if self.budgets:
            headers.update(limits.headers(self.budgets, now))

    def finish(self, now: float, status: int, error: str | None) -> None:
        """The answer is done (or its client left): `status` as the client got it, `error` the
        RouterError's code, if any; a stream's own end (`stream_end`) is kept when it had one."""
        self.status = status
        if error is not None:
            self.error = error
        self.duration = now - self.started
        if self.ttfb is None and status != CLIENT_CLOSED_STATUS:
            self.ttfb = self.duration  # a whole answer: its first byte goes with the rest, now
        if self.span is not None:
            self.span.finish(self)



class _Record:
    """A RequestRecord made without the frozen dataclass's __init__ (an object.__setattr__ per
    field): the same slots, then the class swapped, as the feed's fast paths do."""

    __slots__ = RequestRecord.__slots__

    def __init__(self, trail: Trail, route: str, client: str | None):
        self.at = trail.at
        self.id = trail.id
        self.route = route
        self.status = trail.status
        self.duration = round(trail.duration, 6)  # microseconds are enough, and shorter on the wire
        self.key = trail.key
        self.model = trail.model
        self.asked = trail.asked
        self.replica = trail.replica
        self.node = trail.node
        self.error = trail.error
        self.attempts = trail.attempts
        self.fallback = trail.fallback
        queued, ttfb = trail.queued, trail.ttfb
        self.queued = None if queued is None else round(queued, 6)
        self.ttfb = None if ttfb is None else round(ttfb, 6)
        self.prompt_tokens = trail.prompt_tokens
        self.completion_tokens = trail.completion_tokens
        self.estimated = trail.estimated
        self.stream = trail.stream
        self.client = client
        self.client_request_id = trail.client_request_id
        object.__setattr__(self, "__class__", RequestRecord)


def to_record(trail: Trail, route: str, client: str | None) -> RequestRecord:
    """The finished trail as the request log's record: `route` the method and route pattern,
    `client` the client's address."""
    return _Record(trail, route, client)  # type: ignore[return-value]
