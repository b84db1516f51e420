"""What nodes report, as typed values (SPEC §2). `None` means the node did not report it.

These are parsed from the helper's JSON answers; nothing here talks to a node. An answer without
the protocol's shape (a field of the wrong type, a list where an object belongs) raises
`Malformed` naming the field, rather than becoming a fact that fails later, far from its node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from llmgw.contracts.errors import Category, LlmgwError

# Marketed memory sizes (GB) a GPU class is named after. nvidia-smi reports usable MiB, which is a
# little below the marketed size (ECC, reservations): an L40S "48GB" reports 46068 MiB.
_MARKETED_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 144, 180, 192, 256, 288)
_GB_IN_NAME = re.compile(r"(\d+)\s*GB", re.IGNORECASE)
_NOISE = re.compile(r"\b(nvidia|geforce|tesla|quadro|hbm\d*e?|pcie|sxm\d*|nvl|\d+\s*gb)\b", re.IGNORECASE)


def gpu_class(name: str | None, memory_total_mib: int | None) -> str | None:
    """A normalised GPU class such as `h100-80gb` from what nvidia-smi reports."""
    if not name:
        return None
    in_name = _GB_IN_NAME.search(name)
    model = _NOISE.sub(" ", name).lower()
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "gpu"
    if in_name:
        size = int(in_name.group(1))
    elif memory_total_mib:
        gib = memory_total_mib / 1024
        size = next((g for g in _MARKETED_GB if g >= gib - 0.05), round(gib))
    else:
        return model
    return f"{model}-{size}gb"


class Malformed(LlmgwError, ValueError):
    """A helper answer that does not have the protocol's shape; the message names the field."""

    category = Category.PROTOCOL


_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return _KIND_NAMES.get(type(value), type(value).__name__)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"{where} is {_kind(value)}, not an object")
    return value


def _field(data: dict[str, Any], key: str, kinds: tuple[type, ...], where: str, default: Any = None) -> Any:
    """data[key] if it is one of `kinds` (a bool is not an integer), `default` when absent or null."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds if k is not int or float not in kinds)
        raise Malformed(f"{where}{key} is {_kind(value)}, not {wanted}")
    return value


def _required(data: dict[str, Any], key: str, kinds: tuple[type, ...], where: str) -> Any:
    value = _field(data, key, kinds, where)
    if value is None:
        raise Malformed(f"{where}{key} is missing")
    return value


def _list(data: dict[str, Any], key: str, where: str) -> list[Any]:
    return _field(data, key, (list,), where, default=[])


def _strings(data: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    values = _list(data, key, where)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise Malformed(f"{where}{key}[{index}] is {_kind(value)}, not a string")
    return tuple(values)


INT, NUMBER, TEXT, FLAG = (int,), (int, float), (str,), (bool,)


@dataclass(frozen=True)
class GPU:
    index: int
    uuid: str | None
    name: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    utilization_pct: int | None
    healthy: bool
    reasons: tuple[str, ...] = ()

    @property
    def gpu_class(self) -> str | None:
        return gpu_class(self.name, self.memory_total_mib)

    @classmethod
    def from_helper(cls, data: Any, where: str = "") -> GPU:
        data = _object(data, where.rstrip(".") or "a GPU")
        return cls(index=_required(data, "index", INT, where), uuid=_field(data, "uuid", TEXT, where),
                   name=_field(data, "name", TEXT, where),
                   memory_total_mib=_field(data, "memory_total_mib", INT, where),
                   memory_used_mib=_field(data, "memory_used_mib", INT, where),
                   utilization_pct=_field(data, "utilization_pct", INT, where),
                   healthy=_field(data, "healthy", FLAG, where, default=True),
                   reasons=_strings(data, "reasons", where))


def _flags(data: dict[str, Any], key: str, where: str) -> dict[str, bool] | None:
    """{name: bool}, or None when the helper did not check (null or absent)."""
    values = _field(data, key, (dict,), where)
    if values is None:
        return None
    for name, value in values.items():
        if not isinstance(value, bool):
            raise Malformed(f"{where}{key}[{name!r}] is {_kind(value)}, not a boolean")
    return dict(values)


@dataclass(frozen=True)
class ContainerProgram:
    """docker or podman as the node found it (R-4.12). `path` None: not on the node's PATH.
    `answers`: whether `PROGRAM info` worked (docker's needs its daemon); None when it was not
    checked or did not answer in time. `gpu`: whether it can give a container GPUs the way the
    helper asks (docker: the NVIDIA runtime or hook; podman: a CDI spec); None: not checked.
    `images`: whether each image the control plane asked about is present; None: not checked."""

    name: str
    path: str | None
    answers: bool | None = None
    error: str | None = None
    runtimes: tuple[str, ...] | None = None
    gpu: bool | None = None
    images: dict[str, bool] | None = None

    @classmethod
    def from_helper(cls, name: str, data: Any, where: str) -> ContainerProgram:
        data = _object(data, where.rstrip("."))
        return cls(name=name, path=_field(data, "path", TEXT, where), answers=_field(data, "answers", FLAG, where),
                   error=_field(data, "error", TEXT, where),
                   runtimes=None if data.get("runtimes") is None else _strings(data, "runtimes", where),
                   gpu=_field(data, "gpu", FLAG, where), images=_flags(data, "images", where))


@dataclass(frozen=True)
class VenvCheck:
    """A venv recipe as the node judged it (R-4.12): `found` whether the interpreter it is made
    from is there (None: it did not answer in time), and `built` whether its environment is built
    and sealed (None: not checked)."""

    python: str | None  # as the profile names it; None: the helper's own interpreter
    found: bool | None
    interpreter: str | None = None
    version: str | None = None
    id: str | None = None  # the recipe id the environment is kept under
    built: bool | None = None
    error: str | None = None

    @classmethod
    def from_helper(cls, data: Any, where: str) -> VenvCheck:
        data = _object(data, where.rstrip("."))
        return cls(python=_field(data, "python", TEXT, where), found=_field(data, "found", FLAG, where),
                   interpreter=_field(data, "interpreter", TEXT, where), version=_field(data, "version", TEXT, where),
                   id=_field(data, "id", TEXT, where), built=_field(data, "built", FLAG, where),
                   error=_field(data, "error", TEXT, where))


@dataclass(frozen=True)
class Inventory:
    hostname: str | None
    boot_id: str | None
    cpus: int | None
    memory_bytes: int | None
    gpus: tuple[GPU, ...]
    nvidia_smi: str  # "ok" | "absent" | "error"
    nvidia_smi_error: str | None = None
    # What the node can run engines from; None: not reported (a helper that does not say).
    python: str | None = None  # the version of the helper's interpreter, a venv's default
    containers: dict[str, ContainerProgram] | None = None  # by program name: docker, podman
    venvs: dict[str, VenvCheck] | None = None  # by the key the request gave each venv recipe

    @classmethod
    def from_helper(cls, data: Any) -> Inventory:
        data = _object(data, "the answer")
        containers = _field(data, "containers", (dict,), "")
        venvs = _field(data, "venvs", (dict,), "")
        python = _field(data, "python", (dict,), "")
        return cls(hostname=_field(data, "hostname", TEXT, ""), boot_id=_field(data, "boot_id", TEXT, ""),
                   cpus=_field(data, "cpus", INT, ""), memory_bytes=_field(data, "memory_bytes", INT, ""),
                   gpus=tuple(GPU.from_helper(g, f"gpus[{i}].") for i, g in enumerate(_list(data, "gpus", ""))),
                   nvidia_smi=_field(data, "nvidia_smi", TEXT, "", default="absent"),
                   nvidia_smi_error=_field(data, "nvidia_smi_error", TEXT, ""),
                   python=None if python is None else _field(python, "version", TEXT, "python."),
                   containers=None if containers is None else {
                       name: ContainerProgram.from_helper(name, c, f"containers[{name!r}].")
                       for name, c in containers.items()},
                   venvs=None if venvs is None else {
                       key: VenvCheck.from_helper(v, f"venvs[{key!r}].") for key, v in venvs.items()})

    @property
    def gpu_class(self) -> str | None:
        classes = {g.gpu_class for g in self.gpus if g.gpu_class}
        return sorted(classes)[0] if classes else None


@dataclass(frozen=True)
class Filesystem:
    device: str
    fstype: str | None
    mount_point: str | None
    shared: bool
    total_bytes: int | None
    free_bytes: int | None
    dirs: tuple[str, ...]

    @classmethod
    def from_helper(cls, data: Any, where: str = "") -> Filesystem:
        data = _object(data, where.rstrip(".") or "a filesystem")
        return cls(device=_required(data, "device", TEXT, where), fstype=_field(data, "fstype", TEXT, where),
                   mount_point=_field(data, "mount_point", TEXT, where),
                   shared=_field(data, "shared", FLAG, where, default=False),
                   total_bytes=_field(data, "total_bytes", INT, where),
                   free_bytes=_field(data, "free_bytes", INT, where), dirs=_strings(data, "dirs", where))


@dataclass(frozen=True)
class Storage:
    filesystems: tuple[Filesystem, ...]
    missing: tuple[str, ...] = ()
    stuck: tuple[str, ...] = ()

    @classmethod
    def from_helper(cls, data: Any) -> Storage:
        data = _object(data, "the answer")
        filesystems = _list(data, "filesystems", "")
        return cls(filesystems=tuple(Filesystem.from_helper(f, f"filesystems[{i}].") for i, f in enumerate(filesystems)),
                   missing=_strings(data, "missing", ""), stuck=_strings(data, "stuck", ""))

    def filesystem_of(self, directory: str | None) -> Filesystem | None:
        if directory is None:
            return None
        for fs in self.filesystems:
            if directory in fs.dirs:
                return fs
        return None

    @property
    def local(self) -> tuple[Filesystem, ...]:
        return tuple(fs for fs in self.filesystems if not fs.shared)

    @property
    def shared(self) -> tuple[Filesystem, ...]:
        return tuple(fs for fs in self.filesystems if fs.shared)

    @property
    def local_free_bytes(self) -> int | None:
        """Free bytes on the node's own disks; shared filers are never added in (R-2.5)."""
        values = [fs.free_bytes for fs in self.local if fs.free_bytes is not None]
        return sum(values) if values else None


@dataclass(frozen=True)
class ShardStatus:
    shard_id: str
    pid: int | None
    start_time: int | None
    argv: tuple[str, ...]
    alive: bool
    exit_code: int | None
    ended_at: float | None
    started_at: float | None
    port: int | None
    health_status: int | None
    health_error: str | None
    log_tail: tuple[str, ...] | None
    container_id: str | None = None  # the engine's container, when it runs in one
    image_id: str | None = None  # the image that container was started from

    @classmethod
    def from_helper(cls, data: Any, where: str = "") -> ShardStatus:
        data = _object(data, where.rstrip(".") or "a shard")
        health = _field(data, "health", (dict,), where, default={})
        container = _field(data, "container", (dict,), where, default=None) or {}
        return cls(shard_id=_required(data, "shard_id", TEXT, where), pid=_field(data, "pid", INT, where),
                   start_time=_field(data, "start_time", INT, where), argv=_strings(data, "argv", where),
                   alive=_field(data, "alive", FLAG, where, default=False),
                   exit_code=_field(data, "exit_code", INT, where), ended_at=_field(data, "ended_at", NUMBER, where),
                   started_at=_field(data, "started_at", NUMBER, where), port=_field(data, "port", INT, where),
                   health_status=_field(health, "status", INT, f"{where}health."),
                   health_error=_field(health, "error", TEXT, f"{where}health."),
                   log_tail=_strings(data, "log_tail", where) if data.get("log_tail") is not None else None,
                   container_id=_field(container, "id", TEXT, f"{where}container."),
                   image_id=_field(container, "image_id", TEXT, f"{where}container."))


def shard_statuses(answer: Any) -> dict[str, ShardStatus]:
    """The `status` answer: every shard the node has a record of, by id."""
    shards = _list(_object(answer, "the answer"), "shards", "")
    statuses = [ShardStatus.from_helper(s, f"shards[{i}].") for i, s in enumerate(shards)]
    return {status.shard_id: status for status in statuses}


@dataclass(frozen=True)
class Held:
    path: str
    bytes: int | None
    file: str | None = None  # a cache entry's one file (a fetched URL's), as the helper named it
    # A cache entry whose big files this node has not hashed as they are now (another node
    # fetched them onto a shared filer, or they changed): False. None: not a cache entry.
    verified: bool | None = None


def holdings(answer: Any) -> dict[str, Held]:
    """The `holdings` answer: where the node holds each model's weights, by model name."""
    held = _field(_object(answer, "the answer"), "held", (dict,), "", default={})
    found = {}
    for name, entry in held.items():
        where = f"held[{name!r}]."
        entry = _object(entry, where.rstrip("."))
        found[name] = Held(_required(entry, "path", TEXT, where), _field(entry, "bytes", INT, where),
                           _field(entry, "file", TEXT, where), _field(entry, "verified", FLAG, where))
    return found


@dataclass
class NodeFacts:
    """The latest of each kind of report from one node; None = never reported."""

    inventory: Inventory | None = None
    storage: Storage | None = None
    holdings: dict[str, Held] | None = None
    shards: dict[str, ShardStatus] | None = None
    observed_at: dict[str, float] = field(default_factory=dict)
