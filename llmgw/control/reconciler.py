"""The reconciler: compares desired with actual on every pass and acts (R-4.1–R-4.5, R-5.3, R-9.5).

It is the only writer of replica and shard state. A pass (`step`) is synchronous and cheap: it
reads the fleet's latest facts, decides, and starts tasks for anything that needs a node (fetch,
launch, stop). It runs on a tick and immediately when something changes (`wake`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from llmgw.aio import cancel_and_wait
from llmgw.catalog import Catalog, CatalogHolder, Model
from llmgw.config import GatewayConfig, NodeConfig
from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.endpoints import Endpoint
from llmgw.control import placement, publish
from llmgw.control.state import (ENDED, FAILED, FETCHING, PENDING, SERVING, STARTING, STOPPED, STOPPING,
                                 Replica, Shard, delete_replica, load_replicas, new_engine_key,
                                 new_replica_id, save_replica)
from llmgw.engines import ShardVars
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import READY
from llmgw.fleet.session import NodeError
from llmgw.store import Store, audit

log = logging.getLogger(__name__)

STOP_GRACE = 10.0
FAILURE_BACKOFF_BASE = 2.0
FAILURE_BACKOFF_CAP = 300.0
UNHEALTHY_PROBES = 3  # consecutive failed health probes before a serving shard is failed
PORT_ATTEMPTS = 8
RETIRED_KEEP = 600.0  # how long a failed replica stays visible after it stopped
LOG_TAIL_LINES = 50
EXPLAIN_EVERY = 10.0  # seconds between full explanations of a model that does not fit
FETCH_MARGIN = 0.10  # a download may exceed its declared or learned size by 10 %...
FETCH_MARGIN_MIN = 64 * 1024**2  # ...and by at least 64 MiB


@dataclass
class NodeAdmin:
    state: str = "active"  # active | cordoned | draining
    grace_until: float | None = None
    actor: str | None = None


@dataclass
class ModelHealth:
    failures: int = 0
    next_attempt: float = 0.0
    last_failure: str | None = None
    last_log_tail: list[str] | None = None
    launches: int = 0
    failed_on: tuple[str, ...] = ()


class Reconciler:
    def __init__(self, holder: CatalogHolder, fleet: Fleet, store: Store | None, gateway: GatewayConfig, *,
                 push_endpoints: Callable[[dict[str, list[Endpoint]]], None] | None = None,
                 last_used: Callable[[], Mapping[str, float]] | None = None,
                 outstanding: Callable[[str], int] | None = None,
                 abandon: Callable[[str], object] | None = None):
        self.holder = holder
        self.fleet = fleet
        self.store = store
        self.gateway = gateway
        self.push_endpoints = push_endpoints
        self.last_used_source = last_used
        self.outstanding = outstanding
        self.abandon = abandon
        self.replicas: dict[str, Replica] = {}
        self.retired: list[tuple[float, Replica]] = []
        self.admin: dict[str, NodeAdmin] = {name: NodeAdmin() for name in fleet.nodes}
        self.health: dict[str, ModelHealth] = {}
        self.demand: dict[str, float] = {}
        self.last_used: dict[str, float] = {}
        self.unplaceable: dict[str, placement.Explanation] = {}
        self.unknown_engines: dict[str, list[str]] = {}
        self.started_at = time.time()
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop_tasks: dict[str, asyncio.Task] = {}
        self._fetches: dict[tuple[str, str], asyncio.Task] = {}
        self._probe_failures: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._endpoints_pushed: dict[str, list[Endpoint]] | None = None
        self._run_task: asyncio.Task | None = None
        self.passes = 0
        self.settled = False
        self._pass_views: tuple[list[placement.NodeView], dict[str, set[int]]] | None = None
        self._explained_at: dict[str, float] = {}
        self.learned_sizes: dict[str, int | None] = {}  # canonical source -> bytes (None: not said)
        self._sizing: dict[str, asyncio.Task] = {}
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
                self.admin[row["node"]] = NodeAdmin(row["state"], row["grace_until"], row["actor"])
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
        await cancel_and_wait(self._run_task, *self._tasks.values(), *self._stop_tasks.values(),
                              *self._fetches.values(), *self._sizing.values())

    # -- inputs from the router and operators --------------------------------------------------

    def note_demand(self, model: str) -> None:
        """A request wants an on-demand model that has no serving replica (R-6.8)."""
        self.demand[model] = time.time()
        self.wake()

    def set_admin(self, node: str, state: str, grace: float | None = None, actor: str | None = None) -> NodeAdmin:
        """Cordon, uncordon or drain a node (one entry point, R-9.4)."""
        if node not in self.admin:
            raise KeyError(node)
        admin = NodeAdmin(state=state, grace_until=time.time() + grace if grace is not None else None, actor=actor)
        self.admin[node] = admin
        if state == "draining":
            for replica in self.replicas.values():
                if node in replica.nodes and not replica.retiring:
                    replica.draining = True
                    self._save(replica)
        elif state == "active":
            for replica in self.replicas.values():
                if node in replica.nodes and replica.draining and not replica.retiring:
                    replica.draining = False
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
        return placement.NodeView(
            name=name, fabric=node.fabric, labels=node.labels,
            state=link.state if link is not None else "connecting",
            state_reason=link.reason if link is not None else None,
            admin=self.admin[name].state, gpu_class=gpu_class, gpus=gpus, memory_bytes=memory,
            cache_free_bytes=cache_free, holds=holds)

    def allocated(self) -> dict[str, frozenset[int]]:
        used: dict[str, set[int]] = {}
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.state not in ENDED:
                    used.setdefault(shard.node, set()).update(shard.gpus)
        return {node: frozenset(gpus) for node, gpus in used.items()}

    def explain(self, model_name: str) -> placement.Explanation:
        model = self.with_learned_size(self.holder.current.models[model_name])
        return placement.explain_placement(model, self.node_views(), self.allocated(),
                                           avoid=self._avoid(model_name))

    def cache_dir(self, node: NodeConfig) -> str | None:
        """The node's cache directory as an absolute path on it; None until the node said hello."""
        return self.fleet.paths(node.name).cache_dir

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

    # -- the pass ------------------------------------------------------------------------------

    def step(self) -> None:
        """One reconcile pass: observe, decide, start the actions (R-4.1)."""
        now = time.time()
        self.passes += 1
        catalog = self.holder.current
        if self.last_used_source is not None:
            self.last_used.update(self.last_used_source())
        self._observe(now)
        by_model: dict[str, list[Replica]] = {}
        for replica in list(self.replicas.values()):
            model = catalog.models.get(replica.model)
            if not replica.retiring and (model is None or model.static):
                self._retire(replica, "model removed from the catalog")
            elif not replica.retiring and replica.state == FAILED:
                self._record_failure(replica, now)
                self._retire(replica, replica.reason or "failed")
            if not replica.retiring:
                by_model.setdefault(replica.model, []).append(replica)
        for node, admin in self.admin.items():
            if admin.state == "draining":
                for replica in self.replicas.values():
                    if node in replica.nodes and not replica.retiring and not replica.draining:
                        replica.draining = True
                        self._save(replica)
        self.unplaceable = {k: v for k, v in self.unplaceable.items() if k in catalog.models}
        self._pass_views = None  # built on first need, once per pass
        if self._settled(now):
            for model in catalog.models.values():
                if model.static:
                    continue
                self._reconcile_model(model, by_model.get(model.name, []), catalog, now)
        self._pass_views = None
        self._cleanup_retired(now)
        self._push()
        self.view = publish.publish(self)

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

    def _reconcile_model(self, model: Model, live: list[Replica], catalog: Catalog, now: float) -> None:
        active = [r for r in live if not r.draining]
        desired = self._desired(model, active, now)
        health = self.health.setdefault(model.name, ModelHealth())
        missing = desired - len(active)
        if missing > 0:
            if now < health.next_attempt:
                return
            sized = self._sized(model)
            if sized is None:
                return  # its size is being learned from the source first
            for _ in range(missing):
                if not self._place(sized, now):
                    break
        elif missing < 0:
            # Surplus: stop the least useful first — not serving, then the newest.
            surplus = sorted(active, key=lambda r: (r.serving, -r.created_at))[:-missing]
            for replica in surplus:
                self._retire(replica, "surplus: more replicas than wanted")
        else:
            self.unplaceable.pop(model.name, None)
        # Rolling move: a draining replica stops once enough others serve, or at the grace.
        serving_active = sum(1 for r in active if r.serving)
        for replica in live:
            if not replica.draining:
                continue
            grace_over = any(self.admin[n].state == "draining" and self.admin[n].grace_until is not None
                             and now >= self.admin[n].grace_until for n in replica.nodes)
            if serving_active >= desired or grace_over or not replica.serving:
                self._retire(replica, "drained" if serving_active >= desired else
                             "drained: grace period over" if grace_over else "drained before it served")

    def _desired(self, model: Model, active: list[Replica], now: float) -> int:
        if not model.on_demand:
            return model.min_replicas
        # On demand: one replica while there is demand or recent use, however high max is.
        wanted = self.demand.get(model.name)
        if wanted is not None and not active:
            return 1
        if not active:
            return 0
        timeout = model.idle_timeout
        if timeout is None:
            return 1
        for replica in active:
            if not replica.serving:
                return 1
            used = self.last_used.get(replica.id)
            # Unknown last use (router just started) is not idle: the clock starts at that start.
            reference = max(filter(None, [used, replica.serving_since, self.started_at, wanted]))
            if now - reference < timeout:
                return 1
        self.demand.pop(model.name, None)
        return 0

    # -- observing the fleet's facts ------------------------------------------------------------

    def _observe(self, now: float) -> None:
        known: dict[str, set[str]] = {}
        for replica in self.replicas.values():
            serving_before = replica.serving
            for shard in replica.shards:
                known.setdefault(shard.node, set()).add(shard.id)
                if shard.state in (STARTING, SERVING) and not replica.retiring:
                    self._observe_shard(replica, shard, now)
            if replica.serving and not serving_before:
                replica.serving_since = now
                health = self.health.setdefault(replica.model, ModelHealth())
                health.failures, health.next_attempt = 0, 0.0
                self.demand.pop(replica.model, None)
                log.info("replica %s of %s serving on %s", replica.id, replica.model, ", ".join(replica.nodes))
                self._save(replica)
        for name, facts in self.fleet.facts.items():
            if facts.shards is None:
                continue
            strangers = sorted(sid for sid, status in facts.shards.items()
                               if status.alive and sid not in known.get(name, ()))
            if strangers != self.unknown_engines.get(name, []):
                if strangers:
                    log.warning("%s runs engines llmgw has no record of (left alone): %s", name, ", ".join(strangers))
                self.unknown_engines[name] = strangers

    def _observe_shard(self, replica: Replica, shard: Shard, now: float) -> None:
        link = self.fleet.links.get(shard.node)
        if link is None:
            shard.set_state(FAILED, f"node {shard.node} is no longer in the inventory")
            self._save(replica)
            return
        if link.state != READY:
            if now - link.since > self.gateway.settling_window:
                shard.set_state(FAILED, f"node {shard.node} {link.state} since {time.strftime('%H:%M:%S', time.localtime(link.since))}")
                self._save(replica)
                if self.abandon is not None:
                    self.abandon(replica.id)  # requests waiting on it go elsewhere now
            return
        facts = self.fleet.facts[shard.node]
        observed = facts.observed_at.get("status", 0.0)
        if facts.shards is None or observed < shard.state_since or shard.pid is None:
            return  # no report newer than the launch yet
        status = facts.shards.get(shard.id)
        if status is None or not status.alive or (status.pid != shard.pid or status.start_time != shard.start_time):
            if status is None:
                reason = "engine not found on the node"
            elif not status.alive and status.exit_code is not None:
                reason = f"engine exited with status {status.exit_code}"
            elif not status.alive:
                reason = "engine is gone (no exit status recorded)"
            else:
                reason = "a different process now has the engine's id"
            if status is not None and status.log_tail:
                shard.log_tail = replica.without_key(status.log_tail)
            shard.set_state(FAILED, reason)
            self._save(replica)
            return
        healthy = (not shard.serves_http) or status.health_status == 200
        if shard.state == STARTING:
            if healthy:
                shard.set_state(SERVING)
                self._save(replica)
            else:
                timeout = self._start_timeout(replica)
                if now - shard.state_since > timeout:
                    shard.set_state(FAILED, f"did not become ready within {timeout:.0f}s "
                                            f"(last health: {status.health_status or status.health_error})")
                    self._save(replica)
                    self.wake()  # retired on the next pass, which stops its still-running engine
        elif shard.state == SERVING:
            if healthy:
                self._probe_failures.pop(shard.id, None)
            else:
                count = self._probe_failures.get(shard.id, 0) + 1
                self._probe_failures[shard.id] = count
                if count >= UNHEALTHY_PROBES:
                    shard.set_state(FAILED, f"health check failing: {status.health_status or status.health_error}")
                    self._save(replica)

    def _start_timeout(self, replica: Replica) -> float:
        model = self.holder.current.models.get(replica.model)
        return model.profile.start_timeout if model is not None and model.profile is not None else 900.0

    # -- placing and launching -----------------------------------------------------------------

    def _sized(self, model: Model) -> Model | None:
        """The model with its weights' size filled in from the source when it was not declared;
        None while a node is still asking the source (R-5.1)."""
        source = model.source
        if source is None or not source.fetched or model.config.disk_gb is not None:
            return model
        key = source.canonical
        if key not in self.learned_sizes:
            if key not in self._sizing and self.fleet.ready_nodes():
                self._sizing[key] = asyncio.create_task(self._learn_size(model), name=f"size-{model.name}")
            return None if key in self._sizing else model
        return self.with_learned_size(model)

    def with_learned_size(self, model: Model) -> Model:
        """The model as placement sees it: a size learned from the source stands in for disk_gb."""
        size = self.learned_sizes.get(model.source.canonical) if model.source is not None else None
        if size is None or model.config.disk_gb is not None:
            return model
        return dataclasses.replace(model, config=model.config.model_copy(update={"disk_gb": size / 1000**3}))

    async def _learn_size(self, model: Model) -> None:
        key = model.source.canonical
        size = None
        try:
            for node in self.fleet.ready_nodes()[:2]:
                try:
                    source, token = fetch_source(model.source)
                    answer = await self.fleet.call(node, "source_size", {"source": source, "token": token}, timeout=60)
                    size = answer.get("bytes")
                    break
                except NodeError as exc:
                    log.info("could not learn the size of %s's weights from %s: %s", model.name, node, exc)
        finally:
            self.learned_sizes[key] = size
            self._sizing.pop(key, None)
            if size is not None:
                log.info("%s's weights are %.2f GB (learned from the source)", model.name, size / 1000**3)
            self.wake()

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
        plan = placement.place(model, views, allocated, avoid=avoid)
        if plan is None and avoid:  # a preference, not a ban: the failed node is better than none
            plan = placement.place(model, views, allocated)
        if plan is None:
            previous = self.unplaceable.get(model.name)
            if previous is None or now - self._explained_at.get(model.name, 0.0) > EXPLAIN_EVERY:
                explanation = placement.explain_placement(model, views, allocated)
                if previous is None:
                    log.warning("cannot place %s: %s", model.name, explanation.summary)
                self.unplaceable[model.name] = explanation
                self._explained_at[model.name] = now
            return False
        for shard in plan.shards:
            allocated.setdefault(shard.node, set()).update(shard.gpus)
        self.unplaceable.pop(model.name, None)
        replica_id = new_replica_id(model.name)
        shards = [Shard(id=f"{replica_id}-{s.rank}", replica_id=replica_id, rank=s.rank, node=s.node, gpus=s.gpus)
                  for s in plan.shards]
        replica = Replica(id=replica_id, model=model.name, api_key=new_engine_key(), shards=shards)
        draining = [r for r in self.replicas.values() if r.model == model.name and r.draining and not r.retiring]
        if draining:
            replica.replaces = draining[0].id
        self.replicas[replica_id] = replica
        self.health.setdefault(model.name, ModelHealth()).launches += 1
        log.info("placing %s as %s on %s (%s)", model.name, replica_id, ", ".join(replica.nodes),
                 "; ".join(plan.reasons))
        self._save(replica)
        self._tasks[replica_id] = asyncio.create_task(self._launch(replica, model), name=f"launch-{replica_id}")
        return True

    async def _launch(self, replica: Replica, model: Model) -> None:
        try:
            leader = replica.leader
            leader_node = self.fleet.nodes[leader.node]
            if len(replica.shards) > 1:
                leader.dist_port = self._free_port(leader.node, exclude=set())
            paths = await asyncio.gather(*(self._weights(replica, shard, model) for shard in replica.shards))
            await asyncio.gather(*(self._start_shard(replica, shard, model, path, leader_node)
                                   for shard, path in zip(replica.shards, paths)))
        except asyncio.CancelledError:
            raise
        except NodeError as exc:
            self._fail_replica(replica, _node_error_reason(exc))
        except EngineMissing as exc:
            self._fail_replica(replica, str(exc))
        except Exception as exc:  # a bug must fail the replica visibly, not hang it
            log.exception("launching %s failed", replica.id)
            self._fail_replica(replica, f"launch failed: {exc}")
        finally:
            self._tasks.pop(replica.id, None)
            self.wake()

    def _fail_replica(self, replica: Replica, reason: str) -> None:
        for shard in replica.shards:
            if shard.state not in ENDED:
                shard.set_state(FAILED, reason)
        self._save(replica)

    async def _weights(self, replica: Replica, shard: Shard, model: Model) -> str:
        """The weights path on the shard's node, fetching them first when needed (R-5.1–R-5.3)."""
        node = self.fleet.nodes[shard.node]
        source = model.source
        if source is None:
            return model.name
        held = (self.fleet.facts[shard.node].holdings or {}).get(model.name)
        if held is not None:
            return _engine_path(source, held.path)
        if not source.fetched:
            paths = self.fleet.paths(node.name)
            candidates = source.candidates([*paths.model_dirs, *paths.shared_dirs], paths.cache_dir)
            return candidates[0] if candidates else source.path
        shard.set_state(FETCHING)
        self._save(replica)
        key = (shard.node, source.cache_name)
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(node, model), name=f"fetch-{shard.node}-{source.cache_name}")
            self._fetches[key] = task
            task.add_done_callback(lambda _: self._fetches.pop(key, None))
        watchers = getattr(task, "watchers", None)
        if watchers is None:
            watchers = task.watchers = []  # type: ignore[attr-defined]
        watchers.append(shard)
        try:
            path = await asyncio.shield(task)
        finally:
            watchers.remove(shard)
        return _engine_path(source, path)

    async def _fetch(self, node: NodeConfig, model: Model) -> str:
        source = model.source
        assert source is not None and source.fetched
        cache_dir = self.cache_dir(node)
        if cache_dir is None:
            raise NodeError(node.name, "fetch", "paths", "the node's cache directory is not known yet")
        helper_source, token = fetch_source(source)
        args = {"source": helper_source, "cache_dir": cache_dir, "name": source.cache_name, "token": token,
                "max_bytes": fetch_cap(model.config.disk_gb, self.learned_sizes.get(source.canonical),
                                       self.gateway.fetch_limit),
                "stall_timeout": self.gateway.fetch_stall}
        task = asyncio.current_task()
        async with self.fleet.stream(node.name, "fetch", args) as stream:
            async for event, data in stream:
                if event == "progress":
                    # Progress rides on the shard status; it is not a state transition.
                    for shard in getattr(task, "watchers", ()):
                        shard.progress = (int(data.get("bytes") or 0), data.get("total"))
        return stream.result["path"]

    def _used_ports(self, node: str) -> set[int]:
        ports = set()
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.node == node and shard.state not in ENDED:
                    ports.update(p for p in (shard.port, shard.dist_port) if p is not None)
        return ports

    def _free_port(self, node: str, exclude: set[int]) -> int:
        low, high = self.fleet.nodes[node].ports
        used = self._used_ports(node) | exclude
        for port in range(low, high + 1):
            if port not in used:
                return port
        raise NodeError(node, "launch", "ports", f"no free port left in {low}-{high}")

    async def _start_shard(self, replica: Replica, shard: Shard, model: Model, weights: str,
                           leader_node: NodeConfig) -> None:
        node = self.fleet.nodes[shard.node]
        profile = model.profile
        assert profile is not None and model.engine is not None
        local = node.connection == "local"
        tried: set[int] = set()
        for _ in range(PORT_ATTEMPTS):
            port = self._free_port(shard.node, tried)
            shard.port = port
            leader_addr = "127.0.0.1" if leader_node.connection == "local" else (leader_node.host or "127.0.0.1")
            variables = ShardVars(
                model=weights, name=model.config.served_name or model.name,
                host="127.0.0.1" if local else "0.0.0.0", port=port, gpus_per_node=profile.gpus,
                nnodes=profile.nodes, node_rank=shard.rank, leader_addr=leader_addr,
                leader_port=replica.leader.dist_port or 0,
                python=node.python or self.fleet.inventory.ssh.python if not local else "python3")
            spec = model.engine.render(variables, profile.args, profile.env, replica.api_key)
            shard.serves_http = spec.health_path is not None
            shard.argv = spec.argv
            shard.set_state(STARTING)
            self._save(replica)
            args = {"shard_id": shard.id, "argv": spec.argv, "env": spec.env, "files": spec.files,
                    "file_sha256": spec.file_sha256,
                    "port": port if shard.serves_http else None, "host": variables.host,
                    "health_url": f"http://127.0.0.1:{port}{spec.health_path}" if spec.health_path else None,
                    "gpus": list(shard.gpus)}
            try:
                result = await self.fleet.call(shard.node, "launch", args, timeout=60)
            except NodeError as exc:
                if exc.kind == "port_in_use":
                    tried.add(port)
                    continue
                if exc.kind == "engine_missing":
                    raise EngineMissing(model.engine.missing_reason(shard.node, exc.message)) from exc
                raise
            shard.pid, shard.start_time = result.get("pid"), result.get("start_time")
            shard.argv = result.get("argv") or spec.argv
            shard.state_since = time.time()
            self._save(replica)
            self.wake()
            return
        raise NodeError(shard.node, "launch", "ports", f"ports {sorted(tried)} were all in use")

    # -- stopping ------------------------------------------------------------------------------

    def _retire(self, replica: Replica, reason: str) -> None:
        """Take a replica out of service: off the router first, then its engines stopped."""
        if replica.retiring:
            return
        replica.retiring = True
        replica.reason = replica.reason or reason
        log.info("retiring replica %s of %s: %s", replica.id, replica.model, reason)
        task = self._tasks.pop(replica.id, None)
        if task is not None:
            task.cancel()
        self._save(replica)
        self._push()
        self._stop_tasks[replica.id] = asyncio.create_task(self._stop_replica(replica), name=f"stop-{replica.id}")

    async def _stop_replica(self, replica: Replica) -> None:
        try:
            if self.outstanding is not None:
                deadline = time.monotonic() + 30
                while self.outstanding(replica.id) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            await asyncio.gather(*(self._stop_shard(replica, s) for s in replica.shards))
        finally:
            self._stop_tasks.pop(replica.id, None)
        self.replicas.pop(replica.id, None)
        self.retired.append((time.time(), replica))
        if self.store is not None:
            self.store.submit(lambda db: delete_replica(db, replica.id))
        self.wake()

    async def _stop_shard(self, replica: Replica, shard: Shard) -> None:
        failed = shard.state == FAILED
        if shard.state == STOPPED:
            return
        if shard.pid is None and shard.state in (PENDING, FETCHING):
            if not failed:
                shard.set_state(STOPPED)
            return
        if not failed:
            shard.set_state(STOPPING)
            self._save(replica)
        attempt = 0
        while True:
            link = self.fleet.links.get(shard.node)
            if link is None:
                break
            if link.state == READY:
                if failed and shard.log_tail is None:
                    await self._keep_log_tail(replica, shard)
                try:
                    await self.fleet.call(shard.node, "stop", {"shard_id": shard.id, "grace": STOP_GRACE},
                                          timeout=STOP_GRACE + 30)
                    await self.fleet.call(shard.node, "forget", {"shard_id": shard.id}, timeout=30)
                    break
                except NodeError as exc:
                    if exc.kind == "identity":
                        log.warning("%s: not stopping %s: %s", shard.node, shard.id, exc.message)
                        break
                    if exc.kind in ("not_found", "unknown_shard"):
                        break
                    log.info("%s: stopping %s failed (%s); will retry", shard.node, shard.id, exc)
            # A node that is unreachable now is asked again when it returns: its engines must not
            # outlive the replica (no duplicates after a partition heals).
            await asyncio.sleep(min(backoff_delay(attempt, base=1.0, cap=10.0), 10.0))
            attempt += 1
        if not failed:
            shard.set_state(STOPPED)
        self._save(replica)

    async def _keep_log_tail(self, replica: Replica, shard: Shard) -> None:
        """A shard failed while its engine still ran (e.g. start timeout): read its log before
        stopping it, so the failure carries the tail like an engine that exited (R-4.2, R-4.8)."""
        try:
            answer = await self.fleet.call(shard.node, "logs", {"shard_id": shard.id, "lines": LOG_TAIL_LINES},
                                           timeout=30)
        except NodeError:
            return
        shard.log_tail = replica.without_key(answer.get("lines") or [])
        health = self.health.get(replica.model)
        if health is not None and health.last_log_tail is None:
            health.last_log_tail = shard.log_tail
        self._save(replica)

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


def fetch_cap(disk_gb: float | None, learned: int | None, limit: int) -> int:
    """The most bytes one fetch may write: the declared size (disk_gb), else the size learned
    from the source, plus FETCH_MARGIN of it (at least FETCH_MARGIN_MIN, for a source that
    changed a little since); the configured limit when neither is known."""
    size = disk_gb * 1000**3 if disk_gb is not None else learned
    if size is None:
        return limit
    return int(size + max(size * FETCH_MARGIN, FETCH_MARGIN_MIN))


def fetch_source(source) -> tuple[dict, str | None]:
    """The helper's `source` argument and the hub token for it. The token comes from this
    process's environment and travels in the request, never in argv or logs (R-1.6)."""
    helper_source = source.helper_source()
    token = None
    if source.kind == "hf":
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        if os.environ.get("HF_ENDPOINT"):
            helper_source["endpoint"] = os.environ["HF_ENDPOINT"]
    return helper_source, token


def _inside_any(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _engine_path(source, held_path: str) -> str:
    """A single fetched file (a GGUF, say) is handed to the engine as the file, not its directory."""
    if source.kind == "https" and len(source.urls) == 1 and posixpath.basename(held_path).startswith("llmgw-"):
        # The helper saves a URL's file under the last segment of its path, unquoted.
        return posixpath.join(held_path, unquote(urlsplit(source.urls[0]).path.rsplit("/", 1)[-1]))
    return held_path


class EngineMissing(Exception):
    """The node lacks the engine's program; the message says which and how to install it."""


def _node_error_reason(exc: NodeError) -> str:
    if exc.kind == "disk_full":
        return f"not enough disk space: {exc.message}"
    return f"{exc.op} on {exc.node} failed ({exc.phase}): {exc.message}"
