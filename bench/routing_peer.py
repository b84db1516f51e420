"""Prefix routing measured with a client llmgw did not write: vLLM's own `vllm bench serve`.

Two real vLLM engines (the suite's CPU build, scripts/engines) on loopback ports, each with a KV
cache of 10,240 tokens (`--block-size 32 --num-gpu-blocks-override 320`), are one model's static
endpoints behind `llmgw serve`. `vllm bench serve` from the same vLLM build sends `/v1/completions`
streams to the router, 8 at a time, on two datasets:

- `prefix_repetition`: 16 prefixes of 1,024 tokens, each prompt a prefix and a 64-token suffix,
  8 output tokens, 320 prompts. 16 prefixes are 16,384 tokens, more than one engine's cache and
  less than the two caches together: a policy blind to the cache sends every prefix to both
  engines and each evicts what the other half would need; one that keeps each prefix on one
  engine fits. The best hit rate is about 0.89 (each prefix's first request misses; the
  suffixes never hit).
- `random`: prompts of 1,088 random tokens, nothing shared: prefix routing must cost nothing here.

For each dataset, each policy (least-outstanding, prefix) and each router shape (one router with
one worker, one router with two workers, two routers: serve's own and a second `llmgw router`
fed over the admin listener, the client's connections spread over both by a round-robin TCP relay
in this script), the engines' prefix caches are emptied (`POST /reset_prefix_cache`, on with
VLLM_SERVER_DEV_MODE) and the bench runs once. Printed per row: the engines' own prefix-cache hit
rate (deltas of vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), the share of the
requests each engine got, preemptions, TTFT mean / p50 / p90 and requests/s as `vllm bench serve`
measured them, the CPU time llmgw's processes (serve, routers, workers) used per request, and each
row's ratios to least-outstanding's in the same shape.

    .venv/bin/python bench/routing_peer.py [--prompts 320] [--datasets prefix_repetition,random]
        [--shapes 1,2w,2r] [--policies least-outstanding,prefix] [--repeat N]

On two cores shared by the client, llmgw and both engines, two runs of one row differ by 10-20 %
in throughput and TTFT; `--repeat N` runs each row N times, the policies' order alternating, and
prints the medians and each row's spread, so that a ratio is read against the noise.

Needs the real vLLM (./scripts/engines); about 5 minutes here per repeat, most of it the bench runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.gateway import GatewayProcess, free_port, wait_for  # noqa: E402
from tests.testbed import engines as real  # noqa: E402

MODEL = "peer"
BLOCK_SIZE = 32
BLOCKS = 320  # 10,240 tokens of KV cache per engine
PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 16, 1024, 64, 8
CONCURRENCY = 8
POLICIES = ("least-outstanding", "prefix")
SHAPES = {"1": "1 router, 1 worker", "2w": "1 router, 2 workers", "2r": "2 routers"}
ENGINE_START = 900.0


def _get(url: str, key: str | None = None, timeout: float = 10) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _post(url: str, key: str, timeout: float = 30) -> int:
    request = urllib.request.Request(url, data=b"", method="POST", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def engine_counters(url: str) -> dict[str, float]:
    """The engine's counters this bench reads, summed over their labels."""
    found: dict[str, float] = {}
    for name, value in _SAMPLE.findall(_get(url + "/metrics").decode()):
        if name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
                    "vllm:request_success_total"):
            found[name] = found.get(name, 0.0) + float(value)
    return found


class Engine:
    """One real vLLM on a loopback port, with its own key and the bench's KV cache size."""

    def __init__(self, index: int, model_dir: Path, key: str, logs: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.log_path = logs / f"engine-{index}.log"
        argv = [str(real.EXECUTABLES["vllm"]), "serve", str(model_dir), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048",
                "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(BLOCKS),
                "--enable-prefix-caching"]
        env = {**os.environ, **real.VLLM_CPU_ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key,
               "PYTHONPATH": ""}
        self.proc = subprocess.Popen(argv, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {self.proc.returncode}; its log: {self.log_path}")
        try:
            _get(self.url + "/health", timeout=2)
            return True
        except OSError:
            return False

    def reset(self) -> None:
        _post(self.url + "/reset_prefix_cache", self.key)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Relay:
    """A round-robin TCP relay: each client connection goes to the next address in turn, so a
    client's keep-alive connections are spread over two routers."""

    def __init__(self, targets: list[tuple[str, int]]):
        self.targets = targets
        self.port = free_port()
        self._turn = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def pipe(reader, writer):
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def handle(reader, writer):
            host, port = self.targets[self._turn % len(self.targets)]
            self._turn += 1
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def main():
            self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            self._ready.set()

        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def inventory(path: Path, engines: list[Engine], policy: str) -> Path:
    lines = ["models:", f"  - name: {MODEL}", f"    routing: {policy}", "    endpoints:"]
    for engine in engines:
        lines += [f"      - url: {engine.url}", "        api_key_env: PEER_ENGINE_KEY"]
    path.write_text("\n".join(lines) + "\n")
    return path


def ctl(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(gateway.state_dir), *args],
                          capture_output=True, text=True, env=gateway.env, timeout=60, check=True)


def second_router(gateway: GatewayProcess, work: Path) -> tuple[subprocess.Popen, int]:
    credential = ctl(gateway, "routers", "add", "edge").stdout.strip()
    path = work / "edge.credential"
    path.write_text(credential + "\n")
    path.chmod(0o600)
    port = free_port()
    argv = [sys.executable, "-m", "llmgw.cli.main", "router", "--control", f"http://127.0.0.1:{gateway.admin_port}",
            "--credential-file", str(path), "--listen", f"127.0.0.1:{port}", "--state-dir", str(work / "edge")]
    proc = subprocess.Popen(argv, stdout=open(work / "edge.log", "ab"), stderr=subprocess.STDOUT, env=gateway.env,
                            start_new_session=True)
    return proc, port


def answers(url: str, key: str) -> bool:
    try:
        data = json.loads(_get(url + "/v1/models", key, timeout=5))
    except (OSError, ValueError):
        return False
    return any(m.get("id") == MODEL for m in data.get("data", []))


def bench_serve(base_url: str, key: str, dataset: str, prompts: int, tokenizer: Path, out: Path,
                seed: int) -> dict:
    argv = [str(real.EXECUTABLES["vllm"]), "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tokenizer),
            "--num-prompts", str(prompts), "--max-concurrency", str(CONCURRENCY), "--seed", str(seed),
            "--percentile-metrics", "ttft", "--metric-percentiles", "50,90", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
            "--ready-check-timeout-sec", "0"]
    if dataset == "prefix_repetition":
        argv += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX_LEN),
                 "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
                 "--prefix-repetition-num-prefixes", str(PREFIXES),
                 "--prefix-repetition-output-len", str(OUTPUT_LEN)]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(PREFIX_LEN + SUFFIX_LEN),
                 "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "0"]
    env = {**os.environ, **real.VLLM_CPU_ENV, "OPENAI_API_KEY": key, "PYTHONPATH": ""}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("completed") != prompts:
        raise RuntimeError(f"vllm bench serve completed {result.get('completed')} of {prompts}: "
                           f"{(result.get('errors') or [''])[:3]}")
    return result


def run_row(engines: list[Engine], dataset: str, policy: str, shape: str, prompts: int, tokenizer: Path,
            work: Path, seed: int) -> dict:
    row_dir = Path(tempfile.mkdtemp(prefix=f"{dataset}-{policy}-{shape}-", dir=work))
    workers = 2 if shape == "2w" else 1
    gateway = GatewayProcess(inventory(row_dir / "inventory.yaml", engines, policy), row_dir / "state",
                             env={"PEER_ENGINE_KEY": engines[0].key}, workers=workers)
    gateway.start()
    edge = relay = None
    try:
        key = gateway.create_key("bench")
        wait_for(lambda: answers(gateway.url, key), 60, "the router to know the bench's key and model")
        base_url = gateway.url
        if shape == "2r":
            edge, port = second_router(gateway, row_dir)
            wait_for(lambda: answers(f"http://127.0.0.1:{port}", key), 60, "the second router fed")
            relay = Relay([("127.0.0.1", gateway.port), ("127.0.0.1", port)])
            base_url = f"http://127.0.0.1:{relay.port}"
        for engine in engines:
            engine.reset()
        before = [engine_counters(e.url) for e in engines]
        cpu_before = llmgw_cpu_seconds()
        result = bench_serve(base_url, key, dataset, prompts, tokenizer, row_dir / "result.json", seed)
        cpu = llmgw_cpu_seconds() - cpu_before
        after = [engine_counters(e.url) for e in engines]
    finally:
        if relay is not None:
            relay.close()
        if edge is not None:
            edge.terminate()
            edge.wait(30)
        gateway.stop()

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    hits = sum(delta("vllm:prefix_cache_hits_total", i) for i in range(len(engines)))
    queries = sum(delta("vllm:prefix_cache_queries_total", i) for i in range(len(engines)))
    served = [delta("vllm:request_success_total", i) for i in range(len(engines))]
    return {"dataset": dataset, "policy": policy, "shape": shape,
            "hit_rate": hits / queries if queries else None,
            "engine_hit_rates": [delta("vllm:prefix_cache_hits_total", i) / delta("vllm:prefix_cache_queries_total", i)
                                 if delta("vllm:prefix_cache_queries_total", i) else None for i in range(len(engines))],
            "served": served, "preemptions": sum(delta("vllm:num_preemptions_total", i) for i in range(len(engines))),
            "ttft_mean": result["mean_ttft_ms"], "ttft_p50": result["median_ttft_ms"],
            "ttft_p90": result.get("p90_ttft_ms"), "rps": result["request_throughput"],
            "llmgw_cpu_ms": 1000 * cpu / prompts}


_TICKS = os.sysconf("SC_CLK_TCK")


def llmgw_cpu_seconds() -> float:
    """CPU time used so far by every llmgw process on this machine but this one (serve, the
    router supervisor, its workers, a second router): a row's are the only ones running."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes()
            if b"llmgw.cli.main" not in cmdline and b"llmgw.router.worker" not in cmdline:
                continue
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'dataset':<18} {'shape':<20} {'policy':<18} {'hit rate':>8} {'per engine':>13} {'requests':>9} "
          f"{'preempt':>7} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'req/s':>6} {'llmgw CPU':>9}  vs least-outstanding")
    base = {(r["dataset"], r["shape"]): r for r in rows if r["policy"] == "least-outstanding"}
    for r in rows:
        per = "/".join(_fmt(h, ".2f") for h in r["engine_hit_rates"])
        split = "/".join(f"{s:.0f}" for s in r["served"])
        line = (f"{r['dataset']:<18} {SHAPES[r['shape']]:<20} {r['policy']:<18} {_fmt(r['hit_rate'], '.3f'):>8} "
                f"{per:>13} {split:>9} {r['preemptions']:>7.0f} {r['ttft_mean']:>7.0f}ms {r['ttft_p50']:>5.0f}ms "
                f"{_fmt(r['ttft_p90'], '.0f'):>5}ms {r['rps']:>6.1f} {r['llmgw_cpu_ms']:>5.1f}ms/r")
        other = base.get((r["dataset"], r["shape"]))
        if other is not None and other is not r:
            ratios = []
            if r["hit_rate"] is not None and other["hit_rate"]:
                ratios.append(f"hit {r['hit_rate'] / other['hit_rate']:.2f}x")
            ratios.append(f"p50 {r['ttft_p50'] / other['ttft_p50']:.2f}x")
            ratios.append(f"mean {r['ttft_mean'] / other['ttft_mean']:.2f}x")
            ratios.append(f"req/s {r['rps'] / other['rps']:.2f}x")
            line += "  " + ", ".join(ratios)
        print(line)
    one = {(r["dataset"], r["policy"]): r for r in rows if r["shape"] == "1"}
    for r in rows:
        first = one.get((r["dataset"], r["policy"]))
        if r["shape"] != "1" and r["policy"] == "prefix" and first is not None and first["hit_rate"] and r["hit_rate"]:
            print(f"{r['dataset']}, prefix, {SHAPES[r['shape']]}: hit rate {r['hit_rate'] / first['hit_rate']:.2f}x "
                  f"one router's")


_FIGURES = ("hit_rate", "preemptions", "ttft_mean", "ttft_p50", "ttft_p90", "rps", "llmgw_cpu_ms")


def medians(rows: list[dict]) -> list[dict]:
    """One row per dataset, shape and policy: the median of each figure over its runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["shape"], r["policy"]), []).append(r)
    out = []
    for (dataset, shape, policy), runs in groups.items():
        row = {"dataset": dataset, "shape": shape, "policy": policy}
        for name in _FIGURES:
            values = [r[name] for r in runs if r[name] is not None]
            row[name] = statistics.median(values) if values else None
        middle = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]  # the run of the median throughput
        row["engine_hit_rates"], row["served"] = middle["engine_hit_rates"], middle["served"]
        out.append(row)
    return out


def print_spread(rows: list[dict]) -> None:
    """How far a row's runs are apart: what a ratio between two policies has to beat."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["shape"], r["policy"]), []).append(r)
    print(f"\nmedians of {max(len(runs) for runs in groups.values())} runs each; the spread of each row's runs "
          "(lowest-highest):")
    for (dataset, shape, policy), runs in groups.items():
        rps = sorted(r["rps"] for r in runs)
        p50 = sorted(r["ttft_p50"] for r in runs)
        hits = sorted(r["hit_rate"] for r in runs if r["hit_rate"] is not None)
        print(f"  {dataset:<18} {SHAPES[shape]:<20} {policy:<18} req/s {rps[0]:.1f}-{rps[-1]:.1f}, "
              f"TTFT p50 {p50[0]:.0f}-{p50[-1]:.0f} ms" + (f", hit rate {hits[0]:.3f}-{hits[-1]:.3f}" if hits else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=320)
    parser.add_argument("--datasets", default="prefix_repetition,random")
    parser.add_argument("--shapes", default="1,2w,2r")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each row this many times, the policies' order alternating, and print medians")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    reason = real.missing("vllm")
    if reason is not None:
        print(f"routing_peer: {reason}", file=sys.stderr)
        return 2
    model_dir = real.models()["chat"]
    work = Path(tempfile.mkdtemp(prefix="llmgw-routing-peer-"))
    key = "sk-engine-" + secrets.token_hex(16)
    engines: list[Engine] = []
    rows: list[dict] = []
    try:
        began = time.monotonic()
        engines = [Engine(i, model_dir, key, work) for i in range(2)]
        wait_for(lambda: all(e.healthy() for e in engines), ENGINE_START, "both vLLM engines to start", interval=1)
        print(f"two vLLM engines up in {time.monotonic() - began:.0f} s ({BLOCKS} blocks of {BLOCK_SIZE} tokens "
              f"each); logs in {work}", flush=True)
        policies = args.policies.split(",")
        for dataset in args.datasets.split(","):
            for shape in args.shapes.split(","):
                for turn in range(args.repeat):
                    # Every other turn in the other order: a drift of the machine over a shape's
                    # runs then weighs on both policies alike.
                    for policy in policies if turn % 2 == 0 else policies[::-1]:
                        began = time.monotonic()
                        row = run_row(engines, dataset, policy, shape, args.prompts, model_dir, work, args.seed)
                        rows.append(row)
                        print(f"  {dataset} / {SHAPES[shape]} / {policy}: hit rate {_fmt(row['hit_rate'], '.3f')}, "
                              f"TTFT p50 {row['ttft_p50']:.0f} ms, {row['rps']:.1f} req/s, llmgw CPU "
                              f"{row['llmgw_cpu_ms']:.1f} ms/request ({time.monotonic() - began:.0f} s)", flush=True)
    finally:
        for engine in engines:
            engine.stop()
        if rows:
            print_table(medians(rows) if args.repeat > 1 else rows)
            if args.repeat > 1:
                print_spread(rows)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
