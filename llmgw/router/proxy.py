"""One attempt at one endpoint: send the request, relay the answer, note the usage.

A failure before anything has reached the client becomes a RouterError whose
`retryable_before_first_byte` tells the caller whether another endpoint may be tried (R-6.6).
A stream is committed to the client only once the engine's first bytes are in hand. After that,
nothing is retried: an engine that breaks mid-stream ends the client's stream with an error
event and a cut connection, so the client cannot take a truncated answer for a complete one.

The hot loop relays bytes as they come (`readany`) with no per-chunk parsing or logging; usage is
taken from the tail of the stream, and the usage-only event is removed only where the client did
not ask for it (R-6.9).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from llmgw.router.balancer import Upstream
from llmgw.router.errors import UpstreamConnectFailed, UpstreamRefused, UpstreamTimeout
from llmgw.router.metrics import RouterMetrics
from llmgw.router.usage import (UsageMeter, complete_events_end, find_usage, strip_usage_event, tokens,
                                usage_from_body)

log = logging.getLogger(__name__)

MAX_PENDING = 1 << 20  # an engine that never ends an event still gets relayed past this
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MID_STREAM_ERROR = (b'\n\ndata: {"error": {"message": "the engine stopped in the middle of the answer; '
                     b'the answer is incomplete", "type": "upstream_error", "code": "upstream_interrupted", '
                     b'"param": null}}\n\n')


def _connect_error(up: Upstream, exc: BaseException) -> UpstreamConnectFailed:
    return UpstreamConnectFailed(f"could not reach the engine of replica {up.replica_id} "
                                 f"({type(exc).__name__}: {exc})")


def _timeout(up: Upstream) -> UpstreamTimeout:
    return UpstreamTimeout(f"the engine of replica {up.replica_id} accepted the request but sent "
                           "nothing within the read timeout (gateway.request_timeout)")


class Forwarder:
    """Sends one attempt to one endpoint and relays its answer."""

    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, usage: UsageMeter):
        self.session = session
        self.metrics = metrics
        self.usage = usage

    async def send(self, request: web.Request, up: Upstream, path: str, body: bytes, stream: bool,
                   strip_usage: bool, key_id: str) -> web.StreamResponse:
        started = time.monotonic()
        try:
            resp = await self.session.post(up.endpoint.url + path, data=body,
                                           headers=up.stream_headers if stream else up.headers)
        except aiohttp.ConnectionTimeoutError as exc:
            raise _connect_error(up, exc) from None
        except asyncio.TimeoutError:
            raise _timeout(up) from None
        except aiohttp.ClientError as exc:
            raise _connect_error(up, exc) from None
        finished = False
        try:
            status = resp.status
            self.metrics.upstream_latency(up.model, time.monotonic() - started)
            if status == 502 or status == 503:
                raise UpstreamRefused(f"the engine of replica {up.replica_id} answered {status}")
            if stream and status == 200 and resp.content_type == "text/event-stream":
                response = await self._relay_stream(request, resp, up, strip_usage, key_id)
            else:
                try:
                    answer = await resp.read()
                except asyncio.TimeoutError:
                    raise _timeout(up) from None
                except aiohttp.ClientError as exc:
                    raise _connect_error(up, exc) from None
                if status == 200:
                    prompt, completion = tokens(usage_from_body(answer))
                    self._count(key_id, up.model, prompt, completion)
                response = web.Response(body=answer, status=status,
                                        headers={"Content-Type": resp.headers.get("Content-Type",
                                                                                  "application/json")})
            finished = True
            return response
        finally:
            if finished and resp.content.is_eof():
                resp.release()
            else:
                resp.close()  # the engine sees the connection go: cancels its work

    async def _relay_stream(self, request: web.Request, resp: aiohttp.ClientResponse, up: Upstream,
                            strip: bool, key_id: str) -> web.StreamResponse:
        readany = resp.content.readany
        try:
            chunk = await readany()
        except asyncio.TimeoutError:
            raise _timeout(up) from None
        except aiohttp.ClientError as exc:
            raise _connect_error(up, exc) from None
        if not chunk:
            raise UpstreamConnectFailed(f"the engine of replica {up.replica_id} ended the stream "
                                        "before sending anything")

        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        write = response.write
        usage = None
        oldest = older = old = b""  # the last three chunks relayed: where the usage event is
        pending = b""
        try:
            if not strip:
                while chunk:
                    await write(chunk)
                    oldest, older, old = older, old, chunk
                    chunk = await readany()
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
                        if b"[]" in chunk:  # a usage-only event has "choices": []
                            chunk, found = strip_usage_event(chunk)
                            if found is not None:
                                usage = found
                        if chunk:
                            await write(chunk)
                            oldest, older, old = older, old, chunk
                    chunk = await readany()
                if pending:
                    await write(pending)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # The engine broke after the client got bytes: nothing may be retried.
            log.warning("replica %s broke a stream after its first byte: %s", up.replica_id,
                        type(exc).__name__)
            await self._cut(request, response)
            return response
        except ConnectionError:
            # The client went away: returning closes the engine's connection.
            return response
        if usage is None:
            usage = find_usage(oldest + older + old)
        prompt, completion = tokens(usage)
        self._count(key_id, up.model, prompt, completion)
        return response

    @staticmethod
    async def _cut(request: web.Request, response: web.StreamResponse) -> None:
        try:
            await response.write(_MID_STREAM_ERROR)
        except ConnectionError:
            return
        transport = request.transport
        if transport is not None:
            transport.close()  # no final chunk: the client cannot mistake this for a whole answer

    def _count(self, key_id: str, model: str, prompt: int, completion: int) -> None:
        self.usage.add(key_id, model, prompt, completion)
        if prompt or completion:
            self.metrics.add_tokens(model, prompt, completion)
