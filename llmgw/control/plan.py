"""The plan step: what to launch, retire and mark draining, as small actions (R-4.1, R-6.8, R-6.8a, R-9.5).

Pure: a plan is a function of the catalog's models, the live replicas, the clock, the records
the reconciler keeps (`PlanInputs`: node admin, each model's launch record, demand and scaling,
each replica's last use) and the load of a model's replicas. The reconciler carries the actions
out, in the order given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.catalog import Model
from llmgw.contracts.states import AdminState
from llmgw.control import rollout, scaling
from llmgw.control.state import (ACTIVE_PHASE, DRAINING_PHASE, FAILED, RETIRING_PHASE, STOPPED, STOPPING, ModelHealth,
                                 NodeAdmin, Replica)


@dataclass(frozen=True, slots=True)
class Launch:
    """Place and start `count` more replicas of the model (as many as fit)."""

    model: str
    count: int


@dataclass(frozen=True, slots=True)
class Retire:
    """Take a replica out of service and stop its engines."""

    replica_id: str
    reason: str
    failed: bool = False  # a failure: counted toward the model's backoff first
    drain: bool = False  # a healthy surplus: its engines stop when its requests have ended


@dataclass(frozen=True, slots=True)
class MarkDraining:
    """Mark a replica for a rolling move: it serves until it is retired (R-9.5)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class ForgetDemand:
    """An on-demand model's demand is answered or gone idle: it no longer asks for a replica."""

    model: str


@dataclass(frozen=True, slots=True)
class Scaled:
    """The model's scaling changed (a trend moved on, or a decision: `scale.last` is new)."""

    model: str
    scale: scaling.Scale


@dataclass(frozen=True, slots=True)
class Enough:
    """The model has as many replicas as wanted: a 'cannot place' explanation no longer holds."""

    model: str


@dataclass(frozen=True, slots=True)
class Rolling:
    """A model's target revision and how its replicas move to it (llmgw.control.rollout, R-4.13)."""

    target: str
    shape: rollout.Shape
    paused: str | None = None
    promoted: bool = False


@dataclass(frozen=True, slots=True)
class Rolled:
    """Where the model's rollout stands after this pass: why it waits, or that it is done."""

    model: str
    waiting: str | None
    done: bool


Action = Launch | Retire | MarkDraining | ForgetDemand | Enough | Scaled | Rolled


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the plan reads besides a model, its replicas, the clock and their load: the records the
    reconciler keeps, the same for every model of a pass. The mappings are the reconciler's own,
    read here and never changed."""

    admin: Mapping[str, NodeAdmin]  # node -> what the operator set on it
    health: Mapping[str, ModelHealth]  # model -> its launch record (absent: nothing failed)
    demand: Mapping[str, float]  # on-demand model -> when it was asked for while nothing served it
    last_used: Mapping[str, float]  # replica id -> the routers' last use of it
    scales: Mapping[str, scaling.Scale]  # model -> its scaling as the last pass left it
    started_at: float  # when this control plane started
    rolling: Mapping[str, Rolling] = field(default_factory=dict)  # model -> its target revision and rollout



def sweep(replicas: Iterable[Replica], models: Mapping[str, Model]) -> list[Retire]:
    """Replicas nothing wants any more: their model left the catalog (or serves from a fixed
    URL now), they failed (R-4.1), or their stop was under way when the control plane restarted (or
    their start, which the adopting control plane stops to make again: Records.adopt)."""
    retire = []
    for replica in replicas:
        if replica.phase is RETIRING_PHASE:
            continue
        model = models.get(replica.model)
        if model is None or model.static:
            retire.append(Retire(replica.id, "model removed from the catalog"))
        elif replica.state == FAILED:
            retire.append(Retire(replica.id, replica.reason or "failed", failed=True))
        elif any(s.state in (STOPPING, STOPPED) for s in replica.shards):
            # Adopted while it was being stopped (the retiring phase is not stored): its stop is
            # finished, not forgotten, or it would count as a replica that never serves.
            retire.append(Retire(replica.id, replica.reason or "was being stopped when the control plane restarted"))
    return retire


def live_by_model(replicas: Iterable[Replica]) -> dict[str, list[Replica]]:
    """The replicas not being retired, by model, in the order given."""
    by_model: dict[str, list[Replica]] = {}
    for replica in replicas:
        if replica.phase is not RETIRING_PHASE:
            by_model.setdefault(replica.model, []).append(replica)
    return by_model


def drain_marks(replicas: Iterable[Replica], admin: Mapping[str, NodeAdmin]) -> list[MarkDraining]:
    """Replicas on a draining node that are not marked yet (R-9.5)."""
    wanted = AdminState.DRAINING
    draining = {node for node, a in admin.items() if a.state == wanted}
    if not draining:
        return []
    return [MarkDraining(r.id) for r in replicas
            if r.phase is ACTIVE_PHASE and any(s.node in draining for s in r.shards)]


def desired(model: Model, active: list[Replica], now: float, *, demand: float | None,
            last_used: Mapping[str, float], started_at: float) -> tuple[int, bool]:
    """How many replicas the model wants without load, and whether its demand is to be forgotten.

    On demand: one replica while there is demand or recent use (load may add more up to max,
    llmgw.control.scaling), none once every replica is idle past the timeout (R-6.8)."""
    if not model.on_demand:
        return model.min_replicas, False
    if demand is not None and not active:
        return 1, False
    if not active:
        return 0, False
    timeout = model.idle_timeout
    if timeout is None:
        return 1, False
    for replica in active:
        if not replica.serving:
            return 1, False
        used = last_used.get(replica.id)
        # Unknown last use (router just started) is not idle: the clock starts at that start.
        reference = max(filter(None, [used, replica.serving_since, started_at, demand]))
        if now - reference < timeout:
            return 1, False
    return 0, True


def plan_model(model: Model, live: list[Replica], now: float, inputs: PlanInputs,
               load: Mapping[str, float] | None = None) -> list[Action]:
    """The actions for one model, from its live (not retiring) replicas.

    The count wanted is the scaling decision's (llmgw.control.scaling), from the model's previous
    one (`inputs.scales`) and `load` (replica id -> its load; None: the model does not scale on
    load). A surplus is retired least useful first: not serving, then least loaded, then newest.
    A launch waits out the model's failure backoff, and while it waits nothing else is decided
    for the model, draining replicas included (they keep serving)."""
    name = model.name
    scale = inputs.scales.get(name)
    active = [r for r in live if r.phase is not DRAINING_PHASE]
    floor, forget = desired(model, active, now, demand=inputs.demand.get(name), last_used=inputs.last_used,
                            started_at=inputs.started_at)
    total = None
    if load is not None:
        total = 0.0
        for replica in live:
            total += load.get(replica.id, 0)
    decided = scaling.decide(model, scale, awake=floor > 0, current=len(active), load=total, now=now)
    count = decided.desired
    actions: list[Action] = [ForgetDemand(model.name)] if forget else []
    if decided is not scale:
        actions.append(Scaled(model.name, decided))
    missing = count - len(active)
    surplus: list[Replica] = []
    rolling = inputs.rolling.get(name)
    moved = None
    if rolling is not None:
        members = [rollout.Member(r.id, r.revision, r.serving, r.created_at) for r in active]
        moved = rollout.step(rolling.target, members, count, rolling.shape, paused=rolling.paused,
                             promoted=rolling.promoted)
        actions.append(Rolled(name, moved.waiting, moved.done))
    if moved is not None and not moved.done:
        # Replaced by the rule a drain uses: the old ones leave as drained surplus.
        retiring = set(moved.retire)
        actions.extend(Retire(r.id, f"replaced by revision {rolling.target}", drain=True)
                       for r in active if r.id in retiring)
        surplus = [r for r in active if r.id in retiring]
        if moved.launch:
            health = inputs.health.get(name)
            if health is None or now >= health.next_attempt:
                actions.append(Launch(model.name, moved.launch))
    elif missing > 0:
        health = inputs.health.get(name)
        if health is not None and now < health.next_attempt:
            return actions
        actions.append(Launch(model.name, missing))
    elif missing < 0:
        # Surplus: stop the least useful first — not serving, then the least loaded, then the newest.
        loads = load or {}
        surplus = sorted(active, key=lambda r: (r.serving, loads.get(r.id, 0), -r.created_at))[:-missing]
        last = decided.last
        reason = last.reason if last is not None and last.after == count < last.before else \
            "surplus: more replicas than wanted"
        actions.extend(Retire(r.id, reason, drain=True) for r in surplus)
    else:
        actions.append(Enough(model.name))
    draining = [r for r in live if r.phase is DRAINING_PHASE]
    if not draining:
        return actions
    # Rolling move: a draining replica stops once enough others serve, or at the grace.
    retired = {r.id for r in surplus}
    serving_active = sum(1 for r in active if r.serving and r.id not in retired)
    admin = inputs.admin
    for replica in draining:
        grace_over = any(admin[n].state == AdminState.DRAINING and admin[n].grace_until is not None
                         and now >= admin[n].grace_until for n in replica.nodes if n in admin)
        if serving_active >= count or grace_over or not replica.serving:
            actions.append(Retire(replica.id, "drained" if serving_active >= count else
                                  "drained: grace period over" if grace_over else "drained before it served"))
    return actions
