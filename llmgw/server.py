"""Wires the pieces for `llmgw serve`: store, catalog, fleet, reconciler, router, admin (R-9.1, R-9.2)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import logging
import os
import secrets
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.admin.tokens import AdminTokens, write_token_file
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import Document, Inventory, is_loopback, load_configuration, resolve_state_dir, split_address
from llmgw.router import pidlock
from llmgw.control.feed import FeedPublisher
from llmgw.control.reconciler import Reconciler, Routers
from llmgw.control.feedserver import FEED_SOCKET, FeedServer, FeedSocket, listen_unix
from llmgw.control.service import ControlPlane, load_stored_models, reload_on_signal
from llmgw.aio import cancel_and_wait
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.secret import SecretError, response_secret
from llmgw.localfeed import LocalFeed
from llmgw.router import RUNNER_OPTIONS, Router
from llmgw.router.metrics import ReportedRouterMetrics
from llmgw.router.credential import CREDENTIAL_FILE
from llmgw.router.private import untrusted
from llmgw.router.serving import SHUTDOWN_GRACE, finish_requests_within
from llmgw.routers import Verifiers, list_routers, serve_router_credential
from llmgw.store import Store

log = logging.getLogger(__name__)

TOKEN_FILE = "admin-token"
ADMIN_ADDRESS_FILE = "admin-address"
ADMIN_SOCKET = "admin.sock"
DATABASE = "state.db"
# Made 0600 on every start, whatever they were: the database holds engine keys and key hashes.
PRIVATE_FILES = (DATABASE, DATABASE + "-wal", DATABASE + "-shm", TOKEN_FILE, ADMIN_ADDRESS_FILE)


def secure_state_dir(state_dir: Path) -> None:
    """The state directory 0700 and its files 0600, on every start (R-9.3).

    A directory or database left readable by an earlier version, a restored backup or a
    hand-made directory is closed up here rather than trusted; symlinks are left alone. What
    another user owns is refused, by the rule the router applies to its state too (R-10.9): as
    root, the chmod alone would succeed on it.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)
        problems = [untrusted(state_dir, follow=True)]
        for name in PRIVATE_FILES:
            path = state_dir / name
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.chmod(path, 0o600)
                    problems.append(untrusted(path))
            except FileNotFoundError:
                pass
    except PermissionError as exc:
        # Another user's directory (or one inside it): serve runs as the user who owns its state.
        raise StartupError(f"cannot make the state directory private: {exc.strerror}: {exc.filename} "
                           f"(owner uid {_owner(exc.filename)}, this process runs as uid {os.geteuid()}); "
                           "run llmgw serve as its owner or give --state-dir") from None
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise StartupError(f"refusing the state directory: {problem}") from None


def _owner(path) -> str:
    try:
        return str(os.stat(path).st_uid)
    except (OSError, TypeError):
        return "-"


LOCK_FILE = "serve.lock"


class StartupError(Exception):
    """`llmgw serve` cannot start; the message says why and what to do."""


def hold_instance_lock(state_dir: Path) -> int:
    """Take the state directory for this process: an exclusive lock on a file that holds its pid.

    The kernel drops the lock when the process ends, however it ends, so a stale file never
    blocks a start. Returns the open descriptor; closing it releases the lock."""
    path = state_dir / LOCK_FILE
    try:
        return pidlock.take(path)
    except OSError as exc:  # a symlink planted there is refused, not followed
        raise StartupError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
    except pidlock.LockHeld as held:
        raise StartupError(f"another llmgw serve (pid {held.holder}) is already running with the state directory "
                           f"{state_dir}; stop it first, or give this one its own --state-dir") from None


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


async def in_daemon_thread(fn: Callable[[], object]):
    """`fn()` on a thread of its own that does not hold up the process's exit: opening the
    state database may wait up to its busy timeout for another command, and a SIGTERM meanwhile
    must still stop `serve` at once (the default executor is joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the waiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=run, name="llmgw-start", daemon=True).start()
    return await future


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
    write_token_file(path, token)
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
    _runners: list[web.AppRunner] = field(default_factory=list, init=False)
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
        catalog = Catalog.from_inventory(self.inventory, self.document, stored=stored)
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
                          engine_load=self.publisher.engine_load)
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
            self.feed = LocalFeed(self.publisher, self.router)
            self.feed.pump()  # the router holds the first snapshot before it listens
            self.feed.start()
            router_app = self.router.web_app()
            finish_requests_within(router_app, SHUTDOWN_GRACE)
            await self._listen("router", router_app, self._sockets.pop("router"), RUNNER_OPTIONS)
        admin_app = self._admin_app()
        if admin_app is not None:
            tls = self.inventory.gateway.admin_tls  # set: https, for routers and ctl on other hosts
            runner = await self._listen("admin", admin_app, self._sockets.pop("admin"),
                                        ssl_context=tls.server_context() if tls is not None else None)
            host, port = self.bound["admin"]
            (self.state_dir / ADMIN_ADDRESS_FILE).write_text(f"{host}:{port}\n")
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
        self.reconciler.note_demand(model)

    def _reloaded(self, inventory: Inventory) -> None:
        """A reload applied (R-10.5): routers get the settings they read in a feed change."""
        self.inventory = inventory
        self.publisher.set_gateway(inventory.gateway)

    def _admin_app(self) -> web.Application | None:
        try:
            from llmgw.admin.app import build_admin_app
        except ImportError:
            return None
        return build_admin_app(self)

    async def _listen(self, name: str, app: web.Application, sockets: list[socket.socket],
                      options: dict | None = None, ssl_context=None) -> web.AppRunner:
        runner = web.AppRunner(app, **{"access_log": None, **(options or {})}, shutdown_timeout=SHUTDOWN_GRACE)
        await runner.setup()
        self._runners.append(runner)
        for sock in sockets:
            await web.SockSite(runner, sock, ssl_context=ssl_context).start()
        bound = sockets[0].getsockname()
        self.bound[name] = (bound[0], bound[1])
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


ROUTER_DIR = "router"  # the spawned supervisor's state directory, inside serve's
ROUTER_LOG = "router.log"
ROUTER_START_TIMEOUT = 180.0  # its workers wait for the first snapshot before they say ready
ROUTER_STOP_TIMEOUT = 40.0  # its workers' requests in flight get SHUTDOWN_GRACE, then the supervisor kills them


@dataclass(frozen=True)
class RunningRouter:
    """A router supervisor found running on serve's state directory (R-10.4)."""

    pid: int
    listen: str | None
    workers: int | None


def running_router(state_dir: Path) -> RunningRouter | None:
    from llmgw.router.supervisor import read_status, running_supervisor

    pid = running_supervisor(state_dir / ROUTER_DIR)
    if pid is None:
        return None
    status = read_status(state_dir / ROUTER_DIR) or {}
    workers = status.get("workers")
    return RunningRouter(pid, status.get("listen"), len(workers) if workers else None)


def instance_lock_holder(state_dir: Path) -> str | None:
    """The pid in serve.lock while another serve holds it, without taking it."""
    try:
        fd = os.open(state_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def same_listen(running: str | None, wanted: str) -> bool:
    try:
        (have_host, have_port), (want_host, want_port) = split_address(running or ""), split_address(wanted)
    except ValueError:
        return False
    if have_port != want_port:
        return False
    try:
        wanted_hosts = {info[4][0] for info in socket.getaddrinfo(want_host, want_port, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return have_host in wanted_hosts


def adopt_router(state_dir: Path, running: RunningRouter, listen: str, workers: int) -> None:
    """Leave the running supervisor serving; tell it the worker count wanted (desired.json, SIGUSR1)."""
    from llmgw.router.supervisor import DESIRED_FILE, write_private_json

    log.info("adopting the running router supervisor: pid %d, listening on %s, %s workers", running.pid,
             running.listen or "-", running.workers if running.workers is not None else "-")
    if not same_listen(running.listen, listen):
        log.warning("the running router listens on %s, not on %s as asked: it keeps its address until it is "
                    "restarted (`llmgw router stop --state-dir %s`, then start llmgw serve again)",
                    running.listen or "-", listen, state_dir / ROUTER_DIR)
    if running.workers != workers:
        log.info("asking the router supervisor for %d workers instead of %s", workers,
                 running.workers if running.workers is not None else "-")
        write_private_json(state_dir / ROUTER_DIR / DESIRED_FILE, {"workers": workers})
        os.kill(running.pid, signal.SIGUSR1)


async def spawn_router(state_dir: Path, listen: str, workers: int) -> int:
    """Start `llmgw router` for this state directory, detached, and wait until it serves; its pid.

    It runs in a session of its own with stdin on /dev/null and its log appended to router.log,
    so it outlives serve, however serve ends, and holds none of serve's output open (R-10.4). One
    that has not said ready when serve is stopped has served nothing and is killed: left to start
    on its own, it would wait for a control plane that is gone, and the next serve would find it
    half-started."""
    log_path = state_dir / ROUTER_LOG
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(log_fd, 0o600)
    ready_r, ready_w = os.pipe()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    argv = [sys.executable, "-m", "llmgw.cli.main", "router", "--control", f"unix:{state_dir / FEED_SOCKET}",
            "--credential-file", str(state_dir / ROUTER_DIR / CREDENTIAL_FILE), "--state-dir", str(state_dir / ROUTER_DIR),
            "--listen", listen, "--workers", str(workers), "--ready-fd", str(ready_w), "--log-level", level]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, pass_fds=(ready_w,),
                                start_new_session=True)
    finally:
        os.close(ready_w)
        os.close(log_fd)
    try:
        line = await in_daemon_thread(lambda: _first_line(ready_r, ROUTER_START_TIMEOUT))
    except asyncio.CancelledError:  # serve stopped during its start: a router that never served goes too
        proc.kill()
        raise
    if line is not None and line.startswith("ready"):
        said = dict(word.partition("=")[::2] for word in line.split()[1:])
        log.info("router supervisor started: pid %d, listening on %s, %s workers", proc.pid, said.get("listen", "-"),
                 said.get("workers", "-"))
        return proc.pid
    if line is None:
        proc.kill()
        raise StartupError(f"the router (pid {proc.pid}) did not serve within {ROUTER_START_TIMEOUT:.0f}s; "
                           f"see {log_path}")
    if line.startswith("error: "):
        raise StartupError(line.removeprefix("error: "))
    code = proc.wait()
    raise StartupError(f"the router exited (code {code}) before it served; see {log_path}")


async def stop_router(state_dir: Path) -> None:
    """SIGTERM to the router supervisor of this state directory, and wait until it is gone (its
    workers finish their requests in flight first): an interactive stop of serve (R-10.4)."""
    from llmgw.router.supervisor import running_supervisor

    pid = running_supervisor(state_dir / ROUTER_DIR)
    if pid is None or pid <= 0:
        return
    log.info("stopping the router supervisor (pid %d): its workers finish their requests in flight first", pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + ROUTER_STOP_TIMEOUT
    # Its lock is released a moment before the process ends: wait for the process itself.
    while running_supervisor(state_dir / ROUTER_DIR) is not None or not _process_gone(pid):
        if time.monotonic() > deadline:
            log.warning("the router supervisor (pid %d) did not stop within %.0fs; stop it with `llmgw router stop "
                        "--state-dir %s`", pid, ROUTER_STOP_TIMEOUT, state_dir / ROUTER_DIR)
            return
        await asyncio.sleep(0.1)
    log.info("router stopped (pid %d); the client port is free", pid)


def _process_gone(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # spawned by this serve: reaped here
            return True
    except ChildProcessError:  # another's child (adopted): gone once it is no process or a zombie
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _first_line(fd: int, timeout: float) -> str | None:
    import selectors

    with os.fdopen(fd, "rb", 0) as pipe, selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        data = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").split("\n", 1)[0].strip()


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
        holder = instance_lock_holder(resolved)
        if holder is not None:
            raise StartupError(f"another llmgw serve (pid {holder}) is already running with the state directory "
                               f"{resolved}; stop it first, or give this one its own --state-dir")
        running = running_router(resolved)
        if running is None:
            from llmgw.router.supervisor import SupervisorError, probe_port

            try:  # before anything starts, as when serve bound the port itself
                probe_port(client_listen, "--listen")
            except SupervisorError as exc:
                raise StartupError(str(exc)) from None
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
    loop.add_signal_handler(signal.SIGHUP, reload_on_signal, gateway)  # as `llmgw ctl reload`

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
