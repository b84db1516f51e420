"""The router supervisor behind `llmgw router`: N worker processes on one client port (R-10.3, R-10.4).

- One supervisor per state directory: an exclusive lock on `supervisor.lock`, which holds its pid.
- One owner per port: the address is first bound without SO_REUSEPORT, so a port another process
  listens on (even a supervisor of the same user) ends the start at once, naming the address.
- One SO_REUSEPORT listening socket per worker slot (the kernel spreads new connections across
  them), each kept open here for the supervisor's whole life and handed to its worker. While a
  slot's worker is replaced, connections wait in its socket's queue for the next one: none is
  refused.
- A worker counts as up once it accepts (`listening` or `ready` on its readiness pipe): one without
  a snapshot answers 503s at once rather than leaving connections queued (R-10.2). The
  supervisor's own `ready` line, which `llmgw serve` waits for, comes once every worker holds a
  snapshot (`ready` from each); status.json says which do.
- A worker that dies is restarted, with a capped backoff. SIGHUP restarts the workers one by one:
  the new one starts on the slot's socket and reports ready before the old one gets SIGTERM (and
  lets its requests in flight finish). SIGUSR1 applies the worker count in `desired.json`.
- Each worker holds the read end of a lifeline pipe whose write end only this process holds: if
  the supervisor dies, however, its workers see end of file and stop, so a new supervisor never
  serves beside orphans.
- `status.json` (0600, replaced atomically) says who runs: pid, listen address, workers, restarts.
- The state directory, status.json and desired.json are trusted only when they are this user's
  and nobody else may write them (`private.untrusted`, R-10.9): otherwise refused, saying why.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.addresses import split_address
from llmgw.contracts.privatefiles import write_private
from llmgw.router import credential, pidlock
from llmgw.router.private import untrusted
from llmgw.router.serving import SHUTDOWN_GRACE

log = logging.getLogger("llmgw.router.supervisor")

LOCK_FILE = "supervisor.lock"
STATUS_FILE = "status.json"
DESIRED_FILE = "desired.json"
WORKER_MODULE = "llmgw.router.worker"
WORKER_START_TIMEOUT = 120.0  # for a worker's first readiness line (and, in a rolling restart, its snapshot)
RESTART_BACKOFF = (0.2, 10.0)  # first delay, cap; doubled after each quick death
STABLE_AFTER = 30.0  # a worker that served this long resets its slot's backoff
STOP_GRACE = SHUTDOWN_GRACE + 5.0  # then SIGKILL


class SupervisorError(LlmgwError):
    """The supervisor cannot start or act; the message says why and what to do."""

    category = Category.STARTUP


@dataclass(frozen=True)
class SupervisorConfig:
    listen: str  # HOST:PORT
    workers: int
    state_dir: Path
    control: str
    credential_file: Path | None  # None: the workers read LLMGW_ROUTER_CREDENTIAL
    ca: Path | None = None
    worker_module: str = WORKER_MODULE
    listen_option: str = "--listen"  # named in the message when the port is in use


# -- the state directory and the port ------------------------------------------------------


def hold_supervisor_lock(state_dir: Path) -> int:
    """Take the state directory: an exclusive lock on supervisor.lock, which then holds our pid.

    The kernel drops the lock when the process ends, however it ends; returns the descriptor."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = untrusted(state_dir, follow=True)
    if problem is not None:
        raise SupervisorError(f"refusing the router state directory: {problem}")
    path = state_dir / LOCK_FILE
    try:
        return pidlock.take(path)
    except OSError as exc:
        raise SupervisorError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
    except pidlock.LockHeld as held:
        raise SupervisorError(f"another llmgw router (pid {held.holder}) is already running with the state directory "
                              f"{state_dir}; stop it with `llmgw router stop --state-dir {state_dir}`, or give "
                              "this one its own --state-dir") from None


def running_supervisor(state_dir: Path) -> int | None:
    """The pid of the supervisor holding `state_dir`, or None when none runs there."""
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def split_listen(address: str) -> tuple[str, int]:
    try:
        return split_address(address)
    except ValueError:
        raise SupervisorError(f"--listen {address!r} is not HOST:PORT") from None


def resolve(address: str) -> list[tuple]:
    host, port = split_listen(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SupervisorError(f"cannot listen on {address} for the router: {exc.strerror}") from None
    return [(family, kind, proto, sockaddr) for family, kind, proto, _, sockaddr in dict.fromkeys(infos)]


def probe_port(address: str, option: str = "--listen") -> None:
    """Fail at once when another process listens on `address`.

    The probe binds without SO_REUSEPORT: with that option alone, a second process of the same
    user would share the port silently and take half of its connections."""
    host, port = split_listen(address)
    for family, kind, proto, sockaddr in resolve(address):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no owner
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    holder = port_holder(port)
                    who = f" by pid {holder[0]} ({holder[1]})" if holder else ""
                    raise SupervisorError(f"cannot listen on {host}:{port} for the router: the address is already "
                                          f"in use{who} (another llmgw serve or router, or another program); "
                                          f"choose another with {option}") from None
                raise SupervisorError(f"cannot listen on {host}:{port} for the router: {exc.strerror or exc}") from None


def port_holder(port: int) -> tuple[int, str] | None:
    """(pid, command name) of a process listening on TCP `port`, from /proc; None when not found."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
                    return int(entry.name), comm
        except OSError:  # gone, or another user's
            continue
    return None


def bind_slot(addresses: list[tuple]) -> list[socket.socket]:
    """One listening socket per address of the client port, in the port's SO_REUSEPORT group."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, sockaddr in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SupervisorError(f"cannot listen on {sockaddr[0]}:{sockaddr[1]} for the router: "
                              f"{exc.strerror or exc}") from None
    return sockets


def write_private_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, 0600, replaced atomically (a reader never sees half a file)."""
    write_private(path, (json.dumps(value, indent=1) + "\n").encode())


def read_status(state_dir: Path) -> dict | None:
    """The supervisor's status.json, or None when there is none, it does not parse or another user
    could have written it (R-10.9)."""
    path = state_dir / STATUS_FILE
    problem = untrusted(path)
    if problem is not None:
        log.warning("not reading the router status: %s", problem)
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- the workers ---------------------------------------------------------------------------


@dataclass(eq=False)
class Worker:
    slot: int
    proc: asyncio.subprocess.Process
    started: float  # wall-clock time
    ready: bool = False  # it accepts on its slot's socket
    fed: bool = False  # it holds a snapshot (said `ready`), not only answering 503s

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


@dataclass(eq=False)
class Slot:
    index: int
    sockets: list[socket.socket]
    worker: Worker | None = None
    restarts: int = 0
    backoff: float = RESTART_BACKOFF[0]
    restarting: asyncio.Task | None = None


def exit_status(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(eq=False)
class Supervisor:
    config: SupervisorConfig
    slots: list[Slot] = field(default_factory=list)
    addresses: list[tuple] = field(default_factory=list)
    bound: tuple[str, int] | None = None
    rolls: int = 0  # rolling restarts completed
    roll_failures: int = 0
    last_roll_error: str | None = None
    _lock_fd: int | None = None
    _lifeline: tuple[int, int] | None = None
    _workers: set[Worker] = field(default_factory=set)  # every worker alive, replaced ones included
    _waiting_fed: set[asyncio.Task] = field(default_factory=set)  # tasks that wait for a worker's first snapshot
    _stopping: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _roll_requests: int = 0
    _resize_requested: bool = False
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _ready_fd: int | None = None  # until the `ready` line is said to whoever started this supervisor

    # -- start --

    def prepare(self) -> None:
        """The lock, the credential, the port: everything that may refuse the start, at once."""
        if self.config.workers < 1:
            raise SupervisorError(f"--workers {self.config.workers}: a router needs at least one worker")
        self._lock_fd = hold_supervisor_lock(self.config.state_dir)
        os.chmod(self.config.state_dir, 0o700)
        try:
            credential.source(self.config.credential_file)
        except credential.CredentialError as exc:
            raise SupervisorError(str(exc)) from None
        probe_port(self.config.listen, self.config.listen_option)
        self.addresses = resolve(self.config.listen)
        first = bind_slot(self.addresses)
        # Port 0 asks for any free port: every later slot joins the one the first got.
        port = first[0].getsockname()[1]
        self.addresses = [(f, k, p, (sa[0], port, *sa[2:])) for f, k, p, sa in self.addresses]
        self.bound = (first[0].getsockname()[0], port)
        self.slots = [Slot(0, first)] + [Slot(i, bind_slot(self.addresses)) for i in range(1, self.config.workers)]
        self._lifeline = os.pipe()  # both ends close-on-exec: only the workers get the read end
        (self.config.state_dir / DESIRED_FILE).unlink(missing_ok=True)
        (self.config.state_dir / STATUS_FILE).unlink(missing_ok=True)  # a killed supervisor's

    async def run(self, ready_fd: int | None = None) -> int:
        """Start the workers, say ready, then supervise until SIGTERM/SIGINT. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._request_roll)
        loop.add_signal_handler(signal.SIGUSR1, self._request_resize)
        try:
            failure = await self._start_all()
            if failure is None and self._stop.is_set():
                failure = "stopped during start-up"
            if failure is not None:
                _say(ready_fd, f"error: {failure}")
                log.error("router not started: %s", failure)
                return 1
            host, port = self.bound
            self._write_status("serving")  # before the ready line: whoever waits on it may read the file
            log.info("router serving on %s:%d with %d workers (pids %s)", host, port, len(self.slots),
                     ", ".join(str(slot.worker.pid) for slot in self.slots))
            self._ready_fd = ready_fd
            self._say_ready_when_fed()
            if self._ready_fd is not None or not all(slot.worker.fed for slot in self.slots):
                log.info("router workers answer 503 until they hold a snapshot from the control plane at %s",
                         self.config.control)
            await self._supervise()
            return 0
        finally:
            if self._ready_fd is not None:  # never fed: whoever waits reads end of file
                os.close(self._ready_fd)
                self._ready_fd = None
            await self._shutdown()

    def _say_ready_when_fed(self) -> None:
        """The `ready` line once every slot's worker holds a snapshot: serve waits for it, and must
        not take workers that answer 503s (no control plane has fed them yet) for serving ones."""
        if self._ready_fd is None:
            return
        if not all(slot.worker is not None and slot.worker.fed for slot in self.slots):
            return
        host, port = self.bound
        _say(self._ready_fd, f"ready pid={os.getpid()} listen={host}:{port} workers={len(self.slots)}")
        self._ready_fd = None
        log.info("router workers hold a snapshot: ready")

    async def _start_all(self) -> str | None:
        started = await asyncio.gather(*(self._start_worker(slot) for slot in self.slots))
        failures = [why for worker, why in started if worker is None]
        for slot, (worker, _) in zip(self.slots, started):
            slot.worker = worker
        return failures[0] if failures else None

    async def _start_worker(self, slot: Slot, fed: bool = False) -> tuple[Worker | None, str]:
        """A new worker on `slot`'s socket, once it accepts (`fed`: once it holds a snapshot too);
        (None, why) when it does not."""
        ready_r, ready_w = os.pipe()
        lifeline_r = self._lifeline[0]
        fds = [sock.fileno() for sock in slot.sockets]
        argv = [sys.executable, "-m", self.config.worker_module, "--slot", str(slot.index),
                *[arg for fd in fds for arg in ("--listen-fd", str(fd))],
                "--ready-fd", str(ready_w), "--lifeline-fd", str(lifeline_r),
                "--control", self.config.control, "--state-dir", str(self.config.state_dir)]
        if self.config.credential_file is not None:  # else the workers inherit the environment's
            argv += ["--credential-file", str(self.config.credential_file)]
        if self.config.ca is not None:
            argv += ["--ca", str(self.config.ca)]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(*fds, ready_w, lifeline_r),
                                                        stdin=subprocess.DEVNULL)
        except OSError as exc:
            os.close(ready_r)
            return None, f"cannot start a worker: {exc.strerror or exc}"
        finally:
            os.close(ready_w)
        worker = Worker(slot.index, proc, time.time())
        self._workers.add(worker)
        asyncio.get_running_loop().create_task(self._watch(slot, worker), name=f"worker-{proc.pid}")
        pipe = await ReadinessPipe.open(ready_r)
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        line = await pipe.line(WORKER_START_TIMEOUT)
        if line == "listening" and fed:  # a rolling restart: the new worker must route as the old one did
            line = await pipe.line(deadline - time.monotonic())
        if line == "ready":
            pipe.close()
            worker.ready = worker.fed = True
            log.info("worker %d (pid %d) ready", slot.index, proc.pid)
            return worker, ""
        if line == "listening":
            worker.ready = True
            log.info("worker %d (pid %d) listening, without a snapshot yet", slot.index, proc.pid)
            # Held until done: the loop keeps only a weak reference to a task, and a collected one
            # would never say that its worker holds a snapshot.
            task = asyncio.get_running_loop().create_task(self._wait_fed(worker, pipe), name=f"worker-{proc.pid}-fed")
            self._waiting_fed.add(task)
            task.add_done_callback(self._waiting_fed.discard)
            return worker, ""
        pipe.close()
        worker.signal(signal.SIGKILL if line is None else signal.SIGTERM)
        await proc.wait()
        if line is None:
            why = f"worker {slot.index} (pid {proc.pid}) did not say ready within {WORKER_START_TIMEOUT:.0f}s"
        elif line == "":
            why = f"worker {slot.index} (pid {proc.pid}) ended before it was ready ({exit_status(proc.returncode)})"
        else:
            why = f"worker {slot.index} (pid {proc.pid}) cannot start: {line.removeprefix('error: ')}"
        return None, why

    async def _wait_fed(self, worker: Worker, pipe: ReadinessPipe) -> None:
        try:
            line = await pipe.line(None)
        finally:
            pipe.close()
        if line == "ready":
            worker.fed = True
            log.info("worker %d (pid %d) holds a snapshot", worker.slot, worker.pid)
            self._wake.set()

    # -- supervision --

    async def _watch(self, slot: Slot, worker: Worker) -> None:
        await worker.proc.wait()
        self._workers.discard(worker)
        if slot.worker is not worker or self._stopping:
            log.info("worker %d (pid %d) ended (%s)", slot.index, worker.pid, exit_status(worker.proc.returncode))
            self._wake.set()
            return
        ran = time.time() - worker.started
        slot.backoff = RESTART_BACKOFF[0] if ran >= STABLE_AFTER else slot.backoff
        log.warning("worker %d (pid %d) died (%s) after %.1fs; restarting it in %.1fs", slot.index, worker.pid,
                    exit_status(worker.proc.returncode), ran, slot.backoff)
        slot.worker = None
        slot.restarting = asyncio.get_running_loop().create_task(self._restart(slot))

    async def _restart(self, slot: Slot) -> None:
        while not self._stopping:
            await asyncio.sleep(slot.backoff)
            slot.backoff = min(slot.backoff * 2, RESTART_BACKOFF[1])
            if self._stopping or slot not in self.slots:
                return
            worker, why = await self._start_worker(slot)
            if worker is not None:
                if self._stopping or slot not in self.slots:
                    worker.signal(signal.SIGTERM)
                    return
                slot.worker = worker
                slot.restarts += 1
                self._write_status("serving")
                return
            log.error("%s; trying again in %.1fs", why, slot.backoff)

    def _request_roll(self) -> None:
        self._roll_requests += 1
        self._wake.set()

    def _request_resize(self) -> None:
        self._resize_requested = True
        self._wake.set()

    async def _supervise(self) -> None:
        stopping = asyncio.get_running_loop().create_task(self._stop.wait())
        try:
            while not self._stop.is_set():
                waking = asyncio.get_running_loop().create_task(self._wake.wait())
                await asyncio.wait([stopping, waking], return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
                self._wake.clear()
                if self._stop.is_set():
                    break
                if self._resize_requested:
                    self._resize_requested = False
                    await self._resize()
                if self._roll_requests:
                    self._roll_requests = 0
                    await self._roll()
                self._write_status("serving")
                self._say_ready_when_fed()
        finally:
            stopping.cancel()

    async def _roll(self) -> None:
        """Restart the workers one by one: the new one ready on the slot's socket, then the old one drains."""
        log.info("rolling restart of %d workers", len(self.slots))
        self._write_status("restarting")
        for slot in list(self.slots):
            if self._stop.is_set():
                return
            worker, why = await self._start_worker(slot, fed=slot.worker is not None and slot.worker.fed)
            if worker is None:
                self.roll_failures += 1
                self.last_roll_error = why
                log.error("rolling restart stopped: %s; the running workers keep serving", why)
                return
            old, slot.worker = slot.worker, worker
            if slot.restarting is not None:
                slot.restarting.cancel()
                slot.restarting = None
            if old is not None:
                log.info("worker %d: pid %d replaces pid %d, which now drains", slot.index, worker.pid, old.pid)
                old.signal(signal.SIGTERM)
        self.rolls += 1
        self.last_roll_error = None
        log.info("rolling restart done: workers %s", ", ".join(str(slot.worker.pid) for slot in self.slots if slot.worker))

    async def _resize(self) -> None:
        problem = untrusted(self.config.state_dir / DESIRED_FILE)
        if problem is not None:
            log.error("not reading %s: %s; the worker count stays %d", DESIRED_FILE, problem, len(self.slots))
            return
        try:
            wanted = int(json.loads((self.config.state_dir / DESIRED_FILE).read_text())["workers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("cannot read %s (%s): the worker count stays %d", DESIRED_FILE, exc, len(self.slots))
            return
        if wanted < 1 or wanted == len(self.slots):
            return
        log.info("worker count %d -> %d", len(self.slots), wanted)
        while len(self.slots) > wanted:
            slot = self.slots.pop()
            if slot.restarting is not None:
                slot.restarting.cancel()
            if slot.worker is not None:
                slot.worker.signal(signal.SIGTERM)
            # Connections still queued on this socket are reset: the kernel cannot move them.
            for sock in slot.sockets:
                sock.close()
        while len(self.slots) < wanted:
            try:
                slot = Slot(len(self.slots), bind_slot(self.addresses))
            except SupervisorError as exc:
                log.error("%s", exc)
                return
            worker, why = await self._start_worker(slot)
            if worker is None:
                log.error("%s", why)
                for sock in slot.sockets:
                    sock.close()
                return
            slot.worker = worker
            self.slots.append(slot)

    # -- stop --

    async def _shutdown(self) -> None:
        self._stopping = True
        self._write_status("stopping")
        for slot in self.slots:
            if slot.restarting is not None:
                slot.restarting.cancel()
        workers = list(self._workers)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        if workers:
            log.info("stopping %d workers (up to %.0fs for requests in flight)", len(workers), STOP_GRACE)
            done, pending = await asyncio.wait([asyncio.ensure_future(w.proc.wait()) for w in workers],
                                               timeout=STOP_GRACE)
            for worker in workers:
                if worker.proc.returncode is None:
                    log.warning("worker %d (pid %d) did not stop within %.0fs: killed", worker.slot, worker.pid,
                                STOP_GRACE)
                    worker.signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5)
        for slot in self.slots:
            for sock in slot.sockets:
                sock.close()
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None
        (self.config.state_dir / STATUS_FILE).unlink(missing_ok=True)
        log.info("router stopped")

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _write_status(self, state: str) -> None:
        host, port = self.bound or (None, None)
        status = {"pid": os.getpid(), "state": state, "listen": f"{host}:{port}", "control": self.config.control,
                  "workers": [{"slot": slot.index, "pid": slot.worker.pid if slot.worker else None,
                               "started": slot.worker.started if slot.worker else None,
                               "snapshot": slot.worker.fed if slot.worker else False, "restarts": slot.restarts}
                              for slot in self.slots],
                  "restarts": sum(slot.restarts for slot in self.slots), "rolls": self.rolls,
                  "roll_failures": self.roll_failures, "last_roll_error": self.last_roll_error}
        try:
            write_private_json(self.config.state_dir / STATUS_FILE, status)
        except OSError as exc:
            log.warning("cannot write %s: %s", STATUS_FILE, exc.strerror or exc)


def _say(fd: int | None, line: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (line + "\n").encode())
        os.close(fd)
    except OSError:
        pass


class ReadinessPipe:
    """The read end of a worker's readiness pipe, a line at a time."""

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.ReadTransport):
        self._reader, self._transport = reader, transport

    @classmethod
    async def open(cls, fd: int) -> ReadinessPipe:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", 0))
        return cls(reader, transport)

    async def line(self, timeout: float | None) -> str | None:
        """The next line ("" at end of file), or None after `timeout` seconds (None: no limit)."""
        try:
            line = await asyncio.wait_for(self._reader.readline(), None if timeout is None else max(0.0, timeout))
        except asyncio.TimeoutError:
            return None
        return line.decode(errors="replace").strip()

    def close(self) -> None:
        self._transport.close()


def run_supervisor(config: SupervisorConfig, ready_fd: int | None = None) -> int:
    """`llmgw router`: prepare (may raise SupervisorError), then run until stopped."""
    supervisor = Supervisor(config)
    try:
        supervisor.prepare()
    except SupervisorError:
        supervisor.release()
        raise
    try:
        return asyncio.run(supervisor.run(ready_fd))
    finally:
        supervisor.release()
