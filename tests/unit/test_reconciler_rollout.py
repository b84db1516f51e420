"""A changed model rolls on a simulated fleet (R-4.13, R-8.6): every replica replaced, one at a
time, each old one retired only once a new one serves; a failing revision pauses; undo goes back."""

from __future__ import annotations

import pytest

from llmgw import revisions
from llmgw.contracts import states
from llmgw.control.reconciler import Reconciler
from llmgw.control.routers import Routers
from llmgw.fleet.facts import Held
from llmgw.store import Store
from tests.unit.test_reconciler import build, catalog, serving, settle, until


@pytest.fixture(autouse=True)
def no_refused_transitions():
    states.refused.clear()
    yield
    assert not states.refused, f"transitions refused: {dict(states.refused)}"


def by_revision(reconciler, model="m"):
    counts: dict[str, int] = {}
    for r in reconciler.memory.records.replicas.values():
        if r.model == model and not r.retiring:
            counts[r.revision] = counts.get(r.revision, 0) + 1
    return counts


async def test_r4_13_a_changed_definition_rolls_one_replica_at_a_time(tmp_path):
    store = Store.open(tmp_path / "state.db")
    reconciler, fleet, holder, _ = build([{"name": "m", "scaling": {"min": 3}}], store=store)
    await settle(reconciler, fleet)
    old = revisions.of(holder.current.get("m"))
    assert {r.revision for r in serving(reconciler, "m")} == {old}
    holder.swap(catalog([{"name": "m", "scaling": {"min": 3}, "served_name": "m2"}], version=2))
    new = revisions.of(holder.current.get("m"))
    low = 3
    for _ in range(200):
        await settle(reconciler, fleet, 1)
        live = [r for r in reconciler.memory.records.replicas.values() if r.model == "m" and not r.retiring]
        assert len(live) <= 4  # surge 1
        low = min(low, len(serving(reconciler, "m")))
        if by_revision(reconciler) == {new: 3} and len(serving(reconciler, "m")) == 3:
            break
    else:
        raise AssertionError(f"the rollout did not end: {by_revision(reconciler)}")
    assert low >= 3  # unavailable 0: never fewer serving than the count
    record = reconciler.memory.rollouts.rollouts["m"]
    assert (record.target, record.previous) == (new, old)
    await settle(reconciler, fleet, 1)
    assert reconciler.memory.rollouts.progress["m"].done
    reasons = [r.reason for _, r in reconciler.memory.records.retired]
    assert reasons.count(f"replaced by revision {new}") == 3
    store.write_sync(lambda db: None)  # the writes queued before are done
    rows = {r["id"]: r["number"] for r in store.read_sync(lambda db: list(db["revisions"].rows))}
    assert rows == {old: 1, new: 2}


async def test_r4_13_a_revision_that_fails_pauses_the_rollout_and_the_old_replicas_serve():
    reconciler, fleet, holder, _ = build([{"name": "m", "scaling": {"min": 2}}])
    await settle(reconciler, fleet)
    old = revisions.of(holder.current.get("m"))
    fleet.crash_on_launch = True
    holder.swap(catalog([{"name": "m", "scaling": {"min": 2}, "served_name": "broken"}], version=2))
    await until(lambda: reconciler.memory.rollouts.rollouts["m"].paused if "m" in reconciler.memory.rollouts.rollouts
                else None, reconciler, fleet, what="a paused rollout")
    record = reconciler.memory.rollouts.rollouts["m"]
    assert "failed" in record.paused and "exited with status 1" in record.paused
    await settle(reconciler, fleet, 5)
    assert {r.revision for r in serving(reconciler, "m")} == {old} and len(serving(reconciler, "m")) == 2
    assert reconciler.memory.rollouts.progress["m"].waiting.startswith("paused: ")


async def test_r8_6_replicas_recorded_before_revisions_take_their_models(tmp_path):
    store = Store.open(tmp_path / "state.db")
    reconciler, fleet, holder, _ = build([{"name": "m"}], store=store)
    await settle(reconciler, fleet)
    replica = serving(reconciler, "m")[0]
    replica.revision = None  # as a replica made before revisions were recorded is loaded
    await settle(reconciler, fleet, 2)
    assert replica.revision == revisions.of(holder.current.get("m"))
    assert serving(reconciler, "m") == [replica]  # not replaced
    assert "m" not in reconciler.memory.rollouts.rollouts


@pytest.mark.parametrize("when", [
    pytest.param("placed", id="placed, nothing launched yet"),
    pytest.param("launched", id="launched, the node's answer not recorded"),
])
async def test_r4_13_a_start_a_restart_interrupted_is_made_again_and_the_rollout_goes_on(tmp_path, when):
    """A replica of the target whose start the control plane's restart cut short did not fail:
    the restarted control plane stops whatever it left on its node and starts it again, the
    rollout neither pausing nor the model's backoff counting it."""
    store = Store.open(tmp_path / "state.db")
    reconciler, fleet, holder, pushed = build([{"name": "m", "scaling": {"min": 2}}], store=store)
    await settle(reconciler, fleet)
    old = revisions.of(holder.current.get("m"))
    holder.swap(catalog([{"name": "m", "scaling": {"min": 2}, "served_name": "m2"}], version=2))
    new = revisions.of(holder.current.get("m"))
    reconciler.step()  # the rollout begins: a replica of the new revision placed, its launch not run yet
    placed = [r for r in reconciler.memory.records.replicas.values() if r.revision == new]
    assert len(placed) == 1 and placed[0].state == states.ShardState.PENDING
    await reconciler.close()  # the control plane stops here
    interrupted, shard = placed[0], placed[0].shards[0]
    if when == "launched":  # the engine started on the node; serve died before its answer came
        shard.set_state(states.ShardState.STARTING)
        shard.port = 8123
        reconciler.actions.save(interrupted)
        fleet.engines[shard.node][shard.id] = {"pid": 99, "start_time": 990, "argv": ["vllm"], "alive": True,
                                               "started_at": 0.0, "port": 8123}
    store.write_sync(lambda db: None)  # what the first control plane queued is written

    again = Reconciler(holder, fleet, store, reconciler.gateway, Routers(push_endpoints=pushed.append))
    await again.load()
    await until(lambda: by_revision(again) == {new: 2} and len(serving(again, "m")) == 2, again, fleet,
                what="every replica on the new revision")
    record = again.memory.rollouts.rollouts["m"]
    assert (record.target, record.previous, record.paused) == (new, old, None)
    assert again.memory.records.health["m"].failures == 0
    assert interrupted.id not in again.memory.records.replicas
    assert shard.id not in fleet.engines[shard.node]  # stopped and forgotten on its node
    retired = {r.id: r for _, r in again.memory.records.retired}
    assert retired[interrupted.id].state == states.ShardState.STOPPED
    assert "interrupted by a control-plane restart" in retired[interrupted.id].reason


async def test_r4_13_a_revision_with_other_weights_is_launched_from_them_not_from_what_the_node_held():
    """The nodes' holdings are reported by model: until they are asked again, they still name the
    entry of the weights a reload replaced. A replica of the new revision fetches its own."""
    reconciler, fleet, holder, _ = build([{"name": "m"}], nodes=("a",))
    cache_dir = fleet.paths("a").cache_dir
    old_entry = f"{cache_dir}/{holder.current.get('m').source.cache_name}"
    fleet.facts["a"].holdings = {"m": Held(old_entry, 10**9, None, True)}  # as the node answered
    await settle(reconciler, fleet)
    assert [c for c in fleet.calls if c[1] == "fetch"] == []  # held: launched from it
    holder.swap(catalog([{"name": "m", "weights": "hf:org/m2"}], version=2))
    new = revisions.of(holder.current.get("m"))
    new_entry = f"{cache_dir}/{holder.current.get('m').source.cache_name}"
    await until(lambda: by_revision(reconciler) == {new: 1} and serving(reconciler, "m"), reconciler, fleet,
                what="the replica on the new revision")
    assert [f"{c[2]['cache_dir']}/{c[2]['name']}" for c in fleet.calls if c[1] == "fetch"] == [new_entry]
    first, second = (c[2]["argv"] for c in fleet.calls if c[1] == "launch")
    assert old_entry in first and new_entry in second and old_entry not in second
