"""Router workers: CPU per request and per streamed event with 1 and 2 workers, against a bare proxy.

`llmgw serve --workers N` (N = 1, 2) with one model on a static endpoint (the minimal aiohttp
engine of router_overhead.py, so no node is needed), and the bare pass-through of
router_overhead.py in the same run. The router's CPU is the user+system time of every worker
process (from /proc/PID/stat); the spread is each worker's share of it, with many client
connections. Prints a table; not a pass/fail test.

    .venv/bin/python bench/router_workers.py [--seconds 3] [--connections 32] [--stream-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402  (the engine, the bare proxy and the load generator)

ENGINE_KEY_ENV = "BENCH_ENGINE_KEY"


def start_serve(work: Path, engine_url: str, workers: int) -> tuple[subprocess.Popen, str, Path, str]:
    """`llmgw serve --workers N`; (process, router URL, state dir, client key) once it routes."""
    state = work / f"state-{workers}"
    inventory = work / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({
        "nodes": [], "models": [{"name": ro.MODEL, "endpoints": [{"url": engine_url, "api_key_env": ENGINE_KEY_ENV}]}]}))
    port = ro.free_port()
    env = dict(os.environ, **{ENGINE_KEY_ENV: ro.ENGINE_KEY}, PYTHONPATH=str(ro.ROOT))
    cli = [sys.executable, "-m", "llmgw.cli.main"]
    serve = subprocess.Popen([*cli, "serve", "-i", str(inventory), "--state-dir", str(state), "--listen",
                              f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{ro.free_port()}", "--workers", str(workers),
                              "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run([*cli, "keys", "create", "bench", "--state-dir", str(state)], env=env, capture_output=True,
                         text=True, check=True).stdout
    key = next(word for word in out.split() if word.startswith("sk-"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            request = aiohttp_request(url, key)
            if request == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or serve.poll() is not None:
            raise SystemExit(f"llmgw serve --workers {workers} did not route (see {state}/router.log)")
        time.sleep(0.2)
    return serve, url, state, key


def aiohttp_request(url: str, key: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/v1/chat/completions", data=ro.body(False), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def worker_pids(state: Path, workers: int) -> list[int]:
    """The workers' pids from the supervisor's status file, once it lists them all (a worker may
    answer a moment before its supervisor writes the file)."""
    path = state / "router" / "status.json"
    deadline = time.monotonic() + 30
    while True:
        try:
            pids = [worker["pid"] for worker in json.loads(path.read_text())["workers"]]
            if len(pids) == workers:
                return pids
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} does not list {workers} workers")
        time.sleep(0.1)


async def measure(session, url: str, key: str, pids: list[int], args, payload: bytes) -> dict:
    """One throughput run: requests, and CPU seconds per process of `pids`."""
    target = ro.Target("t", url, key, pids[0])
    before = {pid: ro.cpu_seconds(pid) for pid in pids}
    deadline = time.perf_counter() + args.seconds
    done = errors = 0

    async def client():
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                await ro.one(session, target, payload)
                done += 1
            except Exception:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.connections)))
    elapsed = time.perf_counter() - started
    cpu = {pid: ro.cpu_seconds(pid) - before[pid] for pid in pids}
    return {"requests": done, "errors": errors, "rps": done / elapsed, "cpu": cpu}


async def bench(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-workers-"))
    engine_port, bare_port = ro.free_port(), ro.free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = ro.start_process([sys.executable, ro.__file__, "_engine", "--port", str(engine_port),
                               "--token-delay", str(args.token_delay)])
    bare = ro.start_process([sys.executable, ro.__file__, "_bare", "--port", str(bare_port), "--engine-url", engine_url])
    rows = []
    started: list[tuple[subprocess.Popen, Path]] = []  # each serve and its state dir, stopped at the end
    try:
        ro.wait_healthy(engine_url + "/health")
        await asyncio.to_thread(ro.wait_healthy_post, f"http://127.0.0.1:{bare_port}")
        plain, stream = ro.body(False), ro.body(True, args.stream_tokens)
        connector = aiohttp.TCPConnector(limit=0, force_close=args.new_connections)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            runs = {"bare proxy": (f"http://127.0.0.1:{bare_port}", ro.ENGINE_KEY, [bare.pid])}
            for workers in (1, 2):
                serve, url, state, key = await asyncio.to_thread(start_serve, work, engine_url, workers)
                started.append((serve, state))
                runs[f"{workers} worker{'s' * (workers > 1)}"] = (url, key, worker_pids(state, workers))
            for name, (url, key, pids) in runs.items():
                p = await measure(session, url, key, pids, args, plain)
                s = await measure(session, url, key, pids, args, stream)
                per_request = sum(p["cpu"].values()) / max(p["requests"], 1)
                events = args.stream_tokens + (2 if name != "bare proxy" else 1)
                per_event = (sum(s["cpu"].values()) - s["requests"] * per_request) / max(s["requests"] * events, 1)
                total = sum(p["cpu"].values()) + sum(s["cpu"].values())
                spread = " / ".join(f"{(p['cpu'][pid] + s['cpu'][pid]) / max(total, 1e-9):.0%}" for pid in pids)
                rows.append((name, f"{p['rps']:.0f}", f"{per_request * 1e3:.3f}", f"{s['rps']:.0f}",
                             f"{per_event * 1e6:.1f}", spread if len(pids) > 1 else "-",
                             str(p["errors"] + s["errors"])))
    finally:
        for serve, state in started:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)
            subprocess.run([sys.executable, "-m", "llmgw.cli.main", "router", "stop", "--state-dir",
                            str(state / "router")], capture_output=True, env=dict(os.environ, PYTHONPATH=str(ro.ROOT)))
        for process in (bare, engine):
            process.send_signal(signal.SIGTERM)
            process.wait(10)
    print(f"\n{os.cpu_count()} CPUs; {args.connections} client connections"
          f"{' (a new one per request)' if args.new_connections else ''}; {args.seconds:g} s per run; "
          f"{args.stream_tokens} events per stream; CPU = user+system of every serving process")
    header = ("", "plain req/s", "CPU/request ms", "streams/s", "CPU/event µs", "CPU share per worker", "errors")
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).rjust(width) if i else str(cell).ljust(width) for i, (cell, width)
                        in enumerate(zip(row, widths))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.001)
    parser.add_argument("--new-connections", action="store_true",
                        help="a new connection per request (the kernel picks a worker per connection)")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
