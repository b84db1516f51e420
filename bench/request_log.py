"""Cost of the request log on the control plane (R-6.20): reports carrying records, applied as the
feed applies them, against the same reports without records.

A router sends its records since the last report in each report (every 0.5 s), and the control
plane writes them in the transaction that counts the report's usage (`FeedPublisher.apply_report`,
through the store's writer thread). This applies a fixed count of reports, each with 20 usage rows
and R records (half of them without a node, so the node is looked up in the stored replicas), to
a state database on disk whose request log already holds `--prefill` records (the default keep
is 100,000), and prints per report the wall time and the writer's records per second, against the
baseline of the same reports without records measured in the same run. Then what the rest costs:
one pruning chunk (`PRUNE_CHUNK` rows), a pruning with nothing to delete, and the listing's queries
(newest first: no filter, a model, a class of statuses; a follower's ask after its cursor).

    .venv/bin/python bench/request_log.py [--reports 40] [--records 250 1000 2500] [--prefill 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.catalog import Catalog, CatalogHolder  # noqa: E402
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig  # noqa: E402
from llmgw.contracts.feed import Report, RequestRecord, UsageRow  # noqa: E402
from llmgw.control.feed import FeedPublisher  # noqa: E402
from llmgw.requestlog import PRUNE_CHUNK, RequestQuery, add_requests, find_requests, prune_requests  # noqa: E402
from llmgw.store import Store  # noqa: E402

MODELS = [f"model-{i}" for i in range(20)]
KEYS = [f"key-{i}" for i in range(50)]
CATALOG = Catalog.build(file_models=[ModelConfig(name=m, profile="p") for m in MODELS],
                        profiles={"p": ProfileConfig(engine="vllm")}, engines={})


def records(count: int, at: float, rng: random.Random) -> tuple[RequestRecord, ...]:
    out = []
    for i in range(count):
        model = rng.choice(MODELS)
        replica = f"{model}-{rng.randrange(4):08x}"
        status = rng.choices((200, 429, 503, 502), (90, 4, 4, 2))[0]
        out.append(RequestRecord(at=at + i * 1e-4, id=f"{rng.getrandbits(64):016x}", route="POST /v1/chat/completions",
                                 status=status, duration=rng.uniform(0.05, 20), key=rng.choice(KEYS), model=model,
                                 asked="chat" if i % 10 == 0 else None, replica=replica if status == 200 else None,
                                 node=f"gpu{rng.randrange(64):02d}" if i % 2 else None,
                                 error=None if status == 200 else "queue_timeout", attempts=1,
                                 queued=rng.uniform(0, 1) if i % 5 == 0 else None, ttfb=rng.uniform(0.01, 1),
                                 prompt_tokens=rng.randrange(10, 4000), completion_tokens=rng.randrange(1, 1000),
                                 stream=bool(i % 2), client="10.1.2.3"))
    return tuple(out)


def usage(at: float) -> tuple[UsageRow, ...]:
    bucket = int(at) // 3600 * 3600
    return tuple(UsageRow(bucket, f"id-{k}", MODELS[k % len(MODELS)], 3, 300, 100) for k in range(20))


def replicas(db) -> None:
    """The stored replicas a record without a node is looked up in: 4 per model, one shard each."""
    for model in MODELS:
        for r in range(4):
            rid = f"{model}-{r:08x}"
            db["replicas"].insert({"id": rid, "model": model, "api_key": "k", "state": "serving"})
            db["shards"].insert({"id": f"{rid}-0", "replica_id": rid, "rank": 0, "node": f"gpu{r:02d}",
                                 "state": "serving"})


async def applied(publisher: FeedPublisher, reports: list[Report]) -> list[float]:
    """Seconds per report, each applied and waited for as the feed server does."""
    times = []
    for report in reports:
        start = time.perf_counter()
        await publisher.apply_report(report)
        times.append(time.perf_counter() - start)
    return times


def timed(fn, runs: int = 5) -> float:
    """Median milliseconds of `fn()`."""
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return statistics.median(out)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=40)
    parser.add_argument("--records", type=int, nargs="+", default=[250, 1000, 2500])
    parser.add_argument("--prefill", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="reqlog-bench-") as place:
        store = Store.open(Path(place) / "state.db")
        store.write_sync(replicas)
        now = time.time()
        for start in range(0, args.prefill, 5000):
            chunk = records(min(5000, args.prefill - start), now - 3600, rng)
            store.write_sync(lambda db, chunk=chunk: add_requests(db, "prefill/0", chunk))
        publisher = FeedPublisher(CatalogHolder(CATALOG), store, GatewayConfig(), epoch="bench")
        seq = 0

        def make(count: int) -> list[Report]:
            nonlocal seq
            out = []
            for _ in range(args.reports):
                seq += 1
                at = time.time()
                out.append(Report(router="bench/0", seq=seq, sent_at=at, usage=usage(at),
                                  requests=records(count, at, rng) if count else ()))
            return out

        rows = {}
        base = statistics.median(await applied(publisher, make(0)))
        rows["usage only (baseline)"] = (base, None)
        for count in args.records:
            per_report = statistics.median(await applied(publisher, make(count)))
            rows[f"usage + {count} records"] = (per_report, count / per_report)
        print(f"{args.reports} reports per row, each with 20 usage rows; request log prefilled with {args.prefill} "
              f"records; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        width = max(len(name) for name in rows)
        print(f"{'':{width}}  {'ms/report':>9}  {'x base':>6}  {'records/s':>9}  {'µs/record':>9}")
        for name, (seconds, rate) in rows.items():
            extra = (seconds - base) / (rate * seconds) * 1e6 if rate else None
            print(f"{name:{width}}  {seconds * 1000:9.2f}  {seconds / base:6.1f}  "
                  f"{'-' if rate is None else f'{rate:9.0f}':>9}  {'-' if extra is None else f'{extra:9.1f}':>9}")

        total = store.read_sync(lambda db: db["requests"].count)
        print(f"\nrequest log: {total} records")
        read = lambda query: timed(lambda: store.read_sync(lambda db: find_requests(db, query)))  # noqa: E731
        top = store.read_sync(lambda db: find_requests(db, RequestQuery(n=1)))["cursor"]
        for name, query in (("newest 50", RequestQuery()), ("newest 50 of a model", RequestQuery(model="model-3")),
                            ("newest 50 asked as an alias", RequestQuery(model="chat")),
                            ("newest 50 of a key, 5xx", RequestQuery(key="key-7", status=(500, 599))),
                            ("newest 50 2xx", RequestQuery(status=(200, 299))),
                            ("newest 50 slower than 19 s", RequestQuery(slower_than=19.0)),
                            ("a follower's ask, 1,000 rows behind", RequestQuery(after=top - 1000, n=1000,
                                                                                 status=(500, 599)))):
            print(f"  {name:40} {read(query):7.2f} ms")
        keep = total - PRUNE_CHUNK
        chunk = timed(lambda: store.write_sync(lambda db: prune_requests(db, time.time(), 86400, keep)), runs=1)
        idle = timed(lambda: store.write_sync(lambda db: prune_requests(db, time.time(), 86400, total)))
        print(f"  {f'pruning one chunk ({PRUNE_CHUNK:,} rows)':40} {chunk:7.2f} ms")
        print(f"  {'pruning with nothing to delete':40} {idle:7.2f} ms")
        await publisher.close()
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
