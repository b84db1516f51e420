"""Placing replicas (R-3.5, R-4.1, R-6.8c): where the next replica of a model goes, which idle
replicas of other models are stopped to make room when it fits nowhere (`evict.py`), and why a
model does not fit, with the what-if of `explain-placement`.

`Placing.place` decides, and starts, stops and saves nothing itself: it returns a replica to record
and start (`Start`), replicas to retire (`Evict`), or nothing. `carry_out` applies that decision
through the node tasks (`Actions`): the replica recorded, saved and launched, or the victims
retired and each eviction audited. What placing keeps between passes is `PlacingMemory`: the
models that do not fit, with their explanation, and the evictions under way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw import revisions
from llmgw.catalog import CatalogHolder, Model
from llmgw.config import GatewayConfig
from llmgw.control import evict, placement
from llmgw.control.actions import Actions, Learned
from llmgw.control.nodes import Nodes
from llmgw.control.scaling import ScalingMemory
from llmgw.control.state import ModelHealth, Records, Replica, Shard, new_engine_key, new_replica_id
from llmgw.store import Store, audit

log = logging.getLogger(__name__)

EVICTOR = "evictor"  # the actor of evictions in the audit table
EXPLAIN_EVERY = 10.0  # seconds between full explanations of a model that does not fit


@dataclass(eq=False)
class PlacingMemory:
    """The models that do not fit (their explanation, and when it was made) and the evictions
    under way: the victims still stopping for each model, and what each victim was stopped for."""

    unplaceable: dict[str, placement.Explanation] = field(default_factory=dict)  # model ->
    explained_at: dict[str, float] = field(default_factory=dict)  # model ->
    evicting: dict[str, set[str]] = field(default_factory=dict)  # model -> replicas being stopped to make room for it
    evicted: dict[str, str] = field(default_factory=dict)  # replica id -> the model it was evicted for (kept while listed)

    def forget_models(self, models: Mapping[str, Model]) -> None:
        """A model gone from the catalog is no longer unplaceable."""
        self.unplaceable = {k: v for k, v in self.unplaceable.items() if k in models}

    def forget_evicted(self, records: Records) -> None:
        """An eviction is remembered while its victim is listed, live or retired."""
        if self.evicted:
            listed = records.listed()
            self.evicted = {rid: m for rid, m in self.evicted.items() if rid in listed}


@dataclass(frozen=True, slots=True)
class Start:
    """A replica placed: the reconciler records it, saves it and launches it."""

    replica: Replica
    reasons: tuple[str, ...]  # why its nodes, as placement says


@dataclass(frozen=True, slots=True)
class Evict:
    """Idle replicas of other models to retire, so that one of `model` fits once their GPUs are free."""

    model: str
    victims: tuple[evict.Candidate, ...]
    nodes: tuple[str, ...]  # where the model's replica would then go


class Placing:
    """Placement and eviction over the fleet as one pass sees it."""

    def __init__(self, memory: PlacingMemory, records: Records, scaling: ScalingMemory, learned: Learned,
                 nodes: Nodes, holder: CatalogHolder, gateway: GatewayConfig):
        self.memory = memory
        self.records = records
        self.scaling = scaling  # the routers' last use of each replica: how long it has been idle
        self.learned = learned  # download rates and provisioning times, for the what-if
        self.nodes = nodes
        self.holder = holder
        self.gateway = gateway
        self._pass: tuple[list[placement.NodeView], dict[str, set[int]]] | None = None

    def new_pass(self) -> None:
        """Node views and GPU allocations are built again on first need (once per pass)."""
        self._pass = None

    def explain(self, model_name: str) -> placement.Explanation:
        """Why the model goes where it goes, or nowhere, on the fleet as it is now (R-3.5)."""
        model = self.learned.with_size(self.holder.current.models[model_name])
        allocated = self.records.allocated()
        return placement.explain_placement(model, self.nodes.views(), allocated, avoid=self._avoid(model_name),
                                           what_if=self._what_if(model, allocated, time.time()),
                                           durations=self.learned.durations())

    def place(self, model: Model, now: float) -> Start | Evict | None:
        """One more replica of `model`: placed, else room made for it, else explained (None)."""
        views, allocated = self._views()
        avoid = self._avoid(model.name)
        chosen = placement.place(model, views, allocated, avoid=avoid)
        if chosen is None and avoid:  # a preference, not a ban: the failed node is better than none
            chosen = placement.place(model, views, allocated)
        memory = self.memory
        if chosen is None:
            if self._making_room(model, now):
                memory.unplaceable.pop(model.name, None)
                return None  # placed on a later pass, once the victims' GPUs are free
            room = self._make_room(model, views, allocated, now)
            if room is not None:
                memory.unplaceable.pop(model.name, None)
                return room
            previous = memory.unplaceable.get(model.name)
            if previous is None or now - memory.explained_at.get(model.name, 0.0) > EXPLAIN_EVERY:
                explanation = placement.explain_placement(model, views, allocated,
                                                          what_if=self._what_if(model, allocated, now),
                                                          durations=self.learned.durations())
                if previous is None:
                    log.warning("cannot place %s: %s", model.name, explanation.summary)
                memory.unplaceable[model.name] = explanation
                memory.explained_at[model.name] = now
            return None
        for shard in chosen.shards:
            allocated.setdefault(shard.node, set()).update(shard.gpus)
        memory.unplaceable.pop(model.name, None)
        memory.evicting.pop(model.name, None)
        replica_id = new_replica_id(model.name)
        shards = [Shard(id=f"{replica_id}-{s.rank}", replica_id=replica_id, rank=s.rank, node=s.node, gpus=s.gpus)
                  for s in chosen.shards]
        replica = Replica(id=replica_id, model=model.name, api_key=new_engine_key(), shards=shards,
                          revision=revisions.of(model))
        draining = [r for r in self.records.replicas.values() if r.model == model.name and r.draining]
        if draining:
            replica.replaces = draining[0].id
        return Start(replica, tuple(chosen.reasons))

    def eviction_pool(self, model: Model, now: float) -> list[evict.Candidate]:
        """The replicas that may be evicted for `model`, longest idle first (llmgw.control.evict)."""
        return evict.candidates(self.records.replicas.values(), self.holder.current.models, self.scaling.last_used,
                                now, for_model=model.name, default_idle=self.gateway.evict_idle,
                                started_at=self.records.started_at)

    def _views(self) -> tuple[list[placement.NodeView], dict[str, set[int]]]:
        """Node views and GPU allocations, built once per pass and updated as replicas are placed."""
        if self._pass is None:
            self._pass = (self.nodes.views(), {n: set(g) for n, g in self.records.allocated().items()})
        return self._pass

    def _avoid(self, model: str) -> dict[str, str]:
        """Nodes where this model's last replica just failed: tried elsewhere first."""
        health = self.records.health.get(model)
        if health is None or not health.failed_on or health.failures == 0:
            return {}
        return {node: f"the last replica of {model} failed there ({health.last_failure})"
                for node in health.failed_on}

    def _what_if(self, model: Model, allocated, now: float) -> evict.WhatIf:
        return evict.WhatIf(model, self.eviction_pool(model, now), allocated, self.learned.download_rates, now)

    def _making_room(self, model: Model, now: float) -> bool:
        """Victims are still stopping for `model`: no more are chosen until their GPUs are free."""
        pending = self.memory.evicting.get(model.name)
        if not pending:
            return False
        pending.intersection_update(self.records.replicas)  # a victim's record goes once its engines stop
        if pending:
            return True
        del self.memory.evicting[model.name]
        return False

    def _make_room(self, model: Model, views: list[placement.NodeView], allocated: dict[str, set[int]],
                   now: float) -> Evict | None:
        """Idle replicas of other models whose stop lets a replica of `model` fit (llmgw.control.evict)."""
        if not evict.may_evict_for(self.records.health.get(model.name), now):
            return None
        pool = self.eviction_pool(model, now)
        found = evict.choose(model, views, allocated, pool) if pool else None
        if found is None:
            return None
        victims, chosen = found
        for victim in victims:
            self.memory.evicted[victim.replica_id] = model.name
        self.memory.evicting[model.name] = {v.replica_id for v in victims}
        return Evict(model.name, victims, tuple(s.node for s in chosen.shards))


def carry_out(outcome: Start | Evict | None, model: Model, now: float, actions: Actions, store: Store | None) -> bool:
    """Apply what `Placing.place` decided: a replica recorded, saved and launched (True); or idle
    replicas of other models retired and audited, this model placed on a later pass once they
    stopped (False, as when nothing was placed)."""
    records = actions.records
    match outcome:
        case Start(replica=replica):
            records.replicas[replica.id] = replica
            records.health.setdefault(model.name, ModelHealth()).launches += 1
            log.info("placing %s as %s on %s (%s)", model.name, replica.id, ", ".join(replica.nodes),
                     "; ".join(outcome.reasons))
            actions.save(replica)
            actions.launch(replica, model)
            return True
        case Evict(victims=victims):
            log.info("evicting %s to place %s on %s", ", ".join(v.idle_words(now) for v in victims), model.name,
                     ", ".join(outcome.nodes))
            for victim in victims:
                reason = evict.eviction_reason(model.name, victim, now)
                actions.retire(records.replicas[victim.replica_id], reason)
                if store is not None:
                    detail = {"model": victim.model, "for": model.name, "idle_seconds": round(now - victim.idle_since, 1),
                              "nodes": sorted(victim.gpus), "reason": reason}
                    store.submit(lambda db, rid=victim.replica_id, detail=detail: audit(db, EVICTOR, "evict", rid, detail))
    return False
