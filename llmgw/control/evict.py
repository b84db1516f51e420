"""Eviction (R-6.8c): which idle replicas of other models to stop so that a replica short of GPUs fits, and
the what-if of `explain-placement` — one change per rejected node — by the same rule.

Pure functions of the facts placement uses (node views, GPU allocations), the live replicas, the
router's last use per replica and the clock; no I/O, no logging.

Who may be evicted (a *candidate*):
- a serving replica of another model, not draining or being retired;
- whose model allows it: `scaling.evictable`, or when that is not set, on-demand models
  (`min: 0`) are evictable and models with a minimum are not;
- never taking its model below its min: of a model with N serving replicas, only the N - min
  longest idle are candidates;
- idle at least its model's `idle_timeout` where the model sets one, else (unset or `null`) the
  gateway's `evict_idle`, 10 min by default (`Model.evict_idle`). Idle since the router last used it; a replica the router
  has not reported counts from when it began serving, and one adopted after a restart (its
  start not seen) from the control plane's start, as the idle stop of on-demand models does.

Which are chosen: greedily, longest idle first (ties by replica id), each one's GPUs freed,
until placement's own filters and ranking find a plan; then every chosen replica the plan does
not need is given back, the most recently used first, so that no replica is stopped for nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from llmgw.catalog import Model
from llmgw.contracts.states import AdminState, LinkState
from llmgw.control import placement
from llmgw.control.state import DRAINING_PHASE, ModelHealth, Replica
from llmgw.units import duration_text, format_bytes, format_rate, idle_text

ADMIN_STOPS = frozenset({AdminState.CORDONED, AdminState.DRAINING})  # what an uncordon mends
NOT_READY = frozenset({LinkState.CONNECTING, LinkState.UNREACHABLE, LinkState.UNHEALTHY})  # the node ready again mends
DEFAULT_EVICT_IDLE = 600.0  # seconds; `gateway.evict_idle` for models that set no `idle_timeout`


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that may be stopped to make room, and since when nobody asked for it."""

    replica_id: str
    model: str
    gpus: Mapping[str, frozenset[int]]  # node -> the GPU indices its shards hold there
    idle_since: float

    def idle_words(self, now: float) -> str:
        """`chat-small-1a2b (idle 42 min)`."""
        return f"{self.replica_id} (idle {idle_text(now - self.idle_since)})"


def may_evict_for(health: ModelHealth | None, now: float) -> bool:
    """Nothing is evicted for a model in failure backoff: its next replica would likely fail too."""
    return health is None or not health.failures or now >= health.next_attempt


def candidates(replicas: Iterable[Replica], models: Mapping[str, Model], last_used: Mapping[str, float],
               now: float, *, for_model: str | None, default_idle: float = DEFAULT_EVICT_IDLE,
               started_at: float | None = None) -> list[Candidate]:
    """The replicas that may be evicted for `for_model` (None: for any model), longest idle first."""
    found: list[tuple[float, str, Replica]] = []
    serving: dict[str, int] = {}
    allowed: dict[str, bool] = {}  # model -> may be evicted; asked once per model, not per replica
    for replica in replicas:
        name = replica.model
        ok = allowed.get(name)
        if ok is None:
            model = models.get(name)
            ok = allowed[name] = name != for_model and model is not None and not model.static and model.evictable
        if not ok or not replica.serving or replica.phase is DRAINING_PHASE:
            continue
        serving[name] = serving.get(name, 0) + 1
        model = models[name]
        idle_since = last_used.get(replica.id) or replica.serving_since or started_at
        if idle_since is None:
            continue  # no known time to count from: not known to be idle
        window = model.evict_idle(default_idle)
        if now - idle_since < window:
            continue
        found.append((idle_since, replica.id, replica))
    found.sort(key=lambda f: (f[0], f[1]))
    spare = {name: count - models[name].min_replicas for name, count in serving.items() if name in models}
    chosen = []
    for idle_since, _, replica in found:
        if spare.get(replica.model, 0) <= 0:
            continue  # its model would go below its min
        spare[replica.model] -= 1
        gpus: dict[str, frozenset[int]] = {}
        for shard in replica.shards:
            gpus[shard.node] = gpus.get(shard.node, frozenset()) | frozenset(shard.gpus)
        chosen.append(Candidate(replica.id, replica.model, gpus, idle_since))
    return chosen


def choose(model: Model, nodes: Sequence[placement.NodeView], allocated: Mapping[str, Set[int]],
           pool: Sequence[Candidate], *, avoid: Mapping[str, str] | Set[str] = frozenset()
           ) -> tuple[tuple[Candidate, ...], placement.Plan] | None:
    """The victims whose GPUs let `model` be placed, and the plan it would get; None when none do.

    `pool` is `candidates(...)` in its order. Placement is re-run on the same node views with the
    victims' GPUs freed, so a plan found here is one `placement.place` gives once they stop.
    """
    pool = [c for c in pool if any(c.gpus.values())]  # one that frees no GPU cannot help
    freed = {node: set(gpus) for node, gpus in allocated.items()}
    # First with every candidate gone: a model that lacks more than GPUs (another class, say)
    # is answered with one placement, not one per candidate, on every pass it stays unplaceable.
    for candidate in pool:
        _give(freed, candidate, back=False)
    if not pool or placement.place(model, nodes, freed, avoid=avoid) is None:
        return None
    freed = {node: set(gpus) for node, gpus in allocated.items()}
    taken: list[Candidate] = []
    plan = None
    for candidate in pool:
        _give(freed, candidate, back=False)
        taken.append(candidate)
        plan = placement.place(model, nodes, freed, avoid=avoid)
        if plan is not None:
            break
    if plan is None:
        return None
    # The last one taken made it fit; each earlier one the plan can do without is given back,
    # the most recently used first.
    for candidate in reversed(taken[:-1]):
        _give(freed, candidate, back=True)
        trial = placement.place(model, nodes, freed, avoid=avoid)
        if trial is None:
            _give(freed, candidate, back=False)
        else:
            taken.remove(candidate)
            plan = trial
    return tuple(taken), plan


def eviction_reason(model: str, victim: Candidate, now: float) -> str:
    """`evicted for chat-large (idle 42 min)`: the reason a victim is retired with, kept and shown."""
    return f"evicted for {model} (idle {idle_text(now - victim.idle_since)})"


class WhatIf:
    """The what-if of explain-placement for one model: called for each rejected node with its
    shortfall categories (placement.WhatIfHook), it names one change that makes the node fit.

    Only a node whose shortfalls are all of one kind has one change: GPUs (stop evictable idle
    replicas there, by the eviction rule), cordoned or draining (uncordon), not ready (be ready
    again), labels (add them), cache space (free some). A node that lacks the model's fetched
    weights says what the download would take, at the rate its last fetch was measured at.
    """

    # The first shortfall category of a node not ready or not active is its state (placement._Need.shortfalls).
    mends = frozenset({*ADMIN_STOPS, *NOT_READY, "gpus", "labels", "disk"})

    def __init__(self, model: Model, pool: Sequence[Candidate], allocated: Mapping[str, Set[int]],
                 rates: Mapping[str, float], now: float):
        self.model = model
        self.allocated = allocated
        self.rates = rates
        self.now = now
        self.by_node: dict[str, list[Candidate]] = {}
        for candidate in pool:
            for node, gpus in candidate.gpus.items():
                if gpus:
                    self.by_node.setdefault(node, []).append(candidate)

    def __call__(self, node: placement.NodeView, categories: tuple[str, ...], free: int | None,
                 holds: bool | None, refits) -> str | None:
        kind = categories[0]
        if kind not in self.mends or len(categories) > 1 and any(c != kind for c in categories):
            return None
        if kind in ADMIN_STOPS:
            change = "fits when uncordoned"
        elif kind in NOT_READY:
            change = f"fits once the node is ready again (now {kind})"
        elif kind == "gpus":
            change = self._stop(node, refits)
        elif kind == "labels":
            selector = self.model.profile.node_selector if self.model.profile is not None else {}
            missing = [f"{k}={v}" for k, v in sorted(selector.items()) if node.labels.get(k) != v]
            change = f"fits if labelled {', '.join(missing)}"
        elif kind == "disk" and self.model.disk_bytes is not None and node.cache_free_bytes is not None:
            change = f"fits with {_size(self.model.disk_bytes - node.cache_free_bytes)} more free in its cache"
        else:
            return None
        if change is None:
            return None
        return change + self._download(node, holds)

    def _stop(self, node: placement.NodeView, refits) -> str | None:
        """Victims on this node by the eviction rule: longest idle first until it fits, then the unneeded given back."""
        pool = self.by_node.get(node.name)
        if not pool:
            return None
        held = set(self.allocated.get(node.name) or ())
        taken: list[Candidate] = []
        for candidate in pool:
            held -= candidate.gpus[node.name]
            taken.append(candidate)
            if refits(node, {node.name: held}):
                break
        else:
            return None
        for candidate in reversed(taken[:-1]):
            trial = held | candidate.gpus[node.name]
            if refits(node, {node.name: trial}):
                taken.remove(candidate)
                held = trial
        names = [c.idle_words(self.now) for c in taken]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return f"fits if {listed} {'is' if len(names) == 1 else 'are'} stopped"

    def _download(self, node: placement.NodeView, holds: bool | None) -> str:
        source, size = self.model.source, self.model.disk_bytes
        if holds or source is None or not source.fetched or size is None:
            return ""
        rate = self.rates.get(node.name)
        if rate is None:
            return f", after a {_size(size)} download (this node's download rate is not measured yet)"
        return (f", after a {_size(size)} download (about {duration_text(size / rate)} at this node's last measured "
                f"{format_rate(rate)})")


def _size(value: float) -> str:
    """`38 GB`, `2.5 GB` (rounded up to a tenth, as placement words what a model needs); below a GB, `1.0 MB`."""
    if value < 1e9:
        return format_bytes(math.ceil(value))
    tenths = math.ceil(value / 1e8)
    return f"{tenths // 10} GB" if tenths % 10 == 0 else f"{tenths / 10:.1f} GB"


def _give(allocated: dict[str, set[int]], candidate: Candidate, *, back: bool) -> None:
    for node, gpus in candidate.gpus.items():
        held = allocated.setdefault(node, set())
        if back:
            held |= gpus
        else:
            held -= gpus
