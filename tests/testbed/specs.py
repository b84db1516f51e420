"""What a test asks of a testbed node: its GPUs, memory, disks, fabric and labels.

These are plain values; `Testbed` turns them into running hosts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY_MIB = 81559
L40S_NAME = "NVIDIA L40S"
L40S_MEMORY_MIB = 46068
DEFAULT_DRIVER_VERSION = "570.133.20"


@dataclass(frozen=True)
class GPU:
    """One GPU as the nvidia-smi double reports it.

    `apps` are compute processes llmgw did not start, as (pid, MiB) pairs; they count towards
    memory.used. A `lost` GPU prints `[GPU is lost]` in every field but its index and bus id.
    """

    name: str = H100_NAME
    memory_mib: int = H100_MEMORY_MIB
    ecc_errors: int = 0
    lost: bool = False
    apps: tuple[tuple[int, int], ...] = ()
    utilization: int = 0
    uuid: str | None = None

    @classmethod
    def h100(cls, **changes) -> "GPU":
        return cls(name=H100_NAME, memory_mib=H100_MEMORY_MIB, **changes)

    @classmethod
    def l40s(cls, **changes) -> "GPU":
        return cls(name=L40S_NAME, memory_mib=L40S_MEMORY_MIB, **changes)

    def but(self, **changes) -> "GPU":
        """A copy with some knobs changed: `GPU.h100().but(ecc_errors=2)`."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NodeSpec:
    """A testbed host.

    `gpus=None` is a CPU node: no nvidia-smi on its PATH at all. `gpus=[]` has the tool but no
    devices. `mem_gb=None` is a node whose /proc/meminfo has no MemTotal line (memory unknown).
    `models_mb` and `cache_mb` size the tmpfs behind its model and cache directories, `tmp_mb`
    its private /tmp.
    `shared=True` lists the testbed's shared directory in the node's inventory entry.
    `engines="real"` puts the real vLLM and llama-server (built by scripts/engines, see
    engines.py) on its PATH instead of the engine double; SGLang stays the double there.
    `engines="none"` puts no engine at all on its PATH (a node with nothing installed).
    `uv=True` puts uv (the test environment's) on its PATH, with a uv cache kept beside the
    engines (`UV_CACHE_DIR`, files copied out of it): the helper then builds environments with uv,
    and after the first run installs the same wheels from that cache.
    """

    name: str
    gpus: Sequence[GPU] | None = None
    mem_gb: float | None = 64
    models_mb: int = 64
    cache_mb: int = 256
    tmp_mb: int = 64
    fabric: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    shared: bool = False
    driver_loaded: bool = True
    driver_version: str = DEFAULT_DRIVER_VERSION
    engines: str = "double"
    uv: bool = False

    def __post_init__(self):
        if self.engines not in ("double", "real", "none"):
            raise ValueError(f"engines must be 'double', 'real' or 'none', not {self.engines!r}")
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "labels", dict(self.labels))

    @classmethod
    def gpu_node(cls, name: str, count: int = 8, gpu: GPU | None = None, **kw) -> "NodeSpec":
        """A node with `count` identical GPUs (H100 unless told otherwise)."""
        return cls(name=name, gpus=[gpu or GPU.h100()] * count, **kw)


def gpu_uuid(node: str, index: int) -> str:
    """A stable, well-formed GPU UUID for a node's GPU `index`."""
    h = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def gpu_state(node: str, gpus: Sequence[GPU] | None, driver_loaded: bool, driver_version: str) -> dict:
    """The JSON document the nvidia-smi double reads for one node."""
    devices = []
    for index, gpu in enumerate(gpus or ()):
        devices.append({
            "index": index,
            "uuid": gpu.uuid or gpu_uuid(node, index),
            "name": gpu.name,
            "memory_total": gpu.memory_mib,
            "ecc_errors": gpu.ecc_errors,
            "lost": gpu.lost,
            "utilization": gpu.utilization,
            "pci_bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0",
            "apps": [[pid, mib] for pid, mib in gpu.apps],
        })
    return {"driver_loaded": driver_loaded, "driver_version": driver_version, "gpus": devices}


def meminfo_text(mem_gb: float | None) -> str:
    """A /proc/meminfo for a host of `mem_gb` GiB; without a MemTotal line when None."""
    if mem_gb is None:
        # A host that reports no memory: the rest of the file is there, MemTotal is not.
        return "Buffers:          102400 kB\nCached:          4096000 kB\nSwapTotal:             0 kB\n"
    total = int(mem_gb * 1024 * 1024)
    free = total * 9 // 10
    lines = [
        ("MemTotal", total), ("MemFree", free), ("MemAvailable", free + total // 20),
        ("Buffers", 102400), ("Cached", total // 20), ("SwapCached", 0),
        ("Active", total // 40), ("Inactive", total // 40), ("SwapTotal", 0), ("SwapFree", 0),
        ("Shmem", 1024), ("HugePages_Total", None), ("Hugepagesize", 2048),
    ]
    out = []
    for key, value in lines:
        if value is None:
            out.append(f"{key + ':':<16}{0:>8}")
        else:
            out.append(f"{key + ':':<16}{value:>8} kB")
    return "\n".join(out) + "\n"
