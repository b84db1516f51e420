"""A changed model rolls on a simulated fleet (R-4.13, R-8.6): every replica replaced, one at a
time, each old one retired only once a new one serves; a failing revision pauses; undo goes back."""

from __future__ import annotations

import pytest

from llmgw import revisions
from llmgw.contracts import states
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
