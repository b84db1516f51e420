"""NodeLink: the one way the rest of llmgw reaches a node (`await link.ops.status()`, typed, over
`await link.call(op, args)`).

A link owns one transport (an asyncssh connection, or a local subprocess for `connection: local`)
and one long-lived helper session on it. A single supervisor task per link connects, deploys the
helper when it is missing or fails its integrity check, and reconnects with capped exponential
backoff and jitter when the connection is lost (R-1.1–R-1.3, R-1.7). Only this package knows
that SSH exists.

States: `connecting` until the first attempt ends, then `ready`, or `unreachable` / `unhealthy`
with the reason. Retries of a node that stays down do not pass through `connecting` again, and
`since` is the time it went down (its first failure), not the time of the latest retry.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import errno
import hashlib
import importlib.resources
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import asyncssh

from llmgw.aio import cancel_and_wait
from llmgw.config import NodeConfig, SSHConfig
from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.states import LinkState, transition
from llmgw.fleet.errors import NodeUnavailable, RemoteError
from llmgw.fleet.ops import FleetSecretRequest, Hello, NodeOps
from llmgw.fleet.session import HelperFailed, HelperSession, NodeError, Stream

log = logging.getLogger(__name__)

CONNECTING, READY, UNREACHABLE, UNHEALTHY = LinkState.CONNECTING, LinkState.READY, LinkState.UNREACHABLE, LinkState.UNHEALTHY
HELLO_TIMEOUT = 20.0
BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0
# sshd allows MaxSessions (10) channels per connection; a link opens one, the helper's process,
# whose stdin also carries the helper when the node lacks it.
PREFERRED_CIPHERS = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


# The helper is started through its own verifying loader (the LOADER constant of the helper
# file, read from the shipped copy): it hashes the file before Python parses it, so a tampered
# copy that no longer compiles still fails its check rather than raising a syntax error, and it
# runs the very bytes it hashed. A missing or mismatched copy is replaced on the spot: the loader
# says {"upload": ...}, reads the helper from stdin, checks its hash, writes it atomically (temp +
# rename; directories it creates are 0700, existing ones are left for the helper to judge) and
# runs it: one process start and no extra channel per deployment. `python3 -I` (isolated mode)
# keeps the node's PYTHON* variables, user site-packages and working directory out of it. The
# helper then verifies itself and its directories again.
# Exit 96: stdin ended before the upload was complete; 97: the upload's hash was wrong.


def helper_argv(python: str, path: str, code: HelperCode, root: str) -> list[str]:
    return [python, "-I", "-c", code.loader, path, code.sha256, str(len(code.text)),
            "serve", "--expect-sha256", code.sha256, "--root", root]


@dataclass(frozen=True)
class HelperCode:
    text: bytes
    sha256: str

    @property
    def filename(self) -> str:
        return f"llmgw_helper-{self.sha256}.py"

    @property
    def loader(self) -> str:
        return _loader_of(self.text)


@lru_cache(maxsize=4)
def _loader_of(text: bytes) -> str:
    """The helper's LOADER constant, read from its source without running any of it."""
    for statement in ast.parse(text).body:
        if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == "LOADER"):
            return ast.literal_eval(statement.value)
    raise ValueError("the helper defines no LOADER")


@lru_cache(maxsize=1)
def helper_code() -> HelperCode:
    """The helper this control plane ships, read as package data, and its SHA-256."""
    text = importlib.resources.files("llmgw.remote").joinpath("llmgw_helper.py").read_bytes()
    return HelperCode(text=text, sha256=hashlib.sha256(text).hexdigest())


class ConnectGate:
    """Bounds the SSH handshakes in flight at once and spaces their starts by `spacing` seconds.

    sshd's MaxStartups counts connections that have not authenticated yet, so only the handshake
    and authentication run inside the gate. The TCP connect runs before it, outside, bounded by
    its own timeout: a node that swallows SYNs never holds a place that a live node waits for.
    """

    def __init__(self, limit: int, spacing: float = 0.0):
        self.limit = limit
        self.spacing = spacing
        self._slots = asyncio.Semaphore(limit)
        self._next_start = 0.0  # loop time at which the next handshake may begin

    @asynccontextmanager
    async def handshake(self, node: str) -> AsyncIterator[None]:
        async with self._slots:
            loop = asyncio.get_running_loop()
            now = loop.time()
            start = max(now, self._next_start)
            self._next_start = start + self.spacing
            if start > now:
                await asyncio.sleep(start - now)
            yield


class NodeLink:
    """A node's link. Subclasses open the transport and start the helper."""

    def __init__(self, name: str, *, code: HelperCode | None = None,
                 on_state: Callable[[NodeLink], None] | None = None, fleet_secret: str | None = None):
        self.name = name
        self.code = code or helper_code()
        self._fleet_secret = fleet_secret
        self.state = CONNECTING
        self.reason: str | None = None
        self.since = time.time()
        self.hello: Hello | None = None
        self.connects = 0
        self.failures = 0  # attempts that failed since the node was last ready
        self._session: HelperSession | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._wake = asyncio.Event()
        self._on_state = on_state

    # -- public ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"link-{self.name}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def call(self, op: str, args: dict | None = None, timeout: float | None = 30.0) -> Any:
        """One helper operation by name, its answer as the helper sent it: the transport under
        the typed operations (`ops`)."""
        session = self._session
        if session is None or session.closed:
            raise NodeUnavailable(self.name, op, "not connected", self.reason or f"node is {self.state}")
        return await session.call(op, args, timeout)

    def stream(self, op: str, args: dict | None = None) -> Stream:
        session = self._session
        if session is None or session.closed:
            raise NodeUnavailable(self.name, op, "not connected", self.reason or f"node is {self.state}")
        return session.stream(op, args)

    @property
    def ops(self) -> NodeOps:
        """The node's helper operations, typed (ops.py)."""
        return NodeOps(self.name, self)

    @property
    def answering(self) -> bool:
        """A helper session is open: the node is ready, or unhealthy because of what it answered."""
        return self._session is not None and not self._session.closed

    def report_answers(self, problem: str | None) -> None:
        """What the fleet made of the helper's latest answers. A problem (an answer without the
        protocol's shape) makes the node `unhealthy` with it while the session lasts: placement
        and the reconciler leave it alone. None makes it ready again."""
        if not self.answering:
            return
        if problem is not None:
            self._set_state(UNHEALTHY, problem)
        elif self.state == UNHEALTHY:
            self._set_state(READY)

    def reconnect_now(self) -> None:
        """Skip the rest of the current backoff wait (e.g. after the operator fixed something)."""
        self._wake.set()

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._task)
        await self._teardown()

    # -- supervision -------------------------------------------------------------------------

    def _set_state(self, state: str, reason: str | None = None) -> None:
        if state == self.state and reason == self.reason:
            return
        if not transition(self.state, LinkState(state), f"node {self.name}'s link"):
            return  # the table's refusal is logged and counted (llmgw.contracts.states)
        if (state == READY) != (self.state == READY) or self.state == CONNECTING:
            # Since it became ready, or since it first failed: the retries of a node that stays
            # down (unreachable, unhealthy, with whatever reason) do not restart the clock, or
            # its replicas would never outlast the settling window.
            self.since = time.time()
        if state == READY:
            log.info("%s: ready (helper %s)", self.name, self.hello.version if self.hello else None)
        else:
            log.warning("%s: %s%s", self.name, state, f": {reason}" if reason else "")
        self.state, self.reason = state, reason
        if state == READY:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_state is not None:
            self._on_state(self)

    async def _supervise(self) -> None:
        while not self._closed:
            try:
                session = await self._open()
            except HelperFailed as exc:
                self.failures += 1
                self._set_state(UNHEALTHY, exc.reason)
                await self._teardown()
                await self._sleep(backoff_delay(self.failures + 2, BACKOFF_BASE, BACKOFF_CAP))
                continue
            except (OSError, asyncssh.Error, TimeoutError, NodeError) as exc:
                self.failures += 1
                self._set_state(UNREACHABLE, _describe(exc))
                await self._teardown()
                await self._sleep(backoff_delay(self.failures - 1, BACKOFF_BASE, BACKOFF_CAP))
                continue
            except Exception as exc:  # a bug or an answer nobody foresaw: this node only, retried
                log.exception("%s: connecting failed unexpectedly", self.name)
                self.failures += 1
                self._set_state(UNHEALTHY, f"connecting failed unexpectedly: {type(exc).__name__}: {exc}")
                await self._teardown()
                await self._sleep(backoff_delay(self.failures + 2, BACKOFF_BASE, BACKOFF_CAP))
                continue
            self._session = session
            if self._closed:  # closed while connecting: close() tears the session down
                return
            self.hello = session.hello
            self.connects += 1
            self.failures = 0
            self._set_state(READY)
            reason = await asyncio.shield(session.lost)
            if self._closed:
                return
            self._session = None
            self._set_state(UNREACHABLE, f"connection lost: {reason}")
            await self._teardown()
            await self._sleep(backoff_delay(0, BACKOFF_BASE, BACKOFF_CAP))

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _open(self) -> HelperSession:
        """Connect, start the helper (deploying it when needed) and return the session."""
        raise NotImplementedError

    def _deployed(self, session: HelperSession) -> None:
        if session.uploaded is not None:
            log.info("%s: deploying helper %s (the node's copy was %s)", self.name, self.code.sha256[:12],
                     "missing" if session.uploaded == "missing" else "changed")

    async def _hand_over(self, session: HelperSession) -> None:
        """Give the started helper the fleet secret it seals and checks cache entries with: in the
        session only, never in an argv or a log line."""
        if self._fleet_secret is None:
            return
        try:
            await NodeOps(self.name, session).fleet_secret(FleetSecretRequest(self._fleet_secret), timeout=HELLO_TIMEOUT)
        except RemoteError as exc:  # refused: retrying the same helper would not help
            raise HelperFailed(f"the helper cannot keep the fleet secret: {exc.message}") from None

    async def _teardown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class SSHLink(NodeLink):
    """A node reached over one persistent asyncssh connection (R-1.1, R-1.5)."""

    def __init__(self, node: NodeConfig, ssh: SSHConfig, *, connect_gate: ConnectGate | None = None,
                 **kw):
        super().__init__(node.name, **kw)
        self.node = node
        self.ssh = ssh
        self._conn: asyncssh.SSHClientConnection | None = None
        self._process: asyncssh.SSHClientProcess | None = None
        self._gate = connect_gate
        remote = ssh.remote_dir
        # Relative paths resolve against the login directory: no shell expansion is needed.
        self.remote_dir = remote[2:] if remote.startswith("~/") else remote
        self.helper_path = f"{self.remote_dir}/helper/{self.code.filename}"

    def _connect_options(self) -> dict[str, Any]:
        ssh, node = self.ssh, self.node
        options: dict[str, Any] = {
            "port": node.port or ssh.port,
            "connect_timeout": ssh.connect_timeout,
            "login_timeout": ssh.connect_timeout,
            "keepalive_interval": ssh.keepalive_interval,
            "keepalive_count_max": ssh.keepalive_count,
        }
        user = node.user or ssh.user
        if user:
            options["username"] = user
        identity = node.identity_file or ssh.identity_file
        if identity:
            options["client_keys"] = [os.path.expanduser(identity)]
        if ssh.known_hosts:
            options["known_hosts"] = os.path.expanduser(ssh.known_hosts)
        if ssh.config_file:
            options["config"] = [os.path.expanduser(ssh.config_file)]
        else:
            # AES-GCM first (the rest stay as fallbacks): with AES-NI it costs about half the
            # client CPU per call of asyncssh's default chacha20-poly1305.
            options["encryption_algs"] = PREFERRED_CIPHERS
        return options

    async def _connect(self) -> asyncssh.SSHClientConnection:
        host = self.node.host
        assert host is not None
        options = self._connect_options()
        try:
            # Resolved as asyncssh resolves them (the ssh config's HostName, Port, ProxyJump...),
            # so that the TCP connect below goes where asyncssh itself would have gone.
            resolved = await asyncssh.SSHClientConnectionOptions.construct(host=host, **options)
            if resolved.tunnel or resolved.proxy_command or resolved.canonicalize_hostname:
                # The connection is not a plain TCP connect of ours: asyncssh makes all of it,
                # inside the gate.
                async with self._handshake():
                    return await self._ssh_handshake(host, options["port"], None, resolved)
            sock = await self._tcp_connect(resolved.host, resolved.port, resolved.family, resolved.local_addr)
            try:
                async with self._handshake():
                    return await self._ssh_handshake(host, options["port"], sock, resolved)
            except BaseException:
                sock.close()
                raise
        except asyncssh.HostKeyNotVerifiable as exc:
            raise HelperFailed(await self._host_key_message(host, options, exc)) from None

    def _handshake(self):
        return self._gate.handshake(self.name) if self._gate is not None else contextlib.nullcontext()

    async def _tcp_connect(self, host: str, port: int, family: int, local_addr) -> socket.socket:
        """A connected TCP socket to the node, within connect_timeout (outside the gate)."""
        timeout = self.ssh.connect_timeout
        target = _target(host, port)
        try:
            return await asyncio.wait_for(_open_socket(host, port, family, local_addr), timeout)
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"TCP connect to {target} timed out after {timeout:g}s") from None
        except OSError as exc:
            detail = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
            raise OSError(exc.errno, f"TCP connect to {target}: {detail}") from None

    async def _ssh_handshake(self, host: str, port: int, sock: socket.socket | None,
                             resolved: asyncssh.SSHClientConnectionOptions) -> asyncssh.SSHClientConnection:
        timeout = self.ssh.connect_timeout
        try:
            if sock is None:
                return await asyncssh.connect(host, port, options=resolved)
            # host and port again: the host key is looked up under the name the inventory gave.
            return await asyncssh.connect(host, port, sock=sock, options=resolved)
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"SSH handshake with {_target(resolved.host, resolved.port)} did not "
                                           f"finish within {timeout:g}s") from None

    async def _host_key_message(self, host: str, options: dict, exc: Exception) -> str:
        """Name the node and the fingerprint it presented, and say what to do (R-1.5)."""
        port = options["port"]
        fingerprint = "unknown fingerprint"
        try:
            key = await asyncio.wait_for(asyncssh.get_server_host_key(host, port), self.ssh.connect_timeout)
            if key is not None:
                fingerprint = key.get_fingerprint("sha256")
        except (OSError, asyncssh.Error, asyncio.TimeoutError):
            pass
        known = options.get("known_hosts") or "~/.ssh/known_hosts"
        target = host if port == 22 else f"[{host}]:{port}"
        listed = False
        try:
            entries = asyncssh.read_known_hosts(os.path.expanduser(known))
            listed = bool(entries.match(host, "", port)[0])
        except (OSError, ValueError, asyncssh.Error):
            pass
        if listed:
            return (f"host key for {self.name} ({target}) changed: it now presents {fingerprint}, which does "
                    f"not match {known}; if the node was reinstalled, remove the old key with "
                    f"`ssh-keygen -R {target}` and add the new one after checking it")
        return (f"host key for {self.name} ({target}) is not known ({fingerprint}); check it and add it to "
                f"{known} (e.g. `ssh-keyscan -p {port} {host}` compared with the node's own key)")

    async def _open(self) -> HelperSession:
        self._conn = await self._connect()
        return await self._start_helper()

    async def _start_helper(self) -> HelperSession:
        assert self._conn is not None
        python = self.node.python or self.ssh.python
        command = shlex.join(helper_argv(python, self.helper_path, self.code, self.remote_dir))
        process = await self._conn.create_process(command, encoding=None)
        session = HelperSession(self.name, process.stdout, process.stdin, stderr=process.stderr)
        try:
            await session.start(HELLO_TIMEOUT, upload=self.code.text)
        except HelperFailed as exc:
            stderr = b""
            try:
                await asyncio.wait_for(process.wait_closed(), 5)
                stderr = await asyncio.wait_for(process.stderr.read(), 2)
            except (asyncio.TimeoutError, asyncssh.Error, OSError):
                pass
            status = process.exit_status
            process.close()
            text = stderr.decode(errors="replace").strip()
            if exc.fatal is None and status is None:
                # No exit status at all is a lost connection, not a result.
                raise NodeUnavailable(self.name, "helper", "start", "connection lost while starting the helper")
            reason = exc.reason if exc.fatal else (
                f"helper exited with status {status}: {text[-300:] or 'no output'}")
            if exc.fatal is None and status == 127:
                reason = f"{python!r} was not found on the node (set ssh.python or the node's python)"
            raise HelperFailed(reason, fatal=exc.fatal, exit_status=status) from None
        self._deployed(session)
        self._process = process
        await self._hand_over(session)
        return session

    async def _teardown(self) -> None:
        await super()._teardown()
        if self._process is not None:
            self._process.close()
            self._process = None
        if self._conn is not None:
            self._conn.close()
            try:
                await asyncio.wait_for(self._conn.wait_closed(), 5)
            except (asyncio.TimeoutError, Exception):
                pass
            self._conn = None


class LocalLink(NodeLink):
    """`connection: local`: the helper as a local subprocess, same protocol (R-1.7)."""

    def __init__(self, node: NodeConfig, root: str | os.PathLike, python: str | None = None, **kw):
        super().__init__(node.name, **kw)
        self.node = node
        self.root = Path(root)
        self.python = python or node.python or sys.executable
        self.helper_path = self.root / "helper" / self.code.filename
        self._proc: asyncio.subprocess.Process | None = None

    async def _open(self) -> HelperSession:
        self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the loader makes ROOT and ROOT/helper
        return await self._start_helper()

    async def _start_helper(self) -> HelperSession:
        proc = await asyncio.create_subprocess_exec(
            *helper_argv(self.python, str(self.helper_path), self.code, str(self.root)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=64 * 1024 * 1024, start_new_session=True)
        assert proc.stdout is not None and proc.stdin is not None
        session = HelperSession(self.name, proc.stdout, proc.stdin, stderr=proc.stderr)
        try:
            await session.start(HELLO_TIMEOUT, upload=self.code.text)
        except HelperFailed as exc:
            try:
                status = await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                status = await proc.wait()
            stderr = (await proc.stderr.read()).decode(errors="replace").strip() if proc.stderr else ""
            reason = exc.reason if exc.fatal else f"helper exited with status {status}: {stderr[-300:]}"
            raise HelperFailed(reason, fatal=exc.fatal, exit_status=status) from None
        self._deployed(session)
        self._proc = proc
        await self._hand_over(session)
        return session

    async def _teardown(self) -> None:
        await super()._teardown()
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


async def _open_socket(host: str, port: int, family: int, local_addr) -> socket.socket:
    """Connect to the first address of `host` that accepts, as asyncio's create_connection does."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(errno.EHOSTUNREACH, f"{host} has no address")
    error: OSError | None = None
    for address_family, kind, proto, _, address in infos:
        sock = socket.socket(address_family, kind, proto)
        try:
            sock.setblocking(False)
            if local_addr:
                sock.bind(local_addr)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    assert error is not None
    raise error


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncssh.PermissionDenied):
        return f"authentication refused: {exc.reason}"
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, TimeoutError):
        return "connection timed out"
    return str(exc)


def make_link(node: NodeConfig, ssh: SSHConfig, *, local_root: str | os.PathLike,
              connect_gate: ConnectGate | None = None, **kw) -> NodeLink:
    if node.connection == "local":
        return LocalLink(node, local_root, **kw)
    return SSHLink(node, ssh, connect_gate=connect_gate, **kw)

