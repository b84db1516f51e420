"""Publishing the control plane's state as a `ControlView` (llmgw.contracts.views).

`control_view` is a pure function of what it is given (`Sources`): the control plane's memory
(llmgw.control.memory: records, node admin, placing, scaling), what the node tasks learned, the
cache clean-up's state, the fleet's links, facts and node configurations, the catalog and the
gateway's settings; it makes frozen values of them, copies but for what is frozen already and
shared as it is (the fleet's fact values, the catalog, the node configuration's labels under
placement's node views). It imports nothing of the reconciler.

The reconciler publishes at the end of every pass, and the control plane after an operator
action that must show at once (cordon, drain, model add, remove, scale, a reload). A
publication is cheap: its view is built when first read and then kept, the same object for
every reader until the next publication. A pass over a large fleet therefore pays nothing for it
(placement's node views of 2,000 nodes cost more than a whole pass with nothing to do), and a
view is built at most once per publication, from the state of the moment it is first read.

Three things leave the control plane, each under its own name: a publication of this view (for
the admin, /metrics and ctl: `Reconciler.publish_view`), the endpoint table the reconciler pushes
to the router feed (`Routers.push`, llmgw.control.routers), and the feed's changes, which the
feed publisher (llmgw.control.feed) sends the routers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmgw.catalog import CatalogHolder
from llmgw.config import GatewayConfig
from llmgw.contracts.views import (CacheCleanup, ControlView, PublishedModel, PublishedNode, PublishedNodeAdmin,
                                   PublishedReplica, PublishedShard, frozen_mapping)
from llmgw.control import placement, rollouts
from llmgw.control.actions import Learned
from llmgw.control.adapters import AdapterMemory
from llmgw.control.cleanup import Cleanup
from llmgw.control.memory import ControlMemory
from llmgw.control.nodes import node_views
from llmgw.control.rollouts import RolloutMemory
from llmgw.control.state import ENDED, FAILED, Replica
from llmgw.fleet.fleet import Fleet


@dataclass(frozen=True, slots=True)
class Sources:
    """What a view is made of. Held by a publication until its view is built, then let go."""

    memory: ControlMemory
    learned: Learned
    cleanup: Cleanup
    fleet: Fleet
    holder: CatalogHolder
    gateway: GatewayConfig


class Published:
    """One publication: the pass that made it, when, and its view, built on first read."""

    __slots__ = ("pass_number", "published_at", "_sources", "_view")

    def __init__(self, sources: Sources, pass_number: int):
        self.pass_number = pass_number
        self.published_at = time.time()
        self._sources: Sources | None = sources
        self._view: ControlView | None = None

    def get(self) -> ControlView:
        if self._view is None:
            assert self._sources is not None
            self._view = control_view(self._sources, self.pass_number, self.published_at)
            self._sources = None  # built once: nothing more is read through this publication
        return self._view


def control_view(sources: Sources, pass_number: int, published_at: float) -> ControlView:
    """The ControlView of the control plane's and fleet's state now."""
    fleet, memory, learned = sources.fleet, sources.memory, sources.learned
    records, scaling = memory.records, memory.scaling
    catalog = sources.holder.current
    views = node_views(fleet, memory.nodes.admin)
    allocated = records.allocated()
    live = sorted(records.replicas.values(), key=lambda r: (r.model, r.id))
    holders: dict[str, dict[int, str]] = {}
    on_node: dict[str, set[str]] = {}
    for replica in live:
        for shard in replica.shards:
            if shard.state not in ENDED:
                on_node.setdefault(shard.node, set()).add(replica.id)
                for index in shard.gpus:
                    holders.setdefault(shard.node, {})[index] = replica.id
    nodes = []
    for view in views:
        name = view.name
        config = fleet.nodes[name]
        link = fleet.links.get(name)
        facts = fleet.facts[name]
        admin = memory.nodes.admin.get(name)
        paths = fleet.paths(name)
        nodes.append(PublishedNode(
            name=name, host="local" if config.connection == "local" else config.host, fabric=config.fabric,
            labels=frozen_mapping(config.labels), state=view.state, state_reason=view.state_reason,
            since=link.since if link is not None else None,
            admin=PublishedNodeAdmin(admin.state, admin.grace_until, admin.actor) if admin else PublishedNodeAdmin(),
            gpu_class=view.gpu_class, inventory=facts.inventory, storage=facts.storage,
            holdings=frozen_mapping(facts.holdings) if facts.holdings is not None else None,
            observed_at=max(facts.observed_at.values()) if facts.observed_at else None,
            allocated=allocated.get(name, frozenset()), gpu_holders=frozen_mapping(holders.get(name, {})),
            free_gpus=placement.free_gpus(view, allocated),
            replicas=tuple(sorted(on_node.get(name, ()))),
            unknown_engines=tuple(memory.nodes.unknown_engines.get(name, ())),
            cache_dir=paths.cache_dir, model_dirs=tuple(config.model_dirs), shared_dirs=tuple(config.shared_dirs),
            download_rate=learned.download_rates.get(name), placement=view,
            cleanup=_cleanup(sources.cleanup, name, facts.storage, paths.cache_dir)))
    seen = {r.id for r in live}
    retired = []
    # A failed replica leaves the live set once its engines are stopped; it stays listed for a
    # while so that its error and log tail can be read, and an evicted one for its reason.
    evicted = memory.placing.evicted
    for _, replica in reversed(records.retired):
        if replica.id not in seen and (replica.state == FAILED or replica.id in evicted):
            seen.add(replica.id)
            retired.append(_replica(replica, scaling.last_used.get(replica.id), True, memory.rollouts, None))
    models = {}
    for model in catalog.models.values():
        rollout = rollouts.status(memory.rollouts, model, catalog, live) if not model.static else None
        health = records.health.get(model.name)
        scale = scaling.scales.get(model.name)
        source = model.source
        models[model.name] = PublishedModel(
            name=model.name, failures=health.failures if health else 0,
            next_attempt=health.next_attempt if health and health.failures else None,
            last_failure=health.last_failure if health else None,
            last_log_tail=tuple(health.last_log_tail) if health and health.last_log_tail else None,
            launches=health.launches if health else 0, unplaceable=memory.placing.unplaceable.get(model.name),
            demand=scaling.demand.get(model.name),
            learned_size=learned.sizes.get(source.canonical) if source is not None else None,
            desired=scale.desired if scale is not None else None, last_scale=scale.last if scale is not None else None,
            scale_ups=scale.ups if scale is not None else 0, scale_downs=scale.downs if scale is not None else 0,
            evict_idle=model.evict_idle(sources.gateway.evict_idle) if model.evictable and not model.static
            else None, **(_rollout(rollout) if rollout is not None else {}))
    return ControlView(
        pass_number=pass_number, published_at=published_at, catalog=catalog, nodes=tuple(nodes),
        replicas=tuple(_replica(r, scaling.last_used.get(r.id), False, memory.rollouts, memory.adapters) for r in live),
        retired=tuple(retired), models=frozen_mapping(models),
        free_whole_nodes=frozen_mapping(placement.free_whole_nodes(views, allocated)),
        adapter_counts=frozen_mapping({name: (memory.adapters.loads.get(name, 0), memory.adapters.unloads.get(name, 0),
                                              memory.adapters.load_failures.get(name, 0))
                                       for name in catalog.adapters}))


def _rollout(status: dict) -> dict:
    target, defined = status["target"] or {}, status["catalog"] or {}
    return {"revision": target.get("id"), "revision_number": target.get("number"),
            "catalog_revision": defined.get("id"), "rollout": status["state"],
            "rollout_waiting": status["paused"] or status["waiting"]}


def _cleanup(cleanup: Cleanup, node: str, storage, cache_dir: str | None) -> CacheCleanup:
    fs = storage.filesystem_of(cache_dir) if storage is not None else None
    return cleanup.state(node, fs.total_bytes if fs is not None else None)


def _replica(replica: Replica, last_used: float | None, retired: bool, revisions: RolloutMemory,
             loaded: AdapterMemory | None) -> PublishedReplica:
    number = revisions.number(replica.model, replica.revision)
    adapters = revisions.adapters(replica.model, replica.revision) if number is not None else None
    if adapters is not None and loaded is not None:
        adapters += tuple(a for a in loaded.held(replica.id) if a not in adapters)
    return PublishedReplica(
        id=replica.id, model=replica.model, state=replica.state, serving=replica.serving,
        draining=replica.draining, retiring=replica.retiring, retired=retired, replaces=replica.replaces,
        reason=replica.reason, created_at=replica.created_at, serving_since=replica.serving_since,
        last_used=last_used, revision=replica.revision, revision_number=number,
        # What its engine holds is its revision's adapters, not the catalog's (during a rollout that
        # adds or removes one, old and new replicas differ), and those it loaded since.
        adapters=adapters, adapter_errors=loaded.errors(replica.id) if loaded is not None else (),
        shards=tuple(PublishedShard(rank=s.rank, node=s.node, gpus=tuple(s.gpus), port=s.port, dist_port=s.dist_port,
                                state=s.state, state_since=s.state_since, reason=s.reason,
                                log_tail=tuple(s.log_tail) if s.log_tail is not None else None,
                                progress=s.progress, activity=s.activity, pid=s.pid, created_at=s.created_at)
                     for s in replica.shards))
