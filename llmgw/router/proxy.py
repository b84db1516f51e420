"""One attempt at one endpoint: send the request, relay the answer, note the usage.

A failure before anything has reached the client becomes a RouterError whose
`retryable_before_first_byte` tells the caller whether another endpoint may be tried (R-6.6).
A stream is committed to the client only once the engine's first bytes are in hand. After that,
nothing is retried: an engine that breaks mid-stream ends the client's stream with an error
event and a cut connection, so the client cannot take a truncated answer for a complete one.

The hot loop relays bytes as they come (`readany`) with no per-chunk parsing or logging; usage is
taken from the tail of the stream, and the usage-only event is removed only where the client did
not ask for it (R-6.9), as is the usage vLLM and SGLang put in every chunk when asked (R-6.9a).
Every request that got an answer is counted once, however its stream ended: a stream that carried
no usage is counted from the events relayed, as an estimate (usage.estimate_stream), and a limited
key's reservation settles to that.

Each attempt is noted on the request's trail (router/trail.py): its start (which sends the engine
the request's id as X-Request-Id, and whatever a tracer adds: the attempt's `traceparent`,
R-6.21), a relayed stream's first byte and how the stream ended, the tokens counted, and for a
tracer's span the answer's end; every log line about a request names its id (R-6.20).

Read timeouts: one `Watchdog` sweeps what is in flight once a second (more often for a request
timeout under 4 s). An attempt still waiting for its engine's answer past gateway.request_timeout
is cancelled and becomes a 504 (or the next endpoint); a relayed stream whose engine has been
silent that long is ended. No timer is armed per request: `asyncio.timeout` per attempt, and
aiohttp's own `sock_read`, which re-arms a timer on every chunk received, measured at a few per
cent more router CPU per request and about a third more per streamed event
(bench/router_overhead.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from yarl import URL

from llmgw.router import response_ids
from llmgw.router.balancer import Upstream
from llmgw.router.exchange import Exchange
from llmgw.router.errors import (UpstreamAnswerTooLarge, UpstreamConnectFailed, UpstreamRefused, UpstreamRejectedKey,
                                 UpstreamTimeout)
from llmgw.router.metrics import RouterMetrics
from llmgw.router.routes import ANTHROPIC, OPENAI, RESPONSES
from llmgw.router.trail import CLIENT_CLOSED, Trail
from llmgw.router.usage import (UsageMeter, anthropic_stream_usage, complete_events_end, estimate_stream,
                                find_usage, strip_usage, tokens, usage_from_body)

log = logging.getLogger(__name__)

_USAGE = b'"usage"'
MAX_PENDING = 1 << 20  # an engine that never ends an event still gets relayed past this
DEFAULT_MAX_ANSWER = 64 * 1024**2  # bytes of a non-streamed answer, until told otherwise
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_NOT_EDITED = {"strip_usage": False, "strip_continuous": False}


HEAD_BYTES = 16384  # an Anthropic stream's message_start (its input counts) is within this
_STOPPED = ("the engine stopped in the middle of the answer; the answer is incomplete", "upstream_interrupted")
_SILENT = ("the engine went silent in the middle of the answer (gateway.request_timeout); the answer is incomplete",
           "upstream_timeout")


def _mid_stream_error(message: str, code: str, request_id: str) -> bytes:
    # The leading blank line ends any event the engine left half-written.
    return b"\n\ndata: " + json.dumps({"error": {"message": message, "type": "upstream_error", "code": code,
                                                 "param": None, "request_id": request_id}}).encode() + b"\n\n"


def _anthropic_mid_stream_error(message: str, code: str, request_id: str) -> bytes:
    # Anthropic's clients raise on an `error` event; the blank line first ends a half-written event.
    return b"\n\nevent: error\ndata: " + json.dumps({"type": "error", "error": {"type": "api_error", "message": message},
                                                      "request_id": request_id}).encode() + b"\n\n"


# What shows a stream's engine had sent all of it, per dialect: a client may leave at once after
# (the openai client closes after `data: [DONE]`) while the engine has not ended its body yet.
_ENDS = {OPENAI: (b"data: [DONE]",), ANTHROPIC: (b"message_stop",),
         RESPONSES: (b"response.completed", b"response.incomplete", b"response.failed")}


def _whole(tail: bytes, dialect: str) -> bool:
    return any(end in tail for end in _ENDS.get(dialect, ()))


def _answered(trail: Trail, tail: bytes) -> None:
    """A tracer's span is told the answer's end (its model, its finish reasons; R-6.21)."""
    if trail.span is not None:
        trail.span.answered(tail)


def _connect_error(up: Upstream, exc: BaseException, trail: Trail) -> UpstreamConnectFailed:
    # aiohttp's and asyncio's messages name the engine's host:port; clients only learn the replica
    # and the errno's words, the gateway's log keeps the rest.
    log.info("replica %s: engine %s: %s: %s (request %s)", up.replica_id, up.endpoint.url, type(exc).__name__, exc,
             trail.id)
    errno = getattr(exc, "errno", None)
    why = f"{type(exc).__name__}: {os.strerror(errno)}" if isinstance(errno, int) and errno > 0 else type(exc).__name__
    return UpstreamConnectFailed(f"could not reach the engine of replica {up.replica_id} ({why})")


def _timeout(up: Upstream) -> UpstreamTimeout:
    return UpstreamTimeout(f"the engine of replica {up.replica_id} accepted the request but sent "
                           "nothing within the read timeout (gateway.request_timeout)")


class _Watch:
    __slots__ = ("resp", "progress", "seen", "since", "expired")

    def __init__(self, resp: aiohttp.ClientResponse, now: float):
        self.resp = resp
        self.progress = 0  # bumped by the relay loop on every chunk: the cheapest sign of life
        self.seen = 0
        self.since = now
        self.expired = False


class Watchdog:
    """Cancels attempts whose engine has not answered within `timeout` seconds, and ends relayed
    streams whose engine has sent nothing for that long. `attempts` is the forwarder's record of
    the attempts in flight, by replica."""

    def __init__(self, timeout: float, attempts: dict[str, set[_Attempt]]):
        self.timeout = timeout
        self.interval = min(1.0, timeout / 4)
        self._watches: set[_Watch] = set()
        self._attempts = attempts

    def watch(self, resp: aiohttp.ClientResponse) -> _Watch:
        watch = _Watch(resp, time.monotonic())
        self._watches.add(watch)
        return watch

    def forget(self, watch: _Watch) -> None:
        self._watches.discard(watch)

    def sweep(self, now: float) -> None:
        for attempts in list(self._attempts.values()):
            for attempt in list(attempts):
                if attempt.task is not None and now - attempt.started > self.timeout and not attempt.timed_out:
                    attempt.timed_out = True
                    attempt.task.cancel()  # the attempt becomes UpstreamTimeout (Forwarder.send)
        for watch in list(self._watches):
            if watch.progress != watch.seen:
                watch.seen, watch.since = watch.progress, now
            elif now - watch.since > self.timeout and not watch.expired:
                watch.expired = True
                watch.resp.close()  # the relay loop's read fails and ends the client's stream

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sweep(time.monotonic())


class _Attempt:
    """One attempt in flight: `task` while it waits for the engine's answer (None once relaying)."""

    __slots__ = ("task", "resp", "abandoned", "started", "timed_out")

    def __init__(self, task: asyncio.Task | None, started: float):
        self.task = task
        self.resp: aiohttp.ClientResponse | None = None
        self.abandoned = False  # the replica was given up (Forwarder.abandon)
        self.started = started
        self.timed_out = False  # no answer within the read timeout (Watchdog.sweep)


# How many times an Anthropic stream that begins without message_start is asked for again.
ANTHROPIC_RESENDS = 3


def _lacks_message_start(first: bytes) -> bool:
    """An Anthropic stream whose first event is another named event (comments are let through)."""
    head = first.lstrip()
    return head.startswith(b"event:") and not head.startswith(b"event: message_start") \
        and not head.startswith(b"event:message_start")


class Forwarder:
    """Sends one attempt to one endpoint and relays its answer."""

    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, usage: UsageMeter,
                 read_timeout: float, ids: response_ids.ResponseIds | None = None):
        self.session = session
        self.response_ids = ids  # seals the Responses ids handed out; set by the router's snapshot
        self._fresh: aiohttp.ClientSession | None = None  # for resends: never a pooled connection
        self.metrics = metrics
        self.usage = usage
        self.read_timeout = read_timeout
        self.max_answer = DEFAULT_MAX_ANSWER  # gateway.max_answer, set by the router
        self._attempts: dict[str, set[_Attempt]] = {}
        self.watchdog = Watchdog(read_timeout, self._attempts)

    def set_read_timeout(self, seconds: float) -> None:
        """gateway.request_timeout changed: later attempts and the stream watchdog use the new one."""
        self.read_timeout = seconds
        self.watchdog.timeout = seconds
        self.watchdog.interval = min(1.0, seconds / 4)

    def abandon(self, replica_id: str) -> int:
        """The control plane gave this replica up (its node is unreachable): attempts still
        waiting for its first byte are retried elsewhere, streams already relaying end with an
        error, instead of waiting up to request_timeout for a peer that cannot answer."""
        attempts = self._attempts.get(replica_id, ())
        for attempt in list(attempts):
            attempt.abandoned = True
            if attempt.task is not None:
                attempt.task.cancel()
            elif attempt.resp is not None:
                attempt.resp.close()  # the relay loop's read fails: the stream ends with an error
        return len(attempts)

    async def send(self, request: web.BaseRequest, exchange: Exchange, up: Upstream,
                   accepted: Callable[[], None] | None = None) -> web.StreamResponse:
        """One attempt of `exchange` on `up`. `accepted` is called once the engine answers with a
        status below 400."""
        stream, method, dialect, key_id = exchange.stream, exchange.route.method, exchange.route.dialect, exchange.key.id
        trail = exchange.trail
        # What it counts under: the model of the endpoint (a fallback's own), or the LoRA adapter
        # the request named, which its base's endpoint served.
        served = up.model if exchange.model.adapter_of is None else exchange.model.name
        url = up.base_url + exchange.upstream_path(up)
        body = exchange.upstream_body(up)
        headers = exchange.upstream_headers(request, up)
        extra = trail.attempt_start(up)
        if extra:
            headers.update(extra)
        started = time.monotonic()
        resp = None
        finished = False
        attempt = _Attempt(asyncio.current_task(), started)
        attempts = self._attempts.get(up.replica_id)
        if attempts is None:
            attempts = self._attempts[up.replica_id] = set()
        attempts.add(attempt)
        try:
            try:
                # Until the first byte: the watchdog's read timeout (Watchdog.sweep).
                resp = await self._request(method, url, body, headers)
                status = resp.status
                self.metrics.upstream_latency(served, time.monotonic() - started)
                if status == 502 or status == 503:
                    raise UpstreamRefused(f"the engine of replica {up.replica_id} answered {status}")
                if status == 401:  # passed on, it would tell the client its own key is wrong
                    raise UpstreamRejectedKey(f"the engine of replica {up.replica_id} refused the "
                                              "router's engine key; check the replica's api key")
                if accepted is not None and status < 400:
                    accepted()
                relay = status == 200 and (stream if stream is not None
                                           else resp.content_type == "text/event-stream")
                if relay:
                    first = await resp.content.readany()
                    for _ in range(ANTHROPIC_RESENDS):
                        if dialect != ANTHROPIC or not _lacks_message_start(first):
                            break
                        # llama-server now and then starts an Anthropic stream past its
                        # message_start, which clients need (and which carries the prompt's
                        # tokens). Nothing has reached the client: ask the engine again.
                        log.info("replica %s began an Anthropic stream without message_start; asking again "
                                 "(request %s)", up.replica_id, trail.id)
                        resp.close()
                        resp = await self._request(method, url, body, headers)
                        if resp.status != 200:
                            raise UpstreamRefused(f"the engine of replica {up.replica_id} answered {resp.status}")
                        first = await resp.content.readany()
                    if not first:
                        raise UpstreamConnectFailed(f"the engine of replica {up.replica_id} ended the "
                                                    "stream before sending anything")
                else:
                    answer = await self._read_answer(resp, up)
            except aiohttp.ConnectionTimeoutError as exc:
                raise _connect_error(up, exc, trail) from None
            except aiohttp.ClientError as exc:
                raise _connect_error(up, exc, trail) from None
            except asyncio.CancelledError:
                if attempt.timed_out and asyncio.current_task().uncancel() == 0:
                    raise _timeout(up) from None
                if attempt.abandoned and asyncio.current_task().uncancel() == 0:
                    raise UpstreamConnectFailed(f"replica {up.replica_id} was given up while this request "
                                                "waited for it (its node is unreachable)") from None
                # The client left before the engine answered: a request, whose tokens nobody knows.
                self.usage.add(key_id, served, 0, 0, unmetered=True, via=exchange.via)
                raise
            # From here on a cancellation is the client's; an abandoned replica's stream is cut
            # by closing its response instead.
            attempt.task, attempt.resp = None, resp
            if attempt.abandoned:
                raise UpstreamConnectFailed(f"replica {up.replica_id} was given up (its node is unreachable)")
            if relay:
                # Only SSE is edited; any other streamed format is relayed exactly as it comes.
                sse = resp.content_type == "text/event-stream"
                size = len(body) if isinstance(body, bytes) else 0  # a prompt estimated from it
                if sse and dialect != OPENAI:
                    response = await self._relay_events(request, exchange, resp, up, served, first, size)
                else:
                    if not sse and (exchange.strip_usage or exchange.strip_continuous):
                        exchange = exchange._replace(**_NOT_EDITED)  # not SSE: relayed as it comes
                    response = await self._relay_stream(request, exchange, resp, up, served, first, size)
            else:
                if dialect == RESPONSES:  # the ids clients see name the replica that holds the response
                    answer = self.response_ids.rewrite(answer, served, up.replica_id, key_id)
                _answered(trail, answer)
                if status == 200:
                    usage = {} if exchange.read_back else usage_from_body(answer)
                    if usage is None:  # an answer without usage: its tokens are unknown, not 0
                        self.usage.add(key_id, served, 0, 0, unmetered=True, via=exchange.via)
                    else:
                        self._count(exchange, served, *tokens(usage))
                response = web.Response(body=answer, status=status,
                                        headers={"Content-Type": resp.headers.get("Content-Type",
                                                                                  "application/json")})
            finished = True
            return response
        finally:
            attempts.discard(attempt)
            if not attempts:
                self._attempts.pop(up.replica_id, None)
            if resp is not None:
                if finished and resp.content.is_eof():
                    resp.release()
                else:
                    resp.close()  # the engine sees the connection go: cancels its work

    async def _read_answer(self, resp: aiohttp.ClientResponse, up: Upstream) -> bytes:
        """A non-streamed answer, read as it comes and refused past gateway.max_answer, so that
        an engine cannot make the router hold more than that for it (R-6.18)."""
        limit = self.max_answer
        length = resp.content_length
        parts, size = [], 0
        while length is None or length <= limit:
            chunk = await resp.content.readany()
            if not chunk:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            size += len(chunk)
            if size > limit:
                break
            parts.append(chunk)
        raise UpstreamAnswerTooLarge(f"the engine of replica {up.replica_id} answered with more than {limit} bytes "
                                     "(gateway.max_answer); ask for a shorter answer, or stream it")

    async def _request(self, method: str, url: str, body, headers) -> aiohttp.ClientResponse:
        # `url` is the endpoint's encoded base and a path built by the route table: taken as it is,
        # so that nothing in it is decoded or normalised (a `..` collapsed) out of the route (R-6.14a).
        url = URL(url, encoded=True)
        try:
            return await self.session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # no connection could be made: the engine is not there
            if not (body is None or isinstance(body, bytes)):
                raise  # a streamed upload may have sent part of the client's file: not again
            # A pooled keep-alive connection the engine closed as it was taken: llama-server
            # drops connections without `Connection: close` (after a stream, and under load).
            # Nothing was answered: once more, on a connection made for it (the pool may hold
            # more connections the engine has dropped).
            return await self.fresh_session().request(method, url, data=body, headers=headers)

    def fresh_session(self) -> aiohttp.ClientSession:
        """A session like the pooled one whose connections are never reused."""
        if self._fresh is None or self._fresh.closed:
            self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                                timeout=self.session.timeout)
        return self._fresh

    async def close(self) -> None:
        if self._fresh is not None:
            await self._fresh.close()
            self._fresh = None

    async def _relay_stream(self, request: web.BaseRequest, exchange: Exchange, resp: aiohttp.ClientResponse,
                            up: Upstream, served: str, chunk: bytes, body_size: int) -> web.StreamResponse:
        strip, strip_continuous = exchange.strip_usage, exchange.strip_continuous
        trail = exchange.trail
        content_type = resp.content_type
        headers = SSE_HEADERS if content_type == "text/event-stream" else {**SSE_HEADERS, "Content-Type": content_type}
        response = web.StreamResponse(status=200, headers=headers)
        now = time.monotonic()
        trail.first_byte(now)
        trail.dress(response, now)
        await response.prepare(request)
        readany = resp.content.readany
        write = response.write
        watch = self.watchdog.watch(resp)
        usage = None
        oldest = older = old = b""  # the last three chunks relayed: where the usage event is
        pending = b""
        events = 0  # relayed: a cut stream's completion is estimated from them
        try:
            if not (strip or strip_continuous):
                while chunk:
                    await write(chunk)
                    events += chunk.count(b"\n\n")
                    oldest, older, old = older, old, chunk
                    chunk = await readany()
                    watch.progress += 1
            else:
                while chunk:
                    if pending:
                        chunk, pending = pending + chunk, b""
                    if not chunk.endswith(b"\n\n"):  # hold back an event cut between reads
                        end = complete_events_end(chunk)
                        if end or len(chunk) > MAX_PENDING:
                            if end:
                                chunk, pending = chunk[:end], chunk[end:]
                        else:
                            chunk, pending = b"", chunk
                    if chunk:
                        # A usage-only event has "choices": []; continuous usage is in every chunk.
                        if b"[]" in chunk or (strip_continuous and _USAGE in chunk):
                            chunk, found = strip_usage(chunk, strip, strip_continuous)
                            if found is not None:
                                usage = found
                        if chunk:
                            await write(chunk)
                            events += chunk.count(b"\n\n")
                            oldest, older, old = older, old, chunk
                    chunk = await readany()
                    watch.progress += 1
                if pending:
                    await write(pending)
        except asyncio.CancelledError:
            # The client left: after `data: [DONE]` the openai client closes at once, while
            # llama-server may not yet have ended its body. Usage already relayed still counts;
            # without it, what was relayed is counted as an estimate (R-6.9a).
            tail = oldest + older + old
            self._count_stream(exchange, served, usage or find_usage(tail), body_size, events)
            _answered(trail, tail)
            trail.stream_end(time.monotonic(), None if _whole(tail, exchange.route.dialect) else CLIENT_CLOSED)
            raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            # Usage the engine reported before the break is counted all the same: llama-server
            # may close the connection after its last event without ending the chunked body.
            tail = oldest + older + old
            self._count_stream(exchange, served, usage or find_usage(tail), body_size, events)
            _answered(trail, tail)
            transport = request.transport
            if transport is None or transport.is_closing():
                # The client went away: returning closes the engine's connection.
                trail.stream_end(time.monotonic(), None if _whole(tail, exchange.route.dialect) else CLIENT_CLOSED)
                return response
            # The engine broke after the client got bytes: nothing may be retried.
            await self._cut(request, response, exchange, up, watch.expired, exc)
            return response
        finally:
            self.watchdog.forget(watch)
        self._count_stream(exchange, served, usage or find_usage(oldest + older + old), body_size, events)
        if trail.span is not None:
            trail.span.answered(oldest + older + old)
        trail.stream_end(time.monotonic())
        return response

    def _count_stream(self, exchange: Exchange, model: str, usage: dict | None, body_size: int, events: int,
                      prompt: int | None = None) -> None:
        """A relayed stream, counted once: from its usage, else estimated from what was relayed."""
        if usage is not None:
            self._count(exchange, model, *tokens(usage))
        else:
            self._count(exchange, model, *estimate_stream(body_size, events, prompt))

    async def _relay_events(self, request: web.BaseRequest, exchange: Exchange, resp: aiohttp.ClientResponse,
                            up: Upstream, served: str, chunk: bytes, body_size: int) -> web.StreamResponse:
        """A Responses or Anthropic stream: whole events relayed as they complete, comments and
        named events untouched; Responses ids rewritten to name their replica; usage from
        `response.completed`, or from Anthropic's message_start and message_delta."""
        dialect, key_id, trail = exchange.route.dialect, exchange.key.id, exchange.trail
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        now = time.monotonic()
        trail.first_byte(now)
        trail.dress(response, now)
        await response.prepare(request)
        readany = resp.content.readany
        watch = self.watchdog.watch(resp)
        rewrite = self.response_ids.rewrite if dialect == RESPONSES else None
        head = b""
        oldest = older = old = b""
        pending = b""
        events = 0
        try:
            while chunk:
                if pending:
                    chunk, pending = pending + chunk, b""
                end = len(chunk) if chunk.endswith(b"\n\n") else complete_events_end(chunk)
                if end or len(chunk) > MAX_PENDING:
                    if end:
                        chunk, pending = chunk[:end], chunk[end:]
                    if rewrite is not None:
                        chunk = rewrite(chunk, served, up.replica_id, key_id)
                    await response.write(chunk)
                    events += chunk.count(b"\n\n")
                    if len(head) < HEAD_BYTES:
                        head += chunk[:HEAD_BYTES]
                    oldest, older, old = older, old, chunk
                else:
                    pending = chunk
                chunk = await readany()
                watch.progress += 1
            if pending:
                await response.write(pending)
                oldest, older, old = older, old, pending
        except asyncio.CancelledError:
            # The client left (after the last event, at times before the engine ended its body):
            # usage already relayed still counts, as on chat streams, else what was relayed.
            tail = oldest + older + old
            self._count_events(exchange, served, head, tail, body_size, events)
            _answered(trail, tail)
            trail.stream_end(time.monotonic(), None if _whole(tail, dialect) else CLIENT_CLOSED)
            raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            tail = oldest + older + old
            self._count_events(exchange, served, head, tail, body_size, events)
            _answered(trail, tail)
            transport = request.transport
            if transport is None or transport.is_closing():
                trail.stream_end(time.monotonic(), None if _whole(tail, dialect) else CLIENT_CLOSED)
                return response
            await self._cut(request, response, exchange, up, watch.expired, exc)
            return response
        finally:
            self.watchdog.forget(watch)
        self._count_events(exchange, served, head, oldest + older + old, body_size, events)
        if trail.span is not None:
            trail.span.answered(oldest + older + old)
        trail.stream_end(time.monotonic())
        return response

    def _count_events(self, exchange: Exchange, model: str, head: bytes, tail: bytes, body_size: int,
                      events: int) -> None:
        """Usage of a Responses or Anthropic stream from its first and last events; without its
        final usage, estimated from what was relayed (Anthropic's message_start gives the prompt)."""
        if exchange.route.dialect != ANTHROPIC:
            self._count_stream(exchange, model, find_usage(tail), body_size, events)
            return
        if b"message_delta" in tail and find_usage(tail) is not None:
            self._count(exchange, model, *tokens(anthropic_stream_usage(head, tail)))
            return
        start = anthropic_stream_usage(head, b"")  # message_start's: the prompt the engine counted
        self._count_stream(exchange, model, None, body_size, events, tokens(start)[0] if start else None)

    @staticmethod
    async def _cut(request: web.BaseRequest, response: web.StreamResponse, exchange: Exchange, up: Upstream,
                   silent: bool, exc: BaseException) -> None:
        """End a stream the engine broke (or went silent in) after its first byte: an error event
        naming the request, then the connection cut."""
        trail = exchange.trail
        log.warning("replica %s %s a stream after its first byte: %s (request %s)", up.replica_id,
                    "went silent in" if silent else "broke", type(exc).__name__, trail.id)
        message, code = _SILENT if silent else _STOPPED
        error = _anthropic_mid_stream_error if exchange.route.dialect == ANTHROPIC else _mid_stream_error
        trail.stream_end(time.monotonic(), code)
        try:
            await response.write(error(message, code, trail.id))
        except ConnectionError:
            return
        transport = request.transport
        if transport is not None:
            transport.close()  # no final chunk: the client cannot mistake this for a whole answer

    def _count(self, exchange: Exchange, model: str, prompt: int, completion: int, estimated: int = 0) -> None:
        self.usage.add(exchange.key.id, model, prompt, completion, estimated, via=exchange.via)
        exchange.trail.tokens(prompt, completion, estimated > 0)
        if prompt or completion:  # a limited key's reservation becomes what was used; unknown keeps the estimate
            admission = exchange.admission
            if admission is not None:
                admission.settle(prompt + completion)
        if prompt or completion:
            self.metrics.add_tokens(model, prompt, completion)
