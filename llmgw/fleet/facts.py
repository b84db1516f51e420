"""What nodes report, as typed values (SPEC §2). `None` means the node did not report it.

These are parsed from the helper's JSON answers; nothing here talks to a node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
    def from_helper(cls, data: dict[str, Any]) -> GPU:
        return cls(index=int(data["index"]), uuid=data.get("uuid"), name=data.get("name"),
                   memory_total_mib=data.get("memory_total_mib"), memory_used_mib=data.get("memory_used_mib"),
                   utilization_pct=data.get("utilization_pct"), healthy=bool(data.get("healthy", True)),
                   reasons=tuple(data.get("reasons") or ()))


@dataclass(frozen=True)
class Inventory:
    hostname: str | None
    boot_id: str | None
    cpus: int | None
    memory_bytes: int | None
    gpus: tuple[GPU, ...]
    nvidia_smi: str  # "ok" | "absent" | "error"
    nvidia_smi_error: str | None = None

    @classmethod
    def from_helper(cls, data: dict[str, Any]) -> Inventory:
        return cls(hostname=data.get("hostname"), boot_id=data.get("boot_id"), cpus=data.get("cpus"),
                   memory_bytes=data.get("memory_bytes"),
                   gpus=tuple(GPU.from_helper(g) for g in data.get("gpus") or ()),
                   nvidia_smi=data.get("nvidia_smi", "absent"), nvidia_smi_error=data.get("nvidia_smi_error"))

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
    def from_helper(cls, data: dict[str, Any]) -> Filesystem:
        return cls(device=str(data["device"]), fstype=data.get("fstype"), mount_point=data.get("mount_point"),
                   shared=bool(data.get("shared")), total_bytes=data.get("total_bytes"),
                   free_bytes=data.get("free_bytes"), dirs=tuple(data.get("dirs") or ()))


@dataclass(frozen=True)
class Storage:
    filesystems: tuple[Filesystem, ...]
    missing: tuple[str, ...] = ()
    stuck: tuple[str, ...] = ()

    @classmethod
    def from_helper(cls, data: dict[str, Any]) -> Storage:
        return cls(filesystems=tuple(Filesystem.from_helper(f) for f in data.get("filesystems") or ()),
                   missing=tuple(data.get("missing") or ()), stuck=tuple(data.get("stuck") or ()))

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

    @classmethod
    def from_helper(cls, data: dict[str, Any]) -> ShardStatus:
        health = data.get("health") or {}
        return cls(shard_id=data["shard_id"], pid=data.get("pid"), start_time=data.get("start_time"),
                   argv=tuple(data.get("argv") or ()), alive=bool(data.get("alive")),
                   exit_code=data.get("exit_code"), ended_at=data.get("ended_at"),
                   started_at=data.get("started_at"), port=data.get("port"),
                   health_status=health.get("status"), health_error=health.get("error"),
                   log_tail=tuple(data["log_tail"]) if data.get("log_tail") is not None else None)


@dataclass(frozen=True)
class Held:
    path: str
    bytes: int | None


@dataclass
class NodeFacts:
    """The latest of each kind of report from one node; None = never reported."""

    inventory: Inventory | None = None
    storage: Storage | None = None
    holdings: dict[str, Held] | None = None
    shards: dict[str, ShardStatus] | None = None
    observed_at: dict[str, float] = field(default_factory=dict)
