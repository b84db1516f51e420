"""Wires the pieces for `llmgw serve`: store, catalog, fleet, reconciler, router, admin (R-9.1, R-9.2)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import Document, Inventory, is_loopback, load_configuration, resolve_state_dir, split_address
from llmgw.control.reconciler import Reconciler
from llmgw.control.service import ControlPlane, load_stored_models
from llmgw.fleet.fleet import Fleet
from llmgw.router import RUNNER_OPTIONS, Router
from llmgw.store import Store

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 15.0
TOKEN_FILE = "admin-token"
ADMIN_ADDRESS_FILE = "admin-address"
ADMIN_SOCKET = "admin.sock"
DATABASE = "state.db"
# Made 0600 on every start, whatever they were: the database holds engine keys and key hashes.
PRIVATE_FILES = (DATABASE, DATABASE + "-wal", DATABASE + "-shm", TOKEN_FILE, ADMIN_ADDRESS_FILE)


def secure_state_dir(state_dir: Path) -> None:
    """The state directory 0700 and its files 0600, on every start (R-9.3).

    A directory or database left readable by an earlier version, a restored backup or a
    hand-made directory is closed up here rather than trusted; symlinks are left alone.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)
    for name in PRIVATE_FILES:
        path = state_dir / name
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, 0o600)
        except FileNotFoundError:
            pass


def admin_token(state_dir: Path) -> str:
    """The admin token, kept in a 0600 file of the state directory (R-9.3)."""
    path = state_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if token:
            os.chmod(path, 0o600)
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


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


def finish_requests_within(app: web.Application, grace: float) -> None:
    """On shutdown, give the requests in flight `grace` seconds in all, then cancel the rest.

    aiohttp alone waits its shutdown_timeout for a handler and then as long again before it
    cancels it, so one request waiting on an engine that went silent (a node cut off) held a
    SIGTERM for twice the grace, and a restart kept clients out that long (R-4.5).
    """
    handling: dict[asyncio.Task, web.Request] = {}

    @web.middleware
    async def track(request: web.Request, handler):
        task = asyncio.current_task()
        handling[task] = request
        try:
            return await handler(request)
        finally:
            handling.pop(task, None)

    async def finish(_: web.Application) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while handling and loop.time() < deadline:
            await asyncio.wait(list(handling), timeout=deadline - loop.time())
        for request in list(handling.values()):
            request.task.cancel()  # what aiohttp does when the client hangs up

    app.middlewares.insert(0, track)
    app.on_shutdown.append(finish)


@dataclass
class Gateway:
    """Everything `llmgw serve` runs, in one process on one event loop."""

    inventory: Inventory
    document: Document | None
    state_dir: Path
    inventory_source: str = "the inventory file"
    listen: str | None = None
    admin_listen: str | None = None
    store: Store = field(init=False)
    holder: CatalogHolder = field(init=False)
    fleet: Fleet = field(init=False)
    reconciler: Reconciler = field(init=False)
    router: Router = field(init=False)
    control: ControlPlane = field(init=False)
    registry: CollectorRegistry = field(init=False)
    token: str = field(init=False)
    _runners: list[web.AppRunner] = field(default_factory=list, init=False)
    bound: dict[str, tuple[str, int]] = field(default_factory=dict, init=False)
    admin_socket: Path | None = field(default=None, init=False)
    _admin_socket_inode: int | None = field(default=None, init=False)

    async def start(self) -> None:
        secure_state_dir(self.state_dir)
        self.token = admin_token(self.state_dir)
        self.store = Store.open(self.state_dir / DATABASE)
        stored = load_stored_models(self.store)
        catalog = Catalog.from_inventory(self.inventory, self.document, stored=stored)
        self.holder = CatalogHolder(catalog)
        self.registry = CollectorRegistry()
        gateway = self.inventory.gateway
        self.fleet = Fleet(self.inventory, self.state_dir, on_state=lambda _: self._wake_reconciler())
        self.router = Router(self.holder, self.store, gateway, on_demand=self._on_demand, registry=self.registry)
        self.reconciler = Reconciler(self.holder, self.fleet, self.store, gateway,
                                     push_endpoints=self.router.set_endpoints,
                                     last_used=self.router.take_last_used,
                                     outstanding=self.router.outstanding, abandon=self.router.abandon)
        self.fleet.holdings_wanted = self.reconciler.holdings_wanted
        self.control = ControlPlane(self.inventory, self.document, self.holder, self.store, self.reconciler,
                                    self.fleet, self.inventory_source)
        self.holder.subscribe(lambda _: self.reconciler.wake())
        await self.reconciler.load()
        # Adopted replicas are pushed before the router listens, once their nodes confirm them.
        await self.fleet.start()
        router_app = self.router.web_app()
        finish_requests_within(router_app, SHUTDOWN_GRACE)
        await self._listen("router", router_app, self.listen or gateway.listen, RUNNER_OPTIONS)
        admin_app = self._admin_app()
        if admin_app is not None:
            runner = await self._listen("admin", admin_app, self.admin_listen or gateway.admin)
            host, port = self.bound["admin"]
            (self.state_dir / ADMIN_ADDRESS_FILE).write_text(f"{host}:{port}\n")
            if not is_loopback(host):
                warn_exposed_admin(host, port)
            await self._listen_unix(runner, self.state_dir / ADMIN_SOCKET)
        self.reconciler.start()
        # Start-up objects (catalog, config, facts) live for the whole run: keep the collector
        # from walking them on every pass, which made placement latency spiky on large fleets.
        gc.collect()
        gc.freeze()
        log.info("llmgw serving %d models on %d nodes; state in %s", len(catalog.models),
                 len(self.inventory.nodes), self.state_dir)

    def _wake_reconciler(self) -> None:
        # A node that (re)connects or drops is worth a pass now rather than at the next tick.
        reconciler = getattr(self, "reconciler", None)
        if reconciler is not None:
            reconciler.wake()

    def _on_demand(self, model: str) -> None:
        self.reconciler.note_demand(model)

    def _admin_app(self) -> web.Application | None:
        try:
            from llmgw.admin.app import build_admin_app
        except ImportError:
            return None
        return build_admin_app(self)

    async def _listen(self, name: str, app: web.Application, address: str,
                      options: dict | None = None) -> web.AppRunner:
        host, port = split_address(address)
        runner = web.AppRunner(app, **{"access_log": None, **(options or {})}, shutdown_timeout=SHUTDOWN_GRACE)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        sockets = runner.addresses
        bound = sockets[0] if sockets else (host, port)
        self.bound[name] = (bound[0], bound[1])
        self._runners.append(runner)
        log.info("%s listening on %s:%d", name, bound[0], bound[1])
        return runner

    async def _listen_unix(self, runner: web.AppRunner, path: Path) -> None:
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
        """Stop accepting, let in-flight requests finish, leave engines running (R-4.5)."""
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.admin_socket is not None:
            try:  # only the socket this run made: a newer one belongs to another run
                if os.lstat(self.admin_socket).st_ino == self._admin_socket_inode:
                    os.unlink(self.admin_socket)
            except FileNotFoundError:
                pass
            self.admin_socket = None
        await self.reconciler.close()
        await self.router.close()
        await self.fleet.close()
        self.store.close()


async def serve(inventory_path: str | None, *, state_dir: str | None = None, listen: str | None = None,
                admin: str | None = None) -> None:
    inventory, document, source = load_configuration(inventory_path)
    gateway = Gateway(inventory, document, resolve_state_dir(inventory, state_dir), source, listen, admin)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    try:
        await stop.wait()
        log.info("shutting down: in-flight requests get up to %.0fs; engines keep running", SHUTDOWN_GRACE)
    finally:
        await gateway.stop()
