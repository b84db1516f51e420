"""Fair queueing under saturation: the quiet key's latency with a noisy key's load, against idle (R-6.17).

One engine double with a fixed service time (`--token-delay` between `--tokens` streamed tokens),
a profile giving its replica `--concurrency` requests at once (each value given is a run of its
own), and the router in process fed by the real FeedPublisher (as `llmgw serve` runs it). The
quiet key sends `--count` streamed completions one after another: first on the idle fleet, then
while a noisy key keeps `--noisy` requests open at once (several times the model's capacity, so a
backlog waits in the router), each of between half and 1.5x the quiet key's length (requests of
one length started in the same instant would keep every place's end in step). The loaded phase
runs twice, with the replica's headroom set to 0 (fair order alone) and as the router sets it.
Prints, per run, the quiet key's p50 and p99 (nearest rank) in each phase, the p99 ratio to idle
(goal: within 1.5x), the most requests the engine was given at once, and the noisy key's answers
by status. Not a pass/fail test; about three minutes per `--concurrency` value.

What order alone can give. The quiet key's request arrives while the noisy key holds every place
and has a backlog; fair queueing puts it first in line, but nothing preempts a running request,
so it waits for the first of the C places to end. If each place is busy for a service time S and
the arrival falls at an independent uniform point of each, the wait exceeds w with probability
(1 - w/S)^C, so its p99 is (1 - 0.01^(1/C)) x S: 0.68 S at C = 4 (a p99 of about 1.68x the idle
one, which is about S), 0.44 S at C = 8 (about 1.44x). At C = 4 no scheduling order reaches
1.5x with requests of equal length; at C = 8 it is barely within reach. (The noisy lengths here
vary, which lengthens the residuals a little: a request covering a random instant is a long one
more often.)

The mechanism that meets it (llmgw.router.fairqueue): a replica whose places are not its engine's
slots has a headroom of places / 8, rounded up; a key holding less than its weighted share of the
model's places, with nothing of its own or of a higher class waiting, takes a headroom place at
once, so the quiet key does not wait for a place to end. The engine is given at most C plus the
headroom; the noisy key, at its share, never takes it; nothing is refused or dropped.

    .venv/bin/python bench/tenancy.py [--count 100] [--noisy 24] [--concurrency 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import openai
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.catalog import Catalog, CatalogHolder  # noqa: E402
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig  # noqa: E402
from llmgw.control.feed import FeedPublisher  # noqa: E402
from llmgw.keys import create_key, key_entries  # noqa: E402
from llmgw.localfeed import LocalFeed  # noqa: E402
from llmgw.router import Router  # noqa: E402
from llmgw.store import Store  # noqa: E402
from tests.integration.test_router_support import Engines  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def one(client: openai.AsyncOpenAI, tokens: int) -> float:
    started = time.monotonic()
    stream = await client.completions.create(model="m", prompt="a b", max_tokens=tokens, stream=True)
    async for _ in stream:
        pass
    return time.monotonic() - started


async def quiet_run(client, count: int, tokens: int) -> list[float]:
    return [await one(client, tokens) for _ in range(count)]


async def noisy_loop(client, tokens: int, stop: asyncio.Event, statuses: dict, rng: random.Random) -> None:
    while not stop.is_set():
        try:
            await one(client, rng.randint(max(1, tokens // 2), tokens + tokens // 2))
            status = 200
        except openai.APIStatusError as exc:
            status = exc.status_code
        statuses[status] = statuses.get(status, 0) + 1


async def loaded_run(router, quiet, noisy, args, concurrency: int, rng: random.Random) -> dict:
    """The quiet key's latencies while the noisy key keeps its backlog; the most places held at once."""
    stop, statuses = asyncio.Event(), {}
    loops = [asyncio.create_task(noisy_loop(noisy, args.tokens, stop, statuses, rng)) for _ in range(args.noisy)]
    queue = router.fairqueue.models["m"]
    most = 0

    async def watch() -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, queue.held)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    while router.fairqueue.waiting().get("m", 0) < args.noisy - concurrency:
        await asyncio.sleep(0.01)  # the noisy backlog is queued
    waiting = router.fairqueue.waiting()["m"]
    latencies = await quiet_run(quiet, args.count, args.tokens)
    stop.set()
    await asyncio.gather(*loops, watcher)
    return {"latencies": latencies, "statuses": statuses, "waiting": waiting, "most": most,
            "headroom": queue.headroom}


async def run(args, concurrency: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        engines = Engines(Path(tmp))
        try:
            engine = engines.start("m", token_delay=args.token_delay)
            catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="narrow")],
                                    profiles={"narrow": ProfileConfig(engine="vllm", concurrency=concurrency)})
            store = Store.open(Path(tmp) / "state.db")
            _, quiet_secret = store.write_sync(lambda db: create_key(db, "quiet"))
            _, noisy_secret = store.write_sync(lambda db: create_key(db, "noisy"))
            publisher = FeedPublisher(CatalogHolder(catalog), store, GatewayConfig())
            publisher.set_keys(store.read_sync(key_entries))
            publisher.set_endpoints({"m": [engine.endpoint()]})
            publisher.mark_ready()
            router = Router()
            feed = LocalFeed(publisher, router.feed)
            feed.pump()
            feed.start()
            runner = router.runner()
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            quiet = openai.AsyncOpenAI(base_url=url, api_key=quiet_secret, max_retries=0)
            noisy = openai.AsyncOpenAI(base_url=url, api_key=noisy_secret, max_retries=0)
            rng = random.Random(args.seed)
            try:
                await quiet_run(quiet, 3, args.tokens)  # warm connections
                idle = await quiet_run(quiet, args.count, args.tokens)
                queue = router.fairqueue.models["m"]
                headroom = queue.headroom
                queue.headroom = 0  # fair order alone
                alone = await loaded_run(router, quiet, noisy, args, concurrency, rng)
                queue.headroom = headroom
                with_headroom = await loaded_run(router, quiet, noisy, args, concurrency, rng)
                service = queue.service
            finally:
                await runner.cleanup()
                await feed.close()
                await publisher.close()
                await router.close()
                store.close()
        finally:
            engines.close()
    return {"idle": idle, "alone": alone, "headroom": with_headroom, "service": service}


def report(args, concurrency: int, result: dict) -> None:
    idle = result["idle"]
    idle_p50, idle_p99 = percentile(idle, 0.5), percentile(idle, 0.99)
    order_alone = 1 - 0.01 ** (1 / concurrency)
    print(f"\nmodel m: 1 replica x concurrency {concurrency}; service time {args.tokens} tokens x "
          f"{args.token_delay} s; measured hold time (EWMA) {result['service']:.3f} s; "
          f"order alone: p99 wait about {order_alone:.2f} x S")
    print(f"{'quiet key, ' + str(args.count) + ' requests':<36} {'p50 s':>7} {'p99 s':>7} {'p99/idle':>9} "
          f"{'engine max':>10}  noisy answers (waiting when measured)")
    print(f"{'idle fleet':<36} {idle_p50:>7.3f} {idle_p99:>7.3f} {'':>9} {'':>10}")
    for name, label in (("alone", "noisy load, headroom 0"), ("headroom", "noisy load, headroom {h}")):
        phase = result[name]
        loaded = phase["latencies"]
        p50, p99 = percentile(loaded, 0.5), percentile(loaded, 0.99)
        print(f"{label.format(h=phase['headroom']):<36} {p50:>7.3f} {p99:>7.3f} {p99 / idle_p99:>8.2f}x "
              f"{phase['most']:>10}  {dict(sorted(phase['statuses'].items()))} ({phase['waiting']})")


async def main(args) -> None:
    print(f"noisy key: {args.noisy} requests open at once, each of {args.tokens // 2}..{args.tokens + args.tokens // 2} "
          f"tokens; goal: the quiet key's p99 within 1.5x of idle")
    for concurrency in args.concurrency:
        report(args, concurrency, await run(args, concurrency))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="quiet requests per phase")
    parser.add_argument("--noisy", type=int, default=24, help="noisy requests open at once")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8],
                        help="requests the replica is given at once (its profile's concurrency), one run each")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.05,
                        help="seconds between tokens: 8 x 0.05 s = 0.4 s a request, long beside this machine's hiccups")
    parser.add_argument("--seed", type=int, default=1, help="of the noisy requests' lengths")
    asyncio.run(main(parser.parse_args()))
