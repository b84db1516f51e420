"""Cost of taking a whole router feed snapshot: decoding its wire form and `Router.apply`.

A router takes the whole snapshot when it starts, when it sees a gap and when the control plane
restarts (R-10.1). TARGETS.md: a snapshot of 500 models × 4 endpoints and 10,000 keys applied by
a worker in ≤ 50 ms. This builds that snapshot, encodes it as it travels (one JSON line), and
times, over a fixed count of runs: json.loads + from_wire, Router.apply to a fresh router, and
Router.apply to a router that already holds the previous version (every endpoint kept). The
baseline in the same run is json.loads alone. Prints p50 and max of each in wall time, p50 in the
process's CPU time, and each CPU p50 as a ratio of the baseline's.

The target is judged on CPU time: on a machine shared with other work the wall time also counts
the waits for a core, which the load average printed beside it shows; a worker on its own core
takes the CPU time.

    .venv/bin/python bench/feed_apply.py [--runs 11] [--models 500] [--endpoints 4] [--keys 10000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.contracts.endpoints import Endpoint  # noqa: E402
from llmgw.contracts.feed import (GatewaySettings, KeyEntry, RoutedModel, Snapshot, from_wire,  # noqa: E402
                                  to_wire)
from llmgw.contracts.keyhash import hash_secret  # noqa: E402
from llmgw.router import Router  # noqa: E402

TARGET_MS = 50.0


def build(models: int, endpoints: int, keys: int, version: int = 1) -> Snapshot:
    routed = {f"model-{i}": RoutedModel(name=f"model-{i}", engine=("vllm", "sglang", "llama-server")[i % 3],
                                        served_name=f"org/model-{i}" if i % 2 else None,
                                        routing=("least-outstanding", "prefix")[i % 2], on_demand=i % 10 == 0,
                                        fallbacks=(f"model-{(i + 1) % models}",) if i % 5 == 0 else ())
              for i in range(models)}
    lists = {name: tuple(Endpoint(replica_id=f"{name}-r{j}", model=name, url=f"http://10.{i // 250}.{i % 250}.{j}:20001",
                                  api_key=f"engine-key-{i}-{j}-0123456789abcdef") for j in range(endpoints))
             for i, name in enumerate(routed)}
    entries = tuple(KeyEntry(id=f"{k:032x}", name=f"key-{k}", hash=hash_secret(f"sk-llmgw-{k}"), prefix=f"sk-llmgw-{k:06d}"[:15],
                             models=None if k % 4 else frozenset({f"model-{k % models}"})) for k in range(keys))
    return Snapshot(epoch="bench", version=version, models=MappingProxyType(routed), endpoints=MappingProxyType(lists),
                    keys=entries, gateway=GatewaySettings(max_body=16_000_000, request_timeout=600.0, on_demand_wait=120.0))


def timed(fn) -> tuple[float, float]:
    """(wall ms, CPU ms) of one call."""
    gc.collect()  # each figure is its own work, not the collector's debt from the one before
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--keys", type=int, default=10_000)
    args = parser.parse_args()
    line = json.dumps(to_wire(build(args.models, args.endpoints, args.keys)))
    print(f"snapshot: {args.models} models x {args.endpoints} endpoints, {args.keys} keys; "
          f"wire form {len(line) / 1e6:.1f} MB; {args.runs} runs")
    rows = {"json.loads alone (baseline)": [], "decode (json.loads + from_wire)": [], "apply to a fresh router": [],
            "apply over the previous version": [], "decode + apply (target)": []}
    for _ in range(args.runs):
        rows["json.loads alone (baseline)"].append(timed(lambda: json.loads(line)))
        holder = {}
        decode = timed(lambda: holder.setdefault("s", from_wire(json.loads(line))))
        rows["decode (json.loads + from_wire)"].append(decode)
        router = Router()
        fresh = timed(lambda: router.apply(holder["s"]))
        rows["apply to a fresh router"].append(fresh)
        rows["decode + apply (target)"].append((decode[0] + fresh[0], decode[1] + fresh[1]))
        again = from_wire(json.loads(line))
        rows["apply over the previous version"].append(timed(lambda: router.apply(again)))
    wall = {name: statistics.median(w for w, _ in values) for name, values in rows.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in rows.items()}
    base = "json.loads alone (baseline)"
    width = max(len(name) for name in rows)
    print(f"{'':{width}}  {'p50 ms':>8}  {'max ms':>8}  {'CPU p50':>8}  {'x base':>6}")
    for name, values in rows.items():
        print(f"{name:{width}}  {wall[name]:8.1f}  {max(w for w, _ in values):8.1f}  {cpu[name]:8.1f}  "
              f"{cpu[name] / cpu[base]:6.2f}")
    target = "decode + apply (target)"
    print(f"target: decode + apply CPU p50 <= {TARGET_MS:.0f} ms: {'met' if cpu[target] <= TARGET_MS else 'NOT met'} "
          f"({cpu[target]:.1f} ms CPU, {wall[target]:.1f} ms wall; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")

if __name__ == "__main__":
    main()
