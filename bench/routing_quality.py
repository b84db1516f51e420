"""Routing quality: least-outstanding against prefix affinity, side by side on the same requests.

Two parts, one run:

1. SIMULATION of a fleet of 16 replicas (no engine runs): each simulated engine models a prefix
   cache of token blocks (16 tokens a block, chained hashes as vLLM's, LRU, a bounded number of
   blocks) and a cost per prompt token it has not cached, a cost per output token, and a few
   requests served at once. The router's real `Balancer` and affinity key choose the replica;
   time is simulated (events in order), so the figures do not depend on this machine's load.
   Reported: prefix-cache hit rate (cached prompt tokens / prompt tokens), TTFT p50/p90, and load
   imbalance (max / mean requests in flight over replicas, sampled at each arrival).

2. REAL vLLM (with --vllm URL,URL --key KEY): two running vLLM engines, the same shared-prefix
   workload sent for real (streamed chat completions), the replica chosen by the same Balancer
   and affinity key in this process. Reported: the engines' own prefix-cache hit rate (deltas of
   vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), TTFT p50/p90, completed
   requests/s.

Workloads:
  shared  several tenants, each with a long system prompt shared by all its conversations; each
          conversation is several turns, each turn resending the whole history;
  unique  one-turn requests with no prefix in common (no regression expected from prefix routing).

    .venv/bin/python bench/routing_quality.py --quick
    .venv/bin/python bench/routing_quality.py --vllm http://127.0.0.1:8001,http://127.0.0.1:8002 --key K

The two engines for the real part, each started as (port 8001, then 8002; the tiny model of
/opt/llmgw-engines/models; a KV cache of 160 blocks of 32 tokens, so that a replica holds a few
conversations and not the whole workload, as a loaded production engine does):

    VLLM_API_KEY=K VLLM_CPU_KVCACHE_SPACE=1 VLLM_TARGET_DEVICE=cpu \
      /opt/llmgw-engines/vllm-0.32.0/bin/vllm serve MODEL_DIR --served-model-name chat \
      --host 127.0.0.1 --port 8001 --max-model-len 2048 --block-size 32 --num-gpu-blocks-override 160

They run on this machine; the replica is chosen in this process by the router's own Balancer
and affinity key, and requests go straight to the engines (the router's own cost is
bench/router_overhead.py's, with --routing prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.router.affinity import affinity_key  # noqa: E402
from llmgw.router.balancer import LEAST_OUTSTANDING, PREFIX, PREFIX_BOUND, Balancer  # noqa: E402
from llmgw.contracts.endpoints import Endpoint  # noqa: E402

POLICIES = (LEAST_OUTSTANDING, PREFIX)
TENANTS = 32
CONVERSATION_RATE = 6.0
UNIQUE_RATE = 20.0
BLOCK = 16


# -- workloads -----------------------------------------------------------------------------------

@dataclass
class Message:
    role: str
    text: str
    tokens: int


@dataclass
class Request:
    at: float  # arrival, seconds from the start
    messages: list[Message]
    output: int
    conversation: int = -1
    turn: int = 0

    def document(self) -> dict:
        return {"model": "m", "messages": [{"role": m.role, "content": m.text} for m in self.messages]}

    def token_ids(self) -> list[int]:
        ids = []
        for m in self.messages:
            seed = int.from_bytes(hashlib.blake2b(m.text.encode(), digest_size=8).digest(), "big")
            ids.extend((seed + i) & 0xFFFFFFFF for i in range(m.tokens))
        return ids


def words(rng: random.Random, count: int, tag: str) -> str:
    return tag + " " + " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


def shared_workload(rng: random.Random, tenants: int, conversations: int, turns: int, system_tokens: int,
                    rate: float, gap: float) -> list[Request]:
    """`conversations` per tenant start at `rate` a second; each next turn comes `gap` s later."""
    systems = [Message("system", words(rng, 40, f"tenant {t} system prompt"), system_tokens) for t in range(tenants)]
    requests, start = [], 0.0
    for c in range(tenants * conversations):
        start += rng.expovariate(rate)
        history = [systems[c % tenants]]
        for turn in range(turns):
            history = [*history, Message("user", words(rng, 12, f"conversation {c} turn {turn}"), 80)]
            requests.append(Request(start + turn * gap, list(history), 40, c, turn))
            history = [*history, Message("assistant", words(rng, 8, f"answer {c} {turn}"), 40)]
    return sorted(requests, key=lambda r: r.at)


def unique_workload(rng: random.Random, count: int, prompt_tokens: int, rate: float) -> list[Request]:
    requests, at = [], 0.0
    for i in range(count):
        at += rng.expovariate(rate)
        requests.append(Request(at, [Message("user", words(rng, 30, f"unrelated request {i}"), prompt_tokens)], 40))
    return requests


# -- the simulation -------------------------------------------------------------------------------

@dataclass
class SimEngine:
    """SIMULATED engine: a prefix cache of token blocks (LRU) and costs per token; `slots` at once."""

    blocks: int
    prefill_per_token: float
    decode_per_token: float
    slots: int
    cache: OrderedDict = field(default_factory=OrderedDict)
    free_at: list[float] = field(default_factory=list)
    queries: int = 0
    hits: int = 0

    def __post_init__(self):
        self.free_at = [0.0] * self.slots

    def serve(self, ids: list[int], output: int, now: float) -> tuple[float, float]:
        """(time of the first token, time of the end) for a prompt arriving at `now`."""
        hashes, parent = [], 0
        for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            parent = hash((parent, tuple(ids[i:i + BLOCK])))
            hashes.append(parent)
        cached = 0
        for h in hashes:
            if h not in self.cache:
                break
            cached += 1
        for h in hashes:  # every block of the prompt is now cached, most recent last
            self.cache[h] = True
            self.cache.move_to_end(h)
        while len(self.cache) > self.blocks:
            self.cache.popitem(last=False)
        hit_tokens = cached * BLOCK
        self.queries += len(ids)
        self.hits += hit_tokens
        slot = min(range(self.slots), key=self.free_at.__getitem__)
        start = max(now, self.free_at[slot])
        first = start + (len(ids) - hit_tokens) * self.prefill_per_token
        end = first + output * self.decode_per_token
        self.free_at[slot] = end
        return first, end


def simulate(requests: list[Request], policy: str, replicas: int, **engine) -> dict:
    balancer = Balancer()
    endpoints = [Endpoint(f"sim-{i}", "m", f"sim://{i}", None) for i in range(replicas)]
    balancer.replace({"m": endpoints}, {"m": policy})
    ups = {up.replica_id: up for up in balancer.endpoints("m")}
    engines = {rid: SimEngine(**engine) for rid in ups}
    ends: list[tuple[float, int, object]] = []
    ttfts, imbalance = [], []
    over_bound = 0
    for n, request in enumerate(requests):
        while ends and ends[0][0] <= request.at:
            _, _, up = heapq.heappop(ends)
            balancer.release(up)
        loads = [up.outstanding for up in ups.values()]
        total = sum(loads)
        if total:
            imbalance.append(max(loads) / (total / len(loads)))
        key = affinity_key(request.document(), {}) if policy == PREFIX else None
        up = balancer.acquire("m", request.at, key=key)
        # The bound in its own terms: the chosen replica, with this request, within
        # ceil(bound * (in flight + 1) / replicas) at the moment of the choice.
        over_bound += up.outstanding > math.ceil(PREFIX_BOUND * (total + 1) / len(loads))
        first, end = engines[up.replica_id].serve(request.token_ids(), request.output, request.at)
        ttfts.append(first - request.at)
        heapq.heappush(ends, (end, n, up))
    hits = sum(e.hits for e in engines.values())
    queries = sum(e.queries for e in engines.values())
    return {"hit_rate": hits / queries, "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "imbalance_mean": statistics.fmean(imbalance) if imbalance else None,
            "imbalance_p99": percentile(imbalance, 99) if imbalance else None, "over_bound": over_bound,
            "requests": len(requests)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def choice_cost(requests: list[Request], rounds: int = 3) -> float:
    """Microseconds per request of the prefix choice alone (key from a parsed body + acquire)."""
    balancer = Balancer()
    balancer.replace({"m": [Endpoint(f"r-{i}", "m", f"x://{i}", None) for i in range(16)]}, {"m": PREFIX})
    documents = [r.document() for r in requests[:2000]]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for document in documents:
            up = balancer.acquire("m", 1.0, key=affinity_key(document, {}))
            balancer.release(up)
        best = min(best, (time.perf_counter() - started) / len(documents) * 1e6)
    return best


# -- the real vLLM part ----------------------------------------------------------------------------

async def vllm_counters(session, url: str, key: str) -> tuple[float, float]:
    async with session.get(url + "/metrics", headers={"Authorization": "Bearer " + key}) as resp:
        text = await resp.text()
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.split()[-1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.split()[-1])
    return hits, queries


async def run_vllm(requests: list[Request], policy: str, urls: list[str], key: str, model: str,
                   concurrency: int) -> dict:
    """The requests sent for real, each message salted with the policy's name: the same shapes and
    lengths, and nothing either policy can take from the engines' caches of the other's run."""
    import aiohttp
    balancer = Balancer()
    balancer.replace({"m": [Endpoint(f"vllm-{i}", "m", url, key) for i, url in enumerate(urls)]}, {"m": policy})
    headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    ttfts: list[float] = []
    failures = 0
    async with aiohttp.ClientSession() as session:
        before = [await vllm_counters(session, url, key) for url in urls]
        # Turns of one conversation go in order; conversations run `concurrency` at a time.
        conversations: dict[int, list[Request]] = {}
        for request in requests:
            conversations.setdefault(request.conversation, []).append(request)
        queue = asyncio.Queue()
        for turns in conversations.values():
            queue.put_nowait(turns)

        async def worker():
            nonlocal failures
            while not queue.empty():
                for request in queue.get_nowait():
                    document = request.document()
                    for message in document["messages"]:
                        message["content"] = f"[{policy}] " + message["content"]
                    up = balancer.acquire("m", time.monotonic(),
                                          key=affinity_key(document, {}) if policy == PREFIX else None)
                    body = {**document, "model": model, "max_tokens": request.output, "stream": True,
                            "ignore_eos": True}
                    started = time.monotonic()
                    try:
                        async with session.post(up.endpoint.url + "/v1/chat/completions", json=body,
                                                headers=headers) as resp:
                            if resp.status != 200:
                                failures += 1
                                continue
                            first = None
                            async for _ in resp.content:
                                if first is None:
                                    first = time.monotonic() - started
                            ttfts.append(first)
                    finally:
                        balancer.release(up)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        after = [await vllm_counters(session, url, key) for url in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {"hit_rate": hits / queries if queries else None, "ttft_p50": percentile(ttfts, 50),
            "ttft_p90": percentile(ttfts, 90), "rps": len(ttfts) / elapsed, "failures": failures,
            "requests": len(ttfts)}


# -- output ----------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(title: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    print("  " + "policy".ljust(18) + "".join(label.rjust(14) for label, _, _ in columns))
    for policy, row in rows.items():
        print("  " + policy.ljust(18) + "".join(fmt(row.get(k), spec).rjust(14) for _, k, spec in columns))


def ratios(rows: dict[str, dict], keys: list[str]) -> str:
    base, other = rows[LEAST_OUTSTANDING], rows[PREFIX]
    parts = []
    for k in keys:
        if base.get(k):
            parts.append(f"{k} {other[k] / base[k]:.2f}x")
    return "prefix / least-outstanding: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller simulated workload")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--vllm", help="comma-separated base URLs of two running vLLM engines")
    parser.add_argument("--key", default="", help="their API key (sent as Authorization: Bearer)")
    parser.add_argument("--model", default="chat", help="the engines' served model name")
    parser.add_argument("--system-words", type=int, default=250,
                        help="real part: words of each tenant's system prompt (about 5 tokens each with the tiny model)")
    parser.add_argument("--tenants", type=int, default=4, help="real part: tenants (one system prompt each)")
    parser.add_argument("--concurrency", type=int, default=2, help="real part: conversations at a time")
    args = parser.parse_args()

    scale = 1 if args.quick else 3
    sim = {"blocks": 4096, "prefill_per_token": 0.0005, "decode_per_token": 0.02, "slots": 4}
    columns = [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"), ("TTFT p90 s", "ttft_p90", ".3f"),
               ("imbal mean", "imbalance_mean", ".2f"), ("imbal p99", "imbalance_p99", ".2f"),
               ("over bound", "over_bound", "d")]
    print("SIMULATION: 16 simulated engines with a block prefix cache (16-token blocks, LRU of "
          f"{sim['blocks']} blocks each, {sim['prefill_per_token'] * 1e3:.1f} ms per uncached prompt token, "
          f"{sim['decode_per_token'] * 1e3:.0f} ms per output token, {sim['slots']} requests at once); "
          f"routing by llmgw's Balancer, bound {PREFIX_BOUND}x the mean")
    rng = random.Random(args.seed)
    shared = shared_workload(rng, tenants=TENANTS, conversations=8 * scale, turns=4, system_tokens=2000,
                             rate=CONVERSATION_RATE, gap=8.0)
    unique = unique_workload(random.Random(args.seed + 1), 400 * scale, 2200, rate=UNIQUE_RATE)
    print(f"  shared: {TENANTS} tenants x {8 * scale} conversations x 4 turns = {len(shared)} requests, system "
          f"prompt 2000 tokens, +80 user / +40 answer tokens a turn, conversations start at {CONVERSATION_RATE}/s, "
          "a turn every 8 s")
    print(f"  unique: {len(unique)} one-turn requests of 2200 tokens with no common prefix, {UNIQUE_RATE}/s")
    rows = {policy: simulate(shared, policy, 16, **sim) for policy in POLICIES}
    table("simulated fleet, shared-prefix workload", rows, columns)
    print("  " + ratios(rows, ["hit_rate", "ttft_p50", "ttft_p90"]))
    rows = {policy: simulate(unique, policy, 16, **sim) for policy in POLICIES}
    table("simulated fleet, no-shared-prefix workload", rows, columns)
    print("  " + ratios(rows, ["ttft_p50", "ttft_p90"]))
    print(f"\nprefix choice in the router (affinity key + ring walk, 16 replicas): "
          f"{choice_cost(shared):.1f} us per request (best of 3)")

    if args.vllm:
        urls = [u.rstrip("/") for u in args.vllm.split(",")]
        rng = random.Random(args.seed + 2)
        real = shared_workload(rng, tenants=args.tenants, conversations=2 * scale, turns=3, system_tokens=0,
                               rate=1.0, gap=0.0)
        for request in real:  # the real engines tokenise the text: make the system prompts long
            system = request.messages[0]
            tenant = system.text.split()[1]
            system.text = words(random.Random(f"{args.seed}-{tenant}"), args.system_words, f"tenant {tenant} system prompt")
        print(f"\nREAL vLLM: {len(urls)} engines {urls}; shared workload: {args.tenants} tenants x {2 * scale} "
              "conversations x "
              f"3 turns (+12 user words, +40 output tokens a turn), system prompts of {args.system_words} words, "
              f"{args.concurrency} conversations at a time, streamed")
        rows = {}
        for policy in POLICIES:
            rows[policy] = asyncio.run(run_vllm(real, policy, urls, args.key, args.model,
                                                   concurrency=args.concurrency))
        table("real vLLM, shared-prefix workload (engines' own prefix-cache counters)", rows,
              [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"),
               ("TTFT p90 s", "ttft_p90", ".3f"), ("req/s", "rps", ".2f"), ("failures", "failures", "d")])
        print("  " + ratios(rows, ["hit_rate", "ttft_p50", "rps"]))
        print("  the policies run one after the other on the same engines, each with its own salted text: "
              "neither finds the other's prompts in cache")
    print(json.dumps({"quick": args.quick, "seed": args.seed}))


if __name__ == "__main__":
    main()
