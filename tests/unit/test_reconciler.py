"""The reconciler's decisions on a simulated fleet (R-4.1–R-4.5, R-6.8, R-9.5)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, Inventory, ModelConfig, NodeConfig, ProfileConfig
from llmgw.contracts import states
from llmgw.control.reconciler import Reconciler
from llmgw.control.routers import Routers
from llmgw.control.state import FAILED
from llmgw.fleet.facts import Held
from llmgw.store import Store
from tests.unit.fake_fleet import FakeFleet

PROFILES = {"one": ProfileConfig(engine="vllm", gpus=1, start_timeout=0.5),
            "whole": ProfileConfig(engine="vllm", gpus=8),
            "pair": ProfileConfig(engine="vllm", gpus=8, nodes=2)}


@pytest.fixture(autouse=True)
def no_refused_transitions():
    """Every state change the reconciler makes is one the transition table allows."""
    states.refused.clear()
    yield
    assert not states.refused, f"transitions refused: {dict(states.refused)}"


def build(models: list[dict], nodes=("a", "b", "c"), fabric="ib", store=None, **gateway):
    inventory = Inventory(nodes=[NodeConfig(name=n, host=f"h-{n}", fabric=fabric) for n in nodes], profiles=PROFILES)
    holder = CatalogHolder(catalog(models))
    fleet = FakeFleet(inventory)
    pushed = []
    settings = GatewayConfig(**{"settling_window": 0.3, **gateway})
    reconciler = Reconciler(holder, fleet, store, settings, Routers(push_endpoints=pushed.append))
    return reconciler, fleet, holder, pushed


def catalog(models: list[dict], version: int = 1) -> Catalog:
    configs = [ModelConfig(**{"profile": "one", "weights": "hf:org/m", **m}) for m in models]
    return Catalog.build(file_models=configs, profiles=PROFILES, version=version)


async def settle(reconciler: Reconciler, fleet: FakeFleet, passes: int = 5) -> None:
    """Run passes the way `run` does: refresh facts, step, let the started tasks run."""
    for _ in range(passes):
        await fleet.refresh()
        reconciler.step()
        for _ in range(5):
            await asyncio.sleep(0)


async def until(condition, reconciler, fleet, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await settle(reconciler, fleet, 1)
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def serving(reconciler, model):
    return [r for r in reconciler.memory.records.replicas.values() if r.model == model and r.serving]


async def test_places_min_replicas_and_pushes_endpoints():
    reconciler, fleet, _, pushed = build([{"name": "m", "scaling": {"min": 2}}])
    await settle(reconciler, fleet)
    assert len(serving(reconciler, "m")) == 2
    endpoints = pushed[-1]["m"]
    assert len(endpoints) == 2 and all(e.api_key.startswith("llmgw-engine-") for e in endpoints)
    launches = [c for c in fleet.calls if c[1] == "launch"]
    assert len(launches) == 2
    assert all("VLLM_API_KEY" in c[2]["env"] and c[2]["env"]["VLLM_API_KEY"] not in c[2]["argv"] for c in launches)
    await settle(reconciler, fleet)
    assert len([c for c in fleet.calls if c[1] == "launch"]) == 2  # nothing to do: nothing done


async def test_crashed_engine_is_replaced_with_growing_backoff():
    reconciler, fleet, _, _ = build([{"name": "m"}])
    await settle(reconciler, fleet)
    first = serving(reconciler, "m")[0]
    fleet.crash_engine(first.leader.node, first.leader.id, code=3)
    await settle(reconciler, fleet, 1)
    health = reconciler.memory.records.health["m"]
    assert health.failures == 1 and "exited with status 3" in health.last_failure
    assert health.last_log_tail == ["boom"]
    await until(lambda: serving(reconciler, "m"), reconciler, fleet, what="replacement")
    assert reconciler.memory.records.health["m"].failures == 0  # reset once a replica serves


async def test_backoff_grows_while_every_start_fails():
    """An engine that dies before it ever serves: each retry waits longer (no busy loop)."""
    reconciler, fleet, _, _ = build([{"name": "m"}])
    fleet.crash_on_launch = True
    delays = []
    for attempt in range(1, 4):
        await until(lambda: reconciler.memory.records.health.get("m") and reconciler.memory.records.health["m"].failures == attempt,
                    reconciler, fleet, what=f"failure {attempt}")
        health = reconciler.memory.records.health["m"]
        delays.append(health.next_attempt - time.time())
        launches = health.launches
        await settle(reconciler, fleet, 2)
        assert health.launches == launches  # nothing is launched while the backoff runs
        health.next_attempt = 0  # skip the wait in the test; the growth is what is checked
    assert delays[0] < delays[2]
    assert "exited with status 1" in reconciler.memory.records.health["m"].last_failure


async def test_a_node_without_the_engine_fails_the_replica_at_once_saying_how_to_install_it():
    reconciler, fleet, _, _ = build([{"name": "m"}], nodes=("a",))
    fleet.missing_program["a"] = "vllm is not on PATH=/usr/bin:/bin on this node"
    await until(lambda: reconciler.memory.records.health.get("m") and reconciler.memory.records.health["m"].failures == 1,
                reconciler, fleet, what="the first failure")
    reason = reconciler.memory.records.health["m"].last_failure
    assert reason.startswith("engine vllm is not installed on a: vllm is not on PATH=/usr/bin:/bin on this node; "
                             "install vLLM on the node (`pip install vllm`"), reason
    failed = [r for r in [*reconciler.memory.records.replicas.values(), *(r for _, r in reconciler.memory.records.retired)] if r.model == "m"]
    assert failed and all(s.state == FAILED and s.reason == reason for r in failed for s in r.shards)
    assert fleet.engines["a"] == {}


async def test_a_stored_log_tail_never_carries_the_engine_key():
    reconciler, fleet, _, _ = build([{"name": "m"}])
    await settle(reconciler, fleet)
    replica = serving(reconciler, "m")[0]
    fleet.crash_engine(replica.leader.node, replica.leader.id, log_tail=[f"Bearer {replica.api_key} refused", "bye"])
    await settle(reconciler, fleet, 1)
    assert replica.leader.log_tail == ["Bearer *** refused", "bye"]
    assert reconciler.memory.records.health["m"].last_log_tail == ["Bearer *** refused", "bye"]


async def test_surplus_and_removed_models_are_stopped():
    reconciler, fleet, holder, pushed = build([{"name": "m", "scaling": {"min": 2}}, {"name": "gone"}])
    await settle(reconciler, fleet)
    holder.swap(catalog([{"name": "m", "scaling": {"min": 1}}], version=2))
    await until(lambda: len(reconciler.memory.records.replicas) == 1, reconciler, fleet, what="teardown")
    stops = [c for c in fleet.calls if c[1] == "stop"]
    assert len(stops) == 2
    assert set(pushed[-1]) == {"m"} and len(pushed[-1]["m"]) == 1


async def test_drain_is_a_rolling_move():
    """R-9.5: the original stops only once its replacement serves."""
    reconciler, fleet, _, pushed = build([{"name": "m", "profile": "whole"}], nodes=("a", "b"))
    await settle(reconciler, fleet)
    original = serving(reconciler, "m")[0]
    source = original.leader.node
    reconciler.set_admin(source, "draining", grace=60)
    reconciler.step()
    for _ in range(5):
        await asyncio.sleep(0)
    assert original.id in reconciler.memory.records.replicas and not original.retiring  # still serving traffic
    assert any(e.replica_id == original.id for e in pushed[-1]["m"])
    await until(lambda: original.id not in reconciler.memory.records.replicas, reconciler, fleet, what="original stopped")
    moved = serving(reconciler, "m")
    assert len(moved) == 1 and moved[0].leader.node != source and moved[0].replaces == original.id


async def test_drain_of_the_only_possible_node_finishes_at_the_grace():
    reconciler, fleet, _, _ = build([{"name": "m", "profile": "whole"}], nodes=("a",))
    await settle(reconciler, fleet)
    original = serving(reconciler, "m")[0]
    reconciler.set_admin("a", "draining", grace=0.2)
    await until(lambda: original.id not in reconciler.memory.records.replicas, reconciler, fleet, what="drain to finish")
    assert "cannot place" not in str(reconciler.memory.placing.unplaceable.get("m", "")) or reconciler.memory.placing.unplaceable["m"].plan is None


async def test_multi_node_replica_spans_one_fabric_with_a_leader():
    reconciler, fleet, _, _ = build([{"name": "m", "profile": "pair"}], nodes=("a", "b", "c"))
    await settle(reconciler, fleet)
    replica = serving(reconciler, "m")[0]
    assert len(replica.shards) == 2 and replica.leader.rank == 0
    launches = {c[2]["shard_id"]: c[2]["argv"] for c in fleet.calls if c[1] == "launch"}
    worker = launches[replica.shards[1].id]
    assert "--headless" in worker and "--node-rank" in worker and "h-" + replica.leader.node in worker


async def test_on_demand_loads_on_demand_and_stops_when_idle():
    """R-6.8: nothing runs until asked; one replica while nothing loads it; stopped after idle_timeout."""
    reconciler, fleet, _, _ = build([{"name": "m", "scaling": {"min": 0, "max": 5, "idle_timeout": 0.3}}])
    await settle(reconciler, fleet)
    assert not reconciler.memory.records.replicas
    reconciler.note_demand("m")
    reconciler.note_demand("m")
    await settle(reconciler, fleet)
    assert len(reconciler.memory.records.replicas) == 1 and len(serving(reconciler, "m")) == 1
    replica_id = next(iter(reconciler.memory.records.replicas))
    reconciler.routers.last_used = lambda: {replica_id: time.time()}
    await settle(reconciler, fleet)
    assert replica_id in reconciler.memory.records.replicas
    reconciler.routers.last_used = lambda: {}
    await until(lambda: not reconciler.memory.records.replicas, reconciler, fleet, what="idle stop")


async def test_load_scales_up_and_down_draining_first_and_every_decision_is_audited(tmp_path):
    """R-6.8a, R-6.8b: the router's figures scale the model; a replica scaled away leaves the
    router at once and is stopped only once its requests have ended."""
    store = Store.open(tmp_path / "state.db")
    reconciler, fleet, _, pushed = build([{"name": "m", "scaling": {"min": 1, "max": 3, "target": 4,
                                                                    "up_delay": 0, "down_delay": 0}}], store=store)
    in_flight: dict[str, int] = {}
    reconciler.routers.outstanding = lambda rid: in_flight.get(rid, 0)  # read by the pass and by each stop
    try:
        await settle(reconciler, fleet)
        [first] = serving(reconciler, "m")
        in_flight[first.id] = 9
        await until(lambda: len(serving(reconciler, "m")) == 3, reconciler, fleet, what="scale-up")
        model = reconciler.view.get().models["m"]
        assert model.desired == 3 and (model.scale_ups, model.scale_downs) == (1, 0)
        assert model.last_scale.reason == "scale 1→3: 9.0 in flight over 0s, target 4"
        others = sorted((r for r in serving(reconciler, "m") if r is not first), key=lambda r: r.created_at)
        in_flight.update({first.id: 2, others[0].id: 1, others[1].id: 1})
        await settle(reconciler, fleet, 2)
        # 4 in flight, target 4: one replica. The two least loaded go (the newest first), off the
        # router at once, but their engines keep running while a request is in flight.
        assert [r.id for r in reconciler.memory.records.replicas.values() if r.retiring] == [o.id for o in others]
        assert [e.replica_id for e in pushed[-1]["m"]] == [first.id]
        stopped = {c[2]["shard_id"] for c in fleet.calls if c[1] == "stop"}
        assert not stopped & {s.id for o in others for s in o.shards}
        in_flight.update({others[0].id: 0, others[1].id: 0})
        await until(lambda: set(reconciler.memory.records.replicas) == {first.id}, reconciler, fleet, what="scale-down")
        model = reconciler.view.get().models["m"]
        assert model.desired == 1 and (model.scale_ups, model.scale_downs) == (1, 1)
        down = "scale 3→1: 4.0 in flight over 0s, target 4"
        assert model.last_scale.reason == down
        assert {r.reason for _, r in reconciler.memory.records.retired} <= {down}
        await store.write(lambda db: None)  # the writes queued before it are done
        rows = store.read_sync(lambda db: list(db["audit"].rows_where("actor = ?", ["autoscaler"], order_by="ts")))
        assert [(r["action"], r["target"], json.loads(r["detail"])["reason"]) for r in rows] == [
            ("model.scale.up", "m", "scale 1→3: 9.0 in flight over 0s, target 4"), ("model.scale.down", "m", down)]
    finally:
        store.close()


async def test_partitioned_node_is_replaced_and_its_engine_stopped_on_return():
    """Scenario 3 in small: no duplicate survives the return."""
    reconciler, fleet, _, _ = build([{"name": "m", "profile": "whole"}], nodes=("a", "b"))
    await settle(reconciler, fleet)
    original = serving(reconciler, "m")[0]
    node = original.leader.node
    fleet.links[node].cut()
    await until(lambda: any(r.serving and r.leader.node != node for r in reconciler.memory.records.replicas.values()),
                reconciler, fleet, what="replacement elsewhere")
    assert original.leader.state == FAILED
    assert fleet.engines[node][original.leader.id]["alive"]  # unreachable: nothing could be signalled
    fleet.links[node].restore()
    await until(lambda: original.leader.id not in fleet.engines[node], reconciler, fleet, timeout=20,
                what="old engine stopped after the return")
    assert len([r for r in reconciler.memory.records.replicas.values() if r.serving]) == 1


async def test_a_node_still_in_its_first_connection_past_the_settling_window_keeps_its_replicas():
    """R-4.5: after a restart a node may wait its turn at the connect gate, or answer slowly,
    for longer than the settling window; nothing is known of it until that attempt ends, so its
    replicas are not given up. Once the attempt fails, the window counts from the failure."""
    reconciler, fleet, _, _ = build([{"name": "m", "profile": "whole"}], nodes=("a", "b"))
    await settle(reconciler, fleet)
    original = serving(reconciler, "m")[0]
    node = original.leader.node
    link = fleet.links[node]
    link.state, link.since = states.LinkState.CONNECTING, time.time() - 60  # 200 settling windows ago
    await settle(reconciler, fleet, 3)
    assert original.serving and len(reconciler.memory.records.replicas) == 1  # kept, and no replacement placed
    link.cut()  # the attempt failed: unreachable from now
    await settle(reconciler, fleet, 1)
    assert original.serving  # within the window, counted from the failure
    await until(lambda: original.leader.state == FAILED, reconciler, fleet, what="the replica given up")
    assert "unreachable since" in (original.leader.reason or "")


async def test_engines_llmgw_does_not_know_are_reported_not_killed():
    reconciler, fleet, _, _ = build([])
    fleet.engines["a"]["stranger-0"] = {"pid": 5, "start_time": 50, "argv": ["x"], "alive": True,
                                        "started_at": 0, "port": 1}
    await settle(reconciler, fleet)
    assert reconciler.memory.nodes.unknown_engines["a"] == ["stranger-0"]
    assert not [c for c in fleet.calls if c[1] == "stop"]


async def test_start_timeout_fails_and_replaces():
    """R-4.3: a shard stuck in starting past the profile's start timeout is failed."""
    reconciler, fleet, _, _ = build([{"name": "m"}])
    original_call = fleet.call

    async def unhealthy_launch(node, op, args=None, timeout=None):
        result = await original_call(node, op, args, timeout)
        if op == "launch":
            fleet.engines[node][args["shard_id"]]["healthy"] = False
        return result

    fleet.call = unhealthy_launch
    await until(lambda: reconciler.memory.records.replicas, reconciler, fleet, what="a placement")
    first = next(iter(reconciler.memory.records.replicas.values()))
    await until(lambda: first.leader.state == FAILED, reconciler, fleet, what="start timeout")
    assert "did not become ready within" in first.leader.reason


@pytest.mark.parametrize("memory", [None, 8])
async def test_unknown_memory_is_placeable_small_memory_is_not(memory):
    inventory_models = [{"name": "m", "profile": "one"}]
    reconciler, fleet, _, _ = build(inventory_models, nodes=("a",))
    reconciler.holder.swap(Catalog.build(
        file_models=[ModelConfig(name="m", profile="big", weights="hf:org/x")],
        profiles={**PROFILES, "big": ProfileConfig(engine="vllm", gpus=1, min_memory_gb=24)}, version=2))
    fleet.facts["a"].inventory = fleet.facts["a"].inventory.__class__(
        **{**fleet.facts["a"].inventory.__dict__, "memory_bytes": None if memory is None else memory * 10**9})
    await settle(reconciler, fleet)
    if memory is None:
        assert serving(reconciler, "m")
    else:
        assert not reconciler.memory.records.replicas
        assert "has 8 GB of memory, needs 24" in " ".join(reconciler.memory.placing.unplaceable["m"].verdicts[0].reasons)


async def test_undeclared_size_is_learned_before_placement():
    """R-5.1: without disk_gb, a node asks the source; placement then checks the cache space."""
    reconciler, fleet, _, _ = build([{"name": "m"}], nodes=("a",))
    fleet.source_bytes = 5 * 10**12  # 5 TB: more than the node's cache has free
    storage = fleet.facts["a"].storage
    fleet.facts["a"].storage = storage.__class__(
        (storage.filesystems[0].__class__("1:1", "ext4", "/", False, 10**12, 10**11,
                                          (fleet.paths("a").cache_dir,)),))
    await settle(reconciler, fleet)
    assert not reconciler.memory.records.replicas
    assert [c for c in fleet.calls if c[1] == "source_size"]
    assert list(reconciler.actions.learned.sizes.values()) == [5 * 10**12]
    assert "needs 5000" in " ".join(reconciler.memory.placing.unplaceable["m"].verdicts[0].reasons)
    fleet.source_bytes = 10**9
    reconciler.actions.learned.sizes.clear()  # (a new catalog with another source would be asked afresh)
    await settle(reconciler, fleet)
    assert serving(reconciler, "m")


async def test_shards_waiting_for_the_same_weights_on_a_node_share_one_fetch():
    """R-5.3: one download per node and weights, however many shards wait for it."""
    reconciler, fleet, _, _ = build([{"name": "m", "scaling": {"min": 2}}], nodes=("a",))
    await settle(reconciler, fleet)
    assert len(serving(reconciler, "m")) == 2
    assert len([c for c in fleet.calls if c[1] == "fetch"]) == 1
    assert not reconciler.actions.fetches  # the job is gone once its download ended


@pytest.mark.parametrize("verified,fetches", [pytest.param(True, 0, id="hashed-here"),
                                               pytest.param(False, 1, id="not-hashed-here")])
async def test_a_held_entry_not_yet_hashed_on_the_node_goes_through_fetch_first(verified, fetches):
    """R-5.6: weights another node fetched onto a shared filer are checked by hash on this node
    (the helper's fetch of a present entry) before the launch, so the launch reads no big file."""
    reconciler, fleet, holder, _ = build([{"name": "m"}], nodes=("a",))
    path = f"{fleet.paths('a').cache_dir}/{holder.current.get('m').source.cache_name}"  # where the node holds it
    fleet.facts["a"].holdings = {"m": Held(path, 10**9, None, verified)}
    await settle(reconciler, fleet)
    assert serving(reconciler, "m")
    fetched = [f"{c[2]['cache_dir']}/{c[2]['name']}" for c in fleet.calls if c[1] == "fetch"]
    assert len(fetched) == fetches
    [launch] = [c for c in fleet.calls if c[1] == "launch"]
    assert any((fetched or [path])[0] in part for part in launch[2]["argv"]), "launched from what fetch answered"


async def test_an_on_demand_load_on_a_full_node_evicts_the_longest_idle_replica():
    """Eviction (llmgw.control.evict): the longest idle of the evictable replicas is retired with
    its reason, no more than the placement needs, and the waiting model is placed once it stopped."""
    models = [{"name": n, "weights": f"hf:org/{n}", "disk_gb": 1, "scaling": {"min": 0, "idle_timeout": None}}
              for n in ("old", "recent", "wanted")]
    reconciler, fleet, _, _ = build(models, nodes=("a",), evict_idle=5.0)
    fleet.facts["a"] = dataclasses.replace(fleet.facts["a"], inventory=dataclasses.replace(
        fleet.facts["a"].inventory, gpus=fleet.facts["a"].inventory.gpus[:2]))
    await settle(reconciler, fleet)
    assert reconciler.view.get().node("a").download_rate is None  # nothing fetched yet: unknown, not 0
    for name in ("old", "recent"):
        reconciler.note_demand(name)
    await until(lambda: len(serving(reconciler, "old")) == 1 and len(serving(reconciler, "recent")) == 1,
                reconciler, fleet, what="both serving")
    assert reconciler.actions.learned.download_rates["a"] > 0  # measured from the fetches just made
    old, = serving(reconciler, "old")
    recent, = serving(reconciler, "recent")
    now = time.time()
    reconciler.routers.last_used = lambda: {old.id: now - 3600, recent.id: now - 60}
    await settle(reconciler, fleet, 1)  # last use is read from the router once a pass

    explanation = reconciler.placing.explain("wanted")
    assert explanation.plan is None
    assert explanation.verdicts[0].what_if.startswith(
        f"fits if {old.id} (idle 1 h) is stopped, after a 1 GB download (about ")  # at the measured rate

    reconciler.note_demand("wanted")
    await settle(reconciler, fleet, 1)
    assert old.retiring and old.reason == "evicted for wanted (idle 1 h)"
    assert recent.serving and not recent.retiring
    await until(lambda: len(serving(reconciler, "wanted")) == 1, reconciler, fleet, what="wanted serving")
    assert old.id not in reconciler.memory.records.replicas and recent.serving
    assert reconciler.memory.placing.evicting == {}
    view = reconciler.view.get()
    evicted = view.replica(old.id)
    assert evicted.retired and evicted.reason == "evicted for wanted (idle 1 h)"
    assert [r.id for r in view.retired] == [old.id]
    stops = [c for c in fleet.calls if c[1] == "stop"]
    assert [c[2]["shard_id"] for c in stops] == [old.shards[0].id]  # one replica stopped, no more


async def test_inventory_asks_about_the_catalogs_engines_and_placement_reads_the_answers():
    """R-4.12: the images and venv recipes of the catalog's profiles are what each inventory asks
    about; the answers become the node views placement judges and ranks by."""
    from llmgw.control.placement import ContainerView, VenvView
    from llmgw.fleet.facts import ContainerProgram, VenvCheck
    from llmgw.fleet.ops import InventoryRequest
    from llmgw.runtimes import runtime_spec, runtime_digest

    profiles = {**PROFILES, "boxed": ProfileConfig(engine="vllm", gpus=1, runtime="container", image="img:1"),
                "env": ProfileConfig(engine="vllm", runtime="venv", packages=["vllm==1"], python="python3.12")}
    reconciler, fleet, holder, _ = build([{"name": "m"}], nodes=("a", "b", "c"))
    holder.swap(Catalog.build(file_models=[ModelConfig(name="boxed-model", profile="boxed", weights="hf:org/x"),
                                           ModelConfig(name="env-model", profile="env", weights="hf:org/y"),
                                           ModelConfig(name="m", profile="one", weights="hf:org/m")],
                              profiles=profiles, version=2))
    spec = runtime_spec(profiles["env"])
    key = runtime_digest(spec)
    assert reconciler.nodes.inventory_wanted(fleet.nodes["a"]) == InventoryRequest(images=["img:1"], venvs={key: spec})

    down = "docker cannot reach its daemon (DOCKER_HOST=unset): Cannot connect to the Docker daemon"
    absent = ContainerProgram("podman", None)
    reported = {
        "a": ({"docker": ContainerProgram("docker", "/usr/bin/docker", False, down), "podman": absent},
              {key: VenvCheck("python3.12", False, error="not on PATH")}),
        "b": ({"docker": ContainerProgram("docker", "/usr/bin/docker", True, None, ("nvidia", "runc"), True,
                                          {"img:1": True}), "podman": absent},
              {key: VenvCheck("python3.12", True, "/usr/bin/python3.12", "3.12.1", "ab" * 32, True)}),
    }
    for name, (containers, venvs) in reported.items():
        fleet.facts[name].inventory = dataclasses.replace(fleet.facts[name].inventory, containers=containers,
                                                          venvs=venvs)
    assert reconciler.nodes.view("a").containers == {"docker": ContainerView(True, False, None, None, down),
                                                    "podman": ContainerView(False)}
    assert reconciler.nodes.view("b").venvs == {key: VenvView(True, True)}
    assert reconciler.nodes.view("c").containers is None and reconciler.nodes.view("c").venvs is None

    boxed = reconciler.placing.explain("boxed-model")
    verdicts = {v.node: v for v in boxed.verdicts}
    assert boxed.plan.leader.node == "b" and verdicts["b"].holds_engine is True
    assert "has image img:1" in verdicts["b"].reasons
    assert verdicts["c"].fits and "container program not checked yet" in verdicts["c"].reasons
    assert not verdicts["a"].fits and verdicts["a"].reasons == (
        f"docker does not work on the node ({down}): start its daemon, or set DOCKER_HOST for the node's helper, "
        "or use runtime: host",)
    env = {v.node: v for v in reconciler.placing.explain("env-model").verdicts}
    assert [v.node for v in reconciler.placing.explain("env-model").verdicts] == ["b", "c", "a"]
    assert env["a"].reasons[-1].startswith("no Python python3.12 on the node")
