"""The client listener: aiohttp's low-level server (`web.Server`) and the router's route table.

aiohttp's `web.Application` resolves each request through its URL dispatcher, builds and runs a
middleware chain and sends `on_response_prepare` for every answer. Measured against a bare
pass-through (bench/router_overhead.py), that machinery was about a tenth of a proxied request's
CPU, and the router needs none of it: its routes are a fixed table, one handler (Router._handle)
authenticates and makes every error, and the headers every answer carries are put on where the
answer is made (`Router.dress`). So the router is served by aiohttp's low-level server.

`Routes` matches a request as aiohttp's dispatcher matched it, so the API's paths behave as they
did: the path with `%2F` kept encoded (`URL.path_safe`), a `{name}` matching one segment and
decoded of `%2F` and `%25`, a path served with other methods a 405, anything else a 404 (both
after authentication, as before: an unknown path tells nothing to a client without a key).

`Listener` serves the handler with the router's server settings, keeps the requests in flight for
a stop that gives them a grace (R-4.5, R-10.3), closes connections once it is draining (a worker
that stops: the client's next connection goes to a worker that stays), and runs the router's start
and stop around the server (`ListenerRunner`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiohttp import web

from llmgw.router.errors import MethodNotAllowed, NotFound, RouterError
from llmgw.router.routes import served_list

Handler = Callable[..., Awaitable[web.StreamResponse]]
UNMATCHED_PATH_CHARS = 200  # of a path no route matches, as the request log and traces name it
# The low-level server's settings the router depends on.
SERVER_SETTINGS = {
    # Cancel the handler when its client disconnects, so the engine's request is cancelled at
    # once instead of at the next chunk.
    "handler_cancellation": True,
    # Compressed bodies are decoded by the intake (intake.read_body), not by aiohttp's parser,
    # whose refusals of a body that does not decode are plain text, or a 500 once the handler
    # reads it.
    "auto_decompress": False,
    "max_field_size": 16384,
    "access_log": None,  # no log line per request on the hot path
}
_PARAM = re.compile(r"(\{[a-z_]+\})")  # a `{name}` segment of a route's path


PATH_PARAMS = web.RequestKey("llmgw_path_params", dict)  # a request's `{name}` values, when its route has any


class Match(NamedTuple):
    """What a request's method and path found: its handler, or the error it gets."""

    handler: Handler | None
    pattern: str  # the route's path pattern ("/v1/responses/{response_id}"); unmatched: the path, cut short
    name: str | None  # "POST /v1/chat/completions"; None when unmatched (made when it is needed)
    params: dict[str, str]  # the path's `{name}` values
    error: RouterError | None = None  # unmatched: NotFound or MethodNotAllowed
    exempt: bool = False  # served to anyone, without a key: "/" and "/healthz"


class Routes:
    """The router's routes: fixed paths in a dict, the few with `{name}` segments as patterns."""

    def __init__(self):
        self._fixed: dict[str, dict[str, Match]] = {}
        self._patterns: list[tuple[re.Pattern, dict[str, Match]]] = []

    def add(self, method: str, path: str, handler: Handler, exempt: bool = False) -> None:
        """`handler(request, **params)` answers `method` on `path`; a GET also answers HEAD."""
        for each in (method, "HEAD") if method == "GET" else (method,):
            match = Match(handler, path, f"{each} {path}", {}, None, exempt)
            if "{" not in path:
                self._fixed.setdefault(path, {})[each] = match
                continue
            pattern = re.compile("".join(f"(?P<{part[1:-1]}>[^{{}}/]+)" if _PARAM.fullmatch(part) else re.escape(part)
                                         for part in _PARAM.split(path)))
            for known, methods in self._patterns:
                if known.pattern == pattern.pattern:
                    methods[each] = match
                    break
            else:
                self._patterns.append((pattern, {each: match}))

    def resolve(self, method: str, path: str) -> Match:
        """The route `method` and `path` (its `path_safe` form) find, or the error they get."""
        methods = self._fixed.get(path)
        if methods is not None:
            match = methods.get(method)
            if match is not None:
                return match
        allowed = set(methods) if methods else set()
        for pattern, by_method in self._patterns:
            found = pattern.fullmatch(path)
            if found is None:
                continue
            match = by_method.get(method)
            if match is None:
                allowed.update(by_method)
                continue
            params = {name: _unquote_segment(value) for name, value in found.groupdict().items()}
            return match._replace(params=params)
        cut = path[:UNMATCHED_PATH_CHARS]
        if allowed:
            return Match(None, cut, None, {}, MethodNotAllowed("method not allowed here (Method Not Allowed)"))
        return Match(None, cut, None, {}, NotFound(f"no such endpoint; this server offers {served_list()}"))


def _unquote_segment(value: str) -> str:
    """A `{name}` segment as aiohttp gave it: `%2F` and `%25` decoded, nothing else (the rest was already)."""
    if "%" not in value:
        return value
    return value.replace("%2F", "/").replace("%25", "%")


class Listener:
    """Serves `handle(request)` on aiohttp's low-level server; `start()` and `stop()` run around it."""

    def __init__(self, handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                 start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]):
        self._handle = handle
        self._start, self._stop = start, stop
        self.draining = False  # set by a worker that stops: each answer closes its connection
        self._handling: set[asyncio.Task] = set()  # the tasks of the requests in flight

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        handling, task = self._handling, request.task
        handling.add(task)
        try:
            response = await self._handle(request)
        finally:
            handling.discard(task)
        if self.draining:  # the client opens its next connection to a worker that stays
            if not response.prepared:
                response.headers["Connection"] = "close"
            response.force_close()
        return response

    async def finish(self, grace: float) -> None:
        """The requests in flight get `grace` seconds in all; then the rest are cancelled, as
        aiohttp cancels a request whose client hangs up (R-6.11). aiohttp alone waits its
        shutdown_timeout for a handler and then as long again before it cancels it, so one
        request waiting on an engine gone silent held a stop for twice the grace (R-4.5)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._handling and loop.time() < deadline:
            await asyncio.wait(list(self._handling), timeout=deadline - loop.time())
        for task in list(self._handling):
            task.cancel()

    def runner(self, shutdown_timeout: float = 60.0) -> ListenerRunner:
        """A runner for aiohttp's sites (TCPSite, SockSite, UnixSite); made in the event loop.
        A stop gives the requests in flight `shutdown_timeout` seconds."""
        server = web.Server(self._serve, **SERVER_SETTINGS)
        return ListenerRunner(server, self, shutdown_timeout=shutdown_timeout)


class ListenerRunner(web.ServerRunner):
    """aiohttp's runner of a low-level server, which also starts and stops what the listener's
    handler needs (the router's engine session and background tasks)."""

    def __init__(self, server: web.Server, listener: Listener, shutdown_timeout: float):
        super().__init__(server, shutdown_timeout=shutdown_timeout)
        self.listener = listener
        self._grace = shutdown_timeout
        self._started = False

    async def setup(self) -> None:
        await self.listener._start()
        self._started = True
        await super().setup()

    async def shutdown(self) -> None:
        await self.listener.finish(self._grace)

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            if self._started:
                self._started = False
                await self.listener._stop()
