"""The helper's operations as typed calls: one request type and one answer type per operation.

`NodeOps(node, transport)` runs them over anything that carries op names and argument dicts
(`NodeLink`, `HelperSession`; `Fleet.ops(node)` gives the one for a node): the request builds the
arguments the helper's docstring documents, and the answer is parsed and type-checked the way
`facts.py` parses facts, so a malformed answer fails the call where it arrives, as a
`MalformedAnswer` that names the field. Streamed operations (a fetch, a provision, a log follow) give an `OpStream`: typed
events while it runs, a typed `result` once it ended.

A request's repr never shows what is secret in it (engine environment and files, a hub token,
the fleet secret): requests end up in logs and tracebacks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from llmgw.fleet.errors import MalformedAnswer
from llmgw.fleet.facts import (
    FLAG,
    INT,
    NUMBER,
    TEXT,
    Held,
    Inventory,
    Malformed,
    ShardStatus,
    Storage,
    _field,
    _object,
    _required,
    _strings,
    holdings,
    shard_statuses,
)

DEFAULT_ANSWER_WITHIN = 30.0  # seconds a call waits for its answer unless its request says otherwise


class Transport(Protocol):
    """What carries a request to one helper: `NodeLink` and `HelperSession` both do."""

    async def call(self, op: str, args: dict | None = None, timeout: float | None = 30.0) -> Any: ...

    def stream(self, op: str, args: dict | None = None) -> Any: ...


class Request:
    """One helper operation's arguments. `OP` names the operation; `answer_within` bounds the
    wait for its answer (a request may compute it: a stop waits out its grace)."""

    OP: ClassVar[str]
    answer_within: ClassVar[float] = DEFAULT_ANSWER_WITHIN

    def args(self) -> dict[str, Any]:
        raise NotImplementedError


A = TypeVar("A")
E = TypeVar("E")


def _parse(node: str, op: str, what: str, parse: Callable[[Any], A], value: Any) -> A:
    try:
        return parse(value)
    except Malformed as exc:
        raise MalformedAnswer(node, op, "answer", f"malformed {op} {what}: {exc}") from None


# -- the hello line -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The helper's first line: who it is and where it keeps its state (root) on the node."""

    protocol: int | None = None
    version: str | None = None
    sha256: str | None = None
    python: str | None = None
    hostname: str | None = None
    boot_id: str | None = None
    pid: int | None = None
    root: str | None = None  # the absolute state directory
    home: str | None = None  # the helper's ~, which the node's paths are resolved against

    @classmethod
    def from_helper(cls, data: Any) -> Hello:
        data = _object(data, "the hello")
        return cls(protocol=_field(data, "protocol", INT, ""), version=_field(data, "version", TEXT, ""),
                   sha256=_field(data, "sha256", TEXT, ""), python=_field(data, "python", TEXT, ""),
                   hostname=_field(data, "hostname", TEXT, ""), boot_id=_field(data, "boot_id", TEXT, ""),
                   pid=_field(data, "pid", INT, ""), root=_field(data, "root", TEXT, ""),
                   home=_field(data, "home", TEXT, ""))


# -- requests and answers -----------------------------------------------------------------------


@dataclass(frozen=True)
class PingRequest(Request):
    OP = "ping"

    def args(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Pong:
    time: float  # the node's clock, unix seconds

    @classmethod
    def from_helper(cls, data: Any) -> Pong:
        return cls(_required(_object(data, "the answer"), "time", NUMBER, ""))


@dataclass(frozen=True)
class InventoryRequest(Request):
    """GPUs, memory, CPUs, and what the node can run engines from: its container programs, which
    of `images` they hold, and for each venv recipe of `venvs` (a key of the caller's to a
    `runtime_spec`) its interpreter and whether its environment is built; the answer is
    `facts.Inventory` (R-4.12)."""

    OP = "inventory"
    images: Sequence[str] = ()
    venvs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def args(self) -> dict[str, Any]:
        return {"images": sorted(set(self.images)), "venvs": {key: dict(spec) for key, spec in self.venvs.items()}}


@dataclass(frozen=True)
class StorageDir:
    path: str
    shared: bool = False


@dataclass(frozen=True)
class StorageRequest(Request):
    """Filesystems under the given directories; the answer is `facts.Storage`."""

    OP = "storage"
    dirs: Sequence[StorageDir]
    timeout: float = 5.0  # on the node: how long one directory may take before it counts as stuck

    def args(self) -> dict[str, Any]:
        return {"dirs": [{"path": d.path, "shared": d.shared} for d in self.dirs], "timeout": self.timeout}


@dataclass(frozen=True)
class StatusRequest(Request):
    """Every shard the node has a record of; the answer is `facts.ShardStatus` by shard id."""

    OP = "status"
    probe: bool = False  # also ask each live engine's health URL
    timeout: float = 2.0  # on the node: per health probe

    def args(self) -> dict[str, Any]:
        return {"probe": self.probe, "timeout": self.timeout}


@dataclass(frozen=True)
class HoldingsRequest(Request):
    """Where the node holds weights: for each key, the first of its candidate paths that does."""

    OP = "holdings"
    candidates: Mapping[str, Sequence[str]]

    def args(self) -> dict[str, Any]:
        return {"candidates": {key: list(paths) for key, paths in self.candidates.items()}}


@dataclass(frozen=True)
class Holdings:
    held: dict[str, Held]  # by key; Held.file is the one file of a one-file cache entry
    stuck: tuple[str, ...] = ()  # candidates whose filesystem did not answer

    @classmethod
    def from_helper(cls, data: Any) -> Holdings:
        return cls(holdings(data), _strings(_object(data, "the answer"), "stuck", ""))


@dataclass(frozen=True)
class FetchRequest(Request):
    """Download a source into cache_dir/name (single-flight per name on the node)."""

    OP = "fetch"
    source: Mapping[str, Any]  # the helper's source: {"kind": "https", "urls"} or {"kind": "hf", ...}
    cache_dir: str
    name: str  # llmgw-<hex>
    token: str | None = field(default=None, repr=False)
    max_bytes: int | None = None
    stall_timeout: float | None = None  # None: the helper's default

    def args(self) -> dict[str, Any]:
        args = {"source": dict(self.source), "cache_dir": self.cache_dir, "name": self.name, "token": self.token,
                "max_bytes": self.max_bytes}
        if self.stall_timeout is not None:
            args["stall_timeout"] = self.stall_timeout
        return args


@dataclass(frozen=True)
class FetchProgress:
    """Bytes written so far; total only when every file's length is known (never invented)."""

    bytes: int
    total: int | None

    @classmethod
    def from_helper(cls, data: Any) -> FetchProgress:
        data = _object(data, "the event")
        return cls(_required(data, "bytes", INT, ""), _field(data, "total", INT, ""))


@dataclass(frozen=True)
class Fetched:
    """The finished entry: its directory, its size, and the path of its file when it holds exactly
    one (a fetched URL's file, saved under the name the helper chose for it)."""

    path: str
    bytes: int | None
    file: str | None = None

    @classmethod
    def from_helper(cls, data: Any) -> Fetched:
        data = _object(data, "the answer")
        return cls(_required(data, "path", TEXT, ""), _field(data, "bytes", INT, ""), _field(data, "file", TEXT, ""))


@dataclass(frozen=True)
class SourceSizeRequest(Request):
    """What a fetch of the source would download, asked of the source (R-5.1)."""

    OP = "source_size"
    answer_within = 60.0
    source: Mapping[str, Any]
    token: str | None = field(default=None, repr=False)

    def args(self) -> dict[str, Any]:
        return {"source": dict(self.source), "token": self.token}


@dataclass(frozen=True)
class SourceSize:
    bytes: int | None  # None when any file's length is unknown
    files: int | None

    @classmethod
    def from_helper(cls, data: Any) -> SourceSize:
        data = _object(data, "the answer")
        return cls(_field(data, "bytes", INT, ""), _field(data, "files", INT, ""))


@dataclass(frozen=True)
class ProvisionRequest(Request):
    """Make an engine's runtime present on the node, single-flight there: a venv runtime's
    environment built once per recipe (or found built), a container runtime's image found or
    pulled once per image (R-4.10, R-4.11); `runtime` is `llmgw.runtimes.runtime_spec(...)`."""

    OP = "provision"
    runtime: Mapping[str, Any]

    def args(self) -> dict[str, Any]:
        return {"runtime": dict(self.runtime)}


PROVISION_PHASES = ("venv", "pip", "post_install", "seal", "pull")


@dataclass(frozen=True)
class ProvisionProgress:
    """A build's step starting (line None, or what it does) or one line its command printed."""

    phase: str  # one of PROVISION_PHASES
    line: str | None

    @classmethod
    def from_helper(cls, data: Any) -> ProvisionProgress:
        data = _object(data, "the event")
        phase = _required(data, "phase", TEXT, "")
        if phase not in PROVISION_PHASES:
            raise Malformed(f"phase is {phase!r}, not one of {', '.join(PROVISION_PHASES)}")
        return cls(phase, _field(data, "line", TEXT, ""))


@dataclass(frozen=True)
class Provisioned:
    """The runtime present: a venv's environment built (created) or found built and as sealed;
    a container's image found (pulled false) or pulled, with the id it has on the node."""

    kind: str
    id: str | None = None  # a venv recipe's SHA-256
    path: str | None = None
    bytes: int | None = None
    created: bool | None = None
    python: str | None = None  # the version the environment's interpreter reports
    installer: str | None = None  # "pip" or "uv"
    image: str | None = None
    image_id: str | None = None
    program: str | None = None  # "docker" or "podman"
    pulled: bool | None = None

    @classmethod
    def from_helper(cls, data: Any) -> Provisioned:
        data = _object(data, "the answer")
        kind = _required(data, "kind", TEXT, "")
        if kind == "venv":
            return cls(kind=kind, id=_required(data, "id", TEXT, ""), path=_required(data, "path", TEXT, ""),
                       bytes=_field(data, "bytes", INT, ""), created=_required(data, "created", FLAG, ""),
                       python=_field(data, "python", TEXT, ""), installer=_field(data, "installer", TEXT, ""))
        return cls(kind=kind, image=_field(data, "image", TEXT, ""), image_id=_field(data, "image_id", TEXT, ""),
                   program=_field(data, "program", TEXT, ""), pulled=_field(data, "pulled", FLAG, ""))


@dataclass(frozen=True)
class EnvsRequest(Request):
    """The environments built on the node, sealed or not."""

    OP = "envs"
    answer_within = 60.0  # each is walked to check its seal
    wanted: Mapping[str, Mapping[str, Any]] | None = None  # {key: runtime_spec}: the names they provision here

    def args(self) -> dict[str, Any]:
        return {} if self.wanted is None else {"wanted": {k: dict(v) for k, v in self.wanted.items()}}


def _optional_strings(data: dict[str, Any], key: str, where: str) -> tuple[str, ...] | None:
    """A list of strings, or None when the helper does not know it (null)."""
    return None if data.get(key) is None else _strings(data, key, where)


@dataclass(frozen=True)
class Environment:
    """One environment under the helper's root. Only a sealed one is ever run; reason says why
    another is not (being built, left half-built, not llmgw's or changed since its seal)."""

    kind: str
    name: str
    id: str | None
    path: str
    bytes: int | None
    created_at: float | None
    last_used: float | None
    sealed: bool
    python: str | None
    packages: tuple[str, ...] | None
    installer: str | None
    reason: str | None
    used_by: tuple[str, ...] = ()  # live shards running from it

    @classmethod
    def from_helper(cls, data: Any, where: str) -> Environment:
        data = _object(data, where.rstrip("."))
        return cls(kind=_required(data, "kind", TEXT, where), name=_required(data, "name", TEXT, where),
                   id=_field(data, "id", TEXT, where), path=_required(data, "path", TEXT, where),
                   bytes=_field(data, "bytes", INT, where), created_at=_field(data, "created_at", NUMBER, where),
                   last_used=_field(data, "last_used", NUMBER, where), sealed=_required(data, "sealed", FLAG, where),
                   python=_field(data, "python", TEXT, where), packages=_optional_strings(data, "packages", where),
                   installer=_field(data, "installer", TEXT, where), reason=_field(data, "reason", TEXT, where),
                   used_by=_strings(data, "used_by", where))


@dataclass(frozen=True)
class Image:
    """An image a container runtime used on the node, from the helper's record of it. present
    and bytes are what the node's docker said now (None: it did not answer); only an image llmgw
    pulled is ever removed."""

    name: str  # the record's name, img-<32 hex>: what reclaim takes
    image: str | None
    program: str | None
    id: str | None
    bytes: int | None
    first_used: float | None
    last_used: float | None
    pulled: bool | None
    present: bool | None
    used_by: tuple[str, ...]
    reason: str | None

    @classmethod
    def from_helper(cls, data: Any, where: str) -> Image:
        data = _object(data, where.rstrip("."))
        return cls(name=_required(data, "name", TEXT, where), image=_field(data, "image", TEXT, where),
                   program=_field(data, "program", TEXT, where), id=_field(data, "id", TEXT, where),
                   bytes=_field(data, "bytes", INT, where), first_used=_field(data, "first_used", NUMBER, where),
                   last_used=_field(data, "last_used", NUMBER, where), pulled=_field(data, "pulled", FLAG, where),
                   present=_field(data, "present", FLAG, where), used_by=_strings(data, "used_by", where),
                   reason=_field(data, "reason", TEXT, where))


@dataclass(frozen=True)
class Wanted:
    """What one wanted runtime provisions on the node: an environment's or image record's name,
    or why that cannot be told there."""

    name: str | None
    error: str | None

    @classmethod
    def from_helper(cls, data: Any, where: str) -> Wanted:
        data = _object(data, where.rstrip("."))
        return cls(_field(data, "name", TEXT, where), _field(data, "error", TEXT, where))


@dataclass(frozen=True)
class Environments:
    envs: tuple[Environment, ...]
    images: tuple[Image, ...] = ()
    wanted: Mapping[str, Wanted] = field(default_factory=dict)

    @classmethod
    def from_helper(cls, data: Any) -> Environments:
        answer = _object(data, "the answer")
        envs = _field(answer, "envs", (list,), "", default=[])
        images = _field(answer, "images", (list,), "", default=[])
        wanted = _field(answer, "wanted", (dict,), "", default={})
        return cls(tuple(Environment.from_helper(e, f"envs[{i}].") for i, e in enumerate(envs)),
                   tuple(Image.from_helper(e, f"images[{i}].") for i, e in enumerate(images)),
                   {str(k): Wanted.from_helper(v, f"wanted.{k}.") for k, v in wanted.items()})


@dataclass(frozen=True)
class LaunchRequest(Request):
    """Start one shard's engine under the helper's supervisor."""

    OP = "launch"
    answer_within = 60.0
    shard_id: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # holds the engine's key
    files: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold it too
    file_sha256: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None  # checked free before the start; None for an engine without HTTP
    host: str | None = None
    health_url: str | None = None
    gpus: Sequence[int] = ()
    runtime: Mapping[str, Any] | None = None  # None: the host's PATH; else as ProvisionRequest's

    def args(self) -> dict[str, Any]:
        args = {"shard_id": self.shard_id, "argv": list(self.argv), "env": dict(self.env), "files": dict(self.files),
                "file_sha256": dict(self.file_sha256), "port": self.port, "host": self.host,
                "health_url": self.health_url, "gpus": list(self.gpus)}
        if self.runtime is not None:
            args["runtime"] = dict(self.runtime)
        return args


@dataclass(frozen=True)
class Launched:
    """The started engine as the supervisor recorded it; argv is the one really started."""

    shard_id: str | None
    pid: int
    pgid: int | None
    start_time: int | None
    argv: tuple[str, ...]
    log_path: str | None
    started_at: float | None

    @classmethod
    def from_helper(cls, data: Any) -> Launched:
        data = _object(data, "the answer")
        return cls(shard_id=_field(data, "shard_id", TEXT, ""), pid=_required(data, "pid", INT, ""),
                   pgid=_field(data, "pgid", INT, ""), start_time=_field(data, "start_time", INT, ""),
                   argv=_strings(data, "argv", ""), log_path=_field(data, "log_path", TEXT, ""),
                   started_at=_field(data, "started_at", NUMBER, ""))


@dataclass(frozen=True)
class StopRequest(Request):
    """TERM to the engine's group, KILL after the grace; refused when its identity does not hold."""

    OP = "stop"
    shard_id: str
    grace: float = 10.0

    @property
    def answer_within(self) -> float:  # type: ignore[override]
        return self.grace + DEFAULT_ANSWER_WITHIN

    def args(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id, "grace": self.grace}


@dataclass(frozen=True)
class Stopped:
    was_alive: bool
    stopped: bool  # nothing of the engine runs any more

    @classmethod
    def from_helper(cls, data: Any) -> Stopped:
        data = _object(data, "the answer")
        return cls(_required(data, "was_alive", FLAG, ""), _required(data, "stopped", FLAG, ""))


@dataclass(frozen=True)
class ForgetRequest(Request):
    """Remove a shard's record from the node; refused while its engine runs."""

    OP = "forget"
    shard_id: str

    def args(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id}


@dataclass(frozen=True)
class Forgotten:
    @classmethod
    def from_helper(cls, data: Any) -> Forgotten:
        _object(data, "the answer")
        return cls()


@dataclass(frozen=True)
class LogsRequest(Request):
    """The last lines of a shard's log (engine keys already masked by the helper)."""

    OP = "logs"
    shard_id: str
    lines: int = 100

    def args(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id, "lines": self.lines}


@dataclass(frozen=True)
class LogLines:
    """Lines of a log: the answer to a read, or one event of a follow."""

    lines: tuple[str, ...]

    @classmethod
    def from_helper(cls, data: Any) -> LogLines:
        return cls(_strings(_object(data, "the answer"), "lines", ""))


@dataclass(frozen=True)
class ReclaimRequest(Request):
    """List the cache entries of cache_dir (names None: all), or remove the named ones (collect).

    With `until_free` (bytes; the clean-up at a low-water mark) the named entries are removed in
    the order given, only sealed entries of this fleet, and only until the filesystem has that
    much free; the others are answered "kept"."""

    OP = "reclaim"
    answer_within = 120.0  # removing large entries on a slow filer takes a while
    cache_dir: str | None  # None: engines only (envs and images must then be given)
    names: Sequence[str] | None = None
    collect: bool = False
    until_free: int | None = None
    envs: Sequence[str] | None = None  # environment names (venv-<32 hex>) to list or remove
    images: Sequence[str] | None = None  # image record names (img-<32 hex>) to list or remove

    def args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"collect": self.collect}
        if self.cache_dir is not None:
            args["cache_dir"] = self.cache_dir
            args["names"] = list(self.names) if self.names is not None else None
        if self.until_free is not None:
            args["until_free"] = self.until_free
        if self.envs is not None:
            args["envs"] = list(self.envs)
        if self.images is not None:
            args["images"] = list(self.images)
        return args


@dataclass(frozen=True)
class ReclaimEntry:
    name: str
    path: str | None
    bytes: int | None
    action: str  # "listed", "removed", "refused" or "kept" (the mark was reached first)
    reason: str | None
    last_used: float | None = None  # the completion marker's mtime: fetched, or an engine launched on it

    @classmethod
    def from_helper(cls, data: Any, where: str) -> ReclaimEntry:
        data = _object(data, where.rstrip("."))
        return cls(name=_required(data, "name", TEXT, where), path=_field(data, "path", TEXT, where),
                   bytes=_field(data, "bytes", INT, where), action=_required(data, "action", TEXT, where),
                   reason=_field(data, "reason", TEXT, where), last_used=_field(data, "last_used", NUMBER, where))


@dataclass(frozen=True)
class Reclaimed:
    entries: tuple[ReclaimEntry, ...]
    free_bytes: int | None = None  # after a clean-up (until_free): the filesystem's free bytes
    envs: tuple[ReclaimEntry, ...] = ()
    images: tuple[ReclaimEntry, ...] = ()

    @classmethod
    def from_helper(cls, data: Any) -> Reclaimed:
        data = _object(data, "the answer")

        def entries(key: str) -> tuple[ReclaimEntry, ...]:
            found = _field(data, key, (list,), "", default=[])
            return tuple(ReclaimEntry.from_helper(e, f"{key}[{i}].") for i, e in enumerate(found))
        return cls(entries("entries"), _field(data, "free_bytes", INT, ""), entries("envs"), entries("images"))


@dataclass(frozen=True)
class FleetSecretRequest(Request):
    """Hand the helper the fleet secret it seals and checks cache entries with."""

    OP = "fleet_secret"
    secret: str = field(repr=False)

    def args(self) -> dict[str, Any]:
        return {"secret": self.secret}


@dataclass(frozen=True)
class SecretStored:
    stored: bool

    @classmethod
    def from_helper(cls, data: Any) -> SecretStored:
        return cls(_required(_object(data, "the answer"), "stored", FLAG, ""))


# -- streams ------------------------------------------------------------------------------------

R = TypeVar("R")


class OpStream(Generic[E, R]):
    """The typed side of one streamed request: `async with` it, iterate its events, then read
    `result`. Leaving the block before the stream ended cancels the request on the node. An
    event this side does not know (a newer helper's) is skipped; a malformed one ends the stream
    with a `MalformedAnswer`."""

    def __init__(self, node: str, op: str, raw: Any, events: Mapping[str, Callable[[Any], E]],
                 answer: Callable[[Any], R]):
        self._node, self._op, self._raw = node, op, raw
        self._events, self._answer = events, answer
        self._result: R | None = None
        self._ended = False

    @property
    def result(self) -> R:
        if not self._ended:
            raise RuntimeError(f"the {self._op} stream has not ended yet")
        return self._result  # type: ignore[return-value]

    async def __aenter__(self) -> OpStream[E, R]:
        await self._raw.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._raw.__aexit__(*exc)

    def __aiter__(self) -> AsyncIterator[E]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[E]:
        async for name, data in self._raw:
            parse = self._events.get(name)
            if parse is not None:
                yield _parse(self._node, self._op, f"{name} event", parse, data)
        self._result = _parse(self._node, self._op, "answer", self._answer, self._raw.result)
        self._ended = True


# -- the calls ----------------------------------------------------------------------------------


class NodeOps:
    """One node's helper operations, typed. Failures raise `NodeError` subclasses (errors.py);
    `timeout` overrides the request's own `answer_within`."""

    def __init__(self, node: str, transport: Transport):
        self.node = node
        self._transport = transport

    async def _call(self, request: Request, answer: Callable[[Any], A], timeout: float | None) -> A:
        value = await self._transport.call(request.OP, request.args(),
                                           timeout if timeout is not None else request.answer_within)
        return _parse(self.node, request.OP, "answer", answer, value)

    async def ping(self, request: PingRequest = PingRequest(), *, timeout: float | None = None) -> Pong:
        return await self._call(request, Pong.from_helper, timeout)

    async def inventory(self, request: InventoryRequest = InventoryRequest(), *,
                        timeout: float | None = None) -> Inventory:
        return await self._call(request, Inventory.from_helper, timeout)

    async def storage(self, request: StorageRequest, *, timeout: float | None = None) -> Storage:
        return await self._call(request, Storage.from_helper, timeout)

    async def status(self, request: StatusRequest = StatusRequest(), *,
                     timeout: float | None = None) -> dict[str, ShardStatus]:
        return await self._call(request, shard_statuses, timeout)

    async def holdings(self, request: HoldingsRequest, *, timeout: float | None = None) -> Holdings:
        return await self._call(request, Holdings.from_helper, timeout)

    def fetch(self, request: FetchRequest) -> OpStream[FetchProgress, Fetched]:
        """Events: FetchProgress; result: Fetched. Not bounded by a time: a download takes what
        it takes, and the helper fails one that stalls."""
        return OpStream(self.node, request.OP, self._transport.stream(request.OP, request.args()),
                        {"progress": FetchProgress.from_helper}, Fetched.from_helper)

    async def source_size(self, request: SourceSizeRequest, *, timeout: float | None = None) -> SourceSize:
        return await self._call(request, SourceSize.from_helper, timeout)

    def provision(self, request: ProvisionRequest) -> OpStream[ProvisionProgress, Provisioned]:
        """Events: ProvisionProgress; result: Provisioned. Not bounded by a time: pip takes what
        it takes; leaving the stream early abandons the build when nobody else waits for it."""
        return OpStream(self.node, request.OP, self._transport.stream(request.OP, request.args()),
                        {"progress": ProvisionProgress.from_helper}, Provisioned.from_helper)

    async def envs(self, request: EnvsRequest = EnvsRequest(), *, timeout: float | None = None) -> Environments:
        return await self._call(request, Environments.from_helper, timeout)

    async def launch(self, request: LaunchRequest, *, timeout: float | None = None) -> Launched:
        return await self._call(request, Launched.from_helper, timeout)

    async def stop(self, request: StopRequest, *, timeout: float | None = None) -> Stopped:
        return await self._call(request, Stopped.from_helper, timeout)

    async def forget(self, request: ForgetRequest, *, timeout: float | None = None) -> Forgotten:
        return await self._call(request, Forgotten.from_helper, timeout)

    async def logs(self, request: LogsRequest, *, timeout: float | None = None) -> LogLines:
        return await self._call(request, LogLines.from_helper, timeout)

    def follow_logs(self, request: LogsRequest) -> OpStream[LogLines, LogLines]:
        """Events: LogLines, the last `lines` first, then new lines as they are written, until
        the stream is left (which cancels the follow on the node)."""
        args = {**request.args(), "follow": True}
        return OpStream(self.node, request.OP, self._transport.stream(request.OP, args),
                        {"lines": LogLines.from_helper}, LogLines.from_helper)

    async def reclaim(self, request: ReclaimRequest, *, timeout: float | None = None) -> Reclaimed:
        return await self._call(request, Reclaimed.from_helper, timeout)

    async def fleet_secret(self, request: FleetSecretRequest, *, timeout: float | None = None) -> SecretStored:
        return await self._call(request, SecretStored.from_helper, timeout)
