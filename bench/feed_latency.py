"""Router feed latency (R-10.1): from the publisher emitting a Change to each router's apply having it.

The control plane's side (FeedServer on a Unix socket, with a publisher that hands every listener
the same Change objects) runs here; each router is a process of its own running FeedClient, as a
router worker does, and records when its router applied each version. CLOCK_MONOTONIC is one
clock for every process of the machine, so the times compare across them. Baseline in the same
run: the same lines written to the same number of processes over a bare Unix socket (no HTTP, no
parsing), which is what the socket and the scheduling alone cost.

    .venv/bin/python bench/feed_latency.py [--changes 200] [--interval 0.02] [--clients 1 4]

Target: an endpoint change seen by every router within 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.contracts import routerauth  # noqa: E402
from llmgw.contracts.endpoints import Endpoint  # noqa: E402
from llmgw.contracts.feed import (Ack, Change, GatewaySettings, KeyEntry, RoutedModel, Snapshot,  # noqa: E402
                                  to_wire)

TOKEN = "llmgw-router.bench.bench-feed-router-credential"  # the routers' credential (R-10.7)
MODELS = 50
ENDPOINTS = 4
KEYS = 1000


def snapshot() -> Snapshot:
    models = {f"m{i}": RoutedModel(f"m{i}", "vllm", None, "least-outstanding", False) for i in range(MODELS)}
    endpoints = {name: tuple(Endpoint(f"{name}-r{j}", name, f"http://10.0.{i}.{j}:8000", f"key-{i}-{j}")
                             for j in range(ENDPOINTS)) for i, name in enumerate(models)}
    keys = tuple(KeyEntry(f"k{i}", f"user{i}", f"{i:064x}", f"sk-{i:04x}", None) for i in range(KEYS))
    return Snapshot("bench", 1, MappingProxyType(models), MappingProxyType(endpoints), keys,
                    GatewaySettings(16_000_000, 600.0, 120.0))


def change(base: Snapshot, version: int) -> Change:
    name = f"m{version % MODELS}"
    members = tuple(Endpoint(f"{name}-r{j}-{version}", name, f"http://10.1.0.{j}:8000", f"key-{version}-{j}")
                    for j in range(ENDPOINTS))
    return Change(base.epoch, version, endpoints=MappingProxyType({name: members}))


class Listener:
    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(publisher.snapshot)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()

    def close(self) -> None:
        self.publisher.listeners.discard(self)


class Credentials:
    """What the feed server accepts: TOKEN, under the name it carries."""

    def accepted(self, name: str) -> list[bytes]:
        return [routerauth.verifier(TOKEN)] if name == routerauth.credential_name(TOKEN) else []


class Publisher:
    def __init__(self):
        self.snapshot = snapshot()
        self.listeners: set[Listener] = set()

    async def ready(self) -> None:
        pass

    def current(self) -> Snapshot:
        return self.snapshot

    def listen(self) -> Listener:
        listener = Listener(self)
        self.listeners.add(listener)
        return listener

    async def apply_report(self, report, refused=()) -> Ack:
        return Ack(report.router, report.seq)

    def emit(self, message: Change) -> None:
        self.snapshot = self.snapshot.apply(message)
        for listener in self.listeners:
            listener.queue.put_nowait(message)


# -- a router process ------------------------------------------------------------------------


class Recorder:
    """A router that only notes when each version arrived."""

    def __init__(self, last: int):
        self.snapshot = None
        self.on_demand = None
        self.feed_status = None
        self.last = last
        self.seen: dict[int, float] = {}
        self.first = asyncio.Event()
        self.done = asyncio.Event()

    def apply(self, message) -> None:
        now = time.monotonic()
        self.snapshot = message if isinstance(message, Snapshot) else self.snapshot.apply(message)
        if isinstance(message, Change):
            self.seen[message.version] = now
        self.first.set()
        if self.snapshot.version >= self.last:
            self.done.set()

    def report_fields(self) -> dict:
        return {"snapshot": (self.snapshot.epoch, self.snapshot.version) if self.snapshot else None}


async def router_process(address: str, state_dir: str, last: int) -> None:
    from llmgw.router.feedclient import FeedClient

    router = Recorder(last)
    client = FeedClient(router, address, TOKEN, Path(state_dir))
    await client.start()
    await router.first.wait()
    print("ready", flush=True)
    await router.done.wait()
    await client.close()
    print(json.dumps(router.seen), flush=True)


async def bare_process(path: str, last: int) -> None:
    reader, writer = await asyncio.open_unix_connection(path, limit=64 * 1024 * 1024)
    seen = {}
    await reader.readline()  # the snapshot
    print("ready", flush=True)
    while True:
        line = await reader.readline()
        now = time.monotonic()
        version = int(line[:16])
        seen[version] = now
        if version >= last:
            break
    writer.close()
    print(json.dumps(seen), flush=True)


# -- the control plane's side ----------------------------------------------------------------


async def spawn(args: list[str], count: int) -> list[asyncio.subprocess.Process]:
    processes = [await asyncio.create_subprocess_exec(sys.executable, __file__, *args, stdout=asyncio.subprocess.PIPE)
                 for _ in range(count)]
    for process in processes:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise SystemExit(f"a router process did not start: {line!r}")
    return processes


async def collect(processes, emitted: dict[int, float]) -> list[float]:
    latencies = []
    for process in processes:
        seen = json.loads(await asyncio.wait_for(process.stdout.readline(), 120))
        await process.wait()
        missing = set(emitted) - {int(v) for v in seen}
        if missing:
            raise SystemExit(f"a router never saw versions {sorted(missing)[:5]}...")
        latencies += [(at - emitted[int(v)]) * 1000 for v, at in seen.items()]
    return latencies


async def run_feed(place: Path, clients: int, changes: int, interval: float) -> list[float]:
    from llmgw.control.feedserver import FeedServer, listen_unix

    publisher = Publisher()
    server = FeedServer(publisher, Credentials())
    sock = await listen_unix(server, place / "feed.sock")
    try:
        last = changes + 1
        processes = await spawn(["--router", f"unix:{place / 'feed.sock'}", str(place / "router"), str(last)],
                                clients)
        while len(publisher.listeners) < clients:
            await asyncio.sleep(0.01)
        emitted = {}
        for version in range(2, last + 1):
            message = change(publisher.snapshot, version)
            emitted[version] = time.monotonic()
            publisher.emit(message)
            await asyncio.sleep(interval)
        return await collect(processes, emitted)
    finally:
        await sock.close()


async def run_bare(place: Path, clients: int, changes: int, interval: float) -> list[float]:
    writers = []
    connected = asyncio.Event()

    async def accept(reader, writer):
        writer.write(json.dumps(to_wire(snapshot())).encode() + b"\n")
        writers.append(writer)
        if len(writers) == clients:
            connected.set()

    path = str(place / "bare.sock")
    server = await asyncio.start_unix_server(accept, path)
    try:
        last = changes + 1
        processes = await spawn(["--bare", path, str(last)], clients)
        await connected.wait()
        base = snapshot()
        emitted = {}
        for version in range(2, last + 1):
            line = f"{version:016d}".encode() + json.dumps(to_wire(change(base, version))).encode() + b"\n"
            emitted[version] = time.monotonic()
            for writer in writers:
                writer.write(line)
            await asyncio.sleep(interval)
        return await collect(processes, emitted)
    finally:
        server.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between changes")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    print(f"snapshot: {MODELS} models x {ENDPOINTS} endpoints, {KEYS} keys; {args.changes} changes, one every "
          f"{args.interval * 1000:g} ms; load average {os.getloadavg()[0]:.2f}")
    print(f"{'routers':>7}  {'path':<22} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  {'p99 vs bare':>11}")
    for clients in args.clients:
        place = Path(tempfile.mkdtemp(prefix="feedb-", dir="/tmp"))
        try:
            bare = await run_bare(place, clients, args.changes, args.interval)
            feed = await run_feed(place, clients, args.changes, args.interval)
        finally:
            shutil.rmtree(place, ignore_errors=True)
        for name, values in (("bare unix socket", bare), ("feed (FeedClient)", feed)):
            ratio = percentile(values, 0.99) / max(percentile(bare, 0.99), 1e-6)
            print(f"{clients:>7}  {name:<22} {statistics.median(values):8.2f} {percentile(values, 0.99):8.2f} "
                  f"{max(values):8.2f}  {ratio:10.1f}x")
    print("target: every router has an endpoint change within 100 ms (p99 above)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--router":
        asyncio.run(router_process(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--bare":
        asyncio.run(bare_process(sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(main())
