"""Control plane at scale: 2,000 simulated nodes, 500 models (TARGETS.md, "Control plane at scale").

Nodes are simulated (tests/unit/fake_fleet.py): this measures the control plane's own CPU —
placement, the reconcile pass, bookkeeping, explanations with what-if — not SSH. Prints figures and their ratio to the
targets; not a pass/fail test.

With scaling on (the default) every model may scale on load (min 2, max 4) and the reconciler
reads each replica's load from a simulated router (1 request in flight, the engine reporting
1 running, 0 waiting: steady at min); the extra row measures a pass while every model's load
stays above its target (a scale-up trend each pass, before the up-delay lets it decide).
`--no-scaling` gives every model max = min, as before load-based scaling.

    .venv/bin/python bench/reconcile_scale.py [--nodes 2000] [--models 500] [--no-scaling]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.catalog import Catalog, CatalogHolder  # noqa: E402
from llmgw.config import GatewayConfig, Inventory, ModelConfig, NodeConfig, ProfileConfig  # noqa: E402
from llmgw.control import evict, placement  # noqa: E402
from llmgw.control.reconciler import Reconciler  # noqa: E402
from llmgw.control.routers import Routers  # noqa: E402
from llmgw.fleet.facts import GPU, Inventory as InventoryFacts  # noqa: E402
from llmgw.router.engineload import EngineLoad  # noqa: E402
from tests.unit.fake_fleet import FakeFleet  # noqa: E402

CLASSES = [("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"), ("NVIDIA L40S", 46068, "l40s-48gb"),
           ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb")]


def build(nodes: int, models: int, scaling: bool = True):
    node_configs = [NodeConfig(name=f"n{i:04d}", host=f"h{i}", fabric=f"ib-{i % 10}",
                               labels={"zone": f"z{i % 3}"}) for i in range(nodes)]
    profiles = {}
    for name, _, cls in CLASSES:
        profiles[f"{cls}-1"] = ProfileConfig(engine="vllm", gpus=1, gpu_class=cls)
        profiles[f"{cls}-2"] = ProfileConfig(engine="vllm", gpus=2, gpu_class=cls, min_memory_gb=64)
        profiles[f"{cls}-4"] = ProfileConfig(engine="vllm", gpus=4, gpu_class=cls)
    profiles["h100-2x8"] = ProfileConfig(engine="vllm", gpus=8, nodes=2, gpu_class="h100-80gb")
    names = list(profiles)
    configs = []
    for i in range(models):
        profile = "h100-2x8" if i % 50 == 0 else names[i % (len(names) - 1)]
        configs.append(ModelConfig(name=f"model-{i:03d}", profile=profile, weights=f"hf:org/model-{i}",
                                   disk_gb=10, scaling={"min": 2, "max": 4} if scaling else {"min": 2}))
    inventory = Inventory(nodes=node_configs, profiles=profiles)
    catalog = Catalog.build(file_models=configs, profiles=profiles)
    fleet = FakeFleet(inventory)
    for i, node in enumerate(node_configs):
        name, mib, _ = CLASSES[i % len(CLASSES)]
        facts = fleet.facts[node.name]
        facts.inventory = InventoryFacts(hostname=node.name, boot_id="b", cpus=64, memory_bytes=512 * 1024**3,
                                         gpus=tuple(GPU(g, None, name, mib, 0, 0, True) for g in range(8)),
                                         nvidia_smi="ok")
    return inventory, catalog, fleet


async def main(nodes: int, models: int, scaling: bool = True) -> None:
    logging.disable(logging.WARNING)
    inventory, catalog, fleet = build(nodes, models, scaling)
    in_flight = {"each": 1}
    engine = EngineLoad(source="vllm", waiting=0, running=1)
    reconciler = Reconciler(CatalogHolder(catalog), fleet, None, GatewayConfig(),
                            Routers(outstanding=lambda replica_id: in_flight["each"], engine_load=lambda replica_id: engine))
    replicas = reconciler.memory.records.replicas
    wanted = sum(m.min_replicas for m in catalog.models.values())

    cpu = time.process_time()
    reconciler.step()
    place_cpu = time.process_time() - cpu
    placed = len(replicas)

    cpu = time.process_time()
    while not all(r.serving for r in replicas.values()):
        await asyncio.sleep(0)
        await fleet.refresh()
        reconciler.step()
    settle_cpu = time.process_time() - cpu

    idle = []
    for _ in range(20):
        start = time.perf_counter()
        reconciler.step()
        idle.append(time.perf_counter() - start)

    trending = []
    if scaling:
        in_flight["each"] = 3  # 6 per model of 2 replicas: wants 3, for less than the up-delay
        for _ in range(20):
            start = time.perf_counter()
            reconciler.step()
            trending.append(time.perf_counter() - start)
        assert all(s.desired == 2 and s.trend == 1 for s in reconciler.memory.scaling.scales.values())

    views = reconciler.nodes.views()
    allocated = reconciler.memory.records.allocated()
    model = catalog.models["model-001"]
    explain = []
    for _ in range(20):
        start = time.perf_counter()
        placement.explain_placement(model, views, allocated)
        explain.append(time.perf_counter() - start)

    # With what-if, as `explain-placement` gives it on the same views: the eviction pool built
    # from the live replicas, then one change per rejected node.
    what_if = []
    for _ in range(20):
        start = time.perf_counter()
        explain_now = time.time()
        pool = reconciler.placing.eviction_pool(model, explain_now)
        placement.explain_placement(model, views, allocated,
                                    what_if=evict.WhatIf(model, pool, allocated, {}, explain_now))
        what_if.append(time.perf_counter() - start)
    # The worst case for what-if: every GPU taken (the free ones by other holders), every replica
    # evictable and idle, so that every node of the model's class looks for victims.
    now = time.time()
    evictable = {name: dataclasses.replace(m, min_replicas=0, config=m.config.model_copy(
        update={"scaling": m.config.scaling.model_copy(update={"evictable": True})})) for name, m in catalog.models.items()}
    full = {v.name: frozenset(range(8)) for v in views}
    worst, worst_plain = [], []
    rejected_with_change = 0
    for _ in range(20):
        start = time.perf_counter()
        pool = evict.candidates(replicas.values(), evictable, {}, now + 3600, for_model=model.name)
        explained = placement.explain_placement(model, views, full,
                                                what_if=evict.WhatIf(model, pool, full, {}, now + 3600))
        worst.append(time.perf_counter() - start)
        rejected_with_change = sum(1 for v in explained.verdicts if v.what_if)
        start = time.perf_counter()
        placement.explain_placement(model, views, full)
        worst_plain.append(time.perf_counter() - start)

    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gpus = sum(len(f.inventory.gpus) for f in fleet.facts.values())
    print(f"control plane at scale: {nodes} nodes, {gpus} GPUs, {len(catalog.models)} models, "
          f"{wanted} replicas wanted, {placed} placed in the first pass, "
          f"scaling on load {'on (min 2, max 4)' if scaling else 'off'}")
    rows = [
        ("placement of all replicas from empty (first pass, CPU)", place_cpu * 1000, 1000.0),
        ("launch bookkeeping until all serve (CPU)", settle_cpu * 1000, None),
        ("reconcile pass with nothing to do (p50)", statistics.median(idle) * 1000, 20.0),
        *([("reconcile pass, every model's load trending up (p50)", statistics.median(trending) * 1000, None)]
          if trending else []),
        ("one placement with full explanation (p50)", statistics.median(explain) * 1000, 5.0),
        ("one explanation with what-if, as explain-placement (p50)", statistics.median(what_if) * 1000, 5.0),
        ("full fleet: explanation, every node rejected (p50)", statistics.median(worst_plain) * 1000, None),
        (f"full fleet: with what-if, {rejected_with_change} nodes with a change (p50)",
         statistics.median(worst) * 1000, None),
        ("peak RSS (MB)", rss_mb, 250.0),
    ]
    print(f"{'measure':58} {'value':>10} {'target':>8} {'ratio':>7}")
    for label, value, target in rows:
        unit = "" if "RSS" in label else " ms"
        ratio = f"{value / target:.2f}" if target else "-"
        target_text = f"{target:g}{unit}" if target else "-"
        print(f"{label:58} {value:8.1f}{unit:3} {target_text:>8} {ratio:>7}")
    print("ratio = value / target (<= 1.00 meets the target)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--no-scaling", action="store_true", help="every model with max = min")
    args = parser.parse_args()
    asyncio.run(main(args.nodes, args.models, not args.no_scaling))
