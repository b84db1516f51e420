"""What the router costs: an engine double alone vs the same engine through the router, same run.

Measures, against TARGETS.md ("Router"), with authentication, balancing, usage accounting and
metrics all on:
  - added latency and added time-to-first-token, one client, p50/p99;
  - requests/s at concurrency 1, 16 and 64;
  - CPU time of the router process per request and per streamed event (from /proc/PID/stat, so
    every thread of the router counts: the event loop, the store's writer, key reloads);
  - 256 concurrent streams through the router, counting errors.
The router process holds its control plane's feed publisher, as a router fed in-process does; each
report is encoded as a router worker's feed client encodes it and is applied without its request
records, so that the CPU measured is the router's and not the control plane's writing of the
records to SQLite, which a router worker (`llmgw router`) leaves to the control plane's process.
Engine, router and load generator are three processes on this machine; on a 2-core machine
they compete for CPU, so requests/s are indications, and the ratios are what to compare.
Prints a table and ratios; not a pass/fail test.

    .venv/bin/python bench/router_overhead.py [--engine aiohttp|double] [--seconds 3] [--rounds 3]
    .venv/bin/python bench/router_overhead.py --profile /tmp/router.prof   # cProfile the router

`--engine aiohttp` (default) is a minimal aiohttp engine defined here that answers at once;
`--engine double` is the testbed's engine double (stdlib ThreadingHTTPServer), which is slower
than the router and then bounds the baseline.

`--engine vllm` runs the real vLLM (the engines environment scripts/engines builds) on the tiny
random Llama of tests/testbed/engines.py, started from llmgw's built-in template (key and guard
included), and streams the same requests to it directly, through a bare proxy and through the
router, alternating one by one: added time to first token (p50, p99), added inter-token latency
(p50 of each stream's mean gap between content events), and the router's CPU per request and
per streamed event.

    .venv/bin/python bench/router_overhead.py --engine vllm [--count 100] [--stream-tokens 32]

`--request-log` compares routers with the request log (R-6.20) off, on, and on with a file
(`gateway.request_log.path`), three router processes over the same engine, measured in turns
(`--rounds`, each a plain and a streamed throughput run per router, the order rotated every round)
against the bare proxy: the router's CPU per request and per stream, medians over the rounds and
the median of each round's ratio to the log off. Each router's reports are encoded as a router
worker's feed client encodes them (once each, with their records), and the in-process control
plane is not given the records, so what is measured is the router's side alone.

    .venv/bin/python bench/router_overhead.py --request-log [--rounds 5] [--seconds 3]

`--tracing` compares, the same way, a router with traces off and one with `gateway.tracing` on
(R-6.21), exporting every request's spans over OTLP/HTTP to a collector process of this script
that answers each export at once without reading it: the CPU the router spends on the spans,
their batching and their export.

    .venv/bin/python bench/router_overhead.py --tracing [--rounds 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
DOUBLES = ROOT / "tests" / "testbed" / "doubles"
ENGINE_KEY = "bench-engine-key"
MODEL = "m"
TICKS = os.sysconf("SC_CLK_TCK")
TARGETS = {"added_p50_ms": 1.0, "added_ttft_p50_ms": 1.0, "cpu_per_request_ms": 0.4, "cpu_per_event_us": 30.0,
           "added_itl_p50_ms": 0.1}


# ------------------------------------------------------------------------------ the aiohttp engine

def _event(content: str) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                   "model": MODEL, "choices": [{"index": 0, "delta": {"content": content},
                                                                "finish_reason": None}]},
                                  separators=(",", ":")).encode() + b"\n\n"


TOKEN_EVENT = _event(" la")
USAGE_EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"m",'
               b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d,"total_tokens":%d}}\n\n')
ANSWER = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "m heard 3 words"},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
                    separators=(",", ":")).encode()


async def _engine_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=ANSWER, content_type="application/json")
    tokens = int(body.get("max_tokens") or 8)
    delay = request.app["token_delay"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(tokens):
        await response.write(TOKEN_EVENT)
        if delay:
            await asyncio.sleep(delay)
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(USAGE_EVENT % (tokens, tokens + 3))
    await response.write(b"data: [DONE]\n\n")
    return response


def run_aiohttp_engine(port: int, token_delay: float) -> None:
    app = web.Application()
    app["token_delay"] = token_delay
    app.router.add_post("/v1/chat/completions", _engine_chat)
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------------------------ a bare proxy

def run_bare_proxy(port: int, engine_url: str) -> None:
    """The floor for any aiohttp proxy: pass-through, no auth, no balancing, no accounting."""
    headers = {"Authorization": f"Bearer {ENGINE_KEY}", "Content-Type": "application/json"}

    async def forward(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        async with request.app["session"].post(engine_url + request.path, data=data, headers=headers) as upstream:
            if upstream.content_type != "text/event-stream":
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type=upstream.content_type)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            return response

    async def session(app):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app["session"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    app.cleanup_ctx.append(session)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------------------------ a collector of traces

def run_collector(port: int) -> None:
    """OTLP/HTTP's traces path, answering every export with success without decoding it."""
    async def export(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")  # an empty ExportTraceServiceResponse

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/traces", export)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------------------------ the router process

def report_as_a_worker(publisher) -> None:
    """Each report encoded as a router worker's feed client encodes it (once, its records with it),
    then applied without its records: the in-process control plane's handling of them is not the
    router's cost."""
    import dataclasses

    from llmgw.contracts.feed import to_wire

    apply = publisher.apply_report

    async def applied(report, *args):
        json.dumps(to_wire(report), separators=(",", ":")).encode()
        return await apply(dataclasses.replace(report, requests=()), *args)
    publisher.apply_report = applied


async def run_router(port: int, engine_url: str, state_dir: str, profile: str | None,
                     request_timeout: float, routing: str = "least-outstanding", limits: bool = False,
                     request_log: str | None = None, request_log_path: str | None = None,
                     otlp: str | None = None) -> None:
    from prometheus_client import CollectorRegistry

    from llmgw.catalog import Catalog, CatalogHolder
    from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig, RequestLogConfig, TracingConfig
    from llmgw.contracts.feed import Limits
    from llmgw.control.feed import FeedPublisher
    from llmgw.keys import KeySettings, create_key
    from llmgw.localfeed import LocalFeed
    from llmgw.router import Endpoint, Router
    from llmgw.store import Store

    store = Store.open(Path(state_dir) / "state.db")
    # --limits: the key has every limit (and one for the model), each too high to refuse, so
    # every request is admitted, reserved, settled and answered with the x-ratelimit-* headers.
    high = Limits(rpm=10**9, tpm=10**12, concurrency=10**6) if limits else None
    settings = KeySettings(limits=high, model_limits={MODEL: high} if limits else None)
    _, secret = store.write_sync(lambda db: create_key(db, "bench", settings=settings))
    catalog = Catalog.build(file_models=[ModelConfig(name=MODEL, profile="p", routing=routing)],
                            profiles={"p": ProfileConfig(engine="vllm")})
    # Fed as `llmgw serve` feeds it: the publisher and the in-process feed.
    logged = RequestLogConfig(enabled=request_log != "off", path=request_log_path)
    publisher = FeedPublisher(CatalogHolder(catalog), store, GatewayConfig(
        request_timeout=request_timeout, request_log=logged, tracing=TracingConfig(otlp_endpoint=otlp)))
    publisher.set_endpoints({MODEL: [Endpoint("r1", MODEL, engine_url, ENGINE_KEY)]})
    publisher.mark_ready()
    report_as_a_worker(publisher)
    router = Router(registry=CollectorRegistry())
    feed = LocalFeed(publisher, router.feed)
    feed.pump()
    feed.start()
    runner = router.runner()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    print("READY", secret, flush=True)
    await stop.wait()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    await runner.cleanup()
    await feed.close()
    await publisher.close()
    store.close()


# ------------------------------------------------------------------------------ the load generator

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Target:
    def __init__(self, name: str, url: str, key: str, pid: int):
        self.name, self.url, self.key, self.pid = name, url, key, pid
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def body(stream: bool, max_tokens: int = 8) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "one two three"}],
                       "stream": stream, "max_tokens": max_tokens}).encode()


async def one(session, target: Target, payload: bytes) -> tuple[float, float, int]:
    """(seconds to first body byte, seconds to the end, body bytes) of one request."""
    started = time.perf_counter()
    async with session.post(target.url + "/v1/chat/completions", data=payload, headers=target.headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {r.status}: {(await r.read())[:200]!r}")
        first = None
        size = 0
        while True:
            chunk = await r.content.readany()
            if first is None:
                first = time.perf_counter()
            if not chunk:
                break
            size += len(chunk)
    return first - started, time.perf_counter() - started, size


async def latency(session, target: Target, count: int, stream: bool) -> list[float]:
    for _ in range(20):  # warm up connections
        await one(session, target, body(stream))
    out = []
    payload = body(stream)
    for _ in range(count):
        ttfb, total, _ = await one(session, target, payload)
        out.append(ttfb if stream else total)
    return out


async def throughput(session, target: Target, concurrency: int, seconds: float, payload: bytes) -> dict:
    deadline = time.perf_counter() + seconds
    done = errors = 0

    async def worker():
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                await one(session, target, payload)
                done += 1
            except Exception:
                errors += 1

    user, system = cpu_times(target.pid)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    user_after, system_after = cpu_times(target.pid)
    return {"rps": done / elapsed, "requests": done, "errors": errors,
            "cpu": user_after - user + system_after - system, "system": system_after - system}


async def streams_at_once(session, target: Target, count: int, tokens: int) -> tuple[int, int, float]:
    async def stream():
        _, _, size = await one(session, target, body(True, tokens))
        return size

    started = time.perf_counter()
    results = await asyncio.gather(*(stream() for _ in range(count)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    complete = [r for r in results if not isinstance(r, BaseException)]
    return len(complete), len(errors), time.perf_counter() - started


def start_process(argv: list[str], env: dict | None = None, reads_stdout: bool = False) -> subprocess.Popen:
    # Output nobody reads goes to /dev/null: a full pipe would stall the engine double, which
    # logs a line per request.
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if reads_stdout else subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)


def wait_healthy_post(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            time.sleep(0.05)


def wait_healthy(url: str, timeout: float = 20.0) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            time.sleep(0.05)


# ------------------------------------------------------------------------------ the real vLLM

def start_vllm(args, work: Path) -> subprocess.Popen:
    """The real vLLM on a tiny model, with the argv and env of llmgw's built-in template."""
    sys.path.insert(0, str(ROOT))
    from llmgw.engines import BUILTIN_ENGINES, SHARD_DIR, ShardVars
    from tests.testbed import engines as real

    reason = real.missing("vllm")
    if reason is not None:
        raise SystemExit(reason)
    bin_dir = real.EXECUTABLES["vllm"].parent
    model = real.models()["chat"]
    port = free_port()
    variables = ShardVars(model=str(model), name=MODEL, host="127.0.0.1", port=port, gpus_per_node=0, nnodes=1,
                          node_rank=0, leader_addr="127.0.0.1", leader_port=0)
    spec = BUILTIN_ENGINES["vllm"].render(variables, ["--max-model-len", "1024"], real.VLLM_CPU_ENV, ENGINE_KEY)
    for name, text in spec.files.items():
        (work / name).write_text(text)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    env.update({k: v.replace(SHARD_DIR, str(work)) for k, v in spec.env.items()})
    with open(work / "vllm.log", "wb") as log:
        engine = subprocess.Popen(spec.argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    engine.url = f"http://127.0.0.1:{port}"
    print(f"vLLM starting (log {work / 'vllm.log'}) ...", flush=True)
    wait_healthy(engine.url + "/health", timeout=600)
    return engine


async def stream_timings(session, target: Target, payload: bytes) -> tuple[float, list[float], int]:
    """(seconds to the first content event, gaps between content events, events) of one stream."""
    started = time.perf_counter()
    arrivals = []
    events = 0
    async with session.post(target.url + "/v1/chat/completions", data=payload, headers=target.headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            if b'"content":"' in line and b'"content":""' not in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{target.name}: a stream without content")
    return arrivals[0] - started, [b - a for a, b in itertools.pairwise(arrivals)], events


def vllm_body(tokens: int, stream: bool = True) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "one two three"}],
                       "stream": stream, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                       "stream_options": {"include_usage": True} if stream else None}).encode()


async def bench_vllm(args) -> None:
    processes = []
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-vllm-"))
    try:
        engine = start_vllm(args, work)
        processes.append(engine)
        router_port, bare_port = free_port(), free_port()
        router = start_process([sys.executable, __file__, "_router", "--port", str(router_port), "--engine-url",
                                engine.url, "--state", str(work), "--request-timeout", str(args.request_timeout)],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), reads_stdout=True)
        processes.append(router)
        line = router.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit("the router did not start")
        bare = start_process([sys.executable, __file__, "_bare", "--port", str(bare_port), "--engine-url", engine.url])
        processes.append(bare)
        await asyncio.to_thread(wait_healthy_post, f"http://127.0.0.1:{bare_port}")
        targets = (Target("engine", engine.url, ENGINE_KEY, engine.pid),
                   Target("bare", f"http://127.0.0.1:{bare_port}", ENGINE_KEY, bare.pid),
                   Target("router", f"http://127.0.0.1:{router_port}", line[1], router.pid))
        tokens = args.stream_tokens
        payload = vllm_body(tokens)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            for _ in range(5):  # warm up: connections, and vLLM's first requests
                for target in targets:
                    await stream_timings(session, target, payload)
            ttft = {t.name: [] for t in targets}
            itl = {t.name: [] for t in targets}
            events = {t.name: 0 for t in targets}
            cpu = {t.name: 0.0 for t in targets[1:]}
            for _ in range(args.count):
                for target in targets:  # one by one, so that drift of the shared machine hits all alike
                    before = cpu_seconds(target.pid) if target.name in cpu else 0.0
                    first, gaps, count = await stream_timings(session, target, payload)
                    if target.name in cpu:
                        cpu[target.name] += cpu_seconds(target.pid) - before
                    ttft[target.name].append(first)
                    itl[target.name].append(sum(gaps) / len(gaps) if gaps else 0.0)
                    events[target.name] += count
            plain = vllm_body(1, stream=False)
            plain_cpu = {name: 0.0 for name in cpu}
            for _ in range(args.count):
                for target in targets[1:]:
                    before = cpu_seconds(target.pid)
                    await one(session, target, plain)
                    plain_cpu[target.name] += cpu_seconds(target.pid) - before

        per_request = {name: plain_cpu[name] / args.count for name in cpu}
        per_event = {name: (cpu[name] - args.count * per_request[name]) / max(events[name], 1) for name in cpu}
        rows = []
        for label, values in (("time to first token", ttft), ("inter-token latency", itl)):
            for q in (0.5, 0.99):
                ms = {name: percentile(v, q) * 1e3 for name, v in values.items()}
                rows.append((f"{label} p{int(q * 100)} (ms)", f"{ms['engine']:.3f}", f"{ms['bare']:.3f}",
                             f"{ms['router']:.3f}", f"{ms['router'] - ms['engine']:+.3f} ({ms['router'] - ms['bare']:+.3f} bare)"))
        rows.append(("events per stream", *(f"{events[n] / args.count:.1f}" for n in events), ""))
        rows.append(("CPU per request, 1 token (ms)", "", f"{per_request['bare'] * 1e3:.3f}",
                     f"{per_request['router'] * 1e3:.3f}", f"x{per_request['router'] / per_request['bare']:.2f} bare"))
        rows.append(("CPU per streamed event (µs)", "", f"{per_event['bare'] * 1e6:.1f}",
                     f"{per_event['router'] * 1e6:.1f}", f"x{per_event['router'] / per_event['bare']:.2f} bare"))
        width = max(len(r[0]) for r in rows)
        print(f"\nengine: real vLLM (tiny random Llama, CPU); {os.cpu_count()} CPUs; {args.count} streams of "
              f"{tokens} tokens per target, alternating engine / bare proxy / router, then {args.count} plain "
              "1-token requests each; inter-token latency is each stream's mean gap between content events")
        print("CPU is the serving process's user+system time (all threads) during its own requests;"
              " per event = (stream CPU - streams x CPU per plain request) / events\n")
        print(f"{'':{width}}  {'engine':>10}  {'bare proxy':>10}  {'router':>10}  {'router vs engine (vs bare)':>28}")
        for name, a, b, c, d in rows:
            print(f"{name:{width}}  {a:>10}  {b:>10}  {c:>10}  {d:>28}")
        added_ttft = (percentile(ttft["router"], 0.5) - percentile(ttft["engine"], 0.5)) * 1e3
        added_itl = (percentile(itl["router"], 0.5) - percentile(itl["engine"], 0.5)) * 1e3
        print("\nagainst TARGETS.md (router, everything on):")
        for label, value, target, unit in (
                ("added time to first token p50", added_ttft, TARGETS["added_ttft_p50_ms"], "ms"),
                ("added inter-token latency p50", added_itl, TARGETS["added_itl_p50_ms"], "ms"),
                ("CPU per streamed event", per_event["router"] * 1e6, TARGETS["cpu_per_event_us"], "µs")):
            print(f"  {label:30} {value:8.3f} {unit}  target <= {target:g} {unit}  {'met' if value <= target else 'MISSED'}")
    finally:
        for process in reversed(processes):
            try:
                os.killpg(process.pid, signal.SIGTERM) if process is processes[0] else process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL) if process is processes[0] else process.kill()


def start_router(engine_url: str, args, *extra: str) -> tuple[subprocess.Popen, str]:
    """A router process over `engine_url`; returns it and the bench key's secret."""
    state = tempfile.mkdtemp(prefix="llmgw-bench-")
    argv = [sys.executable, __file__, "_router", "--port", str(free_port()), "--engine-url", engine_url,
            "--state", state, "--request-timeout", str(args.request_timeout), *extra]
    router = start_process(argv, env=dict(os.environ, PYTHONPATH=str(ROOT)), reads_stdout=True)
    line = router.stdout.readline().split()
    if not line or line[0] != "READY":
        raise SystemExit("the router did not start")
    router.port = int(argv[argv.index("--port") + 1])
    return router, line[1]


async def bench_request_log(args) -> None:
    """Routers with the request log off, on, and on with a file, in turns, against the bare proxy."""
    log_file = Path(tempfile.mkdtemp(prefix="llmgw-bench-reqlog-")) / "requests.jsonl"

    async def written() -> None:
        await asyncio.sleep(1)  # the file's writer flushes every 0.2 s: give it a moment, then count
        print(f"\nlines in the request log's file: {sum(1 for _ in open(log_file)) if log_file.exists() else 0}")

    await compare_routers(args, (("log off", ("--request-log", "off")), ("log on", ("--request-log", "on")),
                                 ("log on + file", ("--request-log", "on", "--request-log-path", str(log_file)))),
                          written)


async def bench_tracing(args) -> None:
    """A router with traces off and one exporting them to a collector, in turns, against the bare proxy."""
    collector_port = free_port()
    collector = start_process([sys.executable, __file__, "_collector", "--port", str(collector_port)])
    try:
        await asyncio.to_thread(wait_healthy_post, f"http://127.0.0.1:{collector_port}")
        await compare_routers(args, (("traces off", ()), ("traces on", ("--otlp", f"http://127.0.0.1:{collector_port}"))))
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=10)


async def compare_routers(args, variants, after=None) -> None:
    """Routers started with each variant's arguments, measured in turns (`--rounds`) against the
    bare proxy; the first variant is the baseline of the ratios. `after()` reports more, at the end."""
    processes = []
    baseline = variants[0][0]
    try:
        engine_port = free_port()
        engine = start_process([sys.executable, __file__, "_engine", "--port", str(engine_port),
                                "--token-delay", str(args.token_delay)])
        processes.append(engine)
        engine_url = f"http://127.0.0.1:{engine_port}"
        wait_healthy(engine_url + "/health")
        bare_port = free_port()
        bare = start_process([sys.executable, __file__, "_bare", "--port", str(bare_port), "--engine-url", engine_url])
        processes.append(bare)
        await asyncio.to_thread(wait_healthy_post, f"http://127.0.0.1:{bare_port}")
        targets = [Target("bare", f"http://127.0.0.1:{bare_port}", ENGINE_KEY, bare.pid)]
        for name, extra in variants:
            router, secret = start_router(engine_url, args, *extra)
            processes.append(router)
            targets.append(Target(name, f"http://127.0.0.1:{router.port}", secret, router.pid))
        tokens = args.stream_tokens
        kinds = (("CPU per request (ms)", body(False), 1e3), (f"CPU per stream of {tokens} (ms)", body(True, tokens), 1e3))
        figures = {kind: {t.name: [] for t in targets} for kind, _, _ in kinds}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            for target in targets:  # warm up: connections, imports, the first records and file
                for _ in range(200):
                    await one(session, target, body(False))
            for round_ in range(args.rounds):
                order = targets[round_ % len(targets):] + targets[:round_ % len(targets)]
                for kind, payload, _ in kinds:
                    for target in order:
                        run = await throughput(session, target, 16, args.seconds, payload)
                        if run["errors"]:
                            raise SystemExit(f"{target.name}: {run['errors']} errors")
                        figures[kind][target.name].append(run["cpu"] / max(run["requests"], 1))
                print(f"round {round_ + 1}/{args.rounds}: " + "; ".join(
                    f"{name} {values[-1] * 1e3:.3f}" for name, values in figures[kinds[0][0]].items()), flush=True)

        names = [t.name for t in targets]
        width = max(len(kind) for kind, _, _ in kinds) + 10
        print(f"\nengine: aiohttp (token delay {args.token_delay * 1e3:g} ms); {os.cpu_count()} CPUs; "
              f"{args.rounds} rounds, each {args.seconds:g} s per router and kind at concurrency 16, in turns")
        print("CPU is the serving process's user+system time (all threads), median over the rounds;"
              f" ratio: median of each round's ratio to the {baseline}\n")
        print(f"{'':{width}}" + "".join(f"  {n:>14}" for n in names))
        for kind, _, scale in kinds:
            per = figures[kind]
            print(f"{kind:{width}}" + "".join(f"  {statistics.median(per[n]) * scale:>14.3f}" for n in names))
            ratios = {n: statistics.median(a / b for a, b in zip(per[n], per[baseline])) for n in names}
            print(f"{'  vs ' + baseline:{width}}" + "".join(f"  {'x%.3f' % ratios[n]:>14}" for n in names))
            added = {n: statistics.median(a - b for a, b in zip(per[n], per[baseline])) * 1e6 for n in names}
            print(f"{'  minus ' + baseline + ' (µs)':{width}}" + "".join(f"  {added[n]:>+14.1f}" for n in names))
            spread = {n: (min(per[n]) * scale, max(per[n]) * scale) for n in names}
            print(f"{'  range':{width}}" + "".join(f"  {'%.3f-%.3f' % spread[n]:>14}" for n in names))
        if after is not None:
            await after()
    finally:
        _stop(processes)


def _stop(processes: list) -> None:
    """SIGTERM the bench's processes, newest first; kill those not gone within 10 s."""
    for process in reversed(processes):
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


async def bench(args) -> None:
    if args.engine == "vllm":
        await bench_vllm(args)
        return
    if args.request_log:
        await bench_request_log(args)
        return
    if args.tracing:
        await bench_tracing(args)
        return
    processes = []
    try:
        engine_port = free_port()
        if args.engine == "aiohttp":
            engine = start_process([sys.executable, __file__, "_engine", "--port", str(engine_port),
                                    "--token-delay", str(args.token_delay)])
        else:
            env = dict(os.environ, VLLM_API_KEY=ENGINE_KEY, PYTHONPATH=str(DOUBLES),
                       ENGINE_DOUBLE_TOKEN_DELAY=str(args.token_delay))
            engine = start_process([sys.executable, "-c", "import engine_double; engine_double.entry_point('vllm', None)",
                                    "serve", "/weights/m", "--served-model-name", MODEL, "--host", "127.0.0.1",
                                    "--port", str(engine_port)], env=env)
        processes.append(engine)
        engine_url = f"http://127.0.0.1:{engine_port}"
        wait_healthy(engine_url + "/health")

        router_port = free_port()
        state = tempfile.mkdtemp(prefix="llmgw-bench-")
        router_argv = [sys.executable, __file__, "_router", "--port", str(router_port), "--engine-url", engine_url,
                       "--state", state, "--request-timeout", str(args.request_timeout), "--routing", args.routing,
                       *(["--limits"] if args.limits else [])]
        if args.profile:
            router_argv += ["--profile", args.profile]
        router = start_process(router_argv, env=dict(os.environ, PYTHONPATH=str(ROOT)), reads_stdout=True)
        processes.append(router)
        line = router.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit("the router did not start")
        bare_port = free_port()
        bare = start_process([sys.executable, __file__, "_bare", "--port", str(bare_port), "--engine-url", engine_url])
        processes.append(bare)
        bare_url = f"http://127.0.0.1:{bare_port}"
        await asyncio.to_thread(wait_healthy_post, bare_url)
        direct = Target("engine", engine_url, ENGINE_KEY, engine.pid)
        floor = Target("bare", bare_url, ENGINE_KEY, bare.pid)
        routed = Target("router", f"http://127.0.0.1:{router_port}", line[1], router.pid)

        targets = (direct, floor, routed)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            rows = []
            lat = {t.name: await latency(session, t, args.count, stream=False) for t in targets}
            ttft = {t.name: await latency(session, t, args.count, stream=True) for t in targets}
            for label, values in (("latency, 1 client", lat), ("time to first token, 1 client", ttft)):
                for q in (0.5, 0.99):
                    ms = {name: percentile(v, q) * 1e3 for name, v in values.items()}
                    rows.append((f"{label} p{int(q * 100)} (ms)", f"{ms['engine']:.3f}", f"{ms['bare']:.3f}",
                                 f"{ms['router']:.3f}", f"{ms['router'] - ms['engine']:+.3f}"))
            added_p50 = percentile(lat["router"], 0.5) - percentile(lat["engine"], 0.5)
            added_ttft = percentile(ttft["router"], 0.5) - percentile(ttft["engine"], 0.5)

            # The throughput runs in rounds, the targets in turns (the order rotated every round):
            # a noisy neighbour then weighs on each target alike, and each ratio is the median of
            # the rounds' ratios.
            tokens = args.stream_tokens
            kinds = [(c, body(False)) for c in (1, 16, 64)] + [("stream", body(True, tokens))]
            runs = {kind: {t.name: [] for t in targets} for kind, _ in kinds}
            for round_ in range(args.rounds):
                order = targets[round_ % len(targets):] + targets[:round_ % len(targets)]
                for kind, payload in kinds:
                    for target in order:
                        runs[kind][target.name].append(
                            await throughput(session, target, 16 if kind == "stream" else kind, args.seconds, payload))

            def median(kind, name, figure):
                return statistics.median(figure(r) for r in runs[kind][name])

            def ratio(kind, figure, of="router", to="bare"):
                return statistics.median(figure(a) / figure(b) for a, b in zip(runs[kind][of], runs[kind][to]))

            def cpu(r):
                return r["cpu"] / max(r["requests"], 1)

            def rps(r):
                return r["rps"]

            def sys_share(r):
                return r["system"] / max(r["cpu"], 1e-9)

            names = [t.name for t in targets]
            cpu_per_request, ratios = {}, {}
            for concurrency in (1, 16, 64):
                cpu_per_request[concurrency] = {n: median(concurrency, n, cpu) for n in names}
                ratios[concurrency] = ratio(concurrency, cpu)
                rows.append((f"requests/s, concurrency {concurrency}",
                             *(f"{median(concurrency, n, rps):.0f}" for n in names),
                             f"x{ratio(concurrency, rps, to='engine'):.2f}"))
                rows.append((f"  CPU per request, c={concurrency} (ms)",
                             *(f"{cpu_per_request[concurrency][n] * 1e3:.3f}" for n in names),
                             f"x{ratios[concurrency]:.2f} bare, {median(concurrency, 'router', sys_share):.0%} sys"))
                errors = {n: sum(r["errors"] for r in runs[concurrency][n]) for n in names}
                if any(errors.values()):
                    rows.append(("  errors", *(str(e) for e in errors.values()), ""))

            # events per stream: the tokens, [DONE], and for the router the usage event it strips;
            # per event: a stream's CPU less a plain request's (c=16, same round), over its events
            events = {"engine": tokens + 1, "bare": tokens + 1, "router": tokens + 2}
            per_events = {n: [(r["cpu"] - r["requests"] * cpu(plain)) / max(r["requests"] * events[n], 1)
                              for r, plain in zip(runs["stream"][n], runs[16][n])] for n in names}
            per_event = {n: statistics.median(v) for n, v in per_events.items()}
            ratios["event"] = statistics.median(a / b for a, b in zip(per_events["router"], per_events["bare"]))
            rows.append((f"streams/s ({tokens} events each), c=16", *(f"{median('stream', n, rps):.0f}" for n in names),
                         f"x{ratio('stream', rps, to='engine'):.2f}"))
            rows.append(("  CPU per stream (ms)", *(f"{median('stream', n, cpu) * 1e3:.3f}" for n in names),
                         f"x{ratio('stream', cpu):.2f} bare, {median('stream', 'router', sys_share):.0%} sys"))
            rows.append(("  CPU per streamed event (µs)", *(f"{v * 1e6:.1f}" for v in per_event.values()),
                         f"x{ratios['event']:.2f} bare"))

            complete, errors, took = await streams_at_once(session, routed, 256, 50)
            rows.append(("256 concurrent streams via router", "", "", f"{complete} ok, {errors} err", f"{took:.2f} s"))

        width = max(len(r[0]) for r in rows)
        print(f"\nengine: {args.engine} (token delay {args.token_delay * 1e3:g} ms); {os.cpu_count()} CPUs; "
              f"{args.count} sequential requests per latency row; throughput rows: {args.rounds} rounds of "
              f"{args.seconds:g} s per target, in turns, medians")
        print("CPU is the serving process's user+system time (all threads) over the run, per request or event;"
              " per event = (stream CPU - requests x CPU per plain request) / events;\n"
              "a ratio to the bare proxy is the median of the rounds' ratios\n")
        print(f"{'':{width}}  {'engine':>10}  {'bare proxy':>10}  {'router':>14}  {'router vs engine':>16}")
        for name, a, b, c, d in rows:
            print(f"{name:{width}}  {a:>10}  {b:>10}  {c:>14}  {d:>16}")
        print("\nagainst TARGETS.md (router, everything on):")
        for label, value, floor_value, ratio_value, target, unit in (
                ("added latency p50", added_p50 * 1e3, None, None, TARGETS["added_p50_ms"], "ms"),
                ("added time to first token p50", added_ttft * 1e3, None, None, TARGETS["added_ttft_p50_ms"], "ms"),
                ("CPU per request (c=16)", cpu_per_request[16]["router"] * 1e3, cpu_per_request[16]["bare"] * 1e3,
                 ratios[16], TARGETS["cpu_per_request_ms"], "ms"),
                ("CPU per streamed event", per_event["router"] * 1e6, per_event["bare"] * 1e6, ratios["event"],
                 TARGETS["cpu_per_event_us"], "µs")):
            verdict = "met" if value <= target else "MISSED"
            floor_text = f" (bare proxy {floor_value:.3f}, ratio x{ratio_value:.2f})" if floor_value else ""
            print(f"  {label:30} {value:8.3f} {unit}  target <= {target:g} {unit}  {verdict}{floor_text}")
        print(f"\nrouter CPU vs the bare proxy, median of the rounds' ratios: per request x{ratios[1]:.2f} (c=1), "
              f"x{ratios[16]:.2f} (c=16), x{ratios[64]:.2f} (c=64); per streamed event x{ratios['event']:.2f}")
    finally:
        _stop(processes)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        parser = argparse.ArgumentParser()
        parser.add_argument("_engine")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--token-delay", type=float, default=0.0)
        args = parser.parse_args()
        run_aiohttp_engine(args.port, args.token_delay)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_bare":
        parser = argparse.ArgumentParser()
        parser.add_argument("_bare")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--engine-url", required=True)
        args = parser.parse_args()
        run_bare_proxy(args.port, args.engine_url)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_router":
        parser = argparse.ArgumentParser()
        parser.add_argument("_router")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--engine-url", required=True)
        parser.add_argument("--state", required=True)
        parser.add_argument("--profile")
        parser.add_argument("--request-timeout", type=float, default=600.0)
        parser.add_argument("--routing", default="least-outstanding")
        parser.add_argument("--limits", action="store_true")
        parser.add_argument("--request-log", choices=["off", "on"])
        parser.add_argument("--request-log-path")
        parser.add_argument("--otlp")
        args = parser.parse_args()
        asyncio.run(run_router(args.port, args.engine_url, args.state, args.profile, args.request_timeout,
                               args.routing, args.limits, args.request_log, args.request_log_path, args.otlp))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_collector":
        parser = argparse.ArgumentParser()
        parser.add_argument("_collector")
        parser.add_argument("--port", type=int, required=True)
        run_collector(parser.parse_args().port)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["aiohttp", "double", "vllm"], default="aiohttp")
    parser.add_argument("--count", type=int, default=None,
                        help="sequential requests per latency measurement (500; 100 streams with --engine vllm)")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput run")
    parser.add_argument("--token-delay", type=float, default=0.001,
                        help="seconds between streamed events (so that each arrives on its own)")
    parser.add_argument("--stream-tokens", type=int, default=None, help="events per stream (64; 32 with vllm)")
    parser.add_argument("--profile", help="write a cProfile of the router process to this file")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="the router's gateway.request_timeout (an engine silent this long is a 504)")
    parser.add_argument("--routing", choices=["least-outstanding", "prefix"], default="least-outstanding",
                        help="the model's routing policy (prefix: every request's affinity key is hashed)")
    parser.add_argument("--limits", action="store_true",
                        help="the bench key has rpm, tpm and concurrency limits, and a per-model one, all too "
                             "high to refuse: the cost of enforcing them (R-6.16)")
    parser.add_argument("--request-log", action="store_true",
                        help="compare routers with the request log off, on, and on with a file (R-6.20)")
    parser.add_argument("--tracing", action="store_true",
                        help="compare a router with traces off and one exporting them to a collector (R-6.21)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the throughput runs, targets in turns (3; 5 for --request-log and --tracing)")
    args = parser.parse_args()
    real = args.engine == "vllm"
    args.count = args.count or (100 if real else 500)
    args.stream_tokens = args.stream_tokens or (32 if real else 64)
    args.rounds = args.rounds or (5 if args.request_log or args.tracing else 3)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
