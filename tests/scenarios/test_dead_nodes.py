"""Many dead nodes (R-1.1): nodes that swallow every SYN delay no live node, and each ends `unreachable`.

The inventory lists 190 nodes at testbed addresses where nothing answers (a TCP connect hangs
until its timeout, no "host unreachable" comes back) before 10 live testbed nodes. The fleet runs
in this process with a recording connect gate, so the mechanism is checked directly: no dead node
ever holds a place in the gate (TCP connects run outside it), so no live handshake waits behind a
dead one's timeout. Every dead node becomes `unreachable` with its reason and keeps the time it
first failed through its retries, as the admin listing (`ctl nodes`) shows it. The times the live
nodes became ready, with and without the dead ones, are printed as a figure, not asserted.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import yaml

import llmgw.fleet.fleet as fleet_module
from llmgw.admin.views import Listings
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, load_inventory
from llmgw.control.reconciler import Reconciler
from llmgw.fleet.fleet import CONNECT_GATE, Fleet
from llmgw.fleet.link import READY, UNREACHABLE, ConnectGate
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

LIVE, DEAD = 10, 190
CONNECT_TIMEOUT = 4.0
READY_DEADLINE = 60.0  # a deadline to give up waiting, not a speed target


@dataclass(frozen=True)
class Passage:
    """One handshake through the gate: who, when it asked, entered, left, and who held it then."""

    node: str
    asked: float
    entered: float
    left: float
    held_when_asked: frozenset[str]


class RecordingGate(ConnectGate):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passages: list[Passage] = []
        self.holding: set[str] = set()

    @asynccontextmanager
    async def handshake(self, node: str):
        asked, held = time.monotonic(), frozenset(self.holding)
        async with super().handshake(node):
            entered = time.monotonic()
            self.holding.add(node)
            try:
                yield
            finally:
                self.holding.discard(node)
                self.passages.append(Passage(node, asked, entered, time.monotonic(), held))


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec(f"live{i:02d}", gpus=None, mem_gb=8, models_mb=8, cache_mb=8, tmp_mb=16)
                          for i in range(LIVE)])
    yield tb
    tb.close()


def write_inventory(bed, path, dead_addresses: list[str]):
    doc = bed.inventory()
    doc["ssh"]["connect_timeout"] = f"{CONNECT_TIMEOUT:g}s"
    dead = [{"name": f"dead{i:03d}", "host": address} for i, address in enumerate(dead_addresses)]
    doc["nodes"] = dead + doc["nodes"]  # the live ones listed last
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    inventory, _ = load_inventory(path)
    return inventory


async def connect(inventory, state_dir) -> tuple[Fleet, dict[str, float], dict[str, list[str]]]:
    """Start a fleet; returns it, when each node first became ready (seconds after the start)
    and the states each node went through."""
    began = time.monotonic()
    ready_at: dict[str, float] = {}
    states: dict[str, list[str]] = {}

    def on_state(link):
        states.setdefault(link.name, []).append(link.state)
        if link.state == READY:
            ready_at.setdefault(link.name, time.monotonic() - began)

    fleet = Fleet(inventory, state_dir, on_state=on_state)
    await fleet.start()
    return fleet, ready_at, states


async def until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def live_ready_times(inventory, state_dir) -> list[float]:
    fleet, ready_at, _ = await connect(inventory, state_dir)
    try:
        await until(lambda: len(ready_at) == LIVE, READY_DEADLINE, "the live nodes to be ready")
        return sorted(ready_at.values())
    finally:
        await fleet.close()


async def test_dead_nodes_delay_no_live_node_and_end_unreachable(bed, tmp_path, monkeypatch):
    live_only = write_inventory(bed, tmp_path / "live.yaml", [])
    dead_addresses = bed.silent_addresses(DEAD)
    with_dead = write_inventory(bed, tmp_path / "with-dead.yaml", dead_addresses)
    assert [n.name for n in with_dead.nodes][-LIVE:] == [n.name for n in live_only.nodes]

    await live_ready_times(live_only, tmp_path / "state")  # deploys the helper: not measured
    alone = await live_ready_times(live_only, tmp_path / "state")

    monkeypatch.setattr(fleet_module, "ConnectGate", RecordingGate)
    fleet, ready_at, states = await connect(with_dead, tmp_path / "state")
    try:
        gate = fleet.gate
        assert isinstance(gate, RecordingGate) and gate.limit == CONNECT_GATE
        live = [n.name for n in live_only.nodes]
        dead = [n.name for n in with_dead.nodes[:DEAD]]
        await until(lambda: len(ready_at) == LIVE, READY_DEADLINE, f"the live nodes to be ready: {sorted(ready_at)}")
        among_dead = sorted(ready_at.values())
        await until(lambda: all(fleet.links[n].state == UNREACHABLE for n in dead), CONNECT_TIMEOUT + READY_DEADLINE,
                    "every dead node to be unreachable")
        first_failed = {n: fleet.links[n].since for n in dead}
        # A second failed attempt of each: retries must neither pass through `connecting` nor
        # restart the clock.
        await until(lambda: all(fleet.links[n].connects == 0 and fleet.links[n].failures >= 2 for n in dead),
                    3 * CONNECT_TIMEOUT + READY_DEADLINE, "a retry of every dead node")

        print(f"\nlive nodes ready (s after start), {LIVE} alone:          "
              + " ".join(f"{t:.2f}" for t in alone))
        print(f"live nodes ready (s after start), after {DEAD} dead ones: "
              + " ".join(f"{t:.2f}" for t in among_dead))
        longest_wait = max(p.entered - p.asked for p in gate.passages)
        ready_since = fleet.links[live[0]].since
        print(f"gate: {len(gate.passages)} handshakes, longest wait {longest_wait:.3f}s; dead nodes first failed "
              f"{min(first_failed.values()) - ready_since:+.2f}s to {max(first_failed.values()) - ready_since:+.2f}s "
              f"from {live[0]} becoming ready")

        # The mechanism: a dead node never enters the gate, so no live handshake ever waited
        # behind one; every live node went through it exactly once.
        assert {p.node for p in gate.passages} <= set(live), sorted({p.node for p in gate.passages} - set(live))
        assert sorted(p.node for p in gate.passages) == sorted(live)
        assert all(p.held_when_asked <= set(live) for p in gate.passages)
        assert all(fleet.links[n].state == READY for n in live)

        views = {v["name"]: v for v in admin_nodes(fleet)}
        for name, address in zip(dead, dead_addresses):
            link = fleet.links[name]
            assert states[name] == [UNREACHABLE], (name, states[name])  # never `connecting` again
            assert link.since == first_failed[name], name
            view = views[name]
            assert view["state"] == UNREACHABLE and view["since"] == first_failed[name], view
            assert view["state_reason"] == f"TCP connect to {address}:22 timed out after {CONNECT_TIMEOUT:g}s", view
    finally:
        await fleet.close()


def admin_nodes(fleet: Fleet) -> list[dict]:
    """The node listing as the admin API and `ctl nodes` give it."""
    holder = CatalogHolder(Catalog.build(file_models=[], profiles={}))
    reconciler = Reconciler(holder, fleet, None, GatewayConfig())
    return Listings(reconciler.view.get()).nodes()
