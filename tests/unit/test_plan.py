"""The plan step's decisions: what to launch, retire and mark draining (R-4.1, R-6.8, R-9.5)."""

from __future__ import annotations

from llmgw.catalog import Catalog
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.contracts.states import AdminState, ReplicaPhase
from llmgw.control import plan, scaling
from llmgw.control.plan import Enough, ForgetDemand, Launch, MarkDraining, Retire
from llmgw.control.state import FAILED, SERVING, STARTING, STOPPED, STOPPING, ModelHealth, NodeAdmin, Replica, Shard

NOW = 50_000.0
PROFILES = {"one": ProfileConfig(engine="vllm", gpus=1)}


def models(*configs: dict):
    built = [ModelConfig(**{"profile": "one", "weights": "hf:org/m", **c}) if "endpoints" not in c
             else ModelConfig(**c) for c in configs]
    return Catalog.build(file_models=built, profiles=PROFILES).models


def replica(rid, *, model="m", nodes=("a",), state=SERVING, created=0.0, phase=ReplicaPhase.ACTIVE,
            serving_since=None, reason=None):
    shards = [Shard(id=f"{rid}-{i}", replica_id=rid, rank=i, node=n, gpus=(0,), state=state) for i, n in enumerate(nodes)]
    return Replica(id=rid, model=model, api_key="k", shards=shards, created_at=created, phase=phase,
                   serving_since=serving_since, reason=reason)


def admin(**states):
    return {node: NodeAdmin(AdminState(state), grace) for node, (state, grace) in states.items()}


def decide(model, live, *, health=None, nodes=None, demand=None, last_used=None, started_at=0.0, now=NOW,
           scale=None, load=None):
    """The plan's actions but the scaling it keeps (tests/unit/test_scaling.py covers that)."""
    return [a for a in plan.plan_model(model, live, now,
                                       inputs(model, health=health,
                                              nodes=nodes or admin(a=("active", None), b=("active", None)),
                                              demand=demand, last_used=last_used, started_at=started_at,
                                              scale=scale), load)
            if not isinstance(a, plan.Scaled)]


def inputs(model, *, nodes, health=None, demand=None, last_used=None, started_at=0.0, scale=None):
    """What the reconciler keeps, as the plan reads it, with this model's entries as given."""
    return plan.PlanInputs(admin=nodes, health={} if health is None else {model.name: health},
                           demand={} if demand is None else {model.name: demand}, last_used=last_used or {},
                           scales={} if scale is None else {model.name: scale}, started_at=started_at)


# -- replicas nothing wants, drain marks ------------------------------------------------------

def test_sweep_retires_replicas_of_removed_or_static_models_and_failed_ones():
    catalog = models({"name": "m"}, {"name": "fixed", "endpoints": [{"url": "http://10.0.0.9:8000"}]})
    live = [replica("m-1"), replica("m-2", state=FAILED, reason="engine exited with status 1"),
            replica("gone-1", model="gone"), replica("fixed-1", model="fixed"),
            replica("m-3", state=FAILED, phase=ReplicaPhase.RETIRING)]
    assert plan.sweep(live, catalog) == [Retire("m-2", "engine exited with status 1", failed=True),
                                         Retire("gone-1", "model removed from the catalog"),
                                         Retire("fixed-1", "model removed from the catalog")]


def test_sweep_finishes_the_stop_of_a_replica_adopted_while_it_was_being_stopped():
    """The retiring phase is not stored: a replica adopted with stopping (or partly stopped)
    shards is retired again, so its engines are stopped and it never counts as a live replica."""
    catalog = models({"name": "m"})
    partly = replica("m-2", nodes=("a", "b"))
    partly.shards[0].state = STOPPED
    live = [replica("m-1"), replica("m-3", state=STOPPING), partly]
    assert plan.sweep(live, catalog) == [Retire("m-3", "was being stopped when the control plane restarted"),
                                         Retire("m-2", "was being stopped when the control plane restarted")]


def test_replicas_on_a_draining_node_are_marked_once():
    live = [replica("m-1", nodes=("a", "b")), replica("m-2", nodes=("b",)), replica("m-3", nodes=("c",)),
            replica("m-4", phase=ReplicaPhase.DRAINING), replica("m-5", phase=ReplicaPhase.RETIRING)]
    nodes = admin(a=("draining", None), b=("draining", NOW + 60), c=("cordoned", None))
    assert plan.drain_marks(live, nodes) == [MarkDraining("m-1"), MarkDraining("m-2")]
    assert plan.drain_marks(live, admin(a=("active", None))) == []


# -- counts ------------------------------------------------------------------------------------

def test_missing_replicas_are_launched_and_draining_ones_do_not_count():
    [model] = models({"name": "m", "scaling": {"min": 3}}).values()
    live = [replica("m-1"), replica("m-2", phase=ReplicaPhase.DRAINING)]
    # The draining one serves and one other does, fewer than 3: it keeps serving.
    assert decide(model, live) == [Launch("m", 2)]


def test_enough_replicas_is_said_so():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    assert decide(model, [replica("m-1")]) == [Enough("m")]


def test_surplus_stops_the_ones_not_serving_first_then_the_newest():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    live = [replica("old", created=1.0), replica("new", created=3.0), replica("starting", state=STARTING, created=0.5),
            replica("mid", created=2.0)]
    reason = "surplus: more replicas than wanted"
    assert decide(model, live) == [Retire("starting", reason, drain=True), Retire("new", reason, drain=True),
                                   Retire("mid", reason, drain=True)]


def test_scaling_down_retires_the_least_loaded_then_the_newest_with_the_decisions_reason():
    [model] = models({"name": "m", "scaling": {"min": 1, "max": 3, "down_delay": "60s"}}).values()
    live = [replica("old", created=1.0), replica("new", created=3.0), replica("busy", created=2.0)]
    loads = {"old": 0, "new": 0, "busy": 1}
    trend = scaling.Scale(3, -1, since=NOW - 60, samples=((NOW - 60, 0), (NOW - 45, 1), (NOW - 15, 0)))
    actions = plan.plan_model(model, live, NOW, inputs(model, nodes=admin(a=("active", None)), scale=trend), loads)
    [scaled] = [a for a in actions if isinstance(a, plan.Scaled)]
    reason = "scale 3→1: 0.5 in flight over 30s, target 2"
    assert scaled.scale.desired == 1 and scaled.scale.last.reason == reason
    # Off the router at once, stopped when its requests end: the two idle ones, newest first.
    assert [a for a in actions if isinstance(a, Retire)] == [Retire("new", reason, drain=True),
                                                            Retire("old", reason, drain=True)]


def test_a_failure_backoff_holds_the_launch_and_everything_after_it():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    draining = replica("m-1", state=STARTING, phase=ReplicaPhase.DRAINING)
    waiting = ModelHealth(failures=2, next_attempt=NOW + 4)
    assert decide(model, [draining], health=waiting) == []
    assert decide(model, [draining], health=ModelHealth(failures=2, next_attempt=NOW - 1)) == [
        Launch("m", 1), Retire("m-1", "drained before it served")]


# -- on demand (R-6.8) -----------------------------------------------------------------------

def on_demand(timeout=300):
    [model] = models({"name": "m", "scaling": {"min": 0, "max": 5, "idle_timeout": timeout}}).values()
    return model


def test_on_demand_starts_one_replica_when_asked_however_high_max_is():
    assert decide(on_demand(), []) == [Enough("m")]
    assert decide(on_demand(), [], demand=NOW - 1) == [Launch("m", 1)]


def test_on_demand_keeps_a_replica_used_within_the_idle_timeout():
    served = replica("m-1", serving_since=NOW - 1000)
    assert decide(on_demand(), [served], last_used={"m-1": NOW - 10}) == [Enough("m")]
    assert decide(on_demand(), [replica("m-1", state=STARTING)]) == [Enough("m")]  # not serving yet


def test_on_demand_stops_an_idle_replica_and_forgets_its_demand():
    served = replica("m-1", serving_since=NOW - 1000)
    assert decide(on_demand(), [served], last_used={"m-1": NOW - 400}, demand=NOW - 900) == [
        ForgetDemand("m"), Retire("m-1", "surplus: more replicas than wanted", drain=True)]


def test_unknown_last_use_counts_from_the_start_of_the_control_plane():
    served = replica("m-1", serving_since=NOW - 1000)
    assert decide(on_demand(), [served], started_at=NOW - 100) == [Enough("m")]
    assert decide(on_demand(), [served], started_at=NOW - 400)[0] == ForgetDemand("m")


def test_on_demand_without_an_idle_timeout_keeps_its_replica():
    served = replica("m-1", serving_since=NOW - 10**6)
    assert decide(on_demand(timeout=None), [served]) == [Enough("m")]


# -- rolling drain (R-9.5) -------------------------------------------------------------------

def test_a_draining_replica_stops_once_enough_others_serve():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    original = replica("m-1", phase=ReplicaPhase.DRAINING)
    nodes = admin(a=("draining", NOW + 60), b=("active", None))
    assert decide(model, [original, replica("m-2", nodes=("b",), state=STARTING)], nodes=nodes) == [Enough("m")]
    assert decide(model, [original, replica("m-2", nodes=("b",))], nodes=nodes) == [Enough("m"), Retire("m-1", "drained")]


def test_a_draining_replica_stops_at_the_grace_even_without_a_replacement():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    original = replica("m-1", phase=ReplicaPhase.DRAINING)
    assert decide(model, [original], nodes=admin(a=("draining", NOW + 1))) == [Launch("m", 1)]
    assert decide(model, [original], nodes=admin(a=("draining", NOW))) == [
        Launch("m", 1), Retire("m-1", "drained: grace period over")]
    assert decide(model, [original], nodes=admin(a=("draining", None))) == [Launch("m", 1)]  # no grace: waits


def test_a_draining_replica_that_never_served_stops_at_once():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    original = replica("m-1", state=STARTING, phase=ReplicaPhase.DRAINING)
    assert decide(model, [original, replica("m-2", nodes=("b",), state=STARTING)],
                  nodes=admin(a=("draining", NOW + 60), b=("active", None))) == [
        Enough("m"), Retire("m-1", "drained before it served")]


def test_surplus_and_a_drain_in_one_pass():
    [model] = models({"name": "m", "scaling": {"min": 1}}).values()
    original = replica("m-1", phase=ReplicaPhase.DRAINING, nodes=("a",))
    live = [original, replica("m-2", nodes=("b",), state=STARTING, created=1.0), replica("m-3", nodes=("b",), created=2.0)]
    # m-2 (not serving) goes as surplus; m-3 serves, so the original may stop.
    assert decide(model, live, nodes=admin(a=("draining", NOW + 60), b=("active", None))) == [
        Retire("m-2", "surplus: more replicas than wanted", drain=True), Retire("m-1", "drained")]
