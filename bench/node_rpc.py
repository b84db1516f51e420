"""Reaching nodes: llmgw's NodeLink and Fleet against plain SSH, on real testbed hosts.

Measures the figures of TARGETS.md ("Reaching nodes") and, in the same run and against the same
testbed nodes, the baselines they are judged against:

  baselines  a fresh `ssh host true` (OpenSSH); OpenSSH through an open ControlMaster; an
             asyncssh exec channel on an open connection (`conn.run("true")`); a JSON-lines echo
             over one open asyncssh channel (a tiny python3 loop on the node that parses each
             request and writes an answer; the client matches answers to requests by id, as
             llmgw does), also with aes128-gcm instead of the cipher negotiated by default and
             with the writes of one event-loop turn coalesced into one; bare asyncssh
             connects to every node; `python3 -c pass` over an exec channel; the same facts as
             the helper reports, gathered by one shell command per node over an exec channel.
  llmgw      `NodeLink.call("ping")` p50/p99 with one call in flight and calls/s with 64 in
             flight to one node; `Fleet.refresh()` (inventory + storage + status + holdings)
             from 4 and from all nodes once connected; `Fleet.start()` + `wait_connected()` for
             all nodes, first with the helper deployed on connect, then with it already there
             (and once more with connect_stagger 0); the helper's own start-up to hello;
             each fact operation alone on one node.

Nodes, sshd, the helpers and this client share the machine's cores, so absolute times are
indications and the ratios are what to compare. Every loop has a fixed count and every wait a
timeout; traffic goes only to the testbed's own addresses. Needs root (the testbed does).
Prints a table; not a pass/fail test.

    sudo .venv/bin/python bench/node_rpc.py [--nodes 64] [--gpus 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncssh  # noqa: E402

from llmgw.config import SSHConfig, load_inventory  # noqa: E402
from llmgw.fleet.fleet import CONNECT_GATE, Fleet, storage_dirs  # noqa: E402
from llmgw.fleet.link import helper_argv, helper_code  # noqa: E402
from llmgw.fleet.session import NodeError  # noqa: E402
from tests.helper.client import load_helper  # noqa: E402
from tests.testbed.testbed import Testbed, default_specs, requirements_missing  # noqa: E402

PHASE_TIMEOUT = 300.0  # no phase of a healthy run comes near this; a stuck one stops the bench
CONNECT_TIMEOUT = 60.0
IN_FLIGHT = 64
GCM = "aes128-gcm@openssh.com"
REFRESH_FEW = 4

# The node side of the echo baseline: the least a JSON-lines server can do per request.
ECHO = (
    "import json,sys\n"
    "r,w,f=sys.stdin.buffer.readline,sys.stdout.buffer.write,sys.stdout.buffer.flush\n"
    "for line in iter(r,b''):\n"
    " m=json.loads(line)\n"
    " w((json.dumps({'id':m['id'],'ok':True,'result':m['args']},separators=(',',':'))+'\\n').encode());f()\n"
)


@dataclass(frozen=True)
class Counts:
    fresh_ssh: int
    control_master: int
    exec_channel: int
    calls: int  # sequential calls for p50/p99 (echo and ping)
    saturate: int  # calls per throughput run with IN_FLIGHT in flight
    shell_facts: int
    refresh: int
    per_op: int
    connects: int  # Fleet start-ups of each kind


FULL = Counts(fresh_ssh=30, control_master=100, exec_channel=300, calls=3000, saturate=30000,
              shell_facts=10, refresh=30, per_op=30, connects=3)
QUICK = Counts(fresh_ssh=8, control_master=20, exec_channel=50, calls=500, saturate=5000,
               shell_facts=3, refresh=8, per_op=8, connects=1)


class BenchError(Exception):
    pass


# -- statistics ---------------------------------------------------------------------------------


def quantile(samples: list[float], q: float) -> float:
    """Nearest-rank quantile: p99 of 100 samples is the 99th, not an interpolation past it."""
    ordered = sorted(samples)
    rank = max(1, -(-len(ordered) * q // 1))
    return ordered[int(rank) - 1]


def p50(samples: list[float]) -> float:
    return quantile(samples, 0.50)


def p99(samples: list[float]) -> float:
    return quantile(samples, 0.99)


async def timings(operation: Callable[[], Awaitable], count: int, warmup: int = 3) -> list[float]:
    """Seconds per call of `operation`, one at a time, after a few calls that are not counted."""
    for _ in range(min(warmup, count)):
        await operation()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await operation()
        samples.append(time.perf_counter() - start)
    return samples


@dataclass(frozen=True)
class Throughput:
    per_second: float
    cpu_per_call: float  # CPU seconds of this process (client side only) per call


async def saturate(operation: Callable[[], Awaitable], total: int, in_flight: int = IN_FLIGHT) -> Throughput:
    """`total` calls of `operation`, `in_flight` at a time."""
    remaining = itertools.count(total, -1)

    async def worker():
        while next(remaining) > 0:
            await operation()

    for _ in range(2):  # warm-up: the first pass pays for buffer growth and task creation
        await asyncio.gather(*(operation() for _ in range(in_flight)))
    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Throughput(total / elapsed, cpu / total)


# -- baselines ------------------------------------------------------------------------------------


async def run_quiet(argv: list[str]) -> None:
    # DEVNULL, not pipes: a ControlPersist master forks into the background holding its
    # parent's stdout and stderr, and reading pipes would wait for it to exit.
    proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
    status = await asyncio.wait_for(proc.wait(), 30)
    if status != 0:
        raise BenchError(f"{shlex.join(argv)} exited with {status}")


def control_master_argv(tb: Testbed, node: str, control_path: Path, command: str) -> list[str]:
    argv = tb.ssh_argv(node, command)
    options = ["-o", "ControlMaster=auto", "-o", f"ControlPath={control_path}", "-o", "ControlPersist=60"]
    return argv[:-2] + options + argv[-2:]


class EchoClient:
    """A bare JSON-lines client: encode, write, match the answer by id. Nothing else.

    With `coalesce`, lines written in one turn of the event loop go out as one channel write
    (one SSH packet instead of one per request)."""

    def __init__(self, process: asyncssh.SSHClientProcess, coalesce: bool = False):
        self._process = process
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.create_task(self._read())
        self._coalesce = coalesce
        self._queued: list[bytes] = []

    async def _read(self) -> None:
        while line := await self._process.stdout.readline():
            message = json.loads(line)
            self._pending.pop(message["id"]).set_result(message["result"])

    async def call(self, op: str, args: dict | None = None):
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        line = json.dumps({"id": request_id, "op": op, "args": args or {}}, separators=(",", ":")).encode() + b"\n"
        if not self._coalesce:
            self._process.stdin.write(line)
        else:
            if not self._queued:
                asyncio.get_running_loop().call_soon(self._flush)
            self._queued.append(line)
        return await future

    def _flush(self) -> None:
        lines, self._queued = self._queued, []
        self._process.stdin.write(b"".join(lines))

    async def close(self) -> None:
        self._process.stdin.write_eof()
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass
        self._process.close()


async def echo_figures(conn, counts: Counts, phase, label: str, coalesce: bool = False,
                       latency: bool = True) -> tuple[list[float], Throughput]:
    """p50/p99 samples (one in flight) and the rate with IN_FLIGHT in flight, over one channel."""
    echo = EchoClient(await conn.create_process(shlex.join(["python3", "-c", ECHO]), encoding=None), coalesce)
    try:
        samples = []
        if latency:
            samples = await phase(f"{label} x{counts.calls}", timings(lambda: echo.call("ping"), counts.calls, warmup=50))
        rate = await phase(f"{label}, {IN_FLIGHT} in flight x{counts.saturate}",
                           saturate(lambda: echo.call("ping"), counts.saturate))
    finally:
        await echo.close()
    return samples, rate


async def run_checked(conn: asyncssh.SSHClientConnection, command: str, expect: bytes | None = None) -> None:
    """One command on a new exec channel, stdin closed at once; it must succeed."""
    process = await conn.create_process(command, encoding=None)
    process.stdin.write_eof()  # run(input=b"") would send no EOF, and the helper waits for one
    result = await process.wait()
    if result.exit_status != 0 or (expect is not None and not result.stdout.startswith(expect)):
        raise BenchError(f"{command[:60]!r} exited with {result.exit_status}: {result.stderr[-300:]!r}")


def shell_facts_command(tb: Testbed, node: str) -> str:
    """What the helper's inventory, storage, status and holdings read, as one shell command."""
    host = tb.nodes[node]
    helper = load_helper()  # the helper is package data, loaded from its file
    query = ",".join(helper.GPU_QUERY_FIELDS)
    apps = ",".join(helper.COMPUTE_APPS_FIELDS)
    return "; ".join([
        "hostname", "cat /proc/sys/kernel/random/boot_id", "nproc", "cat /proc/meminfo",
        "if command -v nvidia-smi >/dev/null; then "
        f"nvidia-smi --query-gpu={query} --format=csv,noheader,nounits; "
        f"nvidia-smi --query-compute-apps={apps} --format=csv,noheader,nounits; fi",
        f"df -P {shlex.quote(str(host.models_dir))} {shlex.quote(str(host.cache_dir))}",
        "cat /proc/self/mountinfo",
        "ls .llmgw/shards 2>/dev/null",
        f"test -s {shlex.quote(str(host.models_dir / 'bench-model'))}",
        "true",
    ])


async def connect_all(tb: Testbed, names: list[str]) -> list[asyncssh.SSHClientConnection]:
    """Plain asyncssh connections to every node, as many at once as the Fleet allows itself."""
    gate = asyncio.Semaphore(CONNECT_GATE)

    async def one(name):
        async with gate:
            return await tb.connect(name)

    return list(await asyncio.gather(*(one(name) for name in names)))


async def shell_facts(connections, commands) -> None:
    results = await asyncio.gather(*(conn.run(cmd) for conn, cmd in zip(connections, commands)))
    for result in results:
        if result.exit_status != 0:
            raise BenchError(f"facts by shell failed ({result.exit_status}): {result.stderr[-300:]}")


# -- llmgw ------------------------------------------------------------------------------------------


def holdings_wanted(node):
    # One candidate that is not there: the helper still looks, which is the common case.
    return {"bench-model": [f"{node.model_dirs[0]}/bench-model"]}


def remove_helpers(tb: Testbed) -> None:
    for node in tb.nodes.values():
        shutil.rmtree(node.home_dir / ".llmgw", ignore_errors=True)


def helpers_present(tb: Testbed) -> int:
    filename = helper_code().filename
    return sum((node.home_dir / ".llmgw" / "helper" / filename).is_file() for node in tb.nodes.values())


async def start_fleet(inventory, state_dir: Path) -> tuple[Fleet, float]:
    fleet = Fleet(inventory, state_dir, holdings_wanted=holdings_wanted)
    start = time.perf_counter()
    await fleet.start()
    connected = await fleet.wait_connected(CONNECT_TIMEOUT)
    elapsed = time.perf_counter() - start
    if not connected:
        stuck = {name: f"{link.state}: {link.reason}" for name, link in fleet.links.items() if link.state != "ready"}
        await fleet.close()
        raise BenchError(f"{len(stuck)} node(s) did not connect within {CONNECT_TIMEOUT:g}s: {stuck}")
    return fleet, elapsed


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    value: float
    unit: str  # "ms", "s", "/s", "x"
    target: float | None = None
    at_least: bool = False  # the target is a floor (>=), not a ceiling (<=)
    versus: str = ""
    noisy: bool = False


def fmt(value: float, unit: str) -> str:
    if unit == "/s":
        return f"{value:,.0f}/s"
    if unit == "x":
        return f"{value:,.1f}x"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


class StallWatch:
    """The longest the event loop went past a 10 ms timer: CPU taken by others, or a GC pause."""

    def __init__(self):
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.perf_counter() - start - 0.01)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def note(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


async def measure(tb: Testbed, counts: Counts, names: list[str]) -> tuple[list[Row], list[Row]]:
    node = names[0]
    nodes = len(names)
    few = min(REFRESH_FEW, nodes)
    ms = 1000.0

    async def phase(label: str, coro):
        note(label)
        try:
            return await asyncio.wait_for(coro, PHASE_TIMEOUT)
        except NodeError as exc:  # the link's own log line above says why it went
            raise BenchError(f"{label}: {exc}") from None
        except asyncio.TimeoutError:
            raise BenchError(f"{label}: not done within {PHASE_TIMEOUT:g}s") from None

    # OpenSSH
    fresh = await phase(f"fresh ssh x{counts.fresh_ssh}",
                        timings(lambda: run_quiet(tb.ssh_argv(node, "true")), counts.fresh_ssh, warmup=1))
    control_path = tb.dir / "bench-cm.sock"
    await run_quiet(control_master_argv(tb, node, control_path, "true"))  # opens the master
    try:
        muxed = await phase(f"ssh via ControlMaster x{counts.control_master}", timings(
            lambda: run_quiet(control_master_argv(tb, node, control_path, "true")), counts.control_master))
    finally:
        argv = tb.ssh_argv(node, "")
        await run_quiet(argv[:-2] + ["-o", f"ControlPath={control_path}", "-O", "exit", argv[-2]])

    # asyncssh on one open connection to the first node, kept for the helper start-up below
    conn = await tb.connect(node)
    try:
        exec_channel = await phase(f"asyncssh exec channel x{counts.exec_channel}",
                                   timings(lambda: run_checked(conn, "true"), counts.exec_channel))
        python_start = await phase(f"python3 start over an exec channel x{counts.per_op}",
                                   timings(lambda: run_checked(conn, "python3 -c pass"), counts.per_op))
        cipher = conn.get_extra_info("send_cipher")
        echo_lat, echo_rate = await echo_figures(conn, counts, phase, f"JSON-lines echo ({cipher})")
        # What the echo gains from two changes a client can make on its own side.
        gcm = await tb.connect(node, encryption_algs=[GCM])
        try:
            gcm_lat, gcm_rate = await echo_figures(gcm, counts, phase, f"JSON-lines echo ({GCM})")
        finally:
            gcm.close()
            await gcm.wait_closed()
        _, coalesced_rate = await echo_figures(conn, counts, phase, "JSON-lines echo, coalesced writes",
                                               coalesce=True, latency=False)

        # Plain connections to every node, and the facts by shell over them
        start = time.perf_counter()
        connections = await phase(f"bare asyncssh connects to {nodes} nodes", connect_all(tb, names))
        bare_connect = time.perf_counter() - start
        try:
            commands = [shell_facts_command(tb, name) for name in names]
            shell_few = await phase(f"facts by shell, {few} nodes x{counts.shell_facts}", timings(
                lambda: shell_facts(connections[:few], commands[:few]), counts.shell_facts, warmup=1))
            shell_all = await phase(f"facts by shell, {nodes} nodes x{counts.shell_facts}", timings(
                lambda: shell_facts(connections, commands), counts.shell_facts, warmup=1))
        finally:
            for c in connections:
                c.close()
            await asyncio.gather(*(c.wait_closed() for c in connections))

        # llmgw: connecting, with and without deploying the helper
        inventory, _ = load_inventory(tb.write_inventory(tb.dir / "bench-inventory.yaml"))
        # The testbed's inventory detects a cut node in 3 s (1 s x 3) for the fault tests; on a
        # machine this loaded that drops every link whenever this process is starved for 3 s.
        # Reaching nodes is measured with llmgw's own keepalive defaults instead.
        defaults = SSHConfig()
        inventory = inventory.model_copy(update={"ssh": inventory.ssh.model_copy(update={
            "keepalive_interval": defaults.keepalive_interval, "keepalive_count": defaults.keepalive_count})})
        unstaggered = inventory.model_copy(update={"ssh": inventory.ssh.model_copy(update={"connect_stagger": 0.0})})
        state_dir = tb.dir / "bench-state"
        deploy_times, present_times, unstaggered_times = [], [], []
        fleet = None
        for round_ in range(counts.connects):
            remove_helpers(tb)
            fleet, seconds = await phase(f"Fleet connect with helper deploy ({round_ + 1}/{counts.connects})",
                                         start_fleet(inventory, state_dir))
            await fleet.close()
            deploy_times.append(seconds)
            if helpers_present(tb) != nodes:
                raise BenchError(f"helper deployed to {helpers_present(tb)} of {nodes} nodes")
            fleet, seconds = await phase(f"Fleet connect, helper present, connect_stagger 0 "
                                         f"({round_ + 1}/{counts.connects})", start_fleet(unstaggered, state_dir))
            await fleet.close()
            unstaggered_times.append(seconds)
            fleet, seconds = await phase(f"Fleet connect, helper present ({round_ + 1}/{counts.connects})",
                                         start_fleet(inventory, state_dir))
            present_times.append(seconds)
            if round_ + 1 < counts.connects:
                await fleet.close()
        assert fleet is not None

        code = helper_code()
        helper_command = shlex.join(helper_argv(inventory.ssh.python, f".llmgw/helper/{code.filename}",
                                                code, ".llmgw"))
        helper_start = await phase(f"helper start to hello over an exec channel x{counts.per_op}", timings(
            lambda: run_checked(conn, helper_command, expect=b'{"hello"'), counts.per_op))
    finally:
        conn.close()
        await conn.wait_closed()

    try:
        link = fleet.link(node)
        ping_lat = await phase(f"NodeLink.call('ping') x{counts.calls}",
                               timings(lambda: link.call("ping"), counts.calls, warmup=50))
        ping_rate = await phase(f"NodeLink.call('ping'), {IN_FLIGHT} in flight x{counts.saturate}",
                                saturate(lambda: link.call("ping"), counts.saturate))
        few_names = names[:few]
        refresh_few = await phase(f"Fleet.refresh() of {few} nodes x{counts.refresh}",
                                  timings(lambda: fleet.refresh(few_names), counts.refresh))
        refresh_all = await phase(f"Fleet.refresh() of {nodes} nodes x{counts.refresh}",
                                  timings(lambda: fleet.refresh(), counts.refresh))
        missing = [name for name in names if fleet.facts[name].inventory is None]
        if missing:
            raise BenchError(f"refresh left no inventory facts for {missing}")
        config = fleet.nodes[node]
        per_op = {}
        for op, args in [("inventory", {}), ("storage", {"dirs": storage_dirs(config), "timeout": 5.0}),
                         ("status", {"probe": True, "timeout": 2.0}),
                         ("holdings", {"candidates": holdings_wanted(config)})]:
            per_op[op] = await phase(f"{op} on one node x{counts.per_op}",
                                     timings(lambda op=op, args=args: link.call(op, args), counts.per_op))
    finally:
        await fleet.close()

    exec_p50, fresh_p50 = p50(exec_channel), p50(fresh)
    baselines = [
        Row("fresh `ssh host true` (OpenSSH) p50", fresh_p50 * ms, "ms", versus="TARGETS.md: 165-217 ms"),
        Row("fresh `ssh host true` (OpenSSH) p99", p99(fresh) * ms, "ms", noisy=True),
        Row("OpenSSH via open ControlMaster p50", p50(muxed) * ms, "ms", versus="TARGETS.md: 16 ms"),
        Row("OpenSSH via open ControlMaster p99", p99(muxed) * ms, "ms", noisy=True),
        Row("asyncssh exec channel, open connection p50", exec_p50 * ms, "ms", versus="TARGETS.md: 3.1 ms"),
        Row("asyncssh exec channel, open connection p99", p99(exec_channel) * ms, "ms", noisy=True),
        Row("asyncssh JSON-lines echo p50", p50(echo_lat) * ms, "ms", versus="TARGETS.md: 0.30 ms"),
        Row("asyncssh JSON-lines echo p99", p99(echo_lat) * ms, "ms", noisy=True),
        Row(f"asyncssh JSON-lines echo, {IN_FLIGHT} in flight", echo_rate.per_second, "/s",
            versus=f"TARGETS.md: ~9,000/s; client CPU {echo_rate.cpu_per_call * 1e6:.0f} us/call", noisy=True),
        Row("  same, cipher aes128-gcm p50", p50(gcm_lat) * ms, "ms", versus=f"negotiated by default: {cipher}"),
        Row(f"  same, cipher aes128-gcm, {IN_FLIGHT} in flight", gcm_rate.per_second, "/s",
            versus=f"client CPU {gcm_rate.cpu_per_call * 1e6:.0f} us/call", noisy=True),
        Row(f"  same, {IN_FLIGHT} in flight, writes coalesced per loop turn", coalesced_rate.per_second, "/s",
            versus=f"client CPU {coalesced_rate.cpu_per_call * 1e6:.0f} us/call", noisy=True),
        Row(f"facts by one shell command per node, {few} nodes p50", p50(shell_few) * ms, "ms",
            versus="TARGETS.md: ansible -m setup 1.9-2.9 s"),
        Row(f"facts by one shell command per node, all {nodes} nodes p50", p50(shell_all) * ms, "ms", noisy=True),
        Row("`python3 -c pass` over an exec channel p50", p50(python_start) * ms, "ms"),
        Row(f"bare asyncssh connects, {nodes} nodes ({CONNECT_GATE} at a time)", bare_connect, "s", noisy=True),
    ]
    call_p50 = p50(ping_lat)
    llmgw = [
        Row("NodeLink.call('ping') p50, 1 in flight", call_p50 * ms, "ms", 0.5,
            versus=f"{call_p50 / p50(echo_lat):.2f}x the echo"),
        Row("NodeLink.call('ping') p99, 1 in flight", p99(ping_lat) * ms, "ms",
            versus=f"{p99(ping_lat) / p99(echo_lat):.2f}x the echo", noisy=True),
        Row("  speed-up of call p50 over an exec channel", exec_p50 / call_p50, "x", 6, at_least=True),
        Row("  speed-up of call p50 over a fresh ssh", fresh_p50 / call_p50, "x", 300, at_least=True),
        Row(f"NodeLink.call('ping'), {IN_FLIGHT} in flight, one node", ping_rate.per_second, "/s", 5000,
            at_least=True, versus=f"{ping_rate.per_second / echo_rate.per_second:.2f}x the echo; "
                                  f"client CPU {ping_rate.cpu_per_call * 1e6:.0f} us/call", noisy=True),
        Row(f"full facts (Fleet.refresh), {few} nodes p50", p50(refresh_few) * ms, "ms", 5,
            versus=f"{p50(refresh_few) / p50(shell_few):.2f}x facts by shell"),
        Row(f"full facts (Fleet.refresh), all {nodes} nodes p50", p50(refresh_all) * ms, "ms", 100,
            versus=f"{p50(refresh_all) / p50(shell_all):.2f}x facts by shell", noisy=True),
    ]
    llmgw += [Row(f"  {op} on one node p50 (1 in flight)", p50(samples) * ms, "ms",
                  versus=f"p99 {p99(samples) * ms:.1f} ms") for op, samples in per_op.items()]
    llmgw += [
        Row(f"connect {nodes} nodes, deploying the helper (p50 of {len(deploy_times)})", p50(deploy_times), "s",
            3, versus=f"{p50(deploy_times) / bare_connect:.2f}x bare connects", noisy=True),
        Row(f"connect {nodes} nodes, helper present (p50 of {len(present_times)})", p50(present_times), "s",
            3, versus=f"{p50(present_times) / bare_connect:.2f}x bare connects", noisy=True),
        Row(f"  same, connect_stagger 0 instead of {inventory.ssh.connect_stagger:g} s", p50(unstaggered_times), "s",
            versus=f"{p50(unstaggered_times) / bare_connect:.2f}x bare connects", noisy=True),
        Row("  helper start to hello over an exec channel p50", p50(helper_start) * ms, "ms",
            versus=f"{p50(helper_start) / p50(python_start):.2f}x `python3 -c pass`"),
    ]
    return baselines, llmgw


def print_table(baselines: list[Row], llmgw: list[Row]) -> None:
    width = max(len(r.label) for r in baselines + llmgw) + 2

    def line(label, value, target, ratio, verdict, versus):
        print(f"{label:{width}} {value:>12} {target:>9} {ratio:>7} {verdict:>7}  {versus}".rstrip())

    print()
    line("baseline", "value", "", "", "", "reference")
    for r in baselines:
        line(r.label, fmt(r.value, r.unit), "", "", "", r.versus + (" [noisy]" if r.noisy else ""))
    print()
    line("llmgw", "value", "target", "ratio", "", "vs baseline (same run)")
    for r in llmgw:
        if r.target is None:
            target = ratio = verdict = ""
        else:
            target = ("≥ " if r.at_least else "≤ ") + fmt(r.target, r.unit).replace(".000", "").replace(".00", "")
            ratio = f"{r.value / r.target:.2f}"
            met = r.value >= r.target if r.at_least else r.value <= r.target
            verdict = "meets" if met else "MISSES"
        line(r.label, fmt(r.value, r.unit), target, ratio, verdict, r.versus + (" [noisy]" if r.noisy else ""))
    print("\nratio = value / target: a ≤ target is met at <= 1.00, a ≥ target at >= 1.00.")
    print(f"[noisy]: tails, rates and start-up times on a {os.cpu_count()}-core machine shared with other "
          "work; client, sshd, helpers and nodes all run on it.")


async def main(args) -> int:
    reason = requirements_missing()
    if reason:
        print(f"node_rpc: cannot build a testbed here: {reason}", file=sys.stderr)
        return 2
    # Warnings stay on: a link lost under load is a finding, and its reason is in the log line.
    logging.basicConfig(level=logging.WARNING, format="  %(name)s: %(message)s")
    counts = QUICK if args.quick else FULL
    load_before = os.getloadavg()  # others' work: later, this bench's own process bursts count too
    with Testbed(default_specs(args.nodes, args.gpus)) as tb:
        names = list(tb.nodes)
        print(f"reaching nodes: {len(names)} testbed nodes ({args.gpus} GPU doubles each) up in "
              f"{tb.startup_seconds:.2f} s; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before the run"
              f"{'; --quick' if args.quick else ''}", flush=True)
        stalls = StallWatch()
        stalls.start()
        try:
            baselines, llmgw = await measure(tb, counts, names)
        finally:
            stalls.stop()
    print_table(baselines, llmgw)
    print(f"longest event-loop stall of this process during the run: {stalls.worst * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64, help="testbed nodes (1 to 200)")
    parser.add_argument("--gpus", type=int, default=8,
                        help="nvidia-smi double GPUs per node; 0 makes CPU nodes (no nvidia-smi)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (about a minute)")
    try:
        sys.exit(asyncio.run(main(parser.parse_args())))
    except BenchError as exc:
        print(f"node_rpc: {exc}", file=sys.stderr)
        sys.exit(1)
