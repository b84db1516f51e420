"""What the admin listener is given of the running gateway, named and typed: built once by
`Gateway.admin_dependencies` (llmgw/server.py) and handed to the API, the dashboard and the
listings, which use nothing else of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from llmgw.admin.tokens import AdminTokens
    from llmgw.admin.views import DataPlane
    from llmgw.control.service import ControlPlane
    from llmgw.routers import Verifiers
    from llmgw.store import Store


class RouterFeed(Protocol):
    """The router feed served on the admin listener (llmgw.control.feedserver.FeedServer)."""

    paths: frozenset[str]  # checked with router credentials by the feed itself, never the admin token

    def mount(self, app: web.Application) -> None: ...

    def recheck(self) -> None: ...  # end the streams of credentials no longer in force


@dataclass(frozen=True)
class Listener:
    """Where the admin listener is bound, as `GET /api/listener` tells ctl."""

    address: tuple[str, int] | None = None  # TCP (host, port); None: not bound yet
    socket: Path | None = None  # the state directory's admin socket; None: none could be made
    tls: bool = False


@dataclass(frozen=True)
class AdminDependencies:
    """What the admin uses of the gateway."""

    control: ControlPlane  # operator actions, the latest published view, placement explanations
    store: Store  # usage, router credentials, the audit log
    registry: CollectorRegistry  # what /metrics renders; the fleet's collector is registered on it
    tokens: AdminTokens  # the admin token and, during a rotation's grace, the previous one
    data_plane: DataPlane  # the routers' figures per replica, as the feed publisher aggregates them
    feed: RouterFeed | None = None  # None: no router feed on this listener
    router_credentials: Verifiers | None = None  # what the feed accepts, reloaded when they change
    listener: Callable[[], Listener] = Listener  # asked per request: the listener binds after the app is built
