"""Routing quality: least-outstanding against prefix affinity, side by side on the same requests.

Three parts, one run:

1. SIMULATION of a fleet of 16 replicas (no engine runs): each simulated engine models a prefix
   cache of token blocks (16 tokens a block, chained hashes as vLLM's, LRU, a bounded number of
   blocks) and a cost per prompt token it has not cached, a cost per output token, and a few
   requests served at once. The router's real `Balancer` and affinity key choose the replica;
   time is simulated (events in order), so the figures do not depend on this machine's load.
   Reported: prefix-cache hit rate (cached prompt tokens / prompt tokens), TTFT p50/p90, and load
   imbalance: at each arrival, just after the choice, max / mean of the requests in flight per
   replica (the new one counted), averaged over arrivals, beside the least any placement could
   give there (ceil(m / n) / (m / n)), at two loads (about 1 and about 4 requests in flight per
   replica, as measured and printed).

2. ENGINE DOUBLES (with --doubles): 16 engine double processes (tests/testbed/doubles) on loopback
   ports, in their SIMULATED prefix-cache mode (blocks of words, chained hashes, LRU, a prefill
   cost per uncached word, one prefill at a time per engine); each request is sent at its arrival
   time, streamed over HTTP, to the replica llmgw's Balancer picks. Wall-clock time on this
   machine: TTFT as the client sees it, the doubles' own hit counters (their /metrics), and the
   imbalance as in part 1. Each policy gets fresh doubles. About a minute.

3. REAL vLLM (with --fleet; root): two testbed nodes (real sshd hosts, tests/testbed) with the
   real vLLM, an `llmgw serve` over them, and for each policy in turn a model added at runtime
   with that `routing:` and two replicas, one on each node (the first node is cordoned while the
   second replica is placed); the requests go through llmgw's router with the official openai
   client, streamed. Each policy gets engines started for it, so neither finds the other's
   prompts in cache. Reported: the engines' own prefix-cache hit rate (deltas of
   vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, read from each engine's
   /metrics with its key), TTFT p50/p90, completed requests/s.

   Three rows through the router: least-outstanding; prefix with the key taken from the content (the system prompt
   alone, since it is over 1 KiB: every conversation of a tenant goes where the tenant's prompt
   is cached); prefix with each request's `prompt_cache_key` set to its tenant (the same
   grouping, told by the client). Then three rows that are not llmgw's router, to show what the
   load bound costs: the tenant keys placed by the bench's own Balancer on the ring of the
   replicas' ids with the bound at 1.25 (as the router, but on the bench's own counts in flight
   and no engine queue), at 1.5, and lifted (every request of a tenant to its replica, whatever
   the loads), each request sent straight to the engine it picked. About 10 minutes on 2 cores
   (longer while other work loads them), most of it starting 12 engines one after another.

   The KV cache is sized so that the cache matters, as on a loaded production engine: more
   tenants than one replica's cache holds, fewer than two replicas' caches hold between them.
   With the tiny model a word of the system prompt is about 4.8 tokens, so 250 words plus the
   chat template are about 1,200 tokens, 38 blocks of 32 tokens; 10 tenants are 375 blocks. Each
   engine gets 280 blocks (--num-gpu-blocks-override 280 --block-size 32: 8,960 tokens; the
   bench prints the engine's own "KV cache size" line), three quarters of the tenants' prompts.
   A request under way holds its whole prompt, up to about 1,520 tokens (48 blocks), and with 8
   requests at a time about 4 run on each engine. Sent to an engine that has its tenant's prompt
   cached, a request adds only its own turns (about 10 blocks); sent to one that has not, all
   48. Least-outstanding sends every tenant to both engines: each would need 375 blocks for the
   prompts alone, more than its 280. Keyed by tenant, a 5 / 5 split puts 190 blocks of prompts
   on each engine plus 4 x 10 for the turns under way, which fits, as 6 / 4 does (228 + 40);
   7 / 3 (266 + 40) does not. Hashing alone would split the keys by the replicas' ids, new in
   every run: over 200 random pairs of ids, 10 keys split 5 / 5 47 times, 6 / 4 83, 7 / 3 45,
   8 / 2 20, 9 / 1 4 and 10 / 0 once. The router's key bound (a new key's home has at most 1.1x
   the mean of the live keys, R-6.5b) splits them 5 / 5 whatever the ids. --max-model-len 2048
   is the tiny model's limit (max_position_embeddings).

   Printed for each policy, to show why it gets the hit rate it gets: per engine the requests,
   prompt tokens, prefix-cache hits and preemptions (its own /metrics); for prefix routing each
   tenant's home (as the router places it: its key's first request, in the workload's order),
   and the share of requests that went there ("on home"; the load bound sent the rest to the
   other replica); per tenant the engine each of its
   requests reached, from the engines' own logs (--enable-log-requests logs the id of every
   request, which the client sees in the stream); the share of prompt tokens found cached per
   turn (--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens). And the
   best possible hit rate of the workload: every request finding the longest prefix it shares
   with any earlier prompt in one cache that never evicts, in whole blocks, counted with the
   engine's own tokenizer and chat template.

   8 at a time, because with m requests in flight over two replicas the tight bound allows
   max(1.25 * m / 2, ceil(m / 2)) on one: up to m = 4 that is the even split, so a replica
   takes a second request of its keys only when the other holds as many; at m = 8 it may hold
   5 of the 8. The router's looser bound for an engine that reports nothing waiting (2x the
   mean: all 8 with two replicas) applies while vLLM runs everything it is given; the diagnostic
   rows use the tight bound or none.

   What limits the ratio to least-outstanding's hit rate: the printed best possible hit rate
   bounds every policy, so the ratio never exceeds it over least-outstanding's. Below that, the
   split of the keys and the load bound. The key bound splits the 10 tenants 5 / 5. The load
   bound: at 8 in flight a key's replica already holds 5 of the 7 other requests (binomially)
   about 23 % of the time when it has half of the traffic, more when its engine runs slower; the
   tight bound sends that request to the other replica, where its tenant's prompt is not cached,
   and caching it there evicts the prompts of the tenants that replica keeps. The router's rows
   have the looser bound while vLLM reports nothing waiting; the rows with the bench's own
   Balancer at bounds 1.25, 1.5 and none (no engine queue known to it) show what the tight bound
   costs, in hit rate and in TTFT and requests/s.

Workloads:
  shared  several tenants, each with a long system prompt shared by all its conversations; each
          conversation is several turns, each turn resending the whole history;
  unique  one-turn requests with no prefix in common (no regression expected from prefix routing).

    .venv/bin/python bench/routing_quality.py --quick [--doubles]
    sudo .venv/bin/python bench/routing_quality.py --fleet

The router's own cost with prefix hashing is bench/router_overhead.py's, with --routing prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import math
import random
import shutil
import signal
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.router.affinity import affinity_key  # noqa: E402
from llmgw.router.balancer import LEAST_OUTSTANDING, PREFIX, PREFIX_BOUND, Balancer, bound_capacity  # noqa: E402
from llmgw.contracts.endpoints import Endpoint  # noqa: E402

POLICIES = (LEAST_OUTSTANDING, PREFIX)
TENANT_KEY = "prefix, tenant key"  # prefix routing with each request's `prompt_cache_key` set to its tenant
# The real part only, not llmgw's router: the tenant keys placed by the bench's own Balancer with
# another load bound, each request sent straight to the engine (what the bound costs).
DIRECT = (("tenant key, bound 1.25, bench", PREFIX_BOUND), ("tenant key, bound 1.5, bench", 1.5),
          ("tenant key, no bound, bench", math.inf))
VARIANTS = ((LEAST_OUTSTANDING, LEAST_OUTSTANDING, False), (PREFIX, PREFIX, False), (TENANT_KEY, PREFIX, True))
TENANTS = 32
CONVERSATION_RATE = 3.5
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
    tenant: int = -1

    def document(self, tenant_key: bool = False) -> dict:
        document = {"model": "m", "messages": [{"role": m.role, "content": m.text} for m in self.messages]}
        if tenant_key:
            document["prompt_cache_key"] = f"tenant-{self.tenant}"
        return document

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
    systems = [Message("system", words(rng, 300, f"tenant {t} system prompt"), system_tokens) for t in range(tenants)]
    requests, start = [], 0.0
    for c in range(tenants * conversations):
        start += rng.expovariate(rate)
        history = [systems[c % tenants]]
        for turn in range(turns):
            history = [*history, Message("user", words(rng, 12, f"conversation {c} turn {turn}"), 80)]
            requests.append(Request(start + turn * gap, list(history), 40, c, turn, c % tenants))
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


def simulate(requests: list[Request], policy: str, replicas: int, tenant_key: bool = False, **engine) -> dict:
    balancer = Balancer()
    endpoints = [Endpoint(f"sim-{i}", "m", f"sim://{i}", None) for i in range(replicas)]
    balancer.replace({"m": endpoints}, {"m": policy})
    ups = {up.replica_id: up for up in balancer.endpoints("m")}
    engines = {rid: SimEngine(**engine) for rid in ups}
    ends: list[tuple[float, int, object]] = []
    ttfts, imbalance, floors, per_replica = [], [], [], []
    over_bound = over_capacity = 0
    for n, request in enumerate(requests):
        while ends and ends[0][0] <= request.at:
            _, _, up = heapq.heappop(ends)
            balancer.release(up)
        total = sum(up.outstanding for up in ups.values())
        key = affinity_key(request.document(tenant_key), {}, "bench") if policy == PREFIX else None
        up = balancer.acquire("m", request.at, key=key)
        # Sampled at each arrival, just after the choice: requests in flight per replica, this
        # one counted. The least max/mean any placement could have here is ceil(m / n) / (m / n).
        loads = [u.outstanding for u in ups.values()]
        placed, count = total + 1, len(loads)
        mean = placed / count
        imbalance.append(max(loads) / mean)
        floor = math.ceil(placed / count) / mean
        floors.append(floor)
        per_replica.append(mean)
        over_bound += max(loads) / mean > max(PREFIX_BOUND, floor) + 1e-9
        over_capacity += up.outstanding > bound_capacity(total, count) + 1e-9
        first, end = engines[up.replica_id].serve(request.token_ids(), request.output, request.at)
        ttfts.append(first - request.at)
        heapq.heappush(ends, (end, n, up))
    hits = sum(e.hits for e in engines.values())
    queries = sum(e.queries for e in engines.values())
    return {"hit_rate": hits / queries, "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "in_flight": statistics.fmean(per_replica), "imbalance_mean": statistics.fmean(imbalance),
            "imbalance_p99": percentile(imbalance, 99), "floor_mean": statistics.fmean(floors),
            "over_bound": over_bound / len(requests), "over_capacity": over_capacity, "requests": len(requests)}


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
            up = balancer.acquire("m", 1.0, key=affinity_key(document, {}, "bench"))
            balancer.release(up)
        best = min(best, (time.perf_counter() - started) / len(documents) * 1e6)
    return best


# -- engine doubles with the simulated prefix cache: 16 processes, real HTTP, wall-clock time ------

async def replay_on_doubles(requests: list[Request], policy: str, tenant_key: bool, doubles: list) -> dict:
    """Each request at its arrival time, to the replica llmgw's Balancer picks, streamed; TTFT is the
    time to the first content chunk as the client sees it."""
    import aiohttp

    from llmgw.router.engineload import parse_metrics
    balancer = Balancer()
    balancer.replace({"m": [d.endpoint(replica_id=f"double-{i}") for i, d in enumerate(doubles)]}, {"m": policy})
    ttfts: list[float] = []
    failures = 0
    loads: list[float] = []
    floors: list[float] = []
    in_flight: list[float] = []
    ups = balancer.endpoints("m")

    async def one(session: aiohttp.ClientSession, request: Request, begin: float) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, begin + request.at - time.monotonic()))
        document = request.document(tenant_key)
        key = affinity_key(document, {}, "bench") if policy == PREFIX else None
        up = balancer.acquire("m", time.monotonic(), key=key)
        counts = [u.outstanding for u in ups]  # this one counted, as in the simulation
        mean = sum(counts) / len(counts)
        loads.append(max(counts) / mean)
        floors.append(math.ceil(sum(counts) / len(counts)) / mean)
        in_flight.append(mean)
        sent = time.monotonic()
        try:
            body = {**document, "stream": True, "max_tokens": request.output}
            async with session.post(up.endpoint.url + "/v1/chat/completions", json=body, headers=up.headers) as answer:
                first = None
                async for line in answer.content:
                    if first is None and line.startswith(b"data: {") and b'"content":"' in line \
                            and b'"content":""' not in line:
                        first = time.monotonic()
                if answer.status != 200 or first is None:
                    failures += 1
                else:
                    ttfts.append(first - sent)
        except aiohttp.ClientError:
            failures += 1
        finally:
            balancer.release(up)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        begin = time.monotonic() + 0.2
        await asyncio.gather(*(one(session, r, begin) for r in requests))
        hits = queries = 0
        for double in doubles:
            async with session.get(double.url + "/metrics") as answer:
                load = parse_metrics(await answer.text())
            hits += load.prefix_hits
            queries += load.prefix_queries
    return {"hit_rate": hits / queries if queries else None, "ttft_p50": percentile(ttfts, 50),
            "ttft_p90": percentile(ttfts, 90), "in_flight": statistics.fmean(in_flight),
            "imbalance_mean": statistics.fmean(loads), "floor_mean": statistics.fmean(floors), "failures": failures}


def run_doubles(requests: list[Request], variants, knobs: dict, replicas: int = 16) -> dict[str, dict]:
    """Each variant on fresh doubles (the tests' own `Engines`), so that none finds another's prompts in cache."""
    import tempfile

    from tests.integration.test_router_support import Engines
    rows = {}
    with tempfile.TemporaryDirectory() as home:
        for label, policy, tenant_key in variants:
            engines = Engines(Path(home) / label.replace(" ", "-").replace(",", ""))
            try:
                doubles = [engines.start("m", **knobs) for _ in range(replicas)]
                rows[label] = asyncio.run(replay_on_doubles(requests, policy, tenant_key, doubles))
            finally:
                engines.close()
    return rows


# -- the real vLLM part: two replicas on two testbed nodes, through llmgw -----------------------------

FLEET_NODES = ("cpu1", "cpu2")
FLEET_START_TIMEOUT = 300.0  # a vLLM loading on a busy 2-core machine
FLEET_BLOCK = 32  # tokens per KV-cache block
FLEET_BLOCKS = 280  # per engine: 8,960 tokens, see the module docstring
FLEET_MAX_LEN = 2048  # the tiny model's max_position_embeddings


# What each engine is asked for, from its own /metrics: counters summed over their labels.
ENGINE_COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
                   "requests": "vllm:request_success_total", "prompt": "vllm:prompt_tokens_total",
                   "preempted": "vllm:num_preemptions_total"}


def engine_counters(url: str, key: str) -> dict[str, float]:
    """ENGINE_COUNTERS of one engine (tokens, requests, preemptions)."""
    import urllib.request
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer " + key})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    found = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for counter, metric in ENGINE_COUNTERS.items():
            if name == metric:
                found[counter] += float(line.split()[-1])
    return found


def engine_log(gateway, replica_id: str) -> str:
    """The whole log of a replica's engine (its start-up lines and one line per request it received)."""
    status, answer = gateway.admin(f"/api/replicas/{replica_id}/logs?lines=100000")
    assert status == 200, answer
    return "\n".join(answer["lines"])


def best_hit_rate(requests: list[Request], model_dir: Path, block: int) -> float | None:
    """The most any cache could give this workload, in the engine's own tokens: every request finds
    cached the longest prefix it shares with any earlier prompt (one cache, never evicting), in whole
    blocks and short of its last token, as vLLM counts; None when the tokenizer cannot run. Answers'
    own tokens are left out: the next turn resends the bench's fixed answer text, not what was generated."""
    import subprocess

    from tests.testbed import engines as real
    script = ("import json, sys\nfrom transformers import AutoTokenizer\n"
              "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
              "for line in sys.stdin:\n"
              "    ids = t.apply_chat_template(json.loads(line), add_generation_prompt=True, tokenize=True)\n"
              "    print(json.dumps(list(ids['input_ids'] if isinstance(ids, dict) or hasattr(ids, 'keys') else ids)))\n")
    lines = "".join(json.dumps(r.document()["messages"]) + "\n" for r in requests)
    done = subprocess.run([str(real.VLLM_PYTHON), "-c", script, str(model_dir)], input=lines, capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        print(f"  (no best possible hit rate: the tokenizer failed: {done.stderr.strip()[-300:]})")
        return None
    prompts = [tuple(json.loads(line)) for line in done.stdout.splitlines()]
    seen: set[tuple] = set()  # every whole-block prefix of every earlier prompt
    hits = total = 0
    for ids in prompts:
        cached = 0
        while cached + block <= len(ids) - 1 and ids[:cached + block] in seen:
            cached += block
        hits += cached
        total += len(ids)
        seen.update(ids[:end] for end in range(block, len(ids) + 1, block))
    return hits / total if total else None


def ring_homes(replica_ids: dict[str, str], requests: list[Request], tenant_key: bool) -> dict[int, str]:
    """tenant -> the node of its affinity key's home, placed as the router places it (the key's
    first request, in the workload's order, every replica idle): where prefix routing sends the
    tenant while loads stay within the bound."""
    balancer = Balancer()
    balancer.replace({"m": [Endpoint(rid, "m", f"x://{rid}", None) for rid in replica_ids]}, {"m": PREFIX})
    homes = {}
    for request in requests:
        if request.tenant not in homes:
            up = balancer.acquire("m", 0.0, key=affinity_key(request.document(tenant_key), {}, "bench"))
            balancer.release(up)
            homes[request.tenant] = replica_ids[up.replica_id]
    return dict(sorted(homes.items()))


def placements(answers: list[dict], logs: dict[str, str]) -> dict[int, dict[str, int]]:
    """tenant -> node -> requests, from the engines' own logs: each engine logs the id of every
    request it receives (--enable-log-requests), and the client saw that id in the stream."""
    found: dict[int, dict[str, int]] = {}
    for answer in answers:
        nodes = [node for node, text in logs.items() if answer["id"] and answer["id"] in text]
        node = nodes[0] if len(nodes) == 1 else "?"
        per = found.setdefault(answer["tenant"], {})
        per[node] = per.get(node, 0) + 1
    return dict(sorted(found.items()))


def fleet_engines(bed, gateway, name: str) -> list[tuple[str, str, str]]:
    """(node, engine URL, engine key) of each serving replica of `name`; the keys are read from the
    gateway's own state database, as the router holds them."""
    import sqlite3

    from tests.integration import real_engines as rt
    replicas = rt.serving(gateway, name)
    db = sqlite3.connect(gateway.state_dir / "state.db")
    try:
        keys = dict(db.execute("SELECT id, api_key FROM replicas").fetchall())
    finally:
        db.close()
    found = []
    for replica in replicas:
        shard = replica["shards"][0]
        found.append((shard["node"], f"http://{bed.node(shard['node']).address}:{shard['port']}", keys[replica["id"]]))
    return sorted(found)


def fleet_up(bed, gateway, name: str, policy: str, weights: str) -> list[tuple[str, str, str]]:
    """`name` added at runtime with `routing: policy`, one replica on each testbed node: the first
    replica is placed, its node cordoned while the model scales to two, then uncordoned."""
    from tests.integration import real_engines as rt
    definition = (f"name: {name}\nprofile: vllm-fleet\nweights: {weights}\nrouting: {policy}\n"
                  "scaling:\n  min: 1\n  max: 2\n  idle_timeout: 1h\n")
    status, answer = gateway.admin("/api/models", "POST", definition.encode())
    assert status == 201, answer
    first = rt.wait_serving(gateway, name, FLEET_START_TIMEOUT + 60)[0]["shards"][0]["node"]
    status, answer = gateway.admin(f"/api/nodes/{first}/admin", "POST", {"action": "cordon"})
    assert status == 200, answer
    status, answer = gateway.admin(f"/api/models/{name}/scale", "POST", {"min": 2, "max": 2})
    assert status == 200, answer
    rt.wait_serving(gateway, name, FLEET_START_TIMEOUT + 60, count=2)
    status, answer = gateway.admin(f"/api/nodes/{first}/admin", "POST", {"action": "uncordon"})
    assert status == 200, answer
    engines = fleet_engines(bed, gateway, name)
    assert sorted(node for node, _, _ in engines) == sorted(FLEET_NODES), engines
    return engines


def warm_up(engines, served: str) -> None:
    """One short request straight to each engine: its first request pays one-off costs."""
    import urllib.request
    for _, url, key in engines:
        body = json.dumps({"model": served, "messages": [{"role": "user", "content": "warm up"}],
                           "max_tokens": 2}).encode()
        request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                         headers={"Authorization": "Bearer " + key,
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()


async def through_router(requests: list[Request], base_url: str, key: str, model: str, concurrency: int,
                         tenant_key: bool = False, direct_to: list | None = None, bound: float = PREFIX_BOUND) -> dict:
    """The requests as streamed chat completions through llmgw's router with the official openai
    client, in their order, `concurrency` at a time; a turn is sent once its conversation's
    previous turn has been answered.

    With `direct_to` (the engines' (replica id, url, key)), not through the router but straight to
    the engine that this process's own Balancer picks by prefix with the load `bound` (infinite:
    every request of a key goes to the key's replica on the ring, whatever the loads)."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    direct = balancer = None
    if direct_to is not None:
        direct = {rid: openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=600)
                  for rid, url, k in direct_to}
        balancer = Balancer(prefix_bound=bound)
        balancer.replace({model: [Endpoint(rid, model, url, k) for rid, url, k in direct_to]}, {model: PREFIX})
    answered: dict[tuple[int, int], asyncio.Event] = {(r.conversation, r.turn): asyncio.Event() for r in requests}
    slots = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    prompt_tokens: list[int] = []
    failures: list[str] = []
    answers: list[dict] = []

    async def send(request: Request) -> None:
        answer = {"tenant": request.tenant, "conversation": request.conversation, "turn": request.turn,
                  "id": None, "prompt": None, "cached": None}
        answers.append(answer)
        up = None
        try:
            started = time.monotonic()
            first = None
            extra = {"ignore_eos": True}
            if tenant_key:
                extra["prompt_cache_key"] = f"tenant-{request.tenant}"
            target = client
            if balancer is not None:  # counted in flight until its answer ends, as the router does
                up = balancer.acquire(model, time.monotonic(), key=affinity_key(request.document(tenant_key), {}, "bench"))
                target = direct[up.replica_id]
            stream = await target.chat.completions.create(
                model=model, messages=request.document()["messages"], max_tokens=request.output,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
            async for chunk in stream:
                answer["id"] = answer["id"] or chunk.id
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic() - started
                if chunk.usage is not None:
                    prompt_tokens.append(chunk.usage.prompt_tokens)
                    answer["prompt"] = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    answer["cached"] = details.cached_tokens if details is not None else None
            if first is not None:
                ttfts.append(first)
        except openai.OpenAIError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            if up is not None:
                balancer.release(up)
            answered[(request.conversation, request.turn)].set()
            slots.release()

    async def dispatch() -> None:
        tasks = []
        for request in requests:
            if request.turn:
                await answered[(request.conversation, request.turn - 1)].wait()
            await slots.acquire()
            tasks.append(asyncio.create_task(send(request)))
        await asyncio.gather(*tasks)

    started = time.monotonic()
    await dispatch()
    elapsed = time.monotonic() - started
    await client.close()
    for other in (direct or {}).values():
        await other.close()
    return {"ttft_p50": percentile(ttfts, 50) if ttfts else None, "ttft_p90": percentile(ttfts, 90) if ttfts else None,
            "rps": len(ttfts) / elapsed, "failures": len(failures), "failure_reasons": failures[:3],
            "requests": len(ttfts), "prompt_tokens": statistics.fmean(prompt_tokens) if prompt_tokens else None,
            "seconds": elapsed, "answers": answers}


def run_fleet(requests: list[Request], concurrency: int, blocks: int = FLEET_BLOCKS) -> dict[str, dict]:
    """Both policies on two real vLLM replicas on two testbed nodes (real sshd hosts), one policy
    after the other, each on engines started fresh for it (no cache carried over)."""
    from tests.integration import real_engines as rt
    from tests.testbed import NodeSpec, Testbed
    from tests.testbed import engines as real

    real.require("vllm")
    made = real.models()

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # SIGTERM too stops the gateway and removes the testbed (finally below)
    signal.signal(signal.SIGTERM, interrupted)
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-routing-"))
    bed = Testbed([NodeSpec(name, engines="real", mem_gb=16, models_mb=32, cache_mb=64, tmp_mb=256)
                   for name in FLEET_NODES]).start()
    rows: dict[str, dict] = {}
    gateway = None
    try:
        weights = rt.publish_hf_dir(bed, "tiny/chat", made["chat"])
        # Each engine logs the id of every request it receives, and answers with the cached
        # prompt tokens in usage: which engine served each request, and what it found cached.
        args = ["--max-model-len", str(FLEET_MAX_LEN), "--block-size", str(FLEET_BLOCK),
                "--num-gpu-blocks-override", str(blocks), "--enable-log-requests",
                "--enable-prompt-tokens-details"]
        profiles = {"vllm-fleet": {"engine": "vllm", "env": dict(real.VLLM_CPU_ENV), "args": args,
                                   "start_timeout": f"{FLEET_START_TIMEOUT:.0f}s"}}
        gateway = rt.start_gateway(bed, tmp, models=[], profiles=profiles)
        bounds = dict(DIRECT)
        for label, policy, tenant_key in (*VARIANTS, *((label, PREFIX, True) for label, _ in DIRECT)):
            name = f"chat-{policy}" + ("-tenant-key" if tenant_key else "") + \
                (f"-direct-{list(bounds).index(label)}" if label in bounds else "")
            began = time.monotonic()
            engines = fleet_up(bed, gateway, name, policy, weights)
            print(f"  {name}: two replicas serving on {[node for node, _, _ in engines]} "
                  f"after {time.monotonic() - began:.0f} s", flush=True)
            nodes = {replica["id"]: replica["shards"][0]["node"] for replica in rt.serving(gateway, name)}
            for rid, node in sorted(nodes.items(), key=lambda item: item[1]):  # the engines' own word on their cache
                said = [line.split("] ", 1)[-1] for line in engine_log(gateway, rid).splitlines()
                        if "KV cache size" in line]
                print(f"    {node}: {said[-1] if said else 'no KV cache size in its log'}")
            if policy == PREFIX:
                homes = ring_homes(nodes, requests, tenant_key)
                print("    each tenant's home: " + ", ".join(
                    f"{node} {sorted(t for t, home in homes.items() if home == node)}" for node in sorted(FLEET_NODES)))
            warm_up(engines, name)
            by_node = {node: (url, k) for node, url, k in engines}
            direct_to = [(rid, *by_node[node]) for rid, node in nodes.items()] if label in bounds else None
            _, key = rt.new_client(gateway, f"bench-{name}")
            before = [engine_counters(url, k) for _, url, k in engines]
            row = asyncio.run(through_router(requests, gateway.url + "/v1", key, name, concurrency, tenant_key,
                                             direct_to, bounds.get(label, PREFIX_BOUND)))
            after = [engine_counters(url, k) for _, url, k in engines]
            delta = [{f: a[f] - b[f] for f in ENGINE_COUNTERS} for a, b in zip(after, before, strict=True)]
            queries = sum(d["queries"] for d in delta)
            row["hit_rate"] = sum(d["hits"] for d in delta) / queries if queries else None
            rows[label] = row
            print(f"  {name}: {row['requests']} answered in {row['seconds']:.0f} s, {row['failures']} failed "
                  f"{row['failure_reasons']}", flush=True)
            for (node, _, _), d in zip(engines, delta, strict=True):
                print(f"    {node}: {d['requests']:.0f} requests, {d['prompt']:.0f} prompt tokens, prefix cache "
                      f"{d['hits']:.0f} hit of {d['queries']:.0f} queried ("
                      f"{fmt(d['hits'] / d['queries'] if d['queries'] else None, '.3f')}), "
                      f"{d['preempted']:.0f} preempted")
            logs = {node: engine_log(gateway, rid) for rid, node in nodes.items()}
            placed = placements(row["answers"], logs)
            print("    requests per tenant per engine (engine logs): " + "; ".join(
                f"t{t} " + " ".join(f"{n} {c}" for n, c in sorted(per.items())) for t, per in placed.items()))
            if policy == PREFIX:  # the rest went elsewhere because the bound spilled them
                row["on_home"] = sum(per.get(homes[t], 0) for t, per in placed.items()) / len(row["answers"])
            answers = row.pop("answers")
            for turn in sorted({a["turn"] for a in answers}):
                these = [a for a in answers if a["turn"] == turn and a["prompt"] and a["cached"] is not None]
                if these:
                    print(f"    turn {turn}: {len(these)} requests, prompt {statistics.fmean(a['prompt'] for a in these):.0f} "
                          f"tokens, cached {sum(a['cached'] for a in these) / sum(a['prompt'] for a in these):.3f}")
            status, answer = gateway.admin(f"/api/models/{name}", "DELETE")
            assert status == 200, answer
            from tests.integration.gateway import wait_for
            wait_for(lambda name=name: not rt.replicas(gateway, name), 120, f"{name}'s replicas to stop")
    finally:
        if gateway is not None:
            gateway.stop()
        bed.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


# -- output ----------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(title: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    width = max(20, *(len(policy) + 2 for policy in rows))
    print("  " + "policy".ljust(width) + "".join(label.rjust(14) for label, _, _ in columns))
    for policy, row in rows.items():
        print("  " + policy.ljust(width) + "".join(fmt(row.get(k), spec).rjust(14) for _, k, spec in columns))


def ratios(rows: dict[str, dict], keys: list[str]) -> str:
    base = rows[LEAST_OUTSTANDING]
    lines = []
    for label, other in rows.items():
        if label == LEAST_OUTSTANDING:
            continue
        parts = [f"{k} {other[k] / base[k]:.2f}x" for k in keys if base.get(k) and other.get(k) is not None]
        lines.append(f"{label} / least-outstanding: " + ", ".join(parts))
    return "\n  ".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller simulated workload")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--doubles", action="store_true",
                        help="also 16 engine doubles with the simulated prefix cache, over HTTP in wall-clock time")
    parser.add_argument("--fleet", action="store_true",
                        help="also the real part: two vLLM replicas on two testbed nodes (root; several minutes)")
    parser.add_argument("--system-words", type=int, default=250,
                        help="real part: words of each tenant's system prompt (about 4.8 tokens each with the tiny model)")
    parser.add_argument("--tenants", type=int, default=10, help="real part: tenants (one system prompt each)")
    parser.add_argument("--conversations", type=int, default=6, help="real part: conversations per tenant")
    parser.add_argument("--blocks", type=int, default=FLEET_BLOCKS,
                        help=f"real part: KV-cache blocks of {FLEET_BLOCK} tokens per engine")
    parser.add_argument("--max-tokens", type=int, default=16, help="real part: output tokens a request")
    parser.add_argument("--concurrency", type=int, default=8, help="real part: requests at a time")
    args = parser.parse_args()

    scale = 1 if args.quick else 3
    sim = {"blocks": 4096, "prefill_per_token": 0.0005, "decode_per_token": 0.02, "slots": 8}
    columns = [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"), ("TTFT p90 s", "ttft_p90", ".3f"),
               ("in flight/r", "in_flight", ".2f"), ("imbal mean", "imbalance_mean", ".3f"),
               ("imbal p99", "imbalance_p99", ".2f"), ("least poss.", "floor_mean", ".3f"),
               ("over bound", "over_bound", ".1%"), ("over cap", "over_capacity", "d")]
    print("SIMULATION: 16 simulated engines with a block prefix cache (16-token blocks, LRU of "
          f"{sim['blocks']} blocks each, {sim['prefill_per_token'] * 1e3:.1f} ms per uncached prompt token, "
          f"{sim['decode_per_token'] * 1e3:.0f} ms per output token, {sim['slots']} requests at once); "
          f"routing by llmgw's Balancer, bound {PREFIX_BOUND}x the mean")
    print("  imbalance: at each arrival, just after the choice, max / mean of the requests in flight per "
          "replica (this one counted); 'imbal mean' is the mean over arrivals, 'in flight/r' the mean load per "
          "replica then, 'least poss.' the mean of ceil(m/n)/(m/n) (no placement can do better), 'over bound' "
          f"the arrivals where max/mean > max({PREFIX_BOUND}, ceil(m/n)/(m/n)) (requests that ended lowered the "
          "mean), 'over cap' the choices that put a replica over the bound")
    rng = random.Random(args.seed)
    # Conversations start at `rate` a second, 4 turns 8 s apart: about 1 and 4 requests in flight per
    # replica (printed as measured); the higher load has more conversations, so that most of the run
    # is at that load rather than ramping up to it.
    for label, rate, conversations in (("about 1 request in flight per replica", CONVERSATION_RATE, 8 * scale),
                                       ("about 4 requests in flight per replica", 16.0, 32 * scale)):
        shared = shared_workload(rng, tenants=TENANTS, conversations=conversations, turns=4, system_tokens=2000,
                                 rate=rate, gap=8.0)
        print(f"\n  shared, {label}: {TENANTS} tenants x {conversations} conversations x 4 turns = {len(shared)} "
              f"requests, system prompt 2000 tokens, +80 user / +40 answer tokens a turn, conversations start "
              f"at {rate:.1f}/s, a turn every 8 s")
        rows = {label: simulate(shared, policy, 16, tenant_key, **sim) for label, policy, tenant_key in VARIANTS}
        table(f"simulated fleet, shared-prefix workload, {label}", rows, columns)
        print("  " + ratios(rows, ["hit_rate", "ttft_p50", "ttft_p90", "imbalance_mean"]))
    unique = unique_workload(random.Random(args.seed + 1), 400 * scale, 2200, rate=UNIQUE_RATE)
    print(f"\n  unique: {len(unique)} one-turn requests of 2200 tokens with no common prefix, {UNIQUE_RATE}/s")
    rows = {policy: simulate(unique, policy, 16, **sim) for policy in POLICIES}
    table("simulated fleet, no-shared-prefix workload", rows, columns)
    print("  " + ratios(rows, ["ttft_p50", "ttft_p90", "imbalance_mean"]))
    print(f"\nprefix choice in the router (affinity key + ring walk, 16 replicas): "
          f"{choice_cost(shared):.1f} us per request (best of 3)")

    if args.doubles:
        knobs = {"prefix_cache_blocks": 160, "block_words": 16, "prefill_per_token": 0.001, "token_delay": 0.01}
        rng = random.Random(args.seed + 3)
        doubled = shared_workload(rng, tenants=TENANTS, conversations=4, turns=3, system_tokens=0, rate=4.0, gap=4.0)
        print(f"\nENGINE DOUBLES (SIMULATED prefix cache: {knobs['prefix_cache_blocks']} blocks of "
              f"{knobs['block_words']} words each, {knobs['prefill_per_token'] * 1e3:.0f} ms of prefill per uncached "
              f"word, one prefill at a time, {knobs['token_delay'] * 1e3:.0f} ms per streamed token), 16 processes "
              f"on loopback; {TENANTS} tenants x 4 conversations x 3 turns = {len(doubled)} requests, system "
              "prompts of 300 words, conversations start at 4/s, a turn every 4 s; wall-clock time on this machine")
        rows = run_doubles(doubled, VARIANTS, knobs)
        table("engine doubles x16, shared-prefix workload", rows,
              [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"), ("TTFT p90 s", "ttft_p90", ".3f"),
               ("in flight/r", "in_flight", ".2f"), ("imbal mean", "imbalance_mean", ".3f"),
               ("least poss.", "floor_mean", ".3f"), ("failures", "failures", "d")])
        print("  " + ratios(rows, ["hit_rate", "ttft_p50", "ttft_p90", "imbalance_mean"]))
        unique_doubled = unique_workload(random.Random(args.seed + 4), 200, 0, rate=8.0)
        for request in unique_doubled:
            request.messages[0].text = words(random.Random(request.at), 300, "unrelated")
        rows = run_doubles(unique_doubled, [(p, p, False) for p in POLICIES], knobs)
        table("engine doubles x16, no-shared-prefix workload", rows,
              [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"), ("TTFT p90 s", "ttft_p90", ".3f"),
               ("in flight/r", "in_flight", ".2f"), ("imbal mean", "imbalance_mean", ".3f"),
               ("least poss.", "floor_mean", ".3f"), ("failures", "failures", "d")])
        print("  " + ratios(rows, ["ttft_p50", "ttft_p90", "imbalance_mean"]))

    if args.fleet:
        rng = random.Random(args.seed + 2)
        # A conversation starts about every second and takes its next turn `tenants` seconds later:
        # between two turns of one conversation come those of the few conversations started
        # meanwhile, one of each tenant on average, as a user's think time lets other traffic in.
        fleet = shared_workload(rng, tenants=args.tenants, conversations=args.conversations, turns=3,
                                system_tokens=0, rate=1.0, gap=float(args.tenants))
        for request in fleet:  # the real engines tokenise the text: long system prompts, short answers
            system = request.messages[0]
            tenant = system.text.split()[1]
            system.text = words(random.Random(f"{args.seed}-{tenant}"), args.system_words,
                                f"tenant {tenant} system prompt")
            request.output = args.max_tokens
        print(f"\nREAL vLLM through llmgw: two replicas on testbed nodes {', '.join(FLEET_NODES)} (vLLM "
              f"{args.blocks} KV blocks of {FLEET_BLOCK} tokens each, --max-model-len {FLEET_MAX_LEN}, one OpenMP "
              f"thread); shared workload: {args.tenants} tenants x {args.conversations} conversations x 3 turns = "
              f"{len(fleet)} requests, conversations in tenant rotation and their turns interleaved, system prompts of {args.system_words} words, "
              f"+12 user words a turn, {args.max_tokens} output tokens, {args.concurrency} requests at a time, "
              "streamed through the router", flush=True)
        from tests.testbed import engines as real
        best = best_hit_rate(fleet, real.models()["chat"], FLEET_BLOCK) if real.missing("vllm") is None else None
        print(f"  best possible hit rate of this workload (one cache that never evicts, every tenant on it): "
              f"{fmt(best, '.3f')}", flush=True)
        rows = run_fleet(fleet, args.concurrency, args.blocks)
        table("real vLLM x2 through llmgw, shared-prefix workload (engines' own prefix-cache counters)", rows,
              [("hit rate", "hit_rate", ".3f"), ("TTFT p50 s", "ttft_p50", ".3f"),
               ("TTFT p90 s", "ttft_p90", ".3f"), ("req/s", "rps", ".3f"), ("prompt tok", "prompt_tokens", ".0f"),
               ("on home", "on_home", ".1%"), ("failures", "failures", "d")])
        print("  " + ratios(rows, ["hit_rate", "ttft_p50", "ttft_p90", "rps"]))
        base = rows[LEAST_OUTSTANDING]["hit_rate"]
        if base is not None and best is not None:
            print(f"  2x least-outstanding's hit rate is {2 * base:.3f}; the best possible is {best:.3f} "
                  f"({best / base:.2f}x least-outstanding)")
    print(json.dumps({"quick": args.quick, "seed": args.seed}))


if __name__ == "__main__":
    main()
