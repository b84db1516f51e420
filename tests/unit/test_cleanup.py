"""The clean-up at a cache filesystem's low-water mark (R-5.5): the pure choice (what to remove,
in which order) and the trigger in the reconciler's pass on a simulated fleet."""

from __future__ import annotations

import asyncio

import pytest
import sqlite_utils

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, Inventory, ModelConfig, NodeConfig, ProfileConfig
from llmgw.contracts import states
from llmgw.control.cleanup import Entry, choose, need_now, order
from llmgw.control.reconciler import Reconciler
from llmgw.fleet.facts import Filesystem, Storage
from llmgw.weights import parse_weights
from tests.unit.fake_fleet import FakeFleet

A, B, C, D, E = ("llmgw-" + ch * 32 for ch in "abcde")
GB = 1000**3


# -- the choice -----------------------------------------------------------------------------------


def test_least_recently_used_first_without_wanted_or_pinned():
    entries = [Entry(A, 10, 300.0), Entry(B, 10, 100.0), Entry(C, 10, 200.0), Entry(D, 10, 50.0), Entry(E, 10, 400.0)]
    ordered = order(entries, keep={D, A})  # D wanted, A pinned
    assert [e.name for e in ordered] == [B, C, E]
    assert [e.name for e in choose(ordered, free_bytes=85, threshold=100)] == [B, C]  # 15 bytes needed: two entries
    assert [e.name for e in choose(ordered, free_bytes=95, threshold=100)] == [B]
    assert choose(ordered, free_bytes=100, threshold=100) == []  # at the mark: nothing


def test_an_entry_the_node_found_fault_with_or_without_a_cache_name_is_never_chosen():
    entries = [Entry(A, 10, 1.0, problem="no completion marker"), Entry(".tmp-" + B + "-x", 10, 1.0),
               Entry("models", 10, 1.0), Entry(C, 10, 2.0)]
    assert [e.name for e in order(entries, keep=set())] == [C]


def test_unknown_last_use_comes_after_every_known_one_and_unknown_size_counts_for_nothing():
    ordered = order([Entry(A, 10, None), Entry(B, None, 5.0), Entry(C, 10, 9.0)], keep=set())
    assert [e.name for e in ordered] == [B, C, A]
    assert [e.name for e in choose(ordered, free_bytes=0, threshold=15)] == [B, C, A]
    assert [e.name for e in choose(ordered, free_bytes=0, threshold=10)] == [B, C]


def test_taking_everything_when_even_all_of_it_is_not_enough():
    ordered = order([Entry(A, 1, 1.0), Entry(B, 1, 2.0)], keep=set())
    assert [e.name for e in choose(ordered, free_bytes=0, threshold=100)] == [A, B]


@pytest.mark.parametrize("free,downloads,due", [
    (50, [], True),  # below the mark, nothing downloading
    (150, [], False),
    (150, [(10, 80)], True),  # a download that would take the filesystem below the mark needs the room
    (150, [(70, 80)], False),  # one that still fits above it does not
    (50, [(10, None)], None),  # a download of unknown size is waited for
    (50, [None], None),  # one that has reported nothing yet too
])
def test_a_download_writing_into_the_filesystem(free, downloads, due):
    assert need_now(free, 100, downloads) is due


# -- the trigger ----------------------------------------------------------------------------------


PROFILES = {"one": ProfileConfig(engine="vllm", gpus=1)}
WANTED, PINNED, OLD, NEWER = "hf:org/wanted", "hf:org/pinned", "hf:org/old", "hf:org/newer"


class Cache:
    """A node's cache as the helper would answer reclaim: sizes, last use and free bytes."""

    def __init__(self, free: int):
        self.free = free
        self.entries: dict[str, tuple[int, float]] = {}
        self.listings = 0
        self.asked: list[tuple[list[str], int]] = []
        self.envs: dict[str, dict] = {}  # installed environments, by name, as envs lists them
        self.envs_asked: list[list[str]] = []

    def add(self, source: str, size: int, last_used: float) -> str:
        name = parse_weights(source).cache_name
        self.entries[name] = (size, last_used)
        return name

    def answer(self, args: dict) -> dict:
        if "envs" in args:  # the installed engines' part of the clean-up
            assert args["collect"] and "cache_dir" not in args
            self.envs_asked.append(list(args["envs"]))
            return {"envs": [{"name": n, "path": self.envs.pop(n)["path"], "bytes": 5 * GB, "action": "removed",
                              "reason": None, "last_used": 1.0} for n in args["envs"]], "images": []}
        if not args.get("collect"):
            self.listings += 1
            return {"entries": [{"name": n, "path": f"/c/{n}", "bytes": s, "action": "listed", "reason": None,
                                 "last_used": t} for n, (s, t) in sorted(self.entries.items())]}
        self.asked.append((list(args["names"]), args["until_free"]))
        out = []
        for name in args["names"]:
            if self.free >= args["until_free"]:
                out.append({"name": name, "path": f"/c/{name}", "bytes": None, "action": "kept", "reason": "at the mark"})
                continue
            size, _ = self.entries.pop(name)
            self.free += size
            out.append({"name": name, "path": f"/c/{name}", "bytes": size, "action": "removed", "reason": None})
        return {"entries": out, "free_bytes": self.free}


class AuditStore:
    def __init__(self):
        self.db = sqlite_utils.Database(memory=True)

    def submit(self, fn):
        fn(self.db)


@pytest.fixture(autouse=True)
def no_refused_transitions():
    states.refused.clear()
    yield
    assert not states.refused, f"transitions refused: {dict(states.refused)}"


def _setup(cache: Cache, *, mark="10GB", node_mark=None, pinned=(PINNED,)):
    inventory = Inventory(nodes=[NodeConfig(name="a", host="h-a", cache_low_water=node_mark)], profiles=PROFILES)
    fleet = FakeFleet(inventory)
    models = [ModelConfig(name="m", profile="one", weights=WANTED)]
    holder = CatalogHolder(Catalog.build(file_models=models, profiles=PROFILES))
    store = AuditStore()
    gateway = GatewayConfig(settling_window=0.1, cache_low_water=mark, pinned_weights=list(pinned))
    reconciler = Reconciler(holder, fleet, None, gateway)
    reconciler.cleanup.store = store
    cache_dir = fleet.paths("a").cache_dir
    fleet.facts["a"].storage = Storage((Filesystem("1:1", "ext4", "/", False, 100 * GB, cache.free, (cache_dir,)),))
    original = fleet.call

    async def call(node, op, args=None, timeout=None):
        if op == "reclaim":
            fleet.calls.append((node, op, args))
            return cache.answer(args)
        if op == "envs":  # the environments the node holds; no profile of PROFILES wants one
            return {"envs": list(cache.envs.values()), "images": [], "wanted": {}}
        return await original(node, op, args, timeout)

    fleet.call = call
    return reconciler, fleet, store


async def _passes(reconciler, fleet, count=3):
    for _ in range(count):
        await fleet.refresh()
        reconciler.step()
        for _ in range(10):
            await asyncio.sleep(0)


async def test_below_the_mark_the_oldest_unwanted_unpinned_entries_go_until_it_is_back_up():
    cache = Cache(free=8 * GB)
    wanted = cache.add(WANTED, 3 * GB, 10.0)
    pinned = cache.add(PINNED, 3 * GB, 20.0)  # older than every unwanted entry
    old = cache.add(OLD, 1 * GB, 30.0)
    middle = cache.add("hf:org/middle", 1 * GB, 40.0)
    newer = cache.add(NEWER, 1 * GB, 50.0)
    reconciler, fleet, store = _setup(cache)
    await _passes(reconciler, fleet)

    # The node was asked once, for every unwanted unpinned entry, oldest first, until 10 GB are free.
    assert cache.asked == [([old, middle, newer], 10 * GB)]
    assert set(cache.entries) == {wanted, pinned, newer}
    audit = list(store.db["audit"].rows)
    print("\naudit:", [(r["actor"], r["action"], r["target"], r["detail"]) for r in audit])
    assert [(r["actor"], r["action"], r["target"]) for r in audit] == [("cleanup", "cache.remove", "a")] * 2
    assert '"mark": "10.0 GB"' in audit[0]["detail"] and f'"name": "{old}"' in audit[0]["detail"]
    node = reconciler.view.get().node("a")
    assert [r.name for r in node.cleanup.removed] == [middle, old]  # newest first
    assert node.cleanup.mark == "10.0 GB" and node.cleanup.threshold_bytes == 10 * GB
    assert node.cleanup.last_result.startswith("removed 2 entries (2.0 GB); 10.0 GB free, mark 10.0 GB")


async def test_not_more_than_once_a_minute_per_node():
    cache = Cache(free=1 * GB)
    cache.add(OLD, 1 * GB, 30.0)
    reconciler, fleet, _ = _setup(cache)
    await _passes(reconciler, fleet, 5)
    assert cache.listings == 1 and len(cache.asked) == 1  # still below the mark, but asked once
    reconciler.cleanup.last_run["a"] -= 61
    await _passes(reconciler, fleet, 1)
    assert cache.listings == 2


async def test_above_the_mark_or_off_the_node_is_never_asked():
    cache = Cache(free=50 * GB)
    cache.add(OLD, 1 * GB, 30.0)
    reconciler, fleet, _ = _setup(cache)
    await _passes(reconciler, fleet)
    cache.free = 1 * GB
    off, fleet_off, _ = _setup(cache, node_mark="off")
    fleet_off.facts["a"].storage = fleet.facts["a"].storage
    await _passes(off, fleet_off)
    assert cache.listings == 0 and cache.asked == []
    assert off.view.get().node("a").cleanup.mark is None


async def test_a_share_mark_is_taken_of_the_filesystems_size():
    cache = Cache(free=9 * GB)
    old = cache.add(OLD, 2 * GB, 30.0)
    reconciler, fleet, _ = _setup(cache, mark="5%", node_mark="12%")  # the node's own mark wins: 12 GB of 100
    await _passes(reconciler, fleet)
    assert cache.asked == [([old], 12 * GB)]


async def test_a_download_of_unknown_size_is_waited_for():
    cache = Cache(free=1 * GB)
    cache.add(OLD, 1 * GB, 30.0)
    reconciler, fleet, _ = _setup(cache)
    from llmgw.control.actions import FetchJob
    from llmgw.control.state import Shard

    shard = Shard(id="x-0", replica_id="x", rank=0, node="a", gpus=[0])
    shard.progress = (10, None)
    reconciler.actions.fetches[("a", "llmgw-" + "f" * 32)] = FetchJob("a", "llmgw-" + "f" * 32, watchers=[shard])
    await _passes(reconciler, fleet)
    assert cache.listings == 0
    assert reconciler.view.get().node("a").cleanup.waiting == "waits for a download of unknown size to end"
    shard.progress = (10, 5 * GB)  # now it is known, and it needs the room
    await _passes(reconciler, fleet)
    assert cache.listings == 1


async def test_every_entry_wanted_pinned_or_in_use_asks_for_no_removal():
    cache = Cache(free=1 * GB)
    cache.add(WANTED, 3 * GB, 10.0)
    cache.add(PINNED, 3 * GB, 20.0)
    reconciler, fleet, _ = _setup(cache)
    await _passes(reconciler, fleet)
    assert cache.listings == 1 and cache.asked == []
    assert "every entry is wanted, pinned or in use" in reconciler.view.get().node("a").cleanup.last_result


async def test_a_large_fleet_is_looked_at_in_turn_a_few_nodes_per_pass(monkeypatch):
    from llmgw.control import cleanup as module

    monkeypatch.setattr(module, "CHECKS_PER_PASS", 2)
    inventory = Inventory(nodes=[NodeConfig(name=n, host=f"h-{n}") for n in "abcde"], profiles=PROFILES)
    fleet = FakeFleet(inventory)
    holder = CatalogHolder(Catalog.build(profiles=PROFILES))
    reconciler = Reconciler(holder, fleet, None, GatewayConfig(cache_low_water="10GB"))
    for name in fleet.nodes:
        cache_dir = fleet.paths(name).cache_dir
        fleet.facts[name].storage = Storage((Filesystem("1:1", "ext4", "/", False, 100 * GB, GB, (cache_dir,)),))
    started = []
    monkeypatch.setattr(reconciler.cleanup, "_run", lambda node, *args: _noted(started, node))
    now = 1000.0
    for expected in (["a", "b"], ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]):
        reconciler.cleanup.check(now)
        await asyncio.sleep(0)
        assert started == expected


async def _noted(started, node):
    started.append(node)


def _env(name: str, used_by=()) -> dict:
    return {"kind": "venv", "name": name, "id": name[5:] * 2, "path": f"/root/.llmgw/envs/{name}", "bytes": 5 * GB,
            "created_at": 1.0, "last_used": 1.0, "sealed": True, "python": "3.11.2", "packages": ["vllm==0.32.0"],
            "installer": "pip", "reason": None, "used_by": list(used_by)}


async def test_below_the_mark_engines_no_profile_wants_go_before_weights_and_a_running_one_stays():
    cache = Cache(free=8 * GB)
    old = cache.add(OLD, 1 * GB, 30.0)
    unwanted, running = "venv-" + "a" * 32, "venv-" + "b" * 32
    cache.envs = {unwanted: _env(unwanted), running: _env(running, used_by=["m-1-0"])}
    reconciler, fleet, store = _setup(cache)
    await _passes(reconciler, fleet)

    assert cache.envs_asked == [[unwanted]]
    assert list(cache.envs) == [running]
    assert cache.asked == [([old], 10 * GB)]  # the weights' part follows, judged on the node by its free bytes
    audit = [(r["action"], r["target"]) for r in store.db["audit"].rows]
    assert ("engine.remove", "a") in audit
    node = reconciler.view.get().node("a")
    assert unwanted in [r.name for r in node.cleanup.removed]
