"""The reconciler: compares desired with actual on every pass and acts (R-4.1–R-4.5, R-5.3, R-9.5).

A pass (`step`) is synchronous and cheap: observe (`observe.py` judges every live shard from the
fleet's latest facts), apply (the judgements, through the transition table), plan (`plan.py`
decides per model what to launch, retire and mark draining), act (a launch is placed by
`placing.py`, which says where the replica goes or what to evict for it; anything that needs a
node becomes a task of `actions.py`: fetch, launch, stop), push (the endpoint table to the
routers, `routers.py`, when it changed) and publish its view (for the admin, /metrics and ctl,
llmgw.control.publish). It runs on a tick and at once when something changes (`wake`).

What it remembers between passes is a `ControlMemory` (llmgw.control.memory), whose parts it gives
explicitly to those that keep them: node admin to `Nodes`, placement and eviction to `Placing`,
runtime LoRA adapters to `AdapterLoads`, the records to `Actions`, which saves each change of a
replica to SQLite, retires replicas and drops their records once their engines stopped."""

from __future__ import annotations

import asyncio
import logging
import time

from llmgw.aio import cancel_and_wait
from llmgw.catalog import CatalogHolder, Model
from llmgw.config import GatewayConfig
from llmgw.contracts.states import AdminState
from llmgw.control import adapters, observe, placing, plan, rollouts
from llmgw.control.actions import RETIRE_GRACE, Actions
from llmgw.control.cleanup import CacheUse, Cleanup
from llmgw.control.memory import ControlMemory
from llmgw.control.nodes import NodeMemory, Nodes, follow_admin
from llmgw.control.publish import Published, Sources
from llmgw.control.routers import Routers
from llmgw.control.state import FAILED, SERVING, NodeAdmin, load_replicas
from llmgw.fleet.fleet import Fleet
from llmgw.store import Store, audit

log = logging.getLogger(__name__)

AUTOSCALER = "autoscaler"  # the actor of scaling decisions in the audit table


class Reconciler:
    """The passes on their loop, and what comes between them: a reload, node admin, demand."""

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
        self.actions = Actions(fleet, gateway, memory.records, store, self.routers, self.wake)
        self.nodes = Nodes(fleet, holder, store, memory.nodes)
        self.placing = placing.Placing(memory.placing, memory.records, memory.scaling, self.actions.learned,
                                       self.nodes, holder, gateway)
        self.cleanup = Cleanup(fleet, holder, gateway, store, CacheUse(self.actions.fetches, memory.records,
                                                                                 memory.rollouts.cache_names), self.wake)
        self.adapters = adapters.AdapterLoads(memory.adapters, memory.records, memory.rollouts, self.actions,
                                              self.routers, self.wake)
        self.view: Published  # what the admin, /metrics and ctl read
        self.publish_view()

    # -- lifecycle -----------------------------------------------------------------------------

    async def load(self) -> None:
        """Replicas and node admin state from SQLite: adopted, not restarted (R-4.5)."""
        if self.store is None:
            return
        replicas = await self.store.read(load_replicas)
        await self.nodes.load()
        self.memory.records.adopt(replicas)
        self.memory.rollouts.adopt(*await self.store.read(rollouts.load))

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
        await cancel_and_wait(self._run_task, *self.actions.tasks(), *self.cleanup.tasks.values(), *self.adapters.tasks)
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
            if node in replica.nodes and follow_admin(replica, admin.state):
                self.actions.save(replica)
        self.wake()
        return admin

    # -- the pass ------------------------------------------------------------------------------

    def step(self) -> None:
        """One reconcile pass: observe, apply, plan, act, push, publish its view (R-4.1)."""
        now = time.time()
        self.passes += 1
        memory, records, scaling = self.memory, self.memory.records, self.memory.scaling
        catalog = self.holder.current
        if self.routers.last_used is not None:
            scaling.last_used.update(self.routers.last_used())
        # Observe, and apply: every live shard judged from the fleet's latest facts.
        patience = observe.Patience(self.gateway.settling_window,
                                    lambda name: observe.start_timeout(catalog.models.get(name)), memory.probes.failed)
        observed = observe.observe(records.replicas.values(), self.fleet.links, self.fleet.facts, now, patience)
        for judgement in observed.judgements:
            self._apply(judgement, now)
        self.nodes.note_unknown_engines(observed.unknown_engines)
        # Plan and act: replicas nothing wants any more, drain marks, then each model.
        for action in plan.sweep(records.replicas.values(), catalog.models):
            self._act(action, now)
        by_model = plan.live_by_model(records.replicas.values())
        targets = rollouts.targets(memory.rollouts, catalog, by_model, now)  # each model's revision
        rollouts.keep(self.store, targets, self.actions.save)
        records.canaries = targets.canaries  # on the endpoints the routers balance over
        for action in plan.drain_marks(records.replicas.values(), memory.nodes.admin):
            self._act(action, now)
        memory.placing.forget_models(catalog.models)
        scaling.forget_models(catalog.models)
        self.placing.new_pass()
        if self.nodes.settled(now, records.started_at, self.gateway.settling_window):
            inputs = plan.PlanInputs(memory.nodes.admin, records.health, scaling.demand, scaling.last_used,
                                     scaling.scales, records.started_at, targets.rolling)
            for model in targets.launch.values():  # the models llmgw runs, as launched (an undo's hold)
                live = by_model.get(model.name, [])
                loads = scaling.loads(model, live, self.routers.outstanding, self.routers.engine_load) \
                    if model.scales else None
                for action in plan.plan_model(model, live, now, inputs, loads):
                    if not self._act(action, now, model):
                        break
        self.placing.new_pass()
        for name in self.nodes.drained(records.replicas, now):  # removed by a reload
            self.nodes.forget(name)
            self.cleanup.configure(self.gateway)
        records.prune(now)
        memory.placing.forget_evicted(records)
        self.cleanup.check(now)  # cache filesystems below their low-water mark
        self.adapters.learn(catalog)  # what the engines that load adapters list
        self.routers.push(records.endpoints(self.fleet.nodes))
        self.publish_view()

    def publish_view(self) -> None:
        """A new publication of the state for the admin, /metrics and ctl, its view built when
        first read (llmgw.control.publish). Not the endpoint table, which `Routers.push` sends."""
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
        self.actions.save(replica)
        if judgement.abandon and self.routers.abandon is not None:
            self.routers.abandon(replica.id)  # requests waiting on it go elsewhere now
        if judgement.state == FAILED:
            self.memory.probes.note(shard.id, 0)
        elif judgement.state == SERVING and replica.serving:
            self.memory.records.record_serving(replica, now)
            self.memory.scaling.demand.pop(replica.model, None)

    def _act(self, action: plan.Action, now: float, model: Model | None = None) -> bool:
        """Carry out one action. False when the model's later actions must wait for the next
        pass: a launch whose weights' size is still being learned (R-5.1)."""
        records = self.memory.records
        match action:
            case plan.Enough():  # the common case: most models need nothing
                self.memory.placing.unplaceable.pop(action.model, None)
            case plan.Retire():
                replica = records.replicas[action.replica_id]
                reason = action.reason
                if action.failed:
                    records.record_failure(replica, now)  # the backoff grows; the reason is the failed shard's
                    reason = replica.reason or reason
                    rollouts.note_failure(self.memory.rollouts, self.store, replica, reason, records.replicas)
                self.actions.retire(replica, reason, self.gateway.request_timeout if action.drain else RETIRE_GRACE)
            case plan.Scaled():
                decision = self.memory.scaling.keep(action.model, action.scale)
                if decision is not None:
                    log.info("%s: %s", action.model, decision.reason)
                    if self.store is not None:
                        detail = {"from": decision.before, "to": decision.after, "reason": decision.reason}
                        self.store.submit(lambda db: audit(db, AUTOSCALER, f"model.scale.{decision.direction}",
                                                           action.model, detail))
            case plan.MarkDraining():  # on a draining node
                replica = records.replicas[action.replica_id]
                if follow_admin(replica, AdminState.DRAINING):
                    self.actions.save(replica)
            case plan.Launch():
                assert model is not None
                sized = self.actions.sized(model)
                if sized is None:
                    return False  # its size is being learned from the source first
                for _ in range(action.count):
                    if not placing.carry_out(self.placing.place(sized, now), sized, now, self.actions, self.store):
                        break
            case plan.ForgetDemand():
                self.memory.scaling.demand.pop(action.model, None)
            case plan.Rolled():
                self.memory.rollouts.progress[action.model] = action
        return True
