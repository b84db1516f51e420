"""Network plumbing of the testbed: a bridge in this namespace, one netns + veth per node.

All names start with `llgw` and carry the run id, so that a later run can tell its own objects
from leftovers of a run that died (`cleanup_stale`). Addresses come from 10.213.N.0/24 only.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

PREFIX = "llgw"
SUPERNET = "10.213"
RUNS_ROOT = Path("/tmp")
LOCK_FILE = RUNS_ROOT / "llgw-testbed.lock"
NETNS_DIR = Path("/run/netns")


class TestbedError(RuntimeError):
    """The testbed could not be built or torn down; the message says what failed."""

    __test__ = False  # not a test class, despite the name


def run(argv: list[str], *, check: bool = True, input: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def ip_batch(commands: list[str]) -> None:
    """Run many `ip` commands in one process (each `ip` process costs a few ms)."""
    if commands:
        run(["ip", "-batch", "-"], input="\n".join(commands) + "\n")


@contextmanager
def host_lock():
    """Serialise subnet choice and stale cleanup between testbeds started at the same time."""
    with open(LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def subnets_in_use() -> set[int]:
    """Third octets N of 10.213.N.0/24 that any address or route of this host touches."""
    used: set[int] = set()
    out = run(["ip", "-4", "-o", "addr", "show"]).stdout + run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    for net in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", out):
        try:
            network = ipaddress.ip_network(net, strict=False)
        except ValueError:
            continue
        ours = ipaddress.ip_network(f"{SUPERNET}.0.0/16")
        if network.overlaps(ours):
            if network.prefixlen <= 16:
                return set(range(256))  # something covers all of 10.213/16: use nothing
            for sub in network.subnets(new_prefix=24) if network.prefixlen < 24 else [network.supernet(new_prefix=24)]:
                used.add(int(str(sub.network_address).split(".")[2]))
    return used


def choose_subnet(seed: int) -> int:
    """A free N for 10.213.N.0/24, starting from `seed` (call under host_lock)."""
    used = subnets_in_use()
    for step in range(254):
        n = 1 + (seed + step) % 254
        if n not in used:
            return n
    raise TestbedError("no free 10.213.N.0/24 subnet on this host")


# ----------------------------------------------------------------------------- run ownership

def process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_owner(run_dir: Path) -> None:
    """Record which live process owns a run, so cleanup never touches a running testbed."""
    pid = os.getpid()
    (run_dir / "owner.json").write_text(json.dumps({"pid": pid, "start": process_start_time(pid)}))


def process_is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def run_is_alive(run_id: str) -> bool:
    """Whether the process that owns a run still lives (same pid *and* start time, not a zombie)."""
    try:
        owner = json.loads((RUNS_ROOT / f"llgw-{run_id}" / "owner.json").read_text())
    except (OSError, ValueError):
        return False
    pid = int(owner["pid"])
    return (owner.get("start") is not None and process_start_time(pid) == owner["start"]
            and not process_is_zombie(pid))


# ------------------------------------------------------------------------------- inspection

def netns_names() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_names() -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def netns_pids(netns: str) -> list[int]:
    out = run(["ip", "netns", "pids", netns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_netns_processes(netns: str, deadline: float = 5.0) -> None:
    """SIGKILL every process in a netns until none is left (new ones may appear meanwhile)."""
    end = time.monotonic() + deadline
    while True:
        pids = [p for p in netns_pids(netns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise TestbedError(f"processes {pids} in netns {netns} survive SIGKILL")
        time.sleep(0.02)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace, deepest first."""
    prefix = str(path)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def unmount_all_under(path: Path) -> None:
    for point in mounts_under(path):
        run(["umount", "-l", point], check=False)


def remove_run_dir(run_dir: Path) -> None:
    unmount_all_under(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- cleanup

RUN_NETNS = re.compile(rf"^{PREFIX}-([a-z0-9]+)-")
RUN_LINK = re.compile(rf"^{PREFIX}([a-z0-9]{{5}})[bv]")
RUN_DIR = re.compile(rf"^{PREFIX}-([a-z0-9]+)$")


def remove_run(run_id: str) -> None:
    """Remove every netns, link, mount and file of one run. The run must be dead or ours.

    Best effort: every step is tried even when one fails; the failures are raised at the end."""
    problems = []
    for netns in netns_names():
        m = RUN_NETNS.match(netns)
        if m and m.group(1) == run_id:
            try:
                kill_netns_processes(netns)
            except TestbedError as exc:
                problems.append(str(exc))
            run(["ip", "netns", "del", netns], check=False)
    for link in link_names():
        m = RUN_LINK.match(link)
        if m and m.group(1) == run_id:
            run(["ip", "link", "del", link], check=False)
    remove_run_dir(RUNS_ROOT / f"{PREFIX}-{run_id}")
    if problems:
        raise TestbedError(f"run {run_id} was not removed cleanly: {'; '.join(problems)}")


def stale_runs() -> set[str]:
    """Run ids that left something behind and whose owner process is gone."""
    ids: set[str] = set()
    for netns in netns_names():
        if m := RUN_NETNS.match(netns):
            ids.add(m.group(1))
    for link in link_names():
        if m := RUN_LINK.match(link):
            ids.add(m.group(1))
    for entry in RUNS_ROOT.iterdir():
        if entry.is_dir() and (m := RUN_DIR.match(entry.name)):
            ids.add(m.group(1))
    return {run_id for run_id in ids if not run_is_alive(run_id)}


def cleanup_stale() -> list[str]:
    """Remove what testbed runs that are no longer alive left behind; returns their ids."""
    with host_lock():
        removed = sorted(stale_runs())
        for run_id in removed:
            remove_run(run_id)
    return removed
