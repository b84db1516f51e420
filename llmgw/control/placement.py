"""Placement: which nodes can run a replica of a model, which ones it goes to, and why (R-3.1–R-3.6).

Pure functions of their inputs: no I/O, no logging, no clock. `Placing` (llmgw.control.placing)
calls `place` for every replica the reconciler starts, and eviction to try the room its victims
would make; `explain_placement` gives the same decision with a verdict for every
node, for `explain-placement` and for `ctl status` (models that cannot be placed, R-7.2).

Filters, in the order their reasons are listed: node ready; not cordoned or draining; not avoided
by the caller; GPU class; free healthy GPUs; memory; cache space; node_selector labels; weights
present for operator-managed paths; what the profile's runtime needs (R-4.12): for `container`,
the container program the helper would use (the one the profile names, else the first of docker,
podman on PATH) working, and able to give containers GPUs when the profile needs some; for
`venv`, the interpreter its environment is made from. A resource the node did not report never
excludes it (R-2.3, R-3.6), except GPUs for a profile that needs some: placement must name the
indices.

Ranking (R-3.3): nodes that hold the weights first (unknown holdings rank like holding nothing,
R-2.7), then nodes that hold the engine (a container's image, a venv's built environment; R-4.12,
unknown ranks like not holding it), then packing (fewest free GPUs left), then the node name. A
multi-node replica (R-3.4) takes N nodes of one fabric chosen by the same keys; the leader (rank
0) is the best of them.

With `Durations` (what fetches and provisions took lately), explain-placement's verdict for a
fitting node also estimates how long fetching the weights and provisioning the engine it lacks
would take before the engine can start (`NodeVerdict.prepare_seconds`; None when a part is not
measured yet).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from llmgw.catalog import Model
from llmgw.contracts.states import AdminState, LinkState
from llmgw.runtimes import runtime_digest, runtime_spec
from llmgw.units import duration_text, format_rate

READY = LinkState.READY
ACTIVE = AdminState.ACTIVE

# Sorts after every real count: a node whose GPUs are unknown packs worse than any known node
# (it may be a whole free GPU node that a multi-node replica needs).
_UNKNOWN_FREE = 1 << 30


@dataclass(frozen=True)
class GPUView:
    """One GPU as the node reported it."""

    index: int
    healthy: bool
    reasons: tuple[str, ...] = ()  # why unhealthy, in operator words


CONTAINER_PROGRAMS = ("docker", "podman")  # the helper's order when a profile names neither
NVIDIA_HOOK = "nvidia-container-runtime-hook"


@dataclass(frozen=True)
class ContainerView:
    """docker or podman on a node, as its inventory reported it (R-4.12). None = not checked.

    `answers`: whether it works (docker: its daemon answers); `gpu`: whether it can give a
    container GPUs the way the helper asks; `images`: for the images asked about, whether each is
    present (an image missing from the mapping was not asked about: unknown)."""

    on_path: bool
    answers: bool | None = None
    gpu: bool | None = None
    images: Mapping[str, bool] | None = None
    error: str | None = None  # why it does not answer, in the helper's words


@dataclass(frozen=True)
class VenvView:
    """A venv recipe on a node (R-4.12): its interpreter found (None: not checked), its
    environment built and sealed (None: not checked)."""

    found: bool | None
    built: bool | None = None


@dataclass(frozen=True)
class NodeView:
    """Everything placement may look at for one node. None = the node did not report it (unknown, not zero).

    `gpus` None means never reported, () means reported no GPUs. `gpu_class` is normalised with
    the inventory override applied. `cache_free_bytes` is the free space of the filesystem that
    holds the node's cache directory. `holds` names the models whose weights the node can see.
    `containers` (by program) and `venvs` (by `runtimes.runtime_digest` of a recipe; one missing was
    not asked about) are what the node can run engines from (R-4.12).
    A view with no state given is `connecting`: nothing is placed on a node not known to be ready.
    """

    name: str
    fabric: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    state: str = LinkState.CONNECTING  # a LinkState: ready, connecting, unreachable, unhealthy
    state_reason: str | None = None
    admin: str = ACTIVE  # an AdminState: active, cordoned, draining
    gpu_class: str | None = None
    gpus: tuple[GPUView, ...] | None = None
    memory_bytes: int | None = None
    cache_free_bytes: int | None = None
    holds: frozenset[str] | None = None
    containers: Mapping[str, ContainerView] | None = None
    venvs: Mapping[str, VenvView] | None = None

    def __post_init__(self) -> None:
        # Derived once per view rather than once per placement: the reconciler places many
        # replicas against one fleet snapshot. Plain attributes, not fields: they stay out of
        # equality, repr and asdict.
        healthy = None if self.gpus is None else tuple(sorted(g.index for g in self.gpus if g.healthy))
        object.__setattr__(self, "_healthy", healthy)
        object.__setattr__(self, "_healthy_set", frozenset(healthy or ()))
        object.__setattr__(self, "_usable", self.state == READY and self.admin == ACTIVE)
        object.__setattr__(self, "_unhealthy_note", _unhealthy_note(self.gpus))


@dataclass(frozen=True)
class ShardPlan:
    node: str
    rank: int  # 0 = leader
    gpus: tuple[int, ...]  # GPU indices on that node


@dataclass(frozen=True)
class Plan:
    model: str
    shards: tuple[ShardPlan, ...]
    fabric: str | None
    reasons: tuple[str, ...] = ()  # why this choice, in operator words

    @property
    def leader(self) -> ShardPlan:
        return next(s for s in self.shards if s.rank == 0)


class NodeVerdict(NamedTuple):
    """One node's verdict. A named tuple, not a frozen dataclass: an explanation makes one per
    node of the fleet, and a tuple is built several times faster (explain-placement, R-3.5)."""

    node: str
    fits: bool
    reasons: tuple[str, ...]  # every shortfall, or why the node is preferred
    free_gpus: int | None
    holds_weights: bool | None
    what_if: str | None = None  # one change that would make a rejected node fit; None: none found
    holds_engine: bool | None = None  # the image or environment of the profile's runtime; None: unknown or host
    # Seconds of fetching weights and provisioning the engine before it can start on a fitting
    # node (0: it holds both); None: a part of it is not measured yet, or not asked.
    prepare_seconds: float | None = None


@dataclass(frozen=True)
class Durations:
    """What preparing nodes took lately, for explain-placement's estimate (R-4.12): bytes/s of
    each node's last fetch that moved bytes, and the seconds the last build or pull of each
    runtime (by `runtimes.runtime_digest`) took on any node. Missing: not measured."""

    fetch_rates: Mapping[str, float] = field(default_factory=dict)
    provisions: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Explanation:
    model: str
    verdicts: tuple[NodeVerdict, ...]  # every node, fitting ones first in rank order, then by name
    plan: Plan | None
    summary: str  # one line: what would happen, or why nothing fits


# ---------------------------------------------------------------------------------------------
# Public functions.


def free_gpus(node: NodeView, allocated: Mapping[str, Set[int]]) -> tuple[int, ...] | None:
    """Healthy GPU indices of the node that no replica holds, lowest first; None if GPUs are unknown.

    An unhealthy GPU is neither used nor free (R-2.2, R-7.2), even when a replica still holds it.
    """
    healthy = node._healthy
    if healthy is None:
        return None
    taken = allocated.get(node.name)
    if not taken:
        return healthy
    return tuple(i for i in healthy if i not in taken)


def free_whole_nodes(nodes: Sequence[NodeView], allocated: Mapping[str, Set[int]]) -> dict[str, int]:
    """Per fabric, how many ready, uncordoned nodes have every GPU healthy and free (R-7.2).

    A node with an unhealthy GPU is not whole: a replica sized for the node would not fit.
    Fabrics with none are listed with 0; nodes without a fabric are not counted.
    """
    counts: dict[str, int] = {}
    for node in nodes:
        if node.fabric is None:
            continue
        counts.setdefault(node.fabric, 0)
        if node._usable and node.gpus and len(node._healthy) == len(node.gpus) \
                and not node._healthy_set.intersection(allocated.get(node.name) or ()):
            counts[node.fabric] += 1
    return counts


def place(model: Model, nodes: Sequence[NodeView], allocated: Mapping[str, Set[int]], *,
          avoid: Mapping[str, str] | Set[str] = frozenset()) -> Plan | None:
    """The plan `explain_placement` would give, without writing a verdict for every node.

    `allocated` maps a node name to the GPU indices llmgw replicas hold there, including replicas
    still starting. `avoid` names nodes this placement must not use (a hard filter): a mapping
    from node to reason (e.g. "being drained"), or just a set of names.
    """
    need = _Need.of(model)
    if need is None:
        return None
    fitting = _fitting(need, model.name, nodes, allocated, avoid, [])
    if need.nodes == 1:
        if not fitting:
            return None
        return _single_plan(_Ask(model, need, allocated), min(fitting, key=_rank))
    by_fabric: dict[str, list] = {}
    for candidate in fitting:
        fabric = candidate[1].fabric
        if fabric is not None:
            by_fabric.setdefault(fabric, []).append(candidate)
    chosen = _choose_fabric(by_fabric, need.nodes)
    return None if chosen is None else _multi_plan(_Ask(model, need, allocated), chosen[0], chosen[1])


def never_fits(model: Model, nodes: Sequence[NodeView]) -> str | None:
    """Why no replica of `model` could ever run on `nodes`, None when one could (R-10.5).

    Whatever runs on the nodes now and whatever their state: each node is taken as ready and
    active with every GPU free and healthy, its cache space, holdings and container programs and
    interpreters unknown (a daemon started, a program installed, mends them); what a node has
    not reported (GPUs, class, memory) does not exclude it (R-3.6). What is left to exclude it is
    what no wait mends: GPU class and count, memory, labels, and for a multi-node profile the
    size of its fabric. The reason is placement's own summary on those nodes.
    """
    need = _Need.of(model)
    if need is None:
        return None  # static endpoints: not placed
    ideal = [replace(node, state=READY, state_reason=None, admin=ACTIVE, cache_free_bytes=None, holds=None,
                     containers=None, venvs=None,
                     gpus=None if node.gpus is None else tuple(GPUView(g.index, True) for g in node.gpus))
             for node in nodes]
    fitting: dict[str | None, int] = {}
    for node in ideal:
        free = None if node.gpus is None else len(node.gpus)
        _, categories = need.shortfalls(node, free, True, {})
        if all(category == "gpus-unknown" for category in categories):
            fitting[node.fabric] = fitting.get(node.fabric, 0) + 1
    if need.nodes == 1 and fitting or any(count >= need.nodes for fabric, count in fitting.items() if fabric):
        return None
    explained = explain_placement(model, ideal, {})
    shown = [f"{v.node}: {', '.join(v.reasons)}" for v in explained.verdicts if not v.fits and v.reasons][:NODES_NAMED]
    more = len(explained.verdicts) - len(shown)
    return explained.summary + (" (" + "; ".join(shown) + (f"; {more} more" if more > 0 else "") + ")" if shown else "")


NODES_NAMED = 5  # nodes whose shortfalls never_fits names


class WhatIfHook(Protocol):
    """What-if for a rejected node (llmgw.control.evict.WhatIf): one change in operator words, or None.

    Called with the node, its shortfall categories in filter order, its free GPUs, whether it
    holds the weights, and `refits(node, allocated)`, which re-runs the filters on a changed view
    of the node. Only nodes whose first category is in `mends` are asked: a fleet rejects most
    nodes for reasons no single change mends (another GPU class), and asking each costs time.
    """

    mends: frozenset[str]

    def __call__(self, node: NodeView, categories: tuple[str, ...], free: int | None, holds: bool | None,
                 refits: Callable[[NodeView, Mapping[str, Set[int]]], bool]) -> str | None: ...


def explain_placement(model: Model, nodes: Sequence[NodeView], allocated: Mapping[str, Set[int]], *,
                      avoid: Mapping[str, str] | Set[str] = frozenset(),
                      what_if: WhatIfHook | None = None, durations: Durations | None = None) -> Explanation:
    """Every node's verdict with its reasons, the plan (the same as `place`), and a one-line summary.

    Rejected nodes list every shortfall, not only the first; the summary counts each rejected
    node once, under the first reason it was turned down for. With `what_if`, each rejected
    node's verdict also carries the one change it proposes (`NodeVerdict.what_if`); with
    `durations`, each fitting node's the time it would take to prepare (`prepare_seconds`).
    """
    need = _Need.of(model)
    if need is None:
        return Explanation(model.name, (), None,
                           f"{model.name} is served by static endpoints; it is not placed on nodes")
    name = model.name
    avoid = _avoid_map(avoid)
    turned_down: list[NodeView] = []
    fitting = _fitting(need, name, nodes, allocated, avoid, turned_down)
    rejected: list[tuple[NodeView, tuple[str, ...], str, int | None, bool | None, str | None]] = []

    def refits(node: NodeView, changed: Mapping[str, Set[int]]) -> bool:
        return bool(_fitting(need, name, (node,), changed, avoid, []))

    mends = what_if.mends if what_if is not None else frozenset()
    for node in turned_down:
        free = _free_count(node, allocated)
        holds = None if node.holds is None else name in node.holds
        reasons, categories = need.shortfalls(node, free, bool(holds), avoid)
        if not reasons:  # the filter and its wording disagree: a bug, never a silent fit
            raise AssertionError(f"placement of {name} rejected {node.name} without a reason")
        change = what_if(node, categories, free, holds, refits) if categories[0] in mends else None
        rejected.append((node, reasons, categories[0], free, holds, change))

    ask = _Ask(model, need, allocated, durations)
    if need.nodes == 1:
        fitting.sort(key=_rank)
        plan = _single_plan(ask, fitting[0]) if fitting else None
        verdicts = _fitting_verdicts(need, fitting, durations)
        if plan is not None:
            summary = f"would place on {_shard_text(plan.leader, leader=False)}: " + ", ".join(plan.reasons)
        else:
            summary = "no node fits: " + _tally(r[2] for r in rejected) if rejected else "no nodes to place on"
        verdicts += _rejected_verdicts(rejected)
        return Explanation(name, tuple(verdicts), plan, summary)
    return _explain_multi(ask, nodes, fitting, rejected, what_if is not None)


# ---------------------------------------------------------------------------------------------
# What a model needs, the filters, and the words for their shortfalls.


class _Need:
    """What a model's profile asks of a node, with the words for each shortfall prepared once per call."""

    __slots__ = ("gpus", "nodes", "gpu_class", "memory_bytes", "disk_bytes", "weights", "path_weights",
                 "selector", "_no_gpus", "_class_needs", "_gpus_needs", "_memory_needs", "_disk_needs",
                 "runtime", "engine_check", "container", "image", "runtime_digest", "python", "_engine_words",
                 "_provision_word")

    def __init__(self, model: Model):
        profile = model.profile
        source = model.source
        self.gpus = profile.gpus
        self.nodes = profile.nodes
        self.gpu_class = profile.gpu_class
        self.memory_bytes = None if profile.min_memory_gb is None else profile.min_memory_gb * 1e9
        # "path": operator-managed, never fetched, so never checked against the cache and a
        # node known not to have it cannot run the model; "fetched" or "none" otherwise.
        self.weights = "none" if source is None else "fetched" if source.fetched else "path"
        self.path_weights = self.weights == "path"
        self.disk_bytes = None if self.path_weights else model.disk_bytes
        self.selector = tuple(sorted(profile.node_selector.items()))
        if self.gpus and self.gpu_class:
            wanted = f"{self.gpus} of class {self.gpu_class}"
        else:
            wanted = str(self.gpus or self.gpu_class or "")
        self._no_gpus = f"has no GPUs, needs {wanted}" if wanted else None
        self._class_needs = f", needs {self.gpu_class}"
        self._gpus_needs = f", needs {self.gpus}"
        self._memory_needs = None if self.memory_bytes is None else f", needs {_gb_up(self.memory_bytes)}"
        self._disk_needs = None if self.disk_bytes is None else f", needs {_gb_up(self.disk_bytes)}"
        # Where the engine comes from: what a node needs for it, and what it may hold.
        self.runtime = profile.runtime
        self.engine_check = self.runtime in ("container", "venv")
        self.container = profile.container
        self.image = profile.image
        self.python = profile.python
        spec = runtime_spec(profile) if self.engine_check else None
        self.runtime_digest = runtime_digest(spec) if spec is not None else None
        self._provision_word = "pull" if self.runtime == "container" else "build"
        if self.runtime == "container":
            self._engine_words = (f"has image {self.image}", f"pulls image {self.image}",
                                  f"image {self.image} not checked yet")
        else:
            self._engine_words = ("has its environment", "builds its environment", "environment not checked yet")

    @classmethod
    def of(cls, model: Model) -> _Need | None:
        return None if model.profile is None else cls(model)

    def shortfalls(self, node: NodeView, free: int | None, holds: bool,
                   avoid: Mapping[str, str | None]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Every filter the node fails, in filter order, and the category of each (the first for the summary)."""
        found: list[str] = []
        categories: list[str] = []
        category = categories.append
        if node.state != READY:
            category(node.state)
            found.append(f"{node.state}: {node.state_reason}" if node.state_reason else node.state)
        if node.admin != ACTIVE:
            category(node.admin)
            found.append(node.admin)
        if node.name in avoid:
            category("avoided")
            reason = avoid[node.name]
            found.append(f"avoided: {reason}" if reason else "avoided for this placement")
        gpus = node.gpus
        if gpus is not None and not gpus and self._no_gpus:
            category("no-gpus")
            found.append(self._no_gpus)
        else:
            if self.gpu_class is not None and node.gpu_class != self.gpu_class:
                if node.gpu_class is not None:
                    category("class")
                    found.append(f"has {node.gpu_class} GPUs{self._class_needs}")
                elif gpus is not None:
                    category("class")
                    found.append(f"GPU class not recognised{self._class_needs}; "
                                 "set gpu_class for the node in the inventory")
            if self.gpus:
                if free is None:
                    category("gpus-unknown")
                    found.append("GPUs not reported yet")
                elif free < self.gpus:
                    category("gpus")
                    found.append(f"{free} of {len(gpus)} GPUs free{node._unhealthy_note}{self._gpus_needs}")
        if self.memory_bytes is not None and node.memory_bytes is not None and node.memory_bytes < self.memory_bytes:
            category("memory")
            found.append(f"has {_gb_down(node.memory_bytes)} GB of memory{self._memory_needs}")
        if not holds and self.disk_bytes is not None and node.cache_free_bytes is not None \
                and node.cache_free_bytes < self.disk_bytes:
            category("disk")
            found.append(f"has {_gb_down(node.cache_free_bytes)} GB free in its cache{self._disk_needs}")
        for key, value in self.selector:
            have = node.labels.get(key)
            if have != value:
                category("labels")
                found.append(f"no label {key}, needs {key}={value}" if have is None
                             else f"label {key}={have}, needs {key}={value}")
        if not holds and self.path_weights and node.holds is not None:
            category("weights")
            found.append("does not have the weights in its model_dirs (weights given as a path are never fetched)")
        if self.engine_check:
            problem, reason, _, _ = self.engine_on(node)
            if problem is not None:
                category(problem)
                found.append(reason)
        return tuple(found), tuple(categories)

    def engine_on(self, node: NodeView) -> tuple[str | None, str | None, bool | None, str | None]:
        """What the node lacks to run the profile's runtime (R-4.12), as (category, reason): both
        None when nothing it reported is missing (unknown never excludes); then whether it holds
        the engine (the image, the built environment; None: not known) and the words for that."""
        has, fetches, unknown = self._engine_words
        if self.runtime == "venv":
            check = None if node.venvs is None else node.venvs.get(self.runtime_digest)
            if check is None:
                return None, None, None, unknown
            if check.found is False:
                python = self.python or "python3"
                return ("python", f"no Python {python} on the node for its environment: install it, "
                                  "or set the profile's python to one the node has", None, None)
            if check.found is None:
                return None, None, None, f"Python {self.python} not checked yet"
            return None, None, check.built, unknown if check.built is None else has if check.built else fetches
        containers = node.containers
        if containers is None:
            return None, None, None, "container program not checked yet"
        names = (self.container,) if self.container else CONTAINER_PROGRAMS
        chosen = None
        for name in names:
            view = containers.get(name)
            if view is None:
                return None, None, None, f"{name} not checked yet"
            if view.on_path:
                chosen = name, view
                break
        if chosen is None:
            return "no-container", self._no_program(containers), None, None
        name, view = chosen
        if view.answers is False:
            return "container-down", self._not_working(name, view, containers), None, None
        if view.answers is None:
            return None, None, None, f"{name} not checked yet" + (f" ({view.error})" if view.error else "")
        if self.gpus and view.gpu is False:
            return "container-gpu", self._no_gpu_runtime(name), None, None
        held = None if view.images is None else view.images.get(self.image)
        return None, None, held, unknown if held is None else has if held else fetches

    def _no_program(self, containers: Mapping[str, ContainerView]) -> str:
        if not self.container:
            return "no docker or podman on PATH: install docker or podman, or use runtime: host"
        other = next(n for n in CONTAINER_PROGRAMS if n != self.container)
        view = containers.get(other)
        if view is not None and view.on_path and view.answers is not False:
            return (f"no {self.container} on PATH (the profile's container): install it, or set container: {other},"
                    " which the node has, or use runtime: host")
        return f"no {self.container} on PATH (the profile's container): install it, or use runtime: host"

    def _not_working(self, name: str, view: ContainerView, containers: Mapping[str, ContainerView]) -> str:
        why = f"{name} does not work on the node" + (f" ({view.error})" if view.error else "")
        fix = "start its daemon, or set DOCKER_HOST for the node's helper" if name == "docker" \
            else "make `podman info` work on the node"
        other = next(n for n in CONTAINER_PROGRAMS if n != name)
        other_view = containers.get(other)
        if not self.container and other_view is not None and other_view.on_path and other_view.answers:
            fix += f", or set container: {other}, which works there"
        return f"{why}: {fix}, or use runtime: host"

    def _no_gpu_runtime(self, name: str) -> str:
        if name == "docker":
            return (f"docker cannot give containers GPUs (no nvidia runtime, no {NVIDIA_HOOK}){self._gpus_needs}: "
                    "install the NVIDIA Container Toolkit, or use runtime: host")
        return (f"podman cannot give containers GPUs (no CDI spec for nvidia.com/gpu in /etc/cdi or /var/run/cdi)"
                f"{self._gpus_needs}: generate one with `nvidia-ctk cdi generate`, or use runtime: host")


# How the summary counts rejected nodes, by the first reason: (one node, several nodes).
_CATEGORY_WORDS = {
    "no-gpus": ("has no GPUs", "have no GPUs"),
    "class": ("has another GPU class", "have another GPU class"),
    "gpus-unknown": ("has not reported GPUs yet", "have not reported GPUs yet"),
    "gpus": ("has too few free GPUs", "have too few free GPUs"),
    "memory": ("has too little memory", "have too little memory"),
    "disk": ("has too little cache space", "have too little cache space"),
    "labels": ("does not match the node selector", "do not match the node selector"),
    "weights": ("does not have the weights", "do not have the weights"),
    "no-container": ("has no container program", "have no container program"),
    "container-down": ("has a container program that does not work", "have a container program that does not work"),
    "container-gpu": ("cannot give containers GPUs", "cannot give containers GPUs"),
    "python": ("does not have the profile's Python", "do not have the profile's Python"),
    "no-fabric": ("has no fabric", "have no fabric"),
    "fabric-short": ("is in a fabric with too few fitting nodes", "are in fabrics with too few fitting nodes"),
}


def _tally(categories) -> str:
    """`3 cordoned, 2 have too little memory`: most common first, then in filter order."""
    counts: dict[str, int] = {}
    for category in categories:
        counts[category] = counts.get(category, 0) + 1
    order = sorted(counts, key=lambda c: -counts[c])  # stable: ties keep first-seen order
    parts = []
    for category in order:
        one, many = _CATEGORY_WORDS.get(category, (category, category))
        parts.append(f"{counts[category]} {one if counts[category] == 1 else many}")
    return ", ".join(parts)


def _unhealthy_note(gpus: tuple[GPUView, ...] | None) -> str:
    """` (2 unhealthy: uncorrected ECC errors; GPU is lost)`, or "" when every GPU is healthy."""
    bad = [g for g in gpus or () if not g.healthy]
    if not bad:
        return ""
    reasons = list(dict.fromkeys(r for g in bad for r in g.reasons))
    return f" ({len(bad)} unhealthy: {'; '.join(reasons)})" if reasons else f" ({len(bad)} unhealthy)"


# Decimal GB to 0.1: what a node has rounds down and what it needs rounds up, so "has 23.9 GB,
# needs 24" never reads "has 24, needs 24". Cached: a fleet repeats a handful of sizes.
@functools.lru_cache(maxsize=4096)
def _gb_down(value: float) -> str:
    return _tenths(math.floor(value / 1e8))


@functools.lru_cache(maxsize=256)
def _gb_up(value: float) -> str:
    return _tenths(math.ceil(value / 1e8))


def _tenths(tenths: int) -> str:
    return str(tenths // 10) if tenths % 10 == 0 else f"{tenths / 10:.1f}"


def _avoid_map(avoid: Mapping[str, str] | Set[str]) -> Mapping[str, str | None]:
    if isinstance(avoid, Mapping):
        return avoid
    return dict.fromkeys(avoid)


def _free_count(node: NodeView, allocated: Mapping[str, Set[int]]) -> int | None:
    healthy = node._healthy
    if healthy is None:
        return None
    taken = allocated.get(node.name)
    if not taken:
        return len(healthy)
    return len(healthy) - len(node._healthy_set.intersection(taken))


def _fitting(need: _Need, name: str, nodes: Sequence[NodeView], allocated: Mapping[str, Set[int]],
             avoid: Mapping[str, str] | Set[str], turned_down: list[NodeView]) -> list[tuple]:
    """Candidates `(rank key, node, free, holds, holds engine, engine words)` for the nodes that
    pass every filter (R-3.1, R-4.12).

    The one place the filters decide; `_Need.shortfalls` words them for the nodes appended to
    `turned_down`. One flat loop, cheapest and most selective tests first: it runs over every
    node for every replica placed.
    """
    cls, gpus, selector = need.gpu_class, need.gpus, need.selector
    memory = need.memory_bytes
    disk, path_weights = need.disk_bytes, need.path_weights
    engine_check = need.engine_check
    get = allocated.get
    fitting: list[tuple] = []
    add = fitting.append
    reject = turned_down.append
    for node in nodes:
        # A node whose GPUs were never reported has no known class: unknown never excludes.
        if not node._usable or cls is not None and node.gpu_class != cls and (
                node.gpu_class is not None or node.gpus is not None):
            reject(node)
            continue
        healthy = node._healthy
        if healthy is None:
            if gpus:  # cannot name indices it never reported
                reject(node)
                continue
            free = None
        else:
            taken = get(node.name)
            free = len(healthy) - len(node._healthy_set.intersection(taken)) if taken else len(healthy)
            if free < gpus:
                reject(node)
                continue
        if memory is not None and node.memory_bytes is not None and node.memory_bytes < memory \
                or selector and not _labels_match(node.labels, selector):
            reject(node)
            continue
        held = node.holds
        holds = held is not None and name in held
        # The disk check is skipped on a node that already holds the weights.
        if not holds and (disk is not None and node.cache_free_bytes is not None and node.cache_free_bytes < disk
                          or path_weights and held is not None) or node.name in avoid:
            reject(node)
            continue
        if engine_check:
            problem, _, engine, words = need.engine_on(node)
            if problem is not None:
                reject(node)
                continue
        else:  # the node's own program: nothing to provision
            engine, words = None, None
        add(((not holds, engine is not True, _UNKNOWN_FREE if free is None else free - gpus, node.name),
             node, free, holds, engine, words))
    return fitting


def _labels_match(labels: Mapping[str, str], selector: tuple[tuple[str, str], ...]) -> bool:
    for key, value in selector:
        if labels.get(key) != value:
            return False
    return True


# A candidate's rank key, as a C-level key function: ranking sorts thousands of candidates.
_rank = operator.itemgetter(0)


# ---------------------------------------------------------------------------------------------
# Ranking and plans, shared by `place` and `explain_placement` so they cannot disagree.


@dataclass(frozen=True, slots=True)
class _Ask:
    """One placement asked for, as the plan and its words are made: the model, what it needs of
    a node, the GPUs replicas hold, and (explain-placement) what preparing nodes took lately."""

    model: Model
    need: _Need
    allocated: Mapping[str, Set[int]]
    durations: Durations | None = None


def _choose_fabric(by_fabric: Mapping[str, list], count: int) -> tuple[str, list] | None:
    """The fabric and its `count` best candidates: most holders of the weights, then of the engine,
    then tightest packing, then name."""
    best_key, best = None, None
    for fabric, candidates in by_fabric.items():
        if len(candidates) < count:
            continue
        candidates.sort(key=_rank)
        chosen = candidates[:count]
        key = (-sum(c[3] for c in chosen), sum(c[0][1] for c in chosen), sum(c[0][2] for c in chosen), fabric)
        if best_key is None or key < best_key:
            best_key, best = key, (fabric, chosen)
    return best


def _take_gpus(node: NodeView, count: int, allocated: Mapping[str, Set[int]]) -> tuple[int, ...]:
    if not count:
        return ()
    return free_gpus(node, allocated)[:count]


def _single_plan(ask: _Ask, candidate: tuple) -> Plan:
    """The plan on one node, from its candidate (as `_fitting` makes them)."""
    _, node, free, holds, engine, words = candidate
    need = ask.need
    shard = ShardPlan(node.name, 0, _take_gpus(node, need.gpus, ask.allocated))
    prepare = None if ask.durations is None else _prepare(need, node, holds, engine, ask.durations)[1]
    return Plan(ask.model.name, (shard,), node.fabric, _preference(need, node, free, holds, words, prepare))


def _multi_plan(ask: _Ask, fabric: str, chosen: list) -> Plan:
    need = ask.need
    shards = tuple(ShardPlan(c[1].name, rank, _take_gpus(c[1], need.gpus, ask.allocated))
                   for rank, c in enumerate(chosen))
    holders = sum(c[3] for c in chosen)
    left = sum(c[0][2] for c in chosen)
    if holders == len(chosen):
        weights = f"all {len(chosen)} nodes hold the weights"
    elif holders:
        weights = f"{holders} of {len(chosen)} nodes hold the weights (the leader among them)"
    else:
        weights = "no chosen node holds the weights; each fetches them"
    reasons = [f"fabric {fabric}", weights]
    if need.engine_check:
        what = f"image {need.image}" if need.runtime == "container" else "its environment"
        engines = sum(c[4] is True for c in chosen)
        reasons.append(f"all {len(chosen)} nodes have {what}" if engines == len(chosen)
                       else f"{engines} of {len(chosen)} nodes have {what}; the others provision it")
    reasons.append(f"packs: leaves {left} GPU{'s' if left != 1 else ''} free across its {len(chosen)} nodes")
    return Plan(ask.model.name, shards, fabric, tuple(reasons))


def _preference(need: _Need, node: NodeView, free: int | None, holds: bool, engine_words: str | None,
                prepare_words: str | None = None) -> tuple[str, ...]:
    """Why a fitting node ranks where it does, in the words of the ranking keys."""
    reasons = []
    if holds:
        reasons.append("holds the weights")
    elif need.weights != "none":
        # A known non-holder of path weights never gets here: the filter turned it down.
        reasons.append("holdings not reported yet" if node.holds is None else "fetches the weights" + (
            f" ({_gb_up(need.disk_bytes)} GB)" if need.disk_bytes else ""))
    if engine_words is not None:
        reasons.append(engine_words)
    if prepare_words is not None:
        reasons.append(prepare_words)
    if free is None:
        reasons.append("GPUs not reported yet")
    else:
        left = free - need.gpus
        reasons.append(f"packs: leaves {left} GPU{'s' if left != 1 else ''} free")
    return tuple(reasons)


def _fitting_verdicts(need: _Need, candidates: list[tuple], durations: Durations | None = None) -> list[NodeVerdict]:
    # A fleet has few distinct (holdings, free GPUs, engine, rate) cases: word each once, not once per node.
    words: dict[tuple, tuple[str, ...]] = {}
    verdicts = []
    for _, node, free, holds, engine, engine_words in candidates:
        known = node.holds is not None
        seconds, prepare = (None, None) if durations is None else _prepare(need, node, holds, engine, durations)
        case = (holds, known, free, engine_words, prepare)
        reasons = words.get(case)
        if reasons is None:
            reasons = words[case] = _preference(need, node, free, holds, engine_words, prepare)
        verdicts.append(NodeVerdict(node.name, True, reasons, free, holds if known else None, None, engine, seconds))
    return verdicts


def _prepare(need: _Need, node: NodeView, holds: bool, engine: bool | None,
             durations: Durations) -> tuple[float | None, str | None]:
    """(seconds, words) of what the node must do before the engine starts: fetch the weights it
    lacks at its last measured rate, provision the engine it lacks in the time the last
    provision of that runtime took. (0, None) when it needs neither; seconds None when a part it
    needs is not measured (or not known to be needed: holdings not reported)."""
    parts: list[tuple[float | None, str]] = []  # (seconds or None: not measured, words) per step
    if need.weights == "fetched" and not holds:
        rate = durations.fetch_rates.get(node.name)
        if node.holds is None:
            parts.append((None, "fetch: holdings not reported yet"))
        elif need.disk_bytes is None:
            parts.append((None, "fetch: size not known"))
        elif rate is None:
            parts.append((None, "fetch: this node's download rate not measured yet"))
        else:
            fetch = need.disk_bytes / rate
            parts.append((fetch, f"fetch about {duration_text(fetch)} at its last measured {format_rate(rate)}"))
    if need.engine_check and engine is not True:
        took = durations.provisions.get(need.runtime_digest)
        word = need._provision_word
        if engine is None:
            parts.append((None, f"{word}: not known whether it is needed"))
        elif took is None:
            parts.append((None, f"{word}: none measured yet"))
        else:
            parts.append((took, f"{word} about {duration_text(took)}, as the last {word} took"))
    if not parts:
        return 0.0, None
    seconds = None if any(p[0] is None for p in parts) else sum(p[0] for p in parts)
    total = "-" if seconds is None else f"about {duration_text(seconds)}"
    words = "; ".join(p[1] for p in parts)
    return seconds, f"before its engine starts: {total} ({words})"


def _index_ranges(indices: tuple[int, ...]) -> str:
    """`0-3,6` for (0, 1, 2, 3, 6)."""
    parts, start = [], None
    for pos, index in enumerate(indices):
        if start is None:
            start = index
        if pos + 1 == len(indices) or indices[pos + 1] != index + 1:
            parts.append(str(index) if index == start else f"{start}-{index}")
            start = None
    return ",".join(parts)


def _shard_text(shard: ShardPlan, *, leader: bool) -> str:
    gpus = f"GPUs {_index_ranges(shard.gpus)}" if shard.gpus else "no GPUs"
    return f"{shard.node} ({'leader, ' if leader else ''}{gpus})"


def _rejected_verdicts(rejected: list) -> list[NodeVerdict]:
    rejected.sort(key=lambda r: r[0].name)
    return [NodeVerdict(node.name, False, reasons, free, holds, change)
            for node, reasons, _, free, holds, change in rejected]


def _explain_multi(ask: _Ask, nodes: Sequence[NodeView], fitting: list, rejected: list,
                   what_if: bool = False) -> Explanation:
    """Multi-node (R-3.4): nodes that pass every filter still need `need.nodes - 1` partners in their fabric."""
    need = ask.need
    by_fabric: dict[str, list] = {}
    for candidate in fitting:
        node = candidate[1]
        if node.fabric is None:
            rejected.append((node, (f"has no fabric; a {need.nodes}-node replica needs nodes of one fabric",),
                             "no-fabric", candidate[2], None if node.holds is None else candidate[3], None))
        else:
            by_fabric.setdefault(node.fabric, []).append(candidate)
    chosen = _choose_fabric(by_fabric, need.nodes)
    plan = None if chosen is None else _multi_plan(ask, chosen[0], chosen[1])

    gpu_counts: dict[str, set[int]] = {}
    for node in nodes:
        if node.fabric is not None and node.gpus:
            gpu_counts.setdefault(node.fabric, set()).add(len(node.gpus))
    shortfalls = {fabric: _fabric_shortfall(fabric, len(candidates), need, gpu_counts.get(fabric, set()))
                  for fabric, candidates in by_fabric.items() if len(candidates) < need.nodes}
    placeable: list[tuple] = []
    for fabric, candidates in by_fabric.items():
        if fabric in shortfalls:
            more = _fabric_more(fabric, need.nodes - len(candidates), need, gpu_counts.get(fabric, set())) \
                if what_if else None
            for c in candidates:
                rejected.append((c[1], (shortfalls[fabric],), "fabric-short", c[2],
                                 None if c[1].holds is None else c[3], more))
        else:
            placeable.extend(candidates)
    first = [] if chosen is None else chosen[1]
    first_names = {c[1].name for c in first}
    rest = sorted((c for c in placeable if c[1].name not in first_names), key=_rank)
    verdicts = _fitting_verdicts(need, first + rest, ask.durations)

    if plan is not None:
        summary = f"would place on fabric {plan.fabric}: " + ", ".join(
            _shard_text(s, leader=s.rank == 0) for s in plan.shards)
    elif shortfalls:
        # Name the fabric closest to fitting: most fitting nodes, then most holders, then name.
        best = min(shortfalls, key=lambda f: (-len(by_fabric[f]), -sum(c[3] for c in by_fabric[f]), f))
        summary = shortfalls[best]
        others = [r[2] for r in rejected if not (r[2] == "fabric-short" and r[0].fabric == best)]
        if others:
            summary += "; other nodes: " + _tally(others)
    elif rejected:
        summary = "no node fits: " + _tally(r[2] for r in rejected)
    else:
        summary = "no nodes to place on"
    verdicts += _rejected_verdicts(rejected)
    return Explanation(ask.model.name, tuple(verdicts), plan, summary)


def _fabric_more(fabric: str, missing: int, need: _Need, gpu_counts: set[int]) -> str:
    """`fabric ib-b would need 1 more free whole node`: the what-if of a fabric too small by `missing`."""
    plural = "" if missing == 1 else "s"
    what = f"free whole node{plural}" if gpu_counts == {need.gpus} else f"node{plural} with {need.gpus} free GPUs"
    return f"fabric {fabric} would need {missing} more {what}"


def _fabric_shortfall(fabric: str, fits: int, need: _Need, gpu_counts: set[int]) -> str:
    """`fabric ib-b has 1 free whole node, needs 2`, or `... 1 node with 4 free GPUs, needs 2`.

    "Whole node" when the profile takes every GPU of each node in the fabric (`gpu_counts`: the
    GPU counts its nodes reported).
    """
    plural = "" if fits == 1 else "s"
    what = f"free whole node{plural}" if gpu_counts == {need.gpus} else f"node{plural} with {need.gpus} free GPUs"
    return f"fabric {fabric} has {fits} {what}, needs {need.nodes}"
