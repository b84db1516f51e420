"""Wires the pieces for `llmgw serve`: store, catalog, fleet, reconciler, router, admin (R-9.1, R-9.2).

`Gateway` makes and starts them on one event loop, the listeners' ports bound first; `serve()`
runs it until a signal, with the router supervisor found or spawned (llmgw.router_process). The
state directory's layout, privacy and lock are llmgw.state_dir's.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.admin.app import build_admin_app
from llmgw.admin.dependencies import AdminDependencies, Listener
from llmgw.admin.tokens import AdminTokens, write_token_file
from llmgw.aio import cancel_and_wait, in_daemon_thread
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import Document, Inventory, load_configuration, resolve_state_dir
from llmgw.contracts.addresses import is_loopback, split_address
from llmgw.contracts.privatefiles import write_private
from llmgw.control.feed import FeedPublisher
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, FeedSocket, listen_unix
from llmgw.control.reconciler import Reconciler
from llmgw.control.routers import Routers
from llmgw.engines import adapter_support
from llmgw.control.service import ControlPlane, load_stored_aliases, load_stored_models, reload_on_signal
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.secret import SecretError, response_secret
from llmgw.localfeed import LocalFeed
from llmgw.router import Router
from llmgw.router.credential import CREDENTIAL_FILE
from llmgw.router.metrics import ReportedRouterMetrics
from llmgw.router.serving import SHUTDOWN_GRACE
from llmgw.router_process import RunningRouter, adopt_router, router_to_adopt, spawn_router, stop_router
from llmgw.routers import Verifiers, list_routers, serve_router_credential
from llmgw.state_dir import (ADMIN_ADDRESS_FILE, ADMIN_SOCKET, DATABASE, ROUTER_DIR, TOKEN_FILE, StartupError,
                             admin_token, hold_instance_lock, refuse_if_held, secure_state_dir)
from llmgw.store import Store

log = logging.getLogger(__name__)


def bind_listener(name: str, address: str, option: str) -> list[socket.socket]:
    """Bind (not yet listen on) every address HOST:PORT resolves to, as asyncio's create_server
    does. Done before anything else starts, so a port in use ends the start at once, naming it."""
    host, port = split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {address} for the {name} ({option}): {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setblocking(False)
            sock.bind(sockaddr)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = (": the address is already in use (another llmgw serve, or another program); "
                f"choose another with {option}") if exc.errno == errno.EADDRINUSE else f": {exc.strerror or exc}"
        raise StartupError(f"cannot listen on {host}:{port} for the {name}{hint}") from None
    return sockets


def warn_exposed_admin(host: str, port: int) -> None:
    """Say, in the log and on stderr, that the admin listener is reachable from other machines."""
    message = (f"the admin listener is bound to {host}:{port}, which is not a loopback address: anyone "
               "who can reach it can try the admin token, and the token travels unencrypted; bind "
               "127.0.0.1 unless remote ctl clients or a dashboard elsewhere need it")
    log.warning("%s", message)
    if not _logs_reach_stderr():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _logs_reach_stderr() -> bool:
    return log.isEnabledFor(logging.WARNING) and any(
        getattr(handler, "stream", None) is sys.stderr for handler in logging.getLogger().handlers)


@dataclass
class Gateway:
    """Everything `llmgw serve` runs, in one process on one event loop."""

    inventory: Inventory
    document: Document | None
    state_dir: Path
    inventory_source: str = "the inventory file"
    listen: str | None = None
    admin_listen: str | None = None
    serve_router: bool = True  # False: router workers of their own serve the client port
    store: Store = field(init=False)
    holder: CatalogHolder = field(init=False)
    fleet: Fleet = field(init=False)
    reconciler: Reconciler = field(init=False)
    router: Router | None = field(default=None, init=False)  # None: the routers are processes of their own
    publisher: FeedPublisher = field(init=False)
    feed: LocalFeed = field(init=False)
    control: ControlPlane = field(init=False)
    registry: CollectorRegistry = field(init=False)
    token: str = field(init=False)
    admin_tokens: AdminTokens = field(init=False)  # the token, and the previous one during a rotation's grace
    router_credentials: Verifiers = field(init=False)  # what the router feed accepts
    _runners: list[web.BaseRunner] = field(default_factory=list, init=False)
    _sockets: dict[str, list[socket.socket]] = field(default_factory=dict, init=False)
    _lock_fd: int | None = field(default=None, init=False)
    bound: dict[str, tuple[str, int]] = field(default_factory=dict, init=False)
    serving: bool = field(default=False, init=False)  # its start is complete
    admin_socket: Path | None = field(default=None, init=False)
    _admin_socket_inode: int | None = field(default=None, init=False)
    feed_server: FeedServer = field(init=False)
    _feed_socket: FeedSocket | None = field(default=None, init=False)

    async def start(self) -> None:
        """Start everything, the state directory's lock and the listeners' ports first.

        A failure leaves part of it started: `stop()` takes down whatever was."""
        secure_state_dir(self.state_dir)
        self._lock_fd = hold_instance_lock(self.state_dir)
        gateway = self.inventory.gateway
        if self.serve_router:
            self._sockets["router"] = bind_listener("router", self.listen or gateway.listen, "--listen")
        self._sockets["admin"] = bind_listener("admin listener", self.admin_listen or gateway.admin, "--admin")
        self.token = admin_token(self.state_dir)
        path = self.state_dir / DATABASE
        try:
            self.store = await in_daemon_thread(lambda: Store.open(path))
        except (sqlite3.Error, RuntimeError) as exc:
            raise StartupError(f"cannot open the state database {path}: {exc}") from None
        self.admin_tokens = AdminTokens(self.token, self.state_dir / TOKEN_FILE)
        self.router_credentials = Verifiers(self.store.read_sync(list_routers))
        stored = load_stored_models(self.store)
        catalog = Catalog.from_inventory(self.inventory, self.document, stored=[s for s in stored if s.config.adapter is None])
        adapters = []
        for model in stored:  # an adapter whose base the file no longer has is not in force
            if model.config.adapter is None:
                continue
            base = catalog.models.get(model.config.base)
            if base is not None and not base.static and adapter_support(base.engine):
                adapters.append(model)
            else:
                log.warning("adapter %s (added at runtime) has the base %s, which the inventory no longer has as a "
                            "model on vllm or llama-server: not in force; `llmgw ctl model remove` it, or declare "
                            "its base again and restart", model.config.name, model.config.base)
        stored = [s for s in stored if s.config.adapter is None] + adapters
        catalog = Catalog.from_inventory(self.inventory, self.document, stored=stored)
        aliases = []
        for alias in load_stored_aliases(self.store):  # one the file left without a model is not in force
            if alias.target in catalog.models and alias.name not in catalog.models \
                    and alias.name not in catalog.aliases:
                aliases.append(alias)
            else:
                log.warning("alias %s (set at runtime) points at %s, which the inventory no longer has as a "
                            "model, or its name is taken: not in force; `llmgw ctl alias set` or `rm` it",
                            alias.name, alias.target)
        if aliases:
            catalog = Catalog.from_inventory(self.inventory, self.document, stored=stored, stored_aliases=aliases)
        self.holder = CatalogHolder(catalog)
        self.registry = CollectorRegistry()
        self.fleet = Fleet(self.inventory, self.state_dir, on_state=lambda _: self._wake_reconciler())
        # The router is fed by the publisher only: models, endpoints, keys and settings go
        # out as a snapshot and changes; counts and state come back as reports.
        try:
            sealing = response_secret(self.state_dir)
        except SecretError as exc:
            raise StartupError(str(exc)) from None
        self.publisher = FeedPublisher(self.holder, self.store, gateway, note_demand=self._on_demand,
                                       response_secret=sealing)
        if self.serve_router:
            self.router = Router(registry=self.registry)
        else:  # no router here; the router metrics are what the router processes report
            self.registry.register(ReportedRouterMetrics(self.publisher.router_counters))
        routers = Routers(push_endpoints=self.publisher.set_endpoints, last_used=self.publisher.take_last_used,
                          outstanding=self.publisher.outstanding, abandon=self.publisher.abandon,
                          engine_load=self.publisher.engine_load, counters=self.publisher.router_counters,
                          adapter_use=self.publisher.adapter_use, adapter_quiet=self.publisher.adapter_quiet,
                          version=self.publisher.version)
        self.reconciler = Reconciler(self.holder, self.fleet, self.store, gateway, routers)
        self.fleet.holdings_wanted = self.reconciler.nodes.holdings_wanted
        self.fleet.inventory_wanted = self.reconciler.nodes.inventory_wanted
        self.control = ControlPlane(self.inventory, self.document, self.holder, self.store, self.reconciler,
                                    self.fleet, self.inventory_source)
        self.control.on_reload.append(self._reloaded)
        self.holder.subscribe(lambda _: self.reconciler.wake())
        # Routers of other processes and hosts, each with a credential of its own.
        self.feed_server = FeedServer(self.publisher, self.router_credentials)
        await self.reconciler.load()
        # Adopted replicas are pushed before the router listens, once their nodes confirm them.
        await self.fleet.start()
        self.publisher.mark_ready()
        if self.serve_router:
            self.feed = LocalFeed(self.publisher, self.router.feed)
            self.feed.pump()  # the router holds the first snapshot before it listens
            self.feed.start()
            await self._listen("router", self.router.runner(SHUTDOWN_GRACE), self._sockets.pop("router"))
        tls = self.inventory.gateway.admin_tls  # set: https, for routers and ctl on other hosts
        admin = web.AppRunner(self._admin_app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE)
        runner = await self._listen("admin", admin, self._sockets.pop("admin"),
                                    ssl_context=tls.server_context() if tls is not None else None)
        host, port = self.bound["admin"]
        write_private(self.state_dir / ADMIN_ADDRESS_FILE, f"{host}:{port}\n".encode())
        if not is_loopback(host):
            warn_exposed_admin(host, port)
        await self._listen_unix(runner, self.state_dir / ADMIN_SOCKET)
        self._feed_socket = await listen_unix(self.feed_server, self.state_dir / FEED_SOCKET)
        self.reconciler.start()
        # Start-up objects (catalog, config, facts) live for the whole run: keep the collector
        # from walking them on every pass, which made placement latency spiky on large fleets.
        gc.collect()
        gc.freeze()
        self.serving = True
        log.info("llmgw serving %d models on %d nodes; state in %s", len(catalog.models),
                 len(self.inventory.nodes), self.state_dir)

    async def keep_router_credential(self) -> Path:
        """Give the router this serve spawns or adopts its credential (R-10.7), in a 0600 file of
        its state directory that it reads for every exchange: the one it has while it is still in
        force, else a new one. Never argv or the environment, which other processes may read."""
        path = self.state_dir / ROUTER_DIR / CREDENTIAL_FILE
        path.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            kept = path.read_text().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):
            kept = None
        credential = await self.store.write(lambda db: serve_router_credential(db, kept))
        if credential != kept:
            await asyncio.to_thread(write_token_file, path, credential)
            log.info("gave the router in %s a new credential (router %s)", path.parent, "local")
        self.router_credentials.load(await self.store.read(list_routers))
        self.feed_server.recheck()
        return path

    def _wake_reconciler(self) -> None:
        # A node that (re)connects or drops is worth a pass now rather than at the next tick.
        reconciler = getattr(self, "reconciler", None)
        if reconciler is not None:
            reconciler.wake()

    def _on_demand(self, model: str) -> None:
        """A request wants an on-demand model with no replica (R-6.8), or a LoRA adapter that no
        replica of its base holds within the load bound (R-8.8)."""
        catalog = self.holder.current
        if model in catalog.adapters:
            self.reconciler.adapters.want(model, catalog)
        else:
            self.reconciler.note_demand(model)

    def _reloaded(self, inventory: Inventory) -> None:
        """A reload applied (R-10.5): routers get the settings they read in a feed change."""
        self.inventory = inventory
        self.publisher.set_gateway(inventory.gateway)

    def admin_dependencies(self) -> AdminDependencies:
        """What the admin listener is given of this gateway (llmgw.admin.dependencies)."""
        tls = self.inventory.gateway.admin_tls is not None  # read once, at start, as the listener is made
        return AdminDependencies(control=self.control, store=self.store, registry=self.registry,
                                 tokens=self.admin_tokens, data_plane=self.publisher, feed=self.feed_server,
                                 router_credentials=self.router_credentials,
                                 listener=lambda: Listener(self.bound.get("admin"), self.admin_socket, tls))

    def _admin_app(self) -> web.Application:
        return build_admin_app(self.admin_dependencies())

    async def _listen(self, name: str, runner: web.BaseRunner, sockets: list[socket.socket],
                      ssl_context=None) -> web.BaseRunner:
        await runner.setup()
        self._runners.append(runner)
        for sock in sockets:
            await web.SockSite(runner, sock, ssl_context=ssl_context).start()
        bound = sockets[0].getsockname()
        self.bound[name] = (bound[0], bound[1])
        log.info("%s listening on %s:%d", name, bound[0], bound[1])
        return runner

    async def _listen_unix(self, runner: web.BaseRunner, path: Path) -> None:
        """The admin app on a Unix socket too, for local `llmgw ctl` (R-9.3).

        Only the state directory's owner can reach it (the directory is 0700, the socket 0600),
        so ctl sends its token there without trusting whoever holds the TCP port: a process that
        bound that port while `llmgw serve` was down would otherwise receive the token.
        """
        site = web.UnixSite(runner, str(path))
        try:
            await site.start()  # replaces a socket a previous run left behind
        except OSError as exc:
            log.warning("no admin socket at %s (%s): local `llmgw ctl` needs --admin HOST:PORT and the token",
                        path, exc.strerror or exc)
            return
        os.chmod(path, 0o600)
        self.admin_socket = path
        self._admin_socket_inode = os.lstat(path).st_ino
        log.info("admin listening on %s", path)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, leave engines running (R-4.5).

        Also takes down a start that failed or was interrupted half-way."""
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        for sockets in self._sockets.values():
            for sock in sockets:
                sock.close()
        self._sockets.clear()
        if self.admin_socket is not None:
            try:  # only the socket this run made: a newer one belongs to another run
                if os.lstat(self.admin_socket).st_ino == self._admin_socket_inode:
                    os.unlink(self.admin_socket)
            except FileNotFoundError:
                pass
            self.admin_socket = None
        if self._feed_socket is not None:
            await self._feed_socket.close()
            self._feed_socket = None
        # The feed's last report carries the router's counts since the previous one: written
        # before the store closes, so a SIGTERM loses no usage.
        for part in ("reconciler", "feed", "publisher", "router", "fleet"):
            running = getattr(self, part, None)
            if running is not None:
                await running.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


async def serve(inventory_path: str | None, *, state_dir: str | None = None, listen: str | None = None,
                admin: str | None = None, workers: int | None = None) -> None:
    """Run until SIGTERM or SIGINT, which also stop a start still under way. A start that fails
    takes down what it started before the error propagates (StartupError: for the operator).

    `workers` None: the router runs in this process. Otherwise the control plane runs here and
    `workers` router workers (none: 0) run under a supervisor of their own that this serve spawns,
    or adopts when one already runs on the state directory. On SIGTERM (systemd, a restart) the
    supervisor outlives this process; on SIGINT (Ctrl-C in a terminal) it is stopped too, once its
    requests in flight end. Engines keep running either way (R-10.4)."""
    inventory, document, source = load_configuration(inventory_path)
    resolved = resolve_state_dir(inventory, state_dir)
    client_listen = listen or inventory.gateway.listen
    running: RunningRouter | None = None
    if workers:
        refuse_if_held(resolved)
        running = router_to_adopt(resolved, client_listen)
    gateway = Gateway(inventory, document, resolved, source, listen, admin)
    gateway.serve_router = workers is None
    stop = asyncio.Event()
    signals: list[signal.Signals] = []  # the first one decides how serve stops

    def stop_on(sig: signal.Signals) -> None:
        signals.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_on, sig)
    # as `llmgw ctl reload`, once the start is complete
    loop.add_signal_handler(signal.SIGHUP, lambda: reload_on_signal(gateway.control if gateway.serving else None))

    async def start() -> None:
        await gateway.start()
        if workers:
            await gateway.keep_router_credential()
        if running is not None:
            adopt_router(resolved, running, client_listen, workers)
        elif workers:
            await spawn_router(resolved, client_listen, workers)

    starting = asyncio.create_task(start(), name="gateway-start")
    stopping = asyncio.create_task(stop.wait(), name="gateway-stop-signal")
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stopping during start-up (%s)", signals[0].name)
            await cancel_and_wait(starting)
            if workers and signals[0] == signal.SIGINT:
                await stop_router(resolved)
            return
        starting.result()  # a start-up failure propagates from here, after the teardown below
        await stopping
        if workers is None:
            log.info("shutting down: in-flight requests get up to %.0fs; engines keep running", SHUTDOWN_GRACE)
        elif workers and signals[0] == signal.SIGINT:
            # Ctrl-C in a terminal: whoever tries llmgw out expects the port to be free afterwards.
            # The router goes first, so its final reports reach this control plane.
            log.info("interrupted (SIGINT): stopping the router workers once their requests end, then the "
                     "control plane; engines keep running (the next llmgw serve adopts them)")
            await stop_router(resolved)
        elif workers:
            log.info("shutting down the control plane (%s); the router workers keep serving (stop them with "
                     "`llmgw router stop --state-dir %s`, or stop serve with Ctrl-C/SIGINT); engines keep running",
                     signals[0].name, resolved / ROUTER_DIR)
        else:
            log.info("shutting down the control plane; engines keep running")
    finally:
        stopping.cancel()
        await gateway.stop()
