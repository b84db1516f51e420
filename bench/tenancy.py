"""Fair queueing under saturation: the quiet key's latency with a noisy key's load, against idle (R-6.17).

One engine double with a fixed service time (`--token-delay` between `--tokens` streamed tokens),
a profile giving its replica `--concurrency` requests at once, and the router in process fed by
the real FeedPublisher (as `llmgw serve` runs it). The quiet key sends `--count` streamed
completions one after another, first on the idle fleet, then while a noisy key keeps
`--noisy` requests open at once (several times the model's capacity, so a backlog waits in the
router), each of between half and 1.5x the quiet key's length: requests of one length started in
the same instant would keep every place's end in step, and a request arriving just after would
wait a whole service time however the places are shared. Prints the quiet key's p50 and p99 in both phases and their ratio (goal: p99 within
1.5x), and the noisy key's answers by status. Not a pass/fail test.

    .venv/bin/python bench/tenancy.py [--count 60] [--noisy 24] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
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
from llmgw.router import RUNNER_OPTIONS, Router  # noqa: E402
from llmgw.store import Store  # noqa: E402
from tests.integration.test_router_support import Engines  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engines = Engines(Path(tmp))
        try:
            engine = engines.start("m", token_delay=args.token_delay)
            catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="narrow")],
                                    profiles={"narrow": ProfileConfig(engine="vllm", concurrency=args.concurrency)})
            store = Store.open(Path(tmp) / "state.db")
            _, quiet_secret = store.write_sync(lambda db: create_key(db, "quiet"))
            _, noisy_secret = store.write_sync(lambda db: create_key(db, "noisy"))
            publisher = FeedPublisher(CatalogHolder(catalog), store, GatewayConfig())
            publisher.set_keys(store.read_sync(key_entries))
            publisher.set_endpoints({"m": [engine.endpoint()]})
            publisher.mark_ready()
            router = Router()
            feed = LocalFeed(publisher, router)
            feed.pump()
            feed.start()
            runner = web.AppRunner(router.web_app(), **RUNNER_OPTIONS)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            quiet = openai.AsyncOpenAI(base_url=url, api_key=quiet_secret, max_retries=0)
            noisy = openai.AsyncOpenAI(base_url=url, api_key=noisy_secret, max_retries=0)
            try:
                await quiet_run(quiet, 3, args.tokens)  # warm connections
                idle = await quiet_run(quiet, args.count, args.tokens)
                stop, statuses = asyncio.Event(), {}
                rng = random.Random(args.seed)
                loops = [asyncio.create_task(noisy_loop(noisy, args.tokens, stop, statuses, rng))
                         for _ in range(args.noisy)]
                while router.fairqueue.waiting().get("m", 0) < args.noisy - args.concurrency:
                    await asyncio.sleep(0.01)  # the noisy backlog is queued
                waiting = router.fairqueue.waiting()["m"]
                loaded = await quiet_run(quiet, args.count, args.tokens)
                stop.set()
                await asyncio.gather(*loops)
                service = router.fairqueue.models["m"].service
            finally:
                await runner.cleanup()
                await feed.close()
                await publisher.close()
                await router.close()
                store.close()
        finally:
            engines.close()
    idle_p50, idle_p99 = percentile(idle, 0.5), percentile(idle, 0.99)
    load_p50, load_p99 = percentile(loaded, 0.5), percentile(loaded, 0.99)
    print(f"model m: 1 replica x concurrency {args.concurrency}; service time {args.tokens} tokens x "
          f"{args.token_delay} s; measured hold time (EWMA) {service:.3f} s")
    print(f"noisy key: {args.noisy} requests open at once ({args.tokens // 2}..{args.tokens + args.tokens // 2} "
          f"tokens), {waiting} waiting in the router when measured; "
          f"answers by status: {dict(sorted(statuses.items()))}")
    print(f"{'quiet key, ' + str(args.count) + ' requests':<34} {'p50 s':>8} {'p99 s':>8}")
    print(f"{'idle fleet':<34} {idle_p50:>8.3f} {idle_p99:>8.3f}")
    print(f"{'under the noisy load':<34} {load_p50:>8.3f} {load_p99:>8.3f}")
    print(f"p99 ratio {load_p99 / idle_p99:.2f}x (goal <= 1.5x); p50 ratio {load_p50 / idle_p50:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=60, help="quiet requests per phase")
    parser.add_argument("--noisy", type=int, default=24, help="noisy requests open at once")
    parser.add_argument("--concurrency", type=int, default=4, help="requests the replica is given at once")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1, help="of the noisy requests' lengths")
    asyncio.run(main(parser.parse_args()))
