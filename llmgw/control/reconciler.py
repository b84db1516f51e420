"""The reconciler: compares desired with actual on every pass and acts (R-4.1–R-4.5, R-5.3, R-9.5).

It is the only writer of replica and shard state. A pass (`step`) is synchronous and cheap, and
it is a loop of four steps: observe (`observe.py` judges every live shard from the fleet's latest
facts; the judgements are applied here through the transition table), plan (`plan.py` decides
per model what to launch, retire and mark draining), act (the actions are carried out here, and
anything that needs a node becomes a task of `actions.py`: fetch, launch, stop), and publish
(the endpoint table goes to the router). It runs on a tick and immediately when something
changes (`wake`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from llmgw.aio import cancel_and_wait
from llmgw.catalog import CatalogHolder, Model
from llmgw.config import GatewayConfig, NodeConfig
from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.states import AdminState, ReplicaPhase, transition
from llmgw.control import evict, observe, placement, plan, publish, scaling
from llmgw.control.actions import RETIRE_GRACE, Actions
from llmgw.control.cleanup import Cleanup
from llmgw.control.state import (ENDED, FAILED, FETCHING, PENDING, RETIRING_PHASE, SERVING, STOPPED, ModelHealth, NodeAdmin,
                                 Replica, Shard, delete_replica, load_replicas, new_engine_key, new_replica_id, save_replica)
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import READY
from llmgw.fleet.ops import InventoryRequest
from llmgw.runtimes import runtime_spec, runtime_digest
from llmgw.store import Store, audit

log = logging.getLogger(__name__)

FAILURE_BACKOFF_BASE = 2.0
FAILURE_BACKOFF_CAP = 300.0
RETIRED_KEEP = 600.0  # how long a failed replica stays visible after it stopped
EXPLAIN_EVERY = 10.0  # seconds between full explanations of a model that does not fit
AUTOSCALER = "autoscaler"  # the actor of scaling decisions in the audit table


class Reconciler:
    def __init__(self, holder: CatalogHolder, fleet: Fleet, store: Store | None, gateway: GatewayConfig, *,
                 push_endpoints: Callable[[dict[str, list[Endpoint]]], None] | None = None,
                 last_used: Callable[[], Mapping[str, float]] | None = None,
                 outstanding: Callable[[str], int] | None = None,
                 abandon: Callable[[str], object] | None = None,
                 engine_load: Callable[[str], object] | None = None):
        self.holder = holder
        self.fleet = fleet
        self.store = store
        self.gateway = gateway
        self.push_endpoints = push_endpoints
        self.last_used_source = last_used
        self.abandon = abandon
        self.outstanding = outstanding  # the router's requests in flight per replica (scaling, draining)
        self.engine_load = engine_load  # the engine's own load per replica as the router polled it, or None
        self.scaling: dict[str, scaling.Scale] = {}  # model -> its scaling (llmgw.control.scaling)
        self._engine_capped: set[str] = set()  # replicas whose engine's count is capped now, said once (R-6.8a)
        self.replicas: dict[str, Replica] = {}
        self.retired: list[tuple[float, Replica]] = []
        self.admin: dict[str, NodeAdmin] = {name: NodeAdmin() for name in fleet.nodes}
        self.health: dict[str, ModelHealth] = {}
        self.demand: dict[str, float] = {}
        self.last_used: dict[str, float] = {}
        self.unplaceable: dict[str, placement.Explanation] = {}
        self.unknown_engines: dict[str, list[str]] = {}
        self.started_at = time.time()
        self._probe_failures: dict[str, int] = {}  # shard id -> failed health probes in a row
        self._wake = asyncio.Event()
        self._endpoints_pushed: dict[str, list[Endpoint]] | None = None
        self._run_task: asyncio.Task | None = None
        self.passes = 0
        self.settled = False
        self._pass_views: tuple[list[placement.NodeView], dict[str, set[int]]] | None = None
        self._explained_at: dict[str, float] = {}
        self.evicting: dict[str, set[str]] = {}  # model -> replicas being stopped to make room for it
        self.evicted: dict[str, str] = {}  # replica id -> the model it was evicted for (kept while listed)
        self.learned_sizes: dict[str, int | None] = {}  # canonical source -> bytes (None: not said)
        self.removing: dict[str, float] = {}  # node left the inventory -> when its drain's grace ends
        self._forgetting: set[asyncio.Task] = set()  # links of forgotten nodes being closed
        self.actions = Actions(fleet, gateway, replicas=self.replicas, health=self.health,
                               learned_sizes=self.learned_sizes, save=self._save, wake=self.wake,
                               stopped=self._stopped, outstanding=outstanding)
        self.cleanup = Cleanup(fleet, holder, gateway, store, fetches=self.actions.fetches, in_use=self.cache_in_use,
                               wake=self.wake)
        self.view = publish.publish(self)  # what the admin, /metrics and ctl read (llmgw.control.publish)

    # -- lifecycle -----------------------------------------------------------------------------

    async def load(self) -> None:
        """Replicas and node admin state from SQLite: adopted, not restarted (R-4.5)."""
        if self.store is None:
            return
        replicas = await self.store.read(load_replicas)
        rows = await self.store.read(lambda db: list(db["node_admin"].rows))
        for row in rows:
            if row["node"] in self.admin:
                self.admin[row["node"]] = NodeAdmin(AdminState(row["state"]), row["grace_until"], row["actor"])
        for replica in replicas:
            if replica.state == STOPPED:
                continue
            # A failed replica is kept: its record is deleted only once its engines are stopped,
            # so one still here may have an engine running on a node that was out of reach. The
            # first pass retires it, and the engine is stopped when the node answers.
            for shard in replica.shards:
                if shard.state in (PENDING, FETCHING):
                    # Nothing was launched yet: the interrupted start is simply made again.
                    shard.set_state(FAILED, "interrupted by a control-plane restart before launch")
            self.replicas[replica.id] = replica
        if self.replicas:
            log.info("adopting %d replicas recorded before the restart", len(self.replicas))

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
        await asyncio.gather(*self._forgetting, return_exceptions=True)

    # -- the inventory changing while running (a reload, R-10.5) ---------------------------------

    def configure(self, gateway: GatewayConfig) -> None:
        """The gateway settings from now on, for the loop and the tasks it starts."""
        self.gateway = gateway
        self.actions.gateway = gateway
        self.cleanup.configure(gateway)

    def add_node(self, name: str) -> None:
        """A node the fleet has just added (or a removal called off): placement may use it."""
        if self.removing.pop(name, None) is not None:
            log.info("%s: back in the inventory; no longer removed", name)
            self.set_admin(name, AdminState.ACTIVE, actor="reload")
        self.admin.setdefault(name, NodeAdmin())
        self.cleanup.configure(self.gateway)
        self.wake()

    def remove_node(self, name: str, grace: float, actor: str | None = None) -> None:
        """A node left the inventory: drained (each replica stopped once its replacement serves
        elsewhere, or at the grace), then forgotten by `_forget_drained` (R-9.5)."""
        self.removing[name] = time.time() + grace
        self.set_admin(name, AdminState.DRAINING, grace, actor)
        log.info("%s: left the inventory; draining it (grace %.0fs) before it is forgotten", name, grace)

    def _forget_drained(self, now: float) -> None:
        """Forget each removed node that runs nothing any more; one that still does once its
        grace is over while it is out of reach (its engines are then not known to be stopped)."""
        for name, deadline in list(self.removing.items()):
            left = [r.id for r in self.replicas.values() if any(s.node == name for s in r.shards)]
            link = self.fleet.links.get(name)
            if left and not (now >= deadline and (link is None or link.state != READY)):
                continue
            if left:
                log.warning("%s: forgotten with replicas %s still recorded on it: the node is out of reach and "
                            "its drain's grace is over; engines it may still run are not stopped", name,
                            ", ".join(left))
            self._forget(name)

    def _forget(self, name: str) -> None:
        self.removing.pop(name, None)
        self.admin.pop(name, None)
        self.unknown_engines.pop(name, None)
        link = self.fleet.detach_node(name)
        self.cleanup.configure(self.gateway)
        if link is not None:
            task = asyncio.ensure_future(link.close())
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)
        if self.store is not None:
            self.store.submit(lambda db: (db["node_admin"].delete_where("node = ?", [name]),
                                          audit(db, "reload", "node.forget", name)))
        log.info("%s: drained and forgotten (its link closed)", name)

    # -- inputs from the router and operators --------------------------------------------------

    def note_demand(self, model: str) -> None:
        """A request wants an on-demand model that has no serving replica (R-6.8)."""
        self.demand[model] = time.time()
        self.wake()

    def set_admin(self, node: str, state: str, grace: float | None = None, actor: str | None = None) -> NodeAdmin:
        """Cordon, uncordon or drain a node (one entry point, R-9.4)."""
        if node not in self.admin:
            raise KeyError(node)
        state = AdminState(state)
        transition(self.admin[node].state, state, f"node {node}")  # every admin move is allowed
        admin = NodeAdmin(state=state, grace_until=time.time() + grace if grace is not None else None, actor=actor)
        self.admin[node] = admin
        if state == AdminState.DRAINING:
            for replica in self.replicas.values():
                if node in replica.nodes and replica.set_phase(ReplicaPhase.DRAINING):
                    self._save(replica)
        elif state == AdminState.ACTIVE:
            for replica in self.replicas.values():
                if node in replica.nodes and replica.draining and replica.set_phase(ReplicaPhase.ACTIVE):
                    self._save(replica)
        if self.store is not None:
            row = {"node": node, "state": state, "grace_until": admin.grace_until, "actor": actor,
                   "updated_at": time.time()}
            self.store.submit(lambda db: (db["node_admin"].upsert(row, pk="node"),
                                          audit(db, actor, state, node, {"grace": grace})))
        self.wake()
        return admin

    # -- views ---------------------------------------------------------------------------------

    def node_views(self) -> list[placement.NodeView]:
        return [self.node_view(name) for name in self.fleet.nodes]

    def node_view(self, name: str) -> placement.NodeView:
        node = self.fleet.nodes[name]
        link = self.fleet.links.get(name)
        facts = self.fleet.facts[name]
        inventory, storage = facts.inventory, facts.storage
        gpus = None
        gpu_class = node.gpu_class
        memory = None
        if inventory is not None:
            gpus = tuple(placement.GPUView(g.index, g.healthy, g.reasons) for g in inventory.gpus)
            gpu_class = gpu_class or inventory.gpu_class
            memory = inventory.memory_bytes
        cache_free = None
        if storage is not None:
            fs = storage.filesystem_of(self.cache_dir(node))
            cache_free = fs.free_bytes if fs is not None else None
        holds = frozenset(facts.holdings) if facts.holdings is not None else None
        containers = venvs = None
        if inventory is not None and inventory.containers is not None:
            containers = {program: placement.ContainerView(c.path is not None, c.answers, c.gpu, c.images, c.error)
                          for program, c in inventory.containers.items()}
        if inventory is not None and inventory.venvs is not None:
            venvs = {key: placement.VenvView(v.found, v.built) for key, v in inventory.venvs.items()}
        return placement.NodeView(
            name=name, fabric=node.fabric, labels=node.labels,
            state=link.state if link is not None else "connecting",
            state_reason=link.reason if link is not None else None,
            admin=self.admin[name].state, gpu_class=gpu_class, gpus=gpus, memory_bytes=memory,
            cache_free_bytes=cache_free, holds=holds, containers=containers, venvs=venvs)

    def allocated(self) -> dict[str, frozenset[int]]:
        used: dict[str, set[int]] = {}
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.state not in ENDED:
                    used.setdefault(shard.node, set()).update(shard.gpus)
        return {node: frozenset(gpus) for node, gpus in used.items()}

    def explain(self, model_name: str) -> placement.Explanation:
        model = self.with_learned_size(self.holder.current.models[model_name])
        allocated = self.allocated()
        return placement.explain_placement(model, self.node_views(), allocated, avoid=self._avoid(model_name),
                                           what_if=self._what_if(model, allocated, time.time()),
                                           durations=self.durations())

    def durations(self) -> placement.Durations:
        """What fetches and provisions took lately, for explain-placement's estimate (R-4.12)."""
        return placement.Durations(dict(self.actions.download_rates), dict(self.actions.provision_seconds))

    def cache_dir(self, node: NodeConfig) -> str | None:
        """The node's cache directory as an absolute path on it; None until the node said hello."""
        return self.fleet.paths(node.name).cache_dir

    def cache_in_use(self, node: str) -> set[str]:
        """Cache names the live replicas with a shard on the node run from."""
        models = self.holder.current.models
        return {m.source.cache_name for r in self.replicas.values() if (m := models.get(r.model)) and m.source
                and m.source.fetched and any(s.node == node for s in r.shards)}

    def holdings_wanted(self, node: NodeConfig) -> dict[str, list[str]]:
        """Candidate paths of every catalog model's weights on this node (R-2.6)."""
        wanted = {}
        paths = self.fleet.paths(node.name)
        dirs = [*paths.model_dirs, *paths.shared_dirs]
        for model in self.holder.current.models.values():
            if model.source is not None:
                candidates = model.source.candidates(dirs, paths.cache_dir)
                if model.source.kind == "path" and model.source.path.startswith("/"):
                    candidates = [c for c in candidates if _inside_any(c, dirs)]
                if candidates:
                    wanted[model.name] = candidates
        return wanted

    def inventory_wanted(self, node: NodeConfig) -> InventoryRequest:
        """What a node's inventory is asked about besides its GPUs (R-4.12): the images of the
        catalog's container profiles, and its venv recipes under the key placement looks for."""
        images: set[str] = set()
        venvs: dict[str, dict] = {}
        for model in self.holder.current.models.values():
            profile = model.profile
            if profile is None:
                continue
            if profile.runtime == "container" and profile.image:
                images.add(profile.image)
            elif profile.runtime == "venv":
                spec = runtime_spec(profile)
                if spec is not None:
                    venvs[runtime_digest(spec)] = spec
        return InventoryRequest(images=sorted(images), venvs=venvs)

    # -- the pass ------------------------------------------------------------------------------

    def step(self) -> None:
        """One reconcile pass: observe, plan, act, publish (R-4.1)."""
        now = time.time()
        self.passes += 1
        catalog = self.holder.current
        if self.last_used_source is not None:
            self.last_used.update(self.last_used_source())
        # Observe: every live shard judged from the fleet's latest facts.
        observed = observe.observe(self.replicas.values(), self.fleet.links, self.fleet.facts, now,
                                   settling_window=self.gateway.settling_window,
                                   start_timeout=self._start_timeout, failed_probes=self._probe_failures)
        for judgement in observed.judgements:
            self._apply(judgement, now)
        self._note_unknown_engines(observed.unknown_engines)
        # Plan and act: replicas nothing wants any more, drain marks, then each model.
        for action in plan.sweep(self.replicas.values(), catalog.models):
            self._act(action, now)
        by_model: dict[str, list[Replica]] = {}
        for replica in self.replicas.values():
            if replica.phase is not RETIRING_PHASE:
                by_model.setdefault(replica.model, []).append(replica)
        for action in plan.drain_marks(self.replicas.values(), self.admin):
            self._act(action, now)
        self.unplaceable = {k: v for k, v in self.unplaceable.items() if k in catalog.models}
        if len(self.scaling) > len(catalog.models) or any(k not in catalog.models for k in self.scaling):
            self.scaling = {k: v for k, v in self.scaling.items() if k in catalog.models}
        self._pass_views = None  # built on first need, once per pass
        if self._settled(now):
            for model in catalog.models.values():
                if model.static:
                    continue
                live = by_model.get(model.name, [])
                actions = plan.plan_model(model, live, now,
                                          health=self.health.setdefault(model.name, ModelHealth()),
                                          admin=self.admin, demand=self.demand.get(model.name),
                                          last_used=self.last_used, started_at=self.started_at,
                                          scale=self.scaling.get(model.name),
                                          load=self._loads(model, live) if model.scales else None)
                for action in actions:
                    if not self._act(action, now, model):
                        break
        self._pass_views = None
        if self.removing:
            self._forget_drained(now)
        self._cleanup_retired(now)
        self.cleanup.check(now)  # cache filesystems below their low-water mark
        # Publish: the router's endpoint table.
        self._push()
        self.view = publish.publish(self)

    # -- applying judgements and actions -------------------------------------------------------

    def _apply(self, judgement: observe.Judgement, now: float) -> None:
        replica = self.replicas[judgement.replica_id]
        shard = replica.shards[judgement.rank]
        if judgement.failed_probes is not None:
            if judgement.failed_probes:
                self._probe_failures[shard.id] = judgement.failed_probes
            else:
                self._probe_failures.pop(shard.id, None)
        if judgement.state is None:
            return
        if judgement.log_tail is not None:
            shard.log_tail = list(judgement.log_tail)
        shard.set_state(judgement.state, judgement.reason)
        self._save(replica)
        if judgement.abandon and self.abandon is not None:
            self.abandon(replica.id)  # requests waiting on it go elsewhere now
        if judgement.state == FAILED:
            self._probe_failures.pop(shard.id, None)
        elif judgement.state == SERVING and replica.serving:
            replica.serving_since = now
            health = self.health.setdefault(replica.model, ModelHealth())
            health.failures, health.next_attempt = 0, 0.0
            self.demand.pop(replica.model, None)
            log.info("replica %s of %s serving on %s", replica.id, replica.model, ", ".join(replica.nodes))

    def _note_unknown_engines(self, unknown: dict[str, list[str]]) -> None:
        for name, strangers in unknown.items():
            if strangers != self.unknown_engines.get(name, []):
                if strangers:
                    log.warning("%s runs engines llmgw has no record of (left alone): %s", name, ", ".join(strangers))
                self.unknown_engines[name] = strangers

    def _act(self, action: plan.Action, now: float, model: Model | None = None) -> bool:
        """Carry out one action. False when the model's later actions must wait for the next
        pass: a launch whose weights' size is still being learned (R-5.1)."""
        if isinstance(action, plan.Enough):  # the common case: most models need nothing
            self.unplaceable.pop(action.model, None)
        elif isinstance(action, plan.Retire):
            replica = self.replicas[action.replica_id]
            reason = action.reason
            if action.failed:
                self._record_failure(replica, now)  # the backoff grows; the reason is the failed shard's
                reason = replica.reason or reason
            self._retire(replica, reason, self.gateway.request_timeout if action.drain else RETIRE_GRACE)
        elif isinstance(action, plan.Scaled):
            self._scaled(action)
        elif isinstance(action, plan.MarkDraining):
            replica = self.replicas[action.replica_id]
            if replica.set_phase(ReplicaPhase.DRAINING):
                self._save(replica)
        elif isinstance(action, plan.Launch):
            assert model is not None
            sized = self._sized(model)
            if sized is None:
                return False  # its size is being learned from the source first
            for _ in range(action.count):
                if not self._place(sized, now):
                    break
        elif isinstance(action, plan.ForgetDemand):
            self.demand.pop(action.model, None)
        return True

    def _loads(self, model: Model, live: list[Replica]) -> dict[str, float]:
        """Each replica's load as scaling counts it (llmgw.control.scaling.replica_load), an
        engine's own count capped at `scaling.engine_cap` (logged once per replica while it lasts)."""
        outstanding, engine_load = self.outstanding, self.engine_load
        if outstanding is None:
            return {}
        cap = scaling.engine_cap(model)
        loads = {}
        for replica in live:
            reading = engine_load(replica.id) if engine_load else None
            own = scaling.engine_count(reading)
            if own is not None and own > cap:
                if replica.id not in self._engine_capped:
                    if len(self._engine_capped) > 4096:  # of replicas long gone: say it again rather than grow
                        self._engine_capped.clear()
                    self._engine_capped.add(replica.id)
                    log.warning("replica %s: its engine reports %d requests waiting or running, more than the %d "
                                "the routers may send it; scaling counts %d", replica.id, own, cap, cap)
            else:
                self._engine_capped.discard(replica.id)
            loads[replica.id] = scaling.replica_load(outstanding(replica.id), reading, cap)
        return loads

    def _scaled(self, action: plan.Scaled) -> None:
        """Keep the model's scaling; a new decision is logged and audited (R-6.8b)."""
        previous = self.scaling.get(action.model)
        self.scaling[action.model] = action.scale
        decision = action.scale.last
        if decision is None or (previous is not None and previous.last is decision):
            return
        log.info("%s: %s", action.model, decision.reason)
        if self.store is not None:
            detail = {"from": decision.before, "to": decision.after, "reason": decision.reason}
            self.store.submit(lambda db: audit(db, AUTOSCALER, f"model.scale.{decision.direction}", action.model,
                                               detail))

    def _settled(self, now: float) -> bool:
        """Place nothing until every node has answered once (or the settling window is over):
        a decision made while half the fleet is still connecting is a worse decision (R-4.5)."""
        if self.settled:
            return True
        links = self.fleet.links
        answered = all(
            (link.state == READY and self.fleet.facts[name].inventory is not None)
            or (link.state != READY and getattr(link, "state", None) != "connecting")
            for name, link in links.items())
        if answered or now - self.started_at >= self.gateway.settling_window:
            self.settled = True
            log.info("fleet settled: %d of %d nodes ready", sum(link.state == READY for link in links.values()), len(links))
        return self.settled

    def _start_timeout(self, model_name: str) -> float:
        model = self.holder.current.models.get(model_name)
        return model.profile.start_timeout if model is not None and model.profile is not None else 900.0

    # -- placing -------------------------------------------------------------------------------

    def _sized(self, model: Model) -> Model | None:
        """The model with its weights' size filled in from the source when it was not declared;
        None while a node is still asking the source (R-5.1)."""
        source = model.source
        if source is None or not source.fetched or model.config.disk_gb is not None:
            return model
        if source.canonical not in self.learned_sizes:
            return None if self.actions.learn_size(model) else model
        return self.with_learned_size(model)

    def with_learned_size(self, model: Model) -> Model:
        """The model as placement sees it: a size learned from the source stands in for disk_gb."""
        size = self.learned_sizes.get(model.source.canonical) if model.source is not None else None
        if size is None or model.config.disk_gb is not None:
            return model
        return dataclasses.replace(model, config=model.config.model_copy(update={"disk_gb": size / 1000**3}))

    def _avoid(self, model: str | None = None) -> dict[str, str]:
        """Nodes where this model's last replica just failed: tried elsewhere first."""
        health = self.health.get(model) if model else None
        if health is None or not health.failed_on or health.failures == 0:
            return {}
        return {node: f"the last replica of {model} failed there ({health.last_failure})"
                for node in health.failed_on}

    def _views(self) -> tuple[list[placement.NodeView], dict[str, set[int]]]:
        """Node views and GPU allocations, built once per pass and updated as replicas are placed."""
        if self._pass_views is None:
            self._pass_views = (self.node_views(), {n: set(g) for n, g in self.allocated().items()})
        return self._pass_views

    def _place(self, model: Model, now: float) -> bool:
        views, allocated = self._views()
        avoid = self._avoid(model.name)
        chosen = placement.place(model, views, allocated, avoid=avoid)
        if chosen is None and avoid:  # a preference, not a ban: the failed node is better than none
            chosen = placement.place(model, views, allocated)
        if chosen is None:
            if self._evict_for(model, views, allocated, now):
                self.unplaceable.pop(model.name, None)
                return False  # placed on a later pass, once the victims' GPUs are free
            previous = self.unplaceable.get(model.name)
            if previous is None or now - self._explained_at.get(model.name, 0.0) > EXPLAIN_EVERY:
                explanation = placement.explain_placement(model, views, allocated,
                                                          what_if=self._what_if(model, allocated, now),
                                                          durations=self.durations())
                if previous is None:
                    log.warning("cannot place %s: %s", model.name, explanation.summary)
                self.unplaceable[model.name] = explanation
                self._explained_at[model.name] = now
            return False
        for shard in chosen.shards:
            allocated.setdefault(shard.node, set()).update(shard.gpus)
        self.unplaceable.pop(model.name, None)
        self.evicting.pop(model.name, None)
        replica_id = new_replica_id(model.name)
        shards = [Shard(id=f"{replica_id}-{s.rank}", replica_id=replica_id, rank=s.rank, node=s.node, gpus=s.gpus)
                  for s in chosen.shards]
        replica = Replica(id=replica_id, model=model.name, api_key=new_engine_key(), shards=shards)
        draining = [r for r in self.replicas.values() if r.model == model.name and r.draining]
        if draining:
            replica.replaces = draining[0].id
        self.replicas[replica_id] = replica
        self.health.setdefault(model.name, ModelHealth()).launches += 1
        log.info("placing %s as %s on %s (%s)", model.name, replica_id, ", ".join(replica.nodes),
                 "; ".join(chosen.reasons))
        self._save(replica)
        self.actions.launch(replica, model)
        return True

    def _eviction_pool(self, model: Model, now: float) -> list[evict.Candidate]:
        return evict.candidates(self.replicas.values(), self.holder.current.models, self.last_used, now,
                                for_model=model.name, default_idle=self.gateway.evict_idle,
                                started_at=self.started_at)

    def _what_if(self, model: Model, allocated, now: float) -> evict.WhatIf:
        return evict.WhatIf(model, self._eviction_pool(model, now), allocated, self.actions.download_rates, now)

    def _evict_for(self, model: Model, views: list[placement.NodeView], allocated: dict[str, set[int]],
                   now: float) -> bool:
        """Stop idle replicas of other models so that a replica of `model` fits (llmgw.control.evict);
        True while victims are stopping for it, so that no more are chosen until their GPUs are free."""
        pending = self.evicting.get(model.name)
        if pending:
            pending.intersection_update(self.replicas)  # a victim's record goes once its engines stop
            if pending:
                return True
            del self.evicting[model.name]
        if not evict.may_evict_for(self.health.get(model.name), now):
            return False
        pool = self._eviction_pool(model, now)
        found = evict.choose(model, views, allocated, pool) if pool else None
        if found is None:
            return False
        victims, chosen = found
        log.info("evicting %s to place %s on %s", ", ".join(v.idle_words(now) for v in victims), model.name,
                 ", ".join(s.node for s in chosen.shards))
        for victim in victims:
            reason = evict.eviction_reason(model.name, victim, now)
            self.evicted[victim.replica_id] = model.name
            self._retire(self.replicas[victim.replica_id], reason)
            if self.store is not None:
                detail = {"model": victim.model, "for": model.name, "idle_seconds": round(now - victim.idle_since, 1),
                          "nodes": sorted(victim.gpus)}
                self.store.submit(lambda db, rid=victim.replica_id, detail=detail, reason=reason:
                                  audit(db, "evictor", "evict", rid, {**detail, "reason": reason}))
        self.evicting[model.name] = {v.replica_id for v in victims}
        return True

    # -- stopping ------------------------------------------------------------------------------

    def _retire(self, replica: Replica, reason: str, grace: float = RETIRE_GRACE) -> None:
        """Take a replica out of service: off the router first, then its engines stopped once
        its requests in flight have ended, or after `grace` seconds."""
        if not replica.set_phase(ReplicaPhase.RETIRING):
            return
        replica.reason = replica.reason or reason
        log.info("retiring replica %s of %s: %s", replica.id, replica.model, reason)
        self.actions.cancel_launch(replica.id)
        self._save(replica)
        self._push()
        self.actions.stop(replica, grace)

    def _stopped(self, replica: Replica) -> None:
        """A retired replica's engines are all stopped: its record goes."""
        self.replicas.pop(replica.id, None)
        self.retired.append((time.time(), replica))
        if self.store is not None:
            self.store.submit(lambda db: delete_replica(db, replica.id))
        self.wake()

    def _record_failure(self, replica: Replica, now: float) -> None:
        health = self.health.setdefault(replica.model, ModelHealth())
        health.failures += 1
        health.next_attempt = now + backoff_delay(health.failures - 1, base=FAILURE_BACKOFF_BASE,
                                                  cap=FAILURE_BACKOFF_CAP)
        failed = next((s for s in replica.shards if s.state == FAILED), None)
        health.last_failure = failed.reason if failed else replica.reason
        health.last_log_tail = failed.log_tail if failed else None
        health.failed_on = tuple(s.node for s in replica.shards if s.state == FAILED)
        replica.reason = health.last_failure
        log.warning("replica %s of %s failed: %s (attempt %d; next in %.0fs)", replica.id, replica.model,
                    health.last_failure, health.failures, health.next_attempt - now)

    def _cleanup_retired(self, now: float) -> None:
        self.retired = [(t, r) for t, r in self.retired if now - t < RETIRED_KEEP][-200:]
        if self.evicted:
            listed = {r.id for _, r in self.retired} | self.replicas.keys()
            self.evicted = {rid: m for rid, m in self.evicted.items() if rid in listed}

    # -- endpoints and persistence -------------------------------------------------------------

    def endpoints(self) -> dict[str, list[Endpoint]]:
        table: dict[str, list[Endpoint]] = {}
        for replica in self.replicas.values():
            if not replica.serving:
                continue
            leader = replica.leader
            node = self.fleet.nodes.get(leader.node)
            if node is None or leader.port is None:
                continue
            host = "127.0.0.1" if node.connection == "local" else node.host
            table.setdefault(replica.model, []).append(
                Endpoint(replica_id=replica.id, model=replica.model, url=f"http://{_url_host(host)}:{leader.port}",
                         api_key=replica.api_key, draining=replica.draining))
        for endpoints in table.values():
            endpoints.sort(key=lambda e: e.replica_id)
        return table

    def _push(self) -> None:
        table = self.endpoints()
        if table != self._endpoints_pushed:
            self._endpoints_pushed = table
            if self.push_endpoints is not None:
                self.push_endpoints(table)

    def _save(self, replica: Replica) -> None:
        if self.store is not None:
            snapshot = Replica(**{**replica.__dict__, "shards": [Shard(**s.__dict__) for s in replica.shards]})
            self.store.submit(lambda db: save_replica(db, snapshot))


def _inside_any(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
