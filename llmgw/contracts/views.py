"""The read model the control plane publishes: typed, frozen values of one moment of its state.

The reconciler publishes a `ControlView` at the end of every pass (and the control plane after an
operator action that must show at once); the admin API, the dashboard, /metrics and `llmgw ctl`
render from it and never from the reconciler's or the fleet's own records. The routers are fed
otherwise: the reconciler pushes each pass's endpoint table to the router feed (llmgw.control.feed).

Every value is frozen: dataclasses frozen with slots, tuples, read-only mappings, and nothing
in a view is changed once it is published. Not everything in it is a copy: a node's inventory and
storage are the fleet's fact values, its `placement` view proxies the node configuration's
labels, and the catalog is the one in force; those are frozen dataclasses, but some of the dicts
they hold (an inventory's containers and venvs, a container's images, labels, a profile's env)
are the fleet's or the configuration's own, shared rather than copied. Nothing changes them in
place: a new report or configuration replaces them whole. None is unknown, never zero (R-2.3,
R-2.7). Nothing here is imported from the control plane, the fleet or the router at run
time: both sides of the contract import this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from llmgw.contracts.states import AdminState, LinkState

if TYPE_CHECKING:  # the value types of what nodes report and of placement, named for readers only
    from llmgw.catalog import Catalog
    from llmgw.control.placement import Explanation, NodeView
    from llmgw.fleet.facts import Held, Inventory, Storage

READY = LinkState.READY
ACTIVE = AdminState.ACTIVE
EMPTY: Mapping = MappingProxyType({})


def frozen_mapping(items) -> Mapping:
    """A read-only copy of a mapping (or of key/value pairs)."""
    return MappingProxyType(dict(items))


@dataclass(frozen=True, slots=True)
class PublishedNodeAdmin:
    """What the operator set on a node (R-9.4): active, cordoned or draining."""

    state: str = ACTIVE
    grace_until: float | None = None
    actor: str | None = None


@dataclass(frozen=True, slots=True)
class CacheRemoval:
    """One cache entry the clean-up removed to bring its filesystem back to the mark."""

    name: str
    path: str | None
    bytes: int | None
    last_used: float | None
    removed_at: float
    mark: str  # as configured: 10% or 50.0 GB
    threshold_bytes: int  # the free bytes that mark meant on that filesystem


@dataclass(frozen=True, slots=True)
class CacheCleanup:
    """The clean-up of a node's cache at its low-water mark (control/cleanup.py)."""

    mark: str | None  # None: off on this node
    threshold_bytes: int | None  # None: off, or a share of a size the node did not report
    last_run: float | None
    last_result: str | None
    waiting: str | None  # why a clean-up that is due has not started
    removed: tuple[CacheRemoval, ...]  # newest first


OFF = CacheCleanup(None, None, None, None, None, ())


@dataclass(frozen=True, slots=True)
class PublishedNode:
    """One node as the control plane sees it: its link, its admin state and what it reported."""

    name: str
    host: str  # "local" for a node reached without SSH
    fabric: str | None
    labels: Mapping[str, str]
    state: str  # the link: connecting | ready | unreachable | unhealthy
    state_reason: str | None
    since: float | None  # when the link entered its state (for a node down: its first failure)
    admin: PublishedNodeAdmin
    gpu_class: str | None  # normalised, the inventory's override applied
    inventory: Inventory | None  # GPUs, memory, CPUs as last reported; None: never reported
    storage: Storage | None
    holdings: Mapping[str, Held] | None  # model -> where the node holds its weights
    observed_at: float | None  # the latest report of any kind
    allocated: frozenset[int]  # GPU indices that live shards hold
    gpu_holders: Mapping[int, str]  # GPU index -> replica id
    free_gpus: tuple[int, ...] | None  # healthy and held by no replica; None: GPUs unknown
    replicas: tuple[str, ...]  # live replicas with a shard here
    unknown_engines: tuple[str, ...]  # engines running there that llmgw has no record of
    cache_dir: str | None  # absolute on the node; None until it said hello
    model_dirs: tuple[str, ...]
    shared_dirs: tuple[str, ...]
    download_rate: float | None  # bytes/s of the node's latest completed fetch; None: never measured
    placement: NodeView  # what placement sees of this node
    cleanup: CacheCleanup = OFF  # the clean-up of its cache at the low-water mark

    @property
    def memory_bytes(self) -> int | None:
        return self.inventory.memory_bytes if self.inventory is not None else None

    @property
    def stale(self) -> bool:
        """What a node that is not ready last reported is kept, but marked stale (R-1.1)."""
        return self.state != READY and self.observed_at is not None


@dataclass(frozen=True, slots=True)
class PublishedShard:
    rank: int
    node: str
    gpus: tuple[int, ...]
    port: int | None
    dist_port: int | None
    state: str
    state_since: float
    reason: str | None
    log_tail: tuple[str, ...] | None
    progress: tuple[int, int | None] | None  # bytes fetched so far, total when the source said
    activity: str | None  # what a fetch without byte counts is doing: an image pull's last line
    pid: int | None
    created_at: float


@dataclass(frozen=True, slots=True)
class PublishedReplica:
    id: str
    model: str
    state: str
    serving: bool
    draining: bool  # marked for a rolling move, still serving until its replacement does
    retiring: bool  # being stopped (surplus, model gone, failed, drained, evicted)
    retired: bool  # stopped already: a failed or evicted replica kept for a while for its reason and log
    replaces: str | None
    reason: str | None
    created_at: float
    serving_since: float | None
    last_used: float | None  # None: the router never reported it used (unknown, not idle)
    shards: tuple[PublishedShard, ...]
    revision: str | None = None  # the model's revision it runs; None: not known
    revision_number: int | None = None
    # The LoRA adapters its engine holds: its revision's, in launch order, then those it
    # loaded since, by name; None: its revision is not known, so neither is what it holds.
    adapters: tuple[str, ...] | None = None
    # (adapter, why) of the loads that failed on it lately.
    adapter_errors: tuple[tuple[str, str], ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.shards)


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One change of a model's wanted replica count, with its reason in operator words (R-6.8b)."""

    at: float
    before: int
    after: int
    reason: str  # "scale 1→3: 7.5 in flight over 30s, target 2"

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"


@dataclass(frozen=True, slots=True)
class PublishedModel:
    """What the control plane knows of one catalog model beyond its definition."""

    name: str
    failures: int  # consecutive failed replicas; 0 once one serves
    next_attempt: float | None  # no replacement is launched before this time (backoff); None: no failure
    last_failure: str | None
    last_log_tail: tuple[str, ...] | None
    launches: int
    unplaceable: Explanation | None  # why a wanted replica fits no node
    demand: float | None  # when an on-demand model was last asked for without a replica
    learned_size: int | None  # bytes of weights learned from the source; None: not learned
    desired: int | None = None  # replicas the model wants now (R-6.8a); None: not decided yet
    last_scale: ScaleDecision | None = None  # the latest change of `desired`
    scale_ups: int = 0  # changes of `desired` since the gateway started, by direction
    scale_downs: int = 0
    evict_idle: float | None = None  # seconds unused before a replica may be evicted (R-6.8c); None: not evictable
    revision: str | None = None  # the revision its replicas are to run; None: llmgw runs none
    revision_number: int | None = None
    catalog_revision: str | None = None  # the catalog's; differs from `revision` while an undo holds the model
    rollout: str = "none"  # none, rolling, paused, canary or done
    rollout_waiting: str | None = None  # why the rollout does not move now, or why it is paused


@dataclass(frozen=True, slots=True)
class ControlView:
    """The whole published state: one pass's nodes, replicas and models."""

    pass_number: int  # the reconcile pass that published it (0: before the first pass)
    published_at: float
    catalog: Catalog  # the catalog in force (never changed: a change builds a new one)
    nodes: tuple[PublishedNode, ...]  # inventory order
    replicas: tuple[PublishedReplica, ...]  # live, by model then id
    retired: tuple[PublishedReplica, ...]  # failed or evicted recently and stopped, newest first
    models: Mapping[str, PublishedModel]
    free_whole_nodes: Mapping[str, int]  # fabric -> ready, active nodes whose GPUs are all healthy and free
    # LoRA adapter -> (loads, unloads, failed loads) since this control plane started
    adapter_counts: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)

    def node(self, name: str) -> PublishedNode | None:
        return next((n for n in self.nodes if n.name == name), None)

    def replica(self, replica_id: str) -> PublishedReplica | None:
        return next((r for r in (*self.replicas, *self.retired) if r.id == replica_id), None)
