"""The admin listener: management API, read-only dashboard and /metrics (R-9.3–R-9.7).

Every request carries the admin token (R-9.3). API clients and Prometheus send it as
`Authorization: Bearer <token>`; a browser opens the dashboard once through the tokenised URL
that `llmgw ctl dashboard` prints, and gets an HttpOnly, SameSite=Strict cookie in exchange
(as Jupyter does). The cookie opens dashboard pages only, never the API: the dashboard is
read-only, so a stolen cookie changes nothing. During a rotation's grace the previous token (and
its cookie) still opens them. The router feed mounted here checks router credentials itself and
never takes the admin token (R-10.7).

Operator refusals (`ServiceError`) become `{"error": {"message", "code", "problems"}}` here, in one
place, with the HTTP status of their kind (`HTTP_STATUS`, one table, as llmgw/router/errors.py
maps the router's errors).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw.admin import dashboard
from llmgw.admin.dependencies import AdminDependencies
from llmgw.admin.metrics import FleetCollector
from llmgw.admin.tokens import AdminTokens, NotText, cookie_value
from llmgw.admin.usage import BY, usage_report
from llmgw.admin.views import Listings, explanation_json, listings
from llmgw.config import NAME_PATTERN
from llmgw.contracts.refusals import ErrorKind, ServiceError
from llmgw.requestlog import DEFAULT_SHOWN, RequestQuery, find_requests, parse_status
from llmgw.units import parse_duration

log = logging.getLogger(__name__)

ACTOR_HEADER = "X-Llmgw-Actor"
SOURCE_HEADER = "X-Llmgw-Source"
COOKIE = "llmgw-dashboard"
MAX_BODY = 1024 * 1024
DEFAULT_LOG_LINES = 100
MAX_LOG_LINES = 100_000
FOLLOW_CHECK = 1.0  # seconds between checks that a log follower is still connected
DEFAULT_USAGE_SINCE = "24h"
DASHBOARD_PATHS = frozenset({"/", *dashboard.PAGES, dashboard.STYLESHEET_PATH})

DEPENDENCIES = web.AppKey("dependencies", AdminDependencies)
TOKEN = web.AppKey("token", AdminTokens)
FEED_PATHS = web.AppKey("feed_paths", frozenset)
FOLLOWS = web.AppKey("follows", set)

_dumps = partial(json.dumps, separators=(",", ":"))

# The one table of a refusal's kind to its HTTP status.
HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.NODE_FAILED: 502,
}


def http_status(error: ServiceError) -> int:
    """The HTTP status the admin API answers `error` with."""
    return HTTP_STATUS[error.kind]


def error_response(status: int, message: str, code: str, problems: list[str] | None = None,
                   headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code, "problems": problems or []}},
                             status=status, headers=headers, dumps=_dumps)


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


UNAUTHORIZED = ("missing or wrong admin token: send 'Authorization: Bearer <token>' with the token from the "
                "admin-token file of the state directory (a router credential is for the router feed only)")


@web.middleware
async def _guard(request: web.Request, handler) -> web.StreamResponse:
    """Token check on every request, then ServiceError and unexpected failures as JSON."""
    tokens: AdminTokens = request.app[TOKEN]
    try:
        refused = _refused(request, tokens)
    except NotText as exc:
        return error_response(401, f"{exc}: send the token from the admin-token file as it is", "unauthorized",
                              headers={"WWW-Authenticate": "Bearer"})
    if refused is not None:
        return refused
    try:
        return await handler(request)
    except ServiceError as exc:
        return error_response(http_status(exc), exc.message, exc.code, exc.problems)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.status, exc.reason, exc.reason.lower().replace(" ", "_"))
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("admin request %s %s failed", request.method, request.path)
        return error_response(500, "internal error; the gateway's log has the details", "internal")


def _refused(request: web.Request, tokens: AdminTokens) -> web.StreamResponse | None:
    """None when the request may go on; the refusal otherwise. The router feed checks its own
    credentials (R-10.7): the admin token is never one of them."""
    if request.path in request.app.get(FEED_PATHS, ()):
        return None
    if request.path in DASHBOARD_PATHS and request.method in ("GET", "HEAD"):
        offered = request.query.get("token")
        if offered is not None:
            if not tokens.accepts(offered):
                return dashboard.refused()
            # Trade the token in the URL for a cookie, and drop it from the address bar and history.
            rest = request.rel_url.with_query([(k, v) for k, v in request.query.items() if k != "token"])
            response = web.Response(status=303, headers={"Location": str(rest), "Cache-Control": "no-store",
                                                         "Referrer-Policy": "no-referrer"})
            response.set_cookie(COOKIE, cookie_value(offered), httponly=True, samesite="Strict", path="/")
            return response
        if not (tokens.accepts_cookie(request.cookies.get(COOKIE)) or tokens.accepts(_bearer(request))):
            return dashboard.refused()
        return None
    if not tokens.accepts(_bearer(request)):
        return error_response(401, UNAUTHORIZED, "unauthorized", headers={"WWW-Authenticate": "Bearer"})
    return None


def build_admin_app(admin: AdminDependencies) -> web.Application:
    """The admin aiohttp application over what a started `Gateway` gives it (see llmgw.server)."""
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[DEPENDENCIES] = admin
    app[TOKEN] = admin.tokens
    app[FOLLOWS] = set()
    admin.registry.register(FleetCollector(lambda: listings(admin)))
    api = Api(admin)
    app.add_routes([
        web.get("/api/status", api.status),
        web.get("/api/nodes", api.nodes),
        web.post("/api/nodes/{node}/admin", api.node_admin),
        web.get("/api/models", api.models),
        web.post("/api/models", api.add_model),
        web.delete("/api/models/{name}", api.remove_model),
        web.post("/api/models/{name}/scale", api.scale),
        web.get("/api/aliases", api.aliases),
        web.put("/api/aliases/{name}", api.set_alias),
        web.delete("/api/aliases/{name}", api.remove_alias),
        web.get("/api/models/{name}/rollout", api.rollout_status),
        web.post("/api/models/{name}/rollout/{action}", api.rollout),
        web.get("/api/explain/{model}", api.explain),
        web.get("/api/replicas", api.replicas),
        web.get("/api/replicas/{replica}/logs", api.logs),
        web.get("/api/storage", api.storage),
        web.get("/api/engines", api.engines),
        web.get("/api/reclaim", api.reclaim_list),
        web.post("/api/reclaim", api.reclaim),
        web.post("/api/reload", api.reload),
        web.get("/api/usage", api.usage),
        web.get("/api/requests", api.requests),
        web.get("/api/listener", api.listener),
        web.post("/api/token/rotate", api.rotate_token),
        web.get("/api/routers", api.routers),
        web.post("/api/routers", api.add_router),
        web.post("/api/routers/{name}/rotate", api.rotate_router),
        web.delete("/api/routers/{name}", api.revoke_router),
        web.get("/metrics", api.metrics),
    ])
    dashboard.add_routes(app, admin)
    if admin.feed is not None:
        admin.feed.mount(app)
        app[FEED_PATHS] = admin.feed.paths
    app.on_shutdown.append(_end_follows)
    return app


async def _end_follows(app: web.Application) -> None:
    """A `logs -f` never ends by itself: end them so that shutdown does not wait for them."""
    for task in list(app[FOLLOWS]):
        task.cancel()


def _json(document: Any, status: int = 200) -> web.Response:
    return web.json_response(document, status=status, dumps=_dumps)


def _actor(request: web.Request, body: dict | None = None) -> str:
    actor = (body or {}).get("actor") or request.headers.get(ACTOR_HEADER)
    if isinstance(actor, str) and actor.strip():
        return actor.strip()[:128]
    return "admin-api"


async def _json_body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise ServiceError(ErrorKind.INVALID, "the request body is not valid JSON", code="bad_json") from None
    if not isinstance(body, dict):
        raise ServiceError(ErrorKind.INVALID, "the request body must be a JSON object", code="bad_json")
    return body


def _int(value: Any, name: str, *, minimum: int = 0, maximum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f" and at most {maximum}" if maximum is not None else ""
        raise ServiceError(ErrorKind.INVALID, f"{name} must be a whole number of at least {minimum}{bound}", code="bad_argument")
    return value


def _duration(value: Any, name: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ServiceError(ErrorKind.INVALID, f"{name}: {exc}", code="bad_argument") from None


class Api:
    """Handlers of the management API: they render the published view and call the control plane."""

    def __init__(self, admin: AdminDependencies):
        self.admin = admin

    def snapshot(self) -> Listings:
        return listings(self.admin)

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.snapshot().status())

    async def nodes(self, request: web.Request) -> web.Response:
        return _json({"nodes": self.snapshot().nodes()})

    async def models(self, request: web.Request) -> web.Response:
        return _json({"models": self.snapshot().models()})

    async def replicas(self, request: web.Request) -> web.Response:
        return _json({"replicas": self.snapshot().replicas()})

    async def storage(self, request: web.Request) -> web.Response:
        return _json(self.snapshot().storage())

    async def explain(self, request: web.Request) -> web.Response:
        return _json(explanation_json(self.admin.control.explain(request.match_info["model"])))

    async def node_admin(self, request: web.Request) -> web.Response:
        """Cordon, uncordon and drain: one endpoint, the action in the body (R-9.4)."""
        body = await _json_body(request)
        action = body.get("action")
        grace = body.get("grace")
        grace_seconds = None if grace is None else _duration(grace, "grace")
        answer = self.admin.control.set_node(request.match_info["node"], str(action), grace_seconds,
                                               _actor(request, body))
        return _json(answer)

    async def add_model(self, request: web.Request) -> web.Response:
        """The body is the model's YAML, as in the inventory's `models:` list (R-8.2).

        JSON bodies `{"yaml": TEXT, "actor": ..., "source": ...}` are accepted too.
        """
        if request.content_type == "application/json":
            body = await _json_body(request)
            text, source = body.get("yaml"), body.get("source")
            if not isinstance(body.get("replace", False), bool):
                raise ServiceError(ErrorKind.INVALID, "replace must be true or false", code="bad_argument")
        else:
            body, source = {}, None
            charset = request.charset or "utf-8"
            try:
                text = (await request.read()).decode(charset)
            except LookupError:
                raise ServiceError(ErrorKind.INVALID, f"unknown charset {charset!r} in the Content-Type; send UTF-8",
                                   code="bad_encoding") from None
            except UnicodeDecodeError as exc:
                raise ServiceError(ErrorKind.INVALID, f"the model definition is not {charset} text (byte {exc.start}: "
                                        f"{exc.reason}); save the file as UTF-8", code="bad_encoding") from None
        if not isinstance(text, str) or not text.strip():
            raise ServiceError(ErrorKind.INVALID, "send the model definition (YAML) as the request body", code="empty_body")
        source = source or request.headers.get(SOURCE_HEADER) or "model file"
        replace = bool(body.get("replace", False))
        answer = await self.admin.control.add_model(text, _actor(request, body), source=str(source)[:256],
                                                    replace=replace)
        return _json(answer, status=200 if replace else 201)

    async def remove_model(self, request: web.Request) -> web.Response:
        answer = await self.admin.control.remove_model(request.match_info["name"], _actor(request))
        return _json(answer)

    async def scale(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if "min" not in body:
            raise ServiceError(ErrorKind.INVALID, "min is required", code="bad_argument")
        minimum = _int(body.get("min"), "min")
        maximum = _int(body.get("max"), "max", allow_none=True)
        answer = await self.admin.control.scale(request.match_info["name"], minimum, maximum,
                                                  _actor(request, body))
        return _json(answer)

    async def aliases(self, request: web.Request) -> web.Response:
        return _json(self.admin.control.aliases())

    async def set_alias(self, request: web.Request) -> web.Response:
        """Point an alias at a model: `{"target": MODEL}` (R-8.7)."""
        body = await _json_body(request)
        target = body.get("target")
        if not isinstance(target, str) or not target:
            raise ServiceError(ErrorKind.INVALID, "target (the model the alias points at) is required",
                               code="bad_argument")
        name = request.match_info["name"]
        if not re.match(NAME_PATTERN, name):
            raise ServiceError(ErrorKind.INVALID, f"{name!r} is not a valid name: letters, digits and ._:- "
                                                  "(first a letter or digit), at most 128", code="bad_argument")
        return _json(await self.admin.control.set_alias(name, target, _actor(request, body)))

    async def remove_alias(self, request: web.Request) -> web.Response:
        return _json(await self.admin.control.remove_alias(request.match_info["name"], _actor(request)))

    async def rollout_status(self, request: web.Request) -> web.Response:
        return _json(self.admin.control.rollout_status(request.match_info["name"]))

    async def rollout(self, request: web.Request) -> web.Response:
        """pause, resume, promote or undo a model's rollout; `canary` (percent) with resume or undo (R-4.13)."""
        body = await _json_body(request)
        canary = _int(body.get("canary"), "canary", allow_none=True)
        answer = await self.admin.control.rollout(request.match_info["name"], request.match_info["action"],
                                                  _actor(request, body), canary)
        return _json(answer)

    async def reload(self, request: web.Request) -> web.Response:
        """Re-read the inventory file and apply what changed; `dry_run` only says what would (R-10.5)."""
        body = await _json_body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise ServiceError(ErrorKind.INVALID, "dry_run must be true or false", code="bad_argument")
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise ServiceError(ErrorKind.INVALID, "force must be true or false", code="bad_argument")
        kwargs = {} if body.get("grace") is None else {"grace": _duration(body["grace"], "grace")}
        return _json(await self.admin.control.reload(_actor(request, body), dry_run=dry_run, force=force,
                                                       **kwargs))

    async def engines(self, request: web.Request) -> web.Response:
        return _json(await self.admin.control.engines())

    async def reclaim_list(self, request: web.Request) -> web.Response:
        return _json(await self.admin.control.reclaim(False, _actor(request)))

    async def reclaim(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        collect = body.get("collect", False)
        if not isinstance(collect, bool):
            raise ServiceError(ErrorKind.INVALID, "collect must be true or false", code="bad_argument")
        return _json(await self.admin.control.reclaim(collect, _actor(request, body)))

    async def logs(self, request: web.Request) -> web.StreamResponse:
        """An engine's log through its node's helper (R-4.8); `follow=1` streams JSON lines."""
        replica = request.match_info["replica"]
        query = request.query
        rank = _int(query.get("shard", 0), "shard")
        lines = _int(query.get("lines", DEFAULT_LOG_LINES), "lines", maximum=MAX_LOG_LINES)
        if query.get("follow", "") not in ("1", "true", "yes"):
            found = await self.admin.control.logs(replica, rank, lines)
            return _json({"replica": replica, "shard": rank, "lines": found})
        follow = self.admin.control.follow_logs(replica, rank, lines)
        # The first chunk comes before the response starts, so an unknown replica is a plain 404.
        first = await anext(follow)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                               "Cache-Control": "no-store"})
        await response.prepare(request)
        task = asyncio.current_task()
        request.app[FOLLOWS].add(task)
        pending: asyncio.Future | None = None
        try:
            await response.write(_dumps({"lines": first}).encode() + b"\n")
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(follow))
                done, _ = await asyncio.wait({pending}, timeout=FOLLOW_CHECK)
                if not done:
                    # A quiet log would otherwise keep the node streaming to a client long gone.
                    if request.transport is None or request.transport.is_closing():
                        break
                    continue
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    break
                pending = None
                await response.write(_dumps({"lines": chunk}).encode() + b"\n")
        except (asyncio.CancelledError, ConnectionResetError):
            pass  # the client left or the listener is shutting down: end the follow quietly
        finally:
            request.app[FOLLOWS].discard(task)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await follow.aclose()
        return response

    async def usage(self, request: web.Request) -> web.Response:
        by = request.query.get("by", "model")
        if by not in BY:
            raise ServiceError(ErrorKind.INVALID, f"by must be one of: {', '.join(BY)}", code="bad_argument")
        since = _duration(request.query.get("since", DEFAULT_USAGE_SINCE), "since")
        report = await self.admin.store.read(lambda db: usage_report(db, by, since))
        return _json(report)

    async def requests(self, request: web.Request) -> web.Response:
        """The request log (R-6.20): newest first, or after a cursor oldest first; filters key,
        model (or the name asked), status (503, 5xx), slower_than (a duration), n and after."""
        query = request.query
        status = query.get("status")
        try:
            statuses = None if status is None else parse_status(status)
        except ValueError as exc:
            raise ServiceError(ErrorKind.INVALID, f"status: {exc}", code="bad_argument") from None
        slower = query.get("slower_than")
        after = query.get("after")
        wanted = RequestQuery(key=query.get("key"), model=query.get("model"), status=statuses,
                              slower_than=None if slower is None else _duration(slower, "slower_than"),
                              n=_int(query.get("n", DEFAULT_SHOWN), "n", minimum=1),
                              after=None if after is None else _int(after, "after"))
        return _json(await self.admin.store.read(lambda db: find_requests(db, wanted)))

    async def listener(self, request: web.Request) -> web.Response:
        """Where this admin listener is bound: TCP address and the state directory's socket."""
        where = self.admin.listener()
        return _json({"address": f"{where.address[0]}:{where.address[1]}" if where.address else None,
                      "socket": str(where.socket) if where.socket is not None else None,
                      "scheme": "https" if where.tls else "http"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.admin.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- credentials (R-9.3, R-10.7) -------------------------------------------------------------

    async def rotate_token(self, request: web.Request) -> web.Response:
        """A new admin token in the admin-token file; the one this request came with works for `grace`."""
        body = await _json_body(request)
        grace = _duration(body.get("grace", "0s"), "grace")
        tokens: AdminTokens = request.app[TOKEN]
        token, until = await asyncio.to_thread(tokens.rotate, grace)
        await self._audit(_actor(request, body), "token.rotate", "admin-token", {"grace_s": grace})
        return _json({"token": token, "file": str(tokens.path) if tokens.path is not None else None,
                      "previous_until": until})

    async def routers(self, request: web.Request) -> web.Response:
        from llmgw.routers import list_routers

        now = time.time()
        found = await self.admin.store.read(list_routers)
        return _json({"routers": [r.as_json(now) for r in found]})

    async def add_router(self, request: web.Request) -> web.Response:
        from llmgw.routers import add_router

        body = await _json_body(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise ServiceError(ErrorKind.INVALID, "name is required", code="bad_argument")
        router, credential = await self._credentials(lambda db: add_router(db, name))
        await self._audit(_actor(request, body), "router.add", router.name)
        return _json({"router": router.as_json(time.time()), "credential": credential}, status=201)

    async def rotate_router(self, request: web.Request) -> web.Response:
        from llmgw.routers import rotate_router

        body = await _json_body(request)
        grace = _duration(body.get("grace", "0s"), "grace")
        name = request.match_info["name"]
        router, credential = await self._credentials(lambda db: rotate_router(db, name, grace))
        await self._audit(_actor(request, body), "router.rotate", router.name, {"grace_s": grace})
        return _json({"router": router.as_json(time.time()), "credential": credential})

    async def revoke_router(self, request: web.Request) -> web.Response:
        from llmgw.routers import revoke_router

        name = request.match_info["name"]
        router, newly = await self._credentials(lambda db: revoke_router(db, name))
        if newly:
            await self._audit(_actor(request), "router.revoke", router.name)
        return _json({"router": router.as_json(time.time()), "revoked": newly})

    async def _credentials(self, change):
        """Apply a change to the router credentials, then let the feed see it at once."""
        from llmgw.routers import RouterRefused, list_routers

        def apply(db):
            try:
                return change(db), list_routers(db)
            except RouterRefused as exc:
                raise ServiceError(ErrorKind.INVALID, str(exc), code="refused") from None

        result, every = await self.admin.store.write(apply)
        if self.admin.router_credentials is not None:
            self.admin.router_credentials.load(every)
        if self.admin.feed is not None:
            self.admin.feed.recheck()
        return result

    async def _audit(self, actor: str, action: str, target: str, detail: Any = None) -> None:
        from llmgw.store import audit

        await self.admin.store.write(lambda db: audit(db, actor, action, target, detail))
