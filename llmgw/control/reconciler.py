"""The reconciler: compares desired with actual on every pass and acts (R-4.1–R-4.5, R-5.3, R-9.5).

A pass (`step`) is synchronous and cheap: observe (`observe.py` judges every live shard from the
fleet's latest facts), apply (the judgements, through the transition table), plan (`plan.py`
decides per model what to launch, retire and mark draining), act (each action carried out here:
a launch asks `placing.py` where the replica goes or what to evict for it, and anything that needs
a node becomes a task of `actions.py`: fetch, launch, stop), push (the endpoint table to the
routers, when it changed) and publish (a view of the state for the admin, llmgw.control.publish).
Every change of a replica is saved to SQLite as it is made. It runs on a tick and immediately when
something changes (`wake`).

What it remembers between passes is a `ControlMemory` (llmgw.control.memory), whose parts it gives
explicitly to those that keep them: node admin to `Nodes`, placement and eviction to `Placing`, the
records to `Actions`, whose tasks change replicas too (a launch's progress, a stop's end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.aio import cancel_and_wait
from llmgw.catalog import CatalogHolder, Model
from llmgw.config import GatewayConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.states import AdminState, ReplicaPhase
from llmgw.control import evict, observe, plan, placing
from llmgw.control.actions import RETIRE_GRACE, Actions
from llmgw.control.cleanup import CacheUse, Cleanup
from llmgw.control.memory import ControlMemory
from llmgw.control.nodes import NodeMemory, Nodes
from llmgw.control.publish import Published, Sources
from llmgw.control.state import (FAILED, RETIRING_PHASE, SERVING, ModelHealth, NodeAdmin, Replica, Shard, delete_replica,
                                 load_replicas, save_replica)
from llmgw.fleet.fleet import Fleet
from llmgw.store import Store, audit

log = logging.getLogger(__name__)

AUTOSCALER = "autoscaler"  # the actor of scaling decisions in the audit table


@dataclass(eq=False)
class Routers:
    """The routers as the reconciler sees them (in `llmgw serve`, through the feed publisher): the
    figures it reads each pass, and where it pushes the endpoint table. None: not known here."""

    push_endpoints: Callable[[dict[str, list[Endpoint]]], None] | None = None
    last_used: Callable[[], Mapping[str, float]] | None = None  # replica id -> last use, since the last call
    outstanding: Callable[[str], int] | None = None  # requests in flight per replica (scaling, draining)
    abandon: Callable[[str], object] | None = None  # requests waiting on a lost replica go elsewhere
    engine_load: Callable[[str], object] | None = None  # the engine's own load per replica, as polled
    pushed: dict[str, list[Endpoint]] | None = None

    def push(self, table: dict[str, list[Endpoint]]) -> None:
        """The endpoint table, when it differs from the one pushed last."""
        if table != self.pushed:
            self.pushed = table
            if self.push_endpoints is not None:
                self.push_endpoints(table)


class Reconciler:
    def __init__(self, holder: CatalogHolder, fleet: Fleet, store: Store | None, gateway: GatewayConfig,
                 routers: Routers | None = None):
        self.holder = holder
        self.fleet = fleet
        self.store = store
        self.gateway = gateway
        self.routers = routers or Routers()
        self.memory = memory = ControlMemory(nodes=NodeMemory.of(fleet.nodes))
        self.passes = 0
        self._wake = asyncio.Event()
        self._run_task: asyncio.Task | None = None
        self.actions = Actions(fleet, gateway, memory.records, save=self._save, wake=self.wake, stopped=self._stopped,
                               outstanding=self.routers.outstanding)
        self.nodes = Nodes(fleet, holder, store, memory.nodes)
        self.placing = placing.Placing(memory.placing, memory.records, memory.scaling, self.actions.learned,
                                       self.nodes, holder, gateway)
        self.cleanup = Cleanup(fleet, holder, gateway, store, CacheUse(self.actions.fetches, memory.records), self.wake)
        self.view: Published  # what the admin, /metrics and ctl read
        self.publish()

    # -- lifecycle -----------------------------------------------------------------------------

    async def load(self) -> None:
        """Replicas and node admin state from SQLite: adopted, not restarted (R-4.5)."""
        if self.store is None:
            return
        replicas = await self.store.read(load_replicas)
        await self.nodes.load()
        self.memory.records.adopt(replicas)

    def start(self) -> None:
        self._run_task = asyncio.create_task(self.run(), name="reconciler")

    async def run(self) -> None:
        while True:
            try:
                await self.fleet.refresh()
            except Exception:
                # The pass still runs, on the facts known so far: a failed refresh must not
                # stop the whole fleet from being reconciled.
                log.exception("refreshing the fleet's facts failed")
            try:
                self.step()
            except Exception:
                log.exception("reconcile pass failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.gateway.tick)
            except asyncio.TimeoutError:
                pass

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop reconciling; engines keep running (they are adopted on the next start)."""
        await cancel_and_wait(self._run_task, *self.actions.tasks(), *self.cleanup.tasks.values())
        await self.nodes.close()

    # -- the inventory changing while running (a reload, R-10.5) ---------------------------------

    def configure(self, gateway: GatewayConfig) -> None:
        """The gateway settings from now on, for the loop and the tasks it starts."""
        self.gateway = self.actions.gateway = self.placing.gateway = gateway
        self.cleanup.configure(gateway)

    def add_node(self, name: str) -> None:
        """A node the fleet has just added (or a removal called off): placement may use it."""
        if self.nodes.add(name):
            self.set_admin(name, AdminState.ACTIVE, actor="reload")
        self.cleanup.configure(self.gateway)
        self.wake()

    def remove_node(self, name: str, grace: float, actor: str | None = None) -> None:
        """A node left the inventory: drained (each replica stopped once its replacement serves
        elsewhere, or at the grace), then forgotten at the end of a pass (R-9.5)."""
        self.nodes.remove(name, grace)
        self.set_admin(name, AdminState.DRAINING, grace, actor)
        log.info("%s: left the inventory; draining it (grace %.0fs) before it is forgotten", name, grace)

    # -- inputs from the router and operators --------------------------------------------------

    def note_demand(self, model: str) -> None:
        """A request wants an on-demand model that has no serving replica (R-6.8)."""
        self.memory.scaling.demand[model] = time.time()
        self.wake()

    def set_admin(self, node: str, state: str, grace: float | None = None, actor: str | None = None) -> NodeAdmin:
        """Cordon, uncordon or drain a node (one entry point, R-9.4); its replicas are marked at once."""
        admin = self.nodes.set_admin(node, state, grace, actor)
        for replica in self.memory.records.replicas.values():
            if node not in replica.nodes:
                continue
            if admin.state == AdminState.DRAINING and replica.set_phase(ReplicaPhase.DRAINING):
                self._save(replica)
            elif admin.state == AdminState.ACTIVE and replica.draining and replica.set_phase(ReplicaPhase.ACTIVE):
                self._save(replica)
        self.wake()
        return admin

    # -- the pass ------------------------------------------------------------------------------

    def step(self) -> None:
        """One reconcile pass: observe, apply, plan, act, push, publish (R-4.1)."""
        now = time.time()
        self.passes += 1
        memory, records, scaling = self.memory, self.memory.records, self.memory.scaling
        catalog = self.holder.current
        if self.routers.last_used is not None:
            scaling.last_used.update(self.routers.last_used())
        # Observe, and apply: every live shard judged from the fleet's latest facts.
        patience = observe.Patience(self.gateway.settling_window, lambda name: _start_timeout(catalog.models.get(name)),
                                    memory.probes.failed)
        observed = observe.observe(records.replicas.values(), self.fleet.links, self.fleet.facts, now, patience)
        for judgement in observed.judgements:
            self._apply(judgement, now)
        self.nodes.note_unknown_engines(observed.unknown_engines)
        # Plan and act: replicas nothing wants any more, drain marks, then each model.
        for action in plan.sweep(records.replicas.values(), catalog.models):
            self._act(action, now)
        by_model: dict[str, list[Replica]] = {}
        for replica in records.replicas.values():
            if replica.phase is not RETIRING_PHASE:
                by_model.setdefault(replica.model, []).append(replica)
        for action in plan.drain_marks(records.replicas.values(), memory.nodes.admin):
            self._act(action, now)
        memory.placing.forget_models(catalog.models)
        scaling.forget_models(catalog.models)
        self.placing.new_pass()
        if self.nodes.settled(now, records.started_at, self.gateway.settling_window):
            inputs = plan.PlanInputs(memory.nodes.admin, records.health, scaling.demand, scaling.last_used,
                                     scaling.scales, records.started_at)
            for model in catalog.models.values():
                if model.static:
                    continue
                live = by_model.get(model.name, [])
                loads = scaling.loads(model, live, self.routers.outstanding, self.routers.engine_load) \
                    if model.scales else None
                for action in plan.plan_model(model, live, now, inputs, loads):
                    if not self._act(action, now, model):
                        break
        self.placing.new_pass()
        if memory.nodes.removing:
            for name in self.nodes.drained(records.replicas, now):
                self.nodes.forget(name)
                self.cleanup.configure(self.gateway)
        records.prune(now)
        memory.placing.forget_evicted(records)
        self.cleanup.check(now)  # cache filesystems below their low-water mark
        self.routers.push(records.endpoints(self.fleet.nodes))
        self.publish()

    def publish(self) -> None:
        """A new publication of the state, its view built when first read (llmgw.control.publish)."""
        self.view = Published(Sources(self.memory, self.actions.learned, self.cleanup, self.fleet, self.holder,
                                      self.gateway), self.passes)

    # -- applying judgements and actions -------------------------------------------------------

    def _apply(self, judgement: observe.Judgement, now: float) -> None:
        replica = self.memory.records.replicas[judgement.replica_id]
        shard = replica.shards[judgement.rank]
        if judgement.failed_probes is not None:
            self.memory.probes.note(shard.id, judgement.failed_probes)
        if judgement.state is None:
            return
        if judgement.log_tail is not None:
            shard.log_tail = list(judgement.log_tail)
        shard.set_state(judgement.state, judgement.reason)
        self._save(replica)
        if judgement.abandon and self.routers.abandon is not None:
            self.routers.abandon(replica.id)  # requests waiting on it go elsewhere now
        if judgement.state == FAILED:
            self.memory.probes.note(shard.id, 0)
        elif judgement.state == SERVING and replica.serving:
            replica.serving_since = now
            health = self.memory.records.health.setdefault(replica.model, ModelHealth())
            health.failures, health.next_attempt = 0, 0.0
            self.memory.scaling.demand.pop(replica.model, None)
            log.info("replica %s of %s serving on %s", replica.id, replica.model, ", ".join(replica.nodes))

    def _act(self, action: plan.Action, now: float, model: Model | None = None) -> bool:
        """Carry out one action. False when the model's later actions must wait for the next
        pass: a launch whose weights' size is still being learned (R-5.1)."""
        match action:
            case plan.Enough():  # the common case: most models need nothing
                self.memory.placing.unplaceable.pop(action.model, None)
            case plan.Retire():
                replica = self.memory.records.replicas[action.replica_id]
                reason = action.reason
                if action.failed:
                    self.memory.records.record_failure(replica, now)  # the backoff grows; the reason is the failed shard's
                    reason = replica.reason or reason
                self._retire(replica, reason, self.gateway.request_timeout if action.drain else RETIRE_GRACE)
            case plan.Scaled():
                decision = self.memory.scaling.keep(action.model, action.scale)
                if decision is not None:
                    log.info("%s: %s", action.model, decision.reason)
                    if self.store is not None:
                        detail = {"from": decision.before, "to": decision.after, "reason": decision.reason}
                        self.store.submit(lambda db: audit(db, AUTOSCALER, f"model.scale.{decision.direction}",
                                                           action.model, detail))
            case plan.MarkDraining():
                replica = self.memory.records.replicas[action.replica_id]
                if replica.set_phase(ReplicaPhase.DRAINING):
                    self._save(replica)
            case plan.Launch():
                assert model is not None
                sized = self.actions.sized(model)
                if sized is None:
                    return False  # its size is being learned from the source first
                for _ in range(action.count):
                    if not self._placed(self.placing.place(sized, now), sized, now):
                        break
            case plan.ForgetDemand():
                self.memory.scaling.demand.pop(action.model, None)
        return True

    def _placed(self, outcome: placing.Start | placing.Evict | None, model: Model, now: float) -> bool:
        """Apply what placing decided: a replica recorded, saved and launched (True); or idle replicas
        of other models retired and audited, this model placed on a later pass once they stopped."""
        match outcome:
            case placing.Start(replica=replica):
                self.memory.records.replicas[replica.id] = replica
                self.memory.records.health.setdefault(model.name, ModelHealth()).launches += 1
                log.info("placing %s as %s on %s (%s)", model.name, replica.id, ", ".join(replica.nodes),
                         "; ".join(outcome.reasons))
                self._save(replica)
                self.actions.launch(replica, model)
                return True
            case placing.Evict(victims=victims):
                log.info("evicting %s to place %s on %s", ", ".join(v.idle_words(now) for v in victims), model.name,
                         ", ".join(outcome.nodes))
                for victim in victims:
                    reason = evict.eviction_reason(model.name, victim, now)
                    self._retire(self.memory.records.replicas[victim.replica_id], reason)
                    if self.store is not None:
                        detail = {"model": victim.model, "for": model.name, "idle_seconds": round(now - victim.idle_since, 1),
                                  "nodes": sorted(victim.gpus), "reason": reason}
                        self.store.submit(lambda db, rid=victim.replica_id, detail=detail:
                                          audit(db, "evictor", "evict", rid, detail))
        return False

    # -- stopping and saving -------------------------------------------------------------------

    def _retire(self, replica: Replica, reason: str, grace: float = RETIRE_GRACE) -> None:
        """Take a replica out of service: off the router first, then its engines stopped once
        its requests in flight have ended, or after `grace` seconds."""
        if not replica.set_phase(ReplicaPhase.RETIRING):
            return
        replica.reason = replica.reason or reason
        log.info("retiring replica %s of %s: %s", replica.id, replica.model, reason)
        self.actions.cancel_launch(replica.id)
        self._save(replica)
        self.routers.push(self.memory.records.endpoints(self.fleet.nodes))
        self.actions.stop(replica, grace)

    def _stopped(self, replica: Replica) -> None:
        """A retired replica's engines are all stopped: its record goes."""
        self.memory.records.replicas.pop(replica.id, None)
        self.memory.records.retired.append((time.time(), replica))
        if self.store is not None:
            self.store.submit(lambda db: delete_replica(db, replica.id))
        self.wake()

    def _save(self, replica: Replica) -> None:
        if self.store is not None:
            snapshot = Replica(**{**replica.__dict__, "shards": [Shard(**s.__dict__) for s in replica.shards]})
            self.store.submit(lambda db: save_replica(db, snapshot))


def _start_timeout(model: Model | None) -> float:
    return model.profile.start_timeout if model is not None and model.profile is not None else 900.0
