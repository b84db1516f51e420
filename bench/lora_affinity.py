"""LoRA adapters loaded on demand (R-8.8): requests over N adapters on two real vLLM replicas,
routed to the replicas that hold their adapter (llmgw) against balanced by load alone.

Two testbed nodes (real sshd hosts, tests/testbed) with the real vLLM, an `llmgw serve` over them
and a base model with two replicas (wherever the placer puts them: every engine shares this
machine's cores anyway), whose profile holds `--max-adapters` (2 by default) adapters per
replica; N adapters (4 by default: twice what one replica holds, as many as both hold
together), none preloaded, all of them the suite's lora-a and lora-b published under N names.
The same requests (each naming an adapter drawn with a fixed seed, a short streamed completion,
`--concurrency` at a time) are sent twice, on the same two engines, each time from no adapter
loaded:

- AFFINITY ON: through llmgw's router with the official openai client. A request whose adapter no
  replica holds waits while the control plane loads it on one; later ones go where it is held.
- AFFINITY OFF: straight to the engines, each request to the replica with the fewest requests in
  flight (this process's own count), the adapter loaded there first when that engine does not
  hold it, making room as llmgw does (its least recently used adapter with nothing in flight
  unloaded first): what a router that balances adapters by load alone must do.

Reported per row: adapter loads and unloads (ON: the control plane's counters; OFF: the calls this
process made), time to first token p50/p90 as the client sees it (a wait for a load included) and
requests/s; then the ratios. Between the rows every loaded adapter is unloaded from both engines
and llmgw learns it from their /v1/models. About 4 minutes on 2 cores, most of it starting the
two engines. Needs root and the engines environment (scripts/engines).

    sudo .venv/bin/python bench/lora_affinity.py [--adapters 4] [--requests 200] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NODES = ("cpu1", "cpu2")
BASE = "tiny-base"
START_TIMEOUT = 400.0
PROMPT = "Tell me about the weather in a few words"


def engine_call(url: str, key: str, path: str, body: dict | None = None):
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        text = answer.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def held(url: str, key: str) -> list[str]:
    return sorted(m["id"] for m in engine_call(url, key, "/v1/models")["data"] if m.get("parent"))


def counts(gateway) -> tuple[int, int]:
    status, answer = gateway.admin("/api/models")
    assert status == 200, answer
    [base] = [m for m in answer["models"] if m["name"] == BASE]
    return sum(a["loads"] for a in base["adapters"]), sum(a["unloads"] for a in base["adapters"])


def summary(ttfts: list[float], seconds: float, failures: list[str]) -> dict:
    ordered = sorted(ttfts)
    pick = (lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000) if ordered else (lambda q: None)
    return {"requests": len(ttfts), "failures": failures, "seconds": seconds, "p50": pick(0.5), "p90": pick(0.9),
            "rps": len(ttfts) / seconds if seconds else None}


async def through_router(asks: list[str], url: str, key: str, concurrency: int) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    slots = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    failures: list[str] = []

    async def send(adapter: str) -> None:
        async with slots:
            began = time.monotonic()
            try:
                stream = await client.completions.create(model=adapter, prompt=PROMPT, max_tokens=8, stream=True)
                first = None
                async for _ in stream:
                    first = first or time.monotonic()
                ttfts.append((first or time.monotonic()) - began)
            except openai.APIError as exc:
                failures.append(f"{adapter}: {exc}")
    began = time.monotonic()
    await asyncio.gather(*(send(a) for a in asks))
    return summary(ttfts, time.monotonic() - began, failures)


async def balanced(asks: list[str], engines: list[tuple[str, str]], paths: dict[str, str], capacity: int,
                   concurrency: int) -> tuple[dict, int, int]:
    """AFFINITY OFF: each request to the engine with the fewest in flight, loading its adapter there
    first when needed (one load or unload at a time per engine, as llmgw does)."""
    import aiohttp
    slots = asyncio.Semaphore(concurrency)
    inflight = [0] * len(engines)
    loaded: list[dict[str, float]] = [{} for _ in engines]  # engine -> adapter -> last use
    using: list[dict[str, int]] = [{} for _ in engines]
    locks = [asyncio.Lock() for _ in engines]
    ttfts: list[float] = []
    failures: list[str] = []
    made = {"loads": 0, "unloads": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def post(index: int, path: str, body: dict) -> None:
            url, key = engines[index]
            async with session.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
                text = await answer.text()
                if answer.status != 200:
                    raise RuntimeError(f"{path} {body}: {answer.status} {text[:200]}")

        async def ensure(index: int, adapter: str) -> None:
            async with locks[index]:
                if adapter in loaded[index]:
                    return
                if len(loaded[index]) >= capacity:
                    idle = [(last, name) for name, last in loaded[index].items() if not using[index].get(name)]
                    if not idle:
                        raise RuntimeError("every adapter of the engine is in use")
                    victim = min(idle)[1]
                    await post(index, "/v1/unload_lora_adapter", {"lora_name": victim})
                    del loaded[index][victim]
                    made["unloads"] += 1
                await post(index, "/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": paths[adapter]})
                loaded[index][adapter] = time.monotonic()
                made["loads"] += 1

        async def send(adapter: str) -> None:
            async with slots:
                index = min(range(len(engines)), key=lambda i: inflight[i])
                inflight[index] += 1
                using[index][adapter] = using[index].get(adapter, 0) + 1
                began = time.monotonic()
                try:
                    await ensure(index, adapter)
                    loaded[index][adapter] = time.monotonic()
                    url, key = engines[index]
                    body = {"model": adapter, "prompt": PROMPT, "max_tokens": 8, "stream": True}
                    async with session.post(url + "/v1/completions", json=body,
                                            headers={"Authorization": f"Bearer {key}"}) as answer:
                        if answer.status != 200:
                            raise RuntimeError(f"{answer.status} {(await answer.text())[:200]}")
                        first = None
                        async for _ in answer.content:
                            first = first or time.monotonic()
                    ttfts.append((first or time.monotonic()) - began)
                except Exception as exc:  # noqa: BLE001 - a failed request is reported, not fatal
                    failures.append(f"{adapter}: {exc}")
                finally:
                    inflight[index] -= 1
                    using[index][adapter] -= 1
        began = time.monotonic()
        await asyncio.gather(*(send(a) for a in asks))
    return summary(ttfts, time.monotonic() - began, failures), made["loads"], made["unloads"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-adapters", type=int, default=2, help="adapters one replica holds (the profile's)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    options = parser.parse_args()

    from tests.integration import real_engines as rt
    from tests.integration.gateway import wait_for
    from tests.testbed import NodeSpec, Testbed
    from tests.testbed import engines as real

    real.require("vllm")
    made = real.models()

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # SIGTERM too stops the gateway and removes the testbed (finally below)
    signal.signal(signal.SIGTERM, interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-lora-"))
    bed = Testbed([NodeSpec(name, engines="real", mem_gb=16, models_mb=64, cache_mb=64, tmp_mb=256)
                   for name in NODES]).start()
    gateway = None
    try:
        weights = rt.publish_hf_dir(bed, "tiny/chat", made["chat"])
        names = [f"tenant-{i}" for i in range(options.adapters)]
        models = [{"name": BASE, "profile": "vllm-lora", "weights": weights, "scaling": {"min": 2}}]
        for i, name in enumerate(names):
            models.append({"name": name, "base": BASE,
                           "adapter": rt.publish_hf_dir(bed, f"tiny/{name}", made["lora-a" if i % 2 else "lora-b"])})
        profiles = {"vllm-lora": {"engine": "vllm", "env": dict(real.VLLM_CPU_ENV), "max_adapters": options.max_adapters,
                                  "max_lora_rank": 8, "start_timeout": f"{START_TIMEOUT:.0f}s"}}
        began = time.monotonic()
        gateway = rt.start_gateway(bed, tmp, models=models, profiles=profiles)
        replicas = rt.wait_serving(gateway, BASE, START_TIMEOUT + 60, count=2)
        print(f"two replicas of {BASE} serving after {time.monotonic() - began:.0f} s on "
              f"{sorted(r['shards'][0]['node'] for r in replicas)}", flush=True)
        import sqlite3
        with sqlite3.connect(gateway.state_dir / "state.db") as db:
            keys = dict(db.execute("SELECT id, api_key FROM replicas").fetchall())
        engines = [(f"http://{bed.node(r['shards'][0]['node']).address}:{r['shards'][0]['port']}", keys[r["id"]])
                   for r in replicas]
        for url, key in engines:  # the first request of an engine pays one-off costs
            engine_call(url, key, "/v1/completions", {"model": BASE, "prompt": PROMPT, "max_tokens": 2})
        draw = random.Random(7)
        asks = [draw.choice(names) for _ in range(options.requests)]
        _, client_key = rt.new_client(gateway, "bench-lora")

        loads0, unloads0 = counts(gateway)
        on = asyncio.run(through_router(asks, gateway.url + "/v1", client_key, options.concurrency))
        loads1, unloads1 = counts(gateway)
        on["loads"], on["unloads"] = loads1 - loads0, unloads1 - unloads0
        # Where llmgw loaded them: the paths the engines list, for the OFF row's loads.
        paths = {}
        for url, key in engines:
            for card in engine_call(url, key, "/v1/models")["data"]:
                if card.get("parent"):
                    paths[card["id"]] = card["root"]
        for url, key in engines:  # from no adapter loaded again
            for name in held(url, key):
                engine_call(url, key, "/v1/unload_lora_adapter", {"lora_name": name})
        wait_for(lambda: not any(r["adapters"] for r in rt.serving(gateway, BASE)), 30,
                 "llmgw to learn that the engines hold no adapter")
        missing = sorted(set(names) - set(paths))
        if missing:
            print(f"adapters llmgw did not load (no path for the OFF row): {missing}")
            asks = [a for a in asks if a in paths]
        off, loads, unloads = asyncio.run(balanced(asks, engines, paths, options.max_adapters, options.concurrency))
        off["loads"], off["unloads"] = loads, unloads

        print(f"\n{options.requests} requests over {options.adapters} adapters, 2 replicas holding "
              f"{options.max_adapters} each, {options.concurrency} at a time:")
        print(f"{'':14} {'loads':>6} {'unloads':>8} {'TTFT p50 ms':>12} {'p90 ms':>8} {'req/s':>7} {'failed':>7}")
        for label, row in (("affinity on", on), ("affinity off", off)):
            print(f"{label:14} {row['loads']:>6} {row['unloads']:>8} {row['p50']:>12.1f} {row['p90']:>8.1f} "
                  f"{row['rps']:>7.2f} {len(row['failures']):>7}")
        print(f"ratios off / on: loads x{off['loads'] / max(on['loads'], 1):.1f}, "
              f"TTFT p50 x{off['p50'] / on['p50']:.2f}, p90 x{off['p90'] / on['p90']:.2f}")
        for row in (on, off):
            for failure in row["failures"][:5]:
                print("  failed:", failure)
        return 0
    finally:
        if gateway is not None:
            gateway.stop()
        bed.close()


if __name__ == "__main__":
    sys.exit(main())
