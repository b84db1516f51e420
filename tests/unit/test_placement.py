"""Placement: filters with their reasons, ranking, multi-node inside one fabric, explanations (R-3.1–R-3.6)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog import Catalog, Model
from llmgw.config import ModelConfig, ProfileConfig, StaticEndpoint
from llmgw.control.placement import (ContainerView, Durations, GPUView, NodeView, ShardPlan, VenvView,
                                     explain_placement, free_gpus, free_whole_nodes, never_fits, place)
from llmgw.runtimes import runtime_spec, runtime_digest

GB = 1000**3
ECC = "uncorrected ECC errors"


def model(name: str = "llama", *, weights: str | None = "hf:org/llama", disk_gb: float | None = None,
          **profile) -> Model:
    """A real catalog model with a profile built from `profile` (engine vllm unless given)."""
    profile.setdefault("engine", "vllm")
    catalog = Catalog.build(file_models=[ModelConfig(name=name, profile="p", weights=weights, disk_gb=disk_gb)],
                            profiles={"p": ProfileConfig(**profile)})
    return catalog.models[name]


def gpus(count: int = 8, unhealthy: dict[int, str] | None = None) -> tuple[GPUView, ...]:
    unhealthy = unhealthy or {}
    return tuple(GPUView(i, i not in unhealthy, (unhealthy[i],) if unhealthy.get(i) else ()) for i in range(count))


def node(name: str = "gpu01", **kw) -> NodeView:
    """A ready, active node with 8 healthy H100s and 512 GB of memory unless told otherwise."""
    kw.setdefault("state", "ready")
    kw.setdefault("fabric", "ib-a")
    kw.setdefault("gpu_class", "h100-80gb")
    kw.setdefault("gpus", gpus())
    kw.setdefault("memory_bytes", 512 * GB)
    kw.setdefault("cache_free_bytes", 2000 * GB)
    kw.setdefault("holds", frozenset())
    return NodeView(name=name, **kw)


def verdict(explanation, name):
    return next(v for v in explanation.verdicts if v.node == name)


# ---------------------------------------------------------------------------------------------
# Filters: one case per rejection, with its exact words.

H100x4 = dict(gpus=4, gpu_class="h100-80gb")


@pytest.mark.parametrize("node_kw,profile,model_kw,allocated,avoid,reason", [
    pytest.param(dict(state="unreachable"), {}, {}, {}, frozenset(), "unreachable", id="unreachable"),
    pytest.param(dict(state="unreachable", state_reason="connection refused"), {}, {}, {}, frozenset(),
                 "unreachable: connection refused", id="unreachable-with-reason"),
    pytest.param(dict(state="unhealthy", state_reason="helper failed verification"), {}, {}, {}, frozenset(),
                 "unhealthy: helper failed verification", id="unhealthy-node"),
    pytest.param(dict(state="connecting"), {}, {}, {}, frozenset(), "connecting", id="connecting"),
    pytest.param(dict(admin="cordoned"), {}, {}, {}, frozenset(), "cordoned", id="cordoned"),
    pytest.param(dict(admin="draining"), {}, {}, {}, frozenset(), "draining", id="draining"),
    pytest.param({}, {}, {}, {}, {"gpu01": "being drained"}, "avoided: being drained", id="avoided-with-reason"),
    pytest.param({}, {}, {}, {}, frozenset({"gpu01"}), "avoided for this placement", id="avoided-by-name"),
    pytest.param(dict(gpu_class="l40s-48gb"), H100x4, {}, {}, frozenset(),
                 "has l40s-48gb GPUs, needs h100-80gb", id="gpu-class"),
    pytest.param(dict(gpu_class=None), H100x4, {}, {}, frozenset(),
                 "GPU class not recognised, needs h100-80gb; set gpu_class for the node in the inventory",
                 id="gpu-class-not-recognised"),
    pytest.param(dict(gpu_class=None, gpus=()), dict(gpus=1), {}, {}, frozenset(),
                 "has no GPUs, needs 1", id="no-gpus"),
    pytest.param(dict(gpu_class=None, gpus=()), H100x4, {}, {}, frozenset(),
                 "has no GPUs, needs 4 of class h100-80gb", id="no-gpus-with-class"),
    pytest.param(dict(gpu_class=None, gpus=None), dict(gpus=1), {}, {}, frozenset(),
                 "GPUs not reported yet", id="gpus-not-reported"),
    pytest.param({}, H100x4, {}, {"gpu01": frozenset(range(6))}, frozenset(),
                 "2 of 8 GPUs free, needs 4", id="too-few-free-gpus"),
    pytest.param(dict(gpus=gpus(unhealthy={7: ECC})), H100x4, {}, {"gpu01": frozenset(range(5))}, frozenset(),
                 "2 of 8 GPUs free (1 unhealthy: uncorrected ECC errors), needs 4", id="too-few-with-unhealthy"),
    pytest.param(dict(gpus=gpus(unhealthy={0: ECC, 1: "GPU is lost", 2: ECC})), dict(gpus=6), {}, {}, frozenset(),
                 "5 of 8 GPUs free (3 unhealthy: uncorrected ECC errors; GPU is lost), needs 6",
                 id="several-unhealthy-reasons"),
    pytest.param(dict(memory_bytes=8 * GB), dict(min_memory_gb=24), {}, {}, frozenset(),
                 "has 8 GB of memory, needs 24", id="memory"),
    pytest.param(dict(memory_bytes=int(23.97 * GB)), dict(min_memory_gb=24), {}, {}, frozenset(),
                 "has 23.9 GB of memory, needs 24", id="memory-just-short-never-reads-equal"),
    pytest.param(dict(cache_free_bytes=12 * GB), {}, dict(disk_gb=140), {}, frozenset(),
                 "has 12 GB free in its cache, needs 140", id="cache-space"),
    pytest.param(dict(labels={"zone": "dc2"}), dict(node_selector={"zone": "dc1"}), {}, {}, frozenset(),
                 "label zone=dc2, needs zone=dc1", id="label-differs"),
    pytest.param({}, dict(node_selector={"zone": "dc1"}), {}, {}, frozenset(),
                 "no label zone, needs zone=dc1", id="label-missing"),
    pytest.param({}, {}, dict(weights="llama-70b"), {}, frozenset(),
                 "does not have the weights in its model_dirs (weights given as a path are never fetched)",
                 id="path-weights-not-held"),
])
def test_each_filter_rejects_with_its_reason(node_kw, profile, model_kw, allocated, avoid, reason):
    m = model(**profile, **model_kw)
    nodes = [node(**node_kw)]
    explanation = explain_placement(m, nodes, allocated, avoid=avoid)
    assert verdict(explanation, "gpu01").fits is False
    assert verdict(explanation, "gpu01").reasons == (reason,)
    assert explanation.plan is None
    assert explanation.summary.startswith("no node fits: 1 ")
    assert place(m, nodes, allocated, avoid=avoid) is None


def test_the_same_node_without_the_shortfall_fits():
    """The baseline of the table above: the default node passes every filter of every case."""
    m = model(disk_gb=140, min_memory_gb=24, node_selector={"zone": "dc1"}, **H100x4)
    plan = place(m, [node(labels={"zone": "dc1"})], {})
    assert plan is not None and plan.shards == (ShardPlan("gpu01", 0, (0, 1, 2, 3)),)


def test_every_shortfall_is_listed_and_the_summary_counts_each_node_once():
    m = model(min_memory_gb=24, node_selector={"zone": "dc1"})
    nodes = [node("a", admin="cordoned", memory_bytes=8 * GB),
             node("b", admin="cordoned", labels={"zone": "dc1"}),
             node("c", admin="cordoned", labels={"zone": "dc1"}),
             node("d", memory_bytes=8 * GB, labels={"zone": "dc1"}),
             node("e", memory_bytes=16 * GB, labels={"zone": "dc1"})]
    explanation = explain_placement(m, nodes, {})
    assert verdict(explanation, "a").reasons == (
        "cordoned", "has 8 GB of memory, needs 24", "no label zone, needs zone=dc1")
    assert explanation.summary == "no node fits: 3 cordoned, 2 have too little memory"


def test_unknown_memory_passes():
    m = model(min_memory_gb=24)
    explanation = explain_placement(m, [node(memory_bytes=None)], {})
    assert explanation.plan is not None and explanation.plan.leader.node == "gpu01"


@pytest.mark.parametrize("cache_free,disk_gb", [
    pytest.param(None, 140, id="cache-free-unknown"),
    pytest.param(1 * GB, None, id="model-size-unknown"),
])
def test_unknown_disk_passes(cache_free, disk_gb):
    plan = place(model(disk_gb=disk_gb), [node(cache_free_bytes=cache_free)], {})
    assert plan is not None and plan.leader.node == "gpu01"


def test_path_weights_are_never_checked_against_the_cache():
    plan = place(model(weights="/models/llama", disk_gb=140), [node(cache_free_bytes=GB, holds=None)], {})
    assert plan is not None


def test_unknown_gpus_do_not_exclude_a_cpu_profile():
    plan = place(model(gpus=0), [node(gpus=None, gpu_class=None)], {})
    assert plan is not None and plan.leader.gpus == ()


# ---------------------------------------------------------------------------------------------
# Ranking.


def test_holder_skips_the_disk_check_and_ranks_first():
    m = model(disk_gb=140, **H100x4)
    nodes = [node("a-fetches"), node("b-holds", cache_free_bytes=1 * GB, holds=frozenset({"llama"}))]
    explanation = explain_placement(m, nodes, {})
    assert explanation.plan.leader.node == "b-holds"
    assert [v.node for v in explanation.verdicts] == ["b-holds", "a-fetches"]
    assert verdict(explanation, "b-holds").reasons == ("holds the weights", "packs: leaves 4 GPUs free")
    assert verdict(explanation, "b-holds").holds_weights is True
    assert verdict(explanation, "a-fetches").reasons == ("fetches the weights (140 GB)", "packs: leaves 4 GPUs free")


def test_holding_the_weights_beats_packing():
    m = model(**H100x4)
    nodes = [node("tight"), node("holder", holds=frozenset({"llama"}))]
    assert place(m, nodes, {"tight": frozenset(range(4))}).leader.node == "holder"


def test_packing_prefers_the_fuller_node():
    m = model(**H100x4)
    nodes = [node("a-empty"), node("b-half")]
    explanation = explain_placement(m, nodes, {"b-half": frozenset({0, 1, 2, 3})})
    assert explanation.plan.shards == (ShardPlan("b-half", 0, (4, 5, 6, 7)),)
    assert explanation.plan.reasons == ("fetches the weights", "packs: leaves 0 GPUs free")
    assert explanation.summary == "would place on b-half (GPUs 4-7): fetches the weights, packs: leaves 0 GPUs free"


def test_cpu_model_packs_onto_cpu_nodes_before_gpu_nodes():
    plan = place(model(gpus=0), [node("a-gpu"), node("b-cpu", gpus=(), gpu_class=None)], {})
    assert plan.leader.node == "b-cpu"


def test_name_breaks_ties():
    m = model(**H100x4)
    assert place(m, [node("b"), node("a"), node("c")], {}).leader.node == "a"


@pytest.mark.parametrize("unknown", ["a", "b"])
def test_unknown_holdings_rank_exactly_like_holding_nothing(unknown):
    nodes = [node(name, holds=None if name == unknown else frozenset({"other"})) for name in ("a", "b")]
    explanation = explain_placement(model(**H100x4), nodes, {})
    assert explanation.plan.leader.node == "a"  # only the name decided
    assert verdict(explanation, unknown).holds_weights is None
    assert verdict(explanation, unknown).reasons[0] == "holdings not reported yet"


# ---------------------------------------------------------------------------------------------
# GPUs: unhealthy ones neither used nor free; allocations respected.


def test_unhealthy_gpus_are_neither_used_nor_free():
    n = node(gpus=gpus(4, unhealthy={0: ECC, 2: "GPU is lost"}))
    assert free_gpus(n, {}) == (1, 3)
    assert free_gpus(n, {"gpu01": frozenset({0, 1})}) == (3,)  # a held unhealthy GPU is not counted twice
    explanation = explain_placement(model(gpus=2), [n], {})
    assert explanation.plan.leader.gpus == (1, 3)
    assert verdict(explanation, "gpu01").free_gpus == 2


def test_free_gpus_unknown_is_none_not_empty():
    assert free_gpus(node(gpus=None), {}) is None
    assert free_gpus(node(gpus=()), {}) == ()


def test_placements_in_a_row_never_share_a_gpu():
    m = model(gpus=3)
    nodes = [node("a"), node("b")]
    allocated: dict[str, frozenset[int]] = {}
    taken = []
    for _ in range(4):
        plan = place(m, nodes, allocated)
        assert plan == explain_placement(m, nodes, allocated).plan
        shard = plan.leader
        assert not set(shard.gpus) & allocated.get(shard.node, frozenset())
        allocated[shard.node] = allocated.get(shard.node, frozenset()) | frozenset(shard.gpus)
        taken += [(shard.node, g) for g in shard.gpus]
    assert len(taken) == len(set(taken)) == 12
    explanation = explain_placement(m, nodes, allocated)
    assert explanation.plan is None
    assert explanation.summary == "no node fits: 2 have too few free GPUs"
    assert verdict(explanation, "a").reasons == ("2 of 8 GPUs free, needs 3",)


# ---------------------------------------------------------------------------------------------
# No requirement fits anywhere; explain lists every node.


def test_a_profile_without_requirements_fits_any_ready_uncordoned_node():
    m = model(weights=None)
    nodes = [NodeView("bare", state="ready"),
             node("no-gpus", gpus=(), gpu_class=None, memory_bytes=None, fabric=None),
             node("gpu"),
             NodeView("cordoned", state="ready", admin="cordoned"),
             NodeView("down", state="unreachable")]
    explanation = explain_placement(m, nodes, {})
    assert {v.node for v in explanation.verdicts if v.fits} == {"bare", "no-gpus", "gpu"}
    assert explanation.plan.leader.node == "no-gpus"  # packs: leaves 0 GPUs free; unknown GPUs rank last
    assert verdict(explanation, "bare").reasons == ("GPUs not reported yet",)


def test_explain_lists_every_node_fitting_ones_first_in_rank_order():
    m = model(**H100x4)
    nodes = [node("z-cordoned", admin="cordoned"), node("y-empty"), node("x-l40s", gpu_class="l40s-48gb"),
             node("w-half"), node("v-holder", holds=frozenset({"llama"}))]
    explanation = explain_placement(m, nodes, {"w-half": frozenset(range(4))})
    assert [(v.node, v.fits) for v in explanation.verdicts] == [
        ("v-holder", True), ("w-half", True), ("y-empty", True), ("x-l40s", False), ("z-cordoned", False)]
    assert explanation.plan == place(m, nodes, {"w-half": frozenset(range(4))})


def test_no_nodes_at_all():
    explanation = explain_placement(model(), [], {})
    assert explanation.plan is None and explanation.verdicts == ()
    assert explanation.summary == "no nodes to place on"


def test_a_model_with_static_endpoints_is_not_placed():
    catalog = Catalog.build(file_models=[ModelConfig(name="ext", endpoints=[StaticEndpoint(url="http://x:1")])])
    m = catalog.models["ext"]
    assert place(m, [node()], {}) is None
    assert explain_placement(m, [node()], {}).summary == "ext is served by static endpoints; it is not placed on nodes"


# ---------------------------------------------------------------------------------------------
# Multi-node inside one fabric.

TWO_WHOLE = dict(gpus=8, nodes=2, gpu_class="h100-80gb")


def test_multi_node_stays_in_one_fabric_with_the_holder_as_leader():
    m = model(**TWO_WHOLE)
    nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a", holds=frozenset({"llama"})),
             node("b1", fabric="ib-b")]
    explanation = explain_placement(m, nodes, {})
    plan = explanation.plan
    assert plan.fabric == "ib-a"
    assert plan.shards == (ShardPlan("a2", 0, tuple(range(8))), ShardPlan("a1", 1, tuple(range(8))))
    assert plan.leader.node == "a2"
    assert plan.reasons == ("fabric ib-a", "1 of 2 nodes hold the weights (the leader among them)",
                            "packs: leaves 0 GPUs free across its 2 nodes")
    assert explanation.summary == "would place on fabric ib-a: a2 (leader, GPUs 0-7), a1 (GPUs 0-7)"
    assert verdict(explanation, "b1").reasons == ("fabric ib-b has 1 free whole node, needs 2",)
    assert place(m, nodes, {}) == plan


def test_multi_node_refuses_to_straddle_fabrics():
    m = model(**TWO_WHOLE)
    nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a"), node("b1", fabric="ib-b"),
             node("b2", fabric="ib-b", admin="cordoned")]
    allocated = {"a2": frozenset({0})}
    explanation = explain_placement(m, nodes, allocated)
    assert explanation.plan is None and place(m, nodes, allocated) is None
    # Both fabrics have one fitting node; the tie goes to the name.
    assert explanation.summary == ("fabric ib-a has 1 free whole node, needs 2; "
                                   "other nodes: 1 has too few free GPUs, 1 cordoned, "
                                   "1 is in a fabric with too few fitting nodes")
    assert verdict(explanation, "b1").reasons == ("fabric ib-b has 1 free whole node, needs 2",)
    assert verdict(explanation, "b1").fits is False


def test_multi_node_shortfall_names_the_fabric_closest_to_fitting():
    m = model(gpus=8, nodes=3)
    nodes = [node("a1", fabric="ib-a"), node("b1", fabric="ib-b"), node("b2", fabric="ib-b")]
    assert explain_placement(m, nodes, {}).summary == (
        "fabric ib-b has 2 free whole nodes, needs 3; other nodes: 1 is in a fabric with too few fitting nodes")


def test_multi_node_shortfall_counts_nodes_with_enough_free_gpus_when_not_whole():
    m = model(gpus=4, nodes=2)
    nodes = [node("b1", fabric="ib-b"), node("b2", fabric="ib-b")]
    explanation = explain_placement(m, nodes, {"b2": frozenset(range(6))})
    assert explanation.summary == "fabric ib-b has 1 node with 4 free GPUs, needs 2; other nodes: 1 has too few free GPUs"


def test_nodes_without_a_fabric_cannot_form_a_multi_node_replica():
    m = model(**TWO_WHOLE)
    nodes = [node("a", fabric=None), node("b", fabric=None)]
    explanation = explain_placement(m, nodes, {})
    assert explanation.plan is None and place(m, nodes, {}) is None
    assert verdict(explanation, "a").reasons == ("has no fabric; a 2-node replica needs nodes of one fabric",)
    assert explanation.summary == "no node fits: 2 have no fabric"


def test_multi_node_prefers_the_fabric_holding_the_weights_then_packing():
    m = model(gpus=4, nodes=2)
    held = frozenset({"llama"})
    nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a"),
             node("b1", fabric="ib-b"), node("b2", fabric="ib-b"),
             node("c1", fabric="ib-c", holds=held), node("c2", fabric="ib-c", holds=held)]
    half = frozenset(range(4))
    # ib-a packs better (nodes half used) but ib-c holds the weights.
    assert place(m, nodes, {"a1": half, "a2": half}).fabric == "ib-c"
    # Without holders, packing decides: ib-b's half-used nodes over ib-a's empty ones.
    nodes = nodes[:4]
    plan = place(m, nodes, {"b1": half, "b2": half})
    assert plan.fabric == "ib-b" and {s.node for s in plan.shards} == {"b1", "b2"}
    assert all(s.gpus == (4, 5, 6, 7) for s in plan.shards)


def test_multi_node_never_puts_two_shards_on_one_node():
    plan = place(model(gpus=2, nodes=2), [node("a1"), node("a2")], {})
    assert sorted(s.node for s in plan.shards) == ["a1", "a2"]
    assert sorted(s.rank for s in plan.shards) == [0, 1]


# ---------------------------------------------------------------------------------------------
# Fleet summary helper.


def test_free_whole_nodes_per_fabric():
    nodes = [node("a1"), node("a2"), node("a3", gpus=gpus(unhealthy={3: ECC})), node("a4", admin="cordoned"),
             node("b1", fabric="ib-b"), node("x", fabric=None), node("c1", fabric="ib-c", gpus=())]
    assert free_whole_nodes(nodes, {"a2": frozenset({5}), "b1": frozenset()}) == {"ib-a": 1, "ib-b": 1, "ib-c": 0}


# ---------------------------------------------------------------------------------------------
# The fast path and the explanation are one decision, on any fleet.

CLASSES = ["h100-80gb", "l40s-48gb", None, None]


@st.composite
def fleets(draw):
    """Small fleets, mostly usable, so that plans (multi-node too) come out as often as refusals."""
    nodes, allocated = [], {}
    for i in range(draw(st.integers(0, 12))):
        count = draw(st.sampled_from([None, 0, 4, 8, 8, 8]))
        gpu_list = None if count is None else tuple(
            GPUView(g, draw(st.sampled_from([True] * 7 + [False])), ("ECC",)) for g in range(count))
        name = f"n{i}"
        nodes.append(NodeView(
            name=name, fabric=draw(st.sampled_from(["ib-a", "ib-b", None])),
            labels=draw(st.sampled_from([{}, {"zone": "dc1"}, {"zone": "dc2"}])),
            state=draw(st.sampled_from(["ready"] * 6 + ["unreachable", "connecting"])),
            admin=draw(st.sampled_from(["active"] * 6 + ["cordoned", "draining"])),
            gpu_class=draw(st.sampled_from(["h100-80gb", "h100-80gb", "l40s-48gb", None])), gpus=gpu_list,
            memory_bytes=draw(st.sampled_from([None, 8 * GB, 64 * GB])),
            cache_free_bytes=draw(st.sampled_from([None, 10 * GB, 500 * GB])),
            holds=draw(st.sampled_from([None, frozenset(), frozenset({"m"})])),
            containers=draw(st.sampled_from([None, None, {}]) | st.fixed_dictionaries(
                {"docker": CONTAINER_VIEWS, "podman": CONTAINER_VIEWS})),
            venvs=draw(st.sampled_from([None, {}]) | st.fixed_dictionaries({VENV_KEY: st.sampled_from(VENV_VIEWS)}))))
        if count and draw(st.booleans()):
            allocated[name] = frozenset(draw(st.sets(st.integers(0, count - 1), max_size=count)))
    names = [n.name for n in nodes]
    avoid = frozenset(draw(st.sets(st.sampled_from(names), max_size=2))) if nodes else frozenset()
    return nodes, allocated, avoid


IMAGE = "vllm/vllm-openai:v1"
VENV_RECIPE = dict(runtime="venv", packages=["vllm==1"], python="python3.12")
VENV_KEY = runtime_digest(runtime_spec(ProfileConfig(engine="vllm", **VENV_RECIPE)))
CONTAINER_VIEWS = st.builds(
    ContainerView, st.booleans(), st.sampled_from([None, True, True, False]), st.sampled_from([None, True, False]),
    st.sampled_from([None, {}, {IMAGE: True}, {IMAGE: False}]))
VENV_VIEWS = [VenvView(found, built) for found in (None, True, True, False) for built in (None, True, False)]
RUNTIMES = [{}, {}, dict(runtime="container", image=IMAGE), dict(runtime="container", image=IMAGE, container="docker"),
            dict(runtime="container", image=IMAGE, container="podman"), VENV_RECIPE]

models = st.builds(
    lambda gpus, nodes, cls, mem, selector, weights, disk, runtime: model(
        "m", weights=weights, disk_gb=disk, gpus=gpus if nodes == 1 else max(gpus, 1), nodes=nodes,
        gpu_class=cls, min_memory_gb=mem, node_selector=selector, **runtime),
    st.sampled_from([0, 1, 2, 4, 8]), st.sampled_from([1, 1, 2, 3]), st.sampled_from(CLASSES),
    st.sampled_from([None, None, 16]), st.sampled_from([{}, {}, {"zone": "dc1"}]),
    st.sampled_from(["hf:org/m", "hf:org/m", "/models/m", None]), st.sampled_from([None, 100]),
    st.sampled_from(RUNTIMES))


def engine_fact(n: NodeView, m: Model) -> tuple[bool, bool | None]:
    """R-4.12 written out once more, plainly: (the node can run the runtime, it holds the engine)."""
    p = m.profile
    if p.runtime == "venv":
        check = (n.venvs or {}).get(VENV_KEY)
        return check is None or check.found is not False, None if check is None or not check.found else check.built
    if p.runtime != "container" or n.containers is None:
        return True, None
    for name in [p.container] if p.container else ["docker", "podman"]:
        view = n.containers.get(name)
        if view is None:
            return True, None
        if view.on_path:
            if view.answers is False or view.answers and p.gpus and view.gpu is False:
                return False, None
            return True, None if not view.answers or view.images is None else view.images.get(IMAGE)
    return False, None


def passes_filters(n: NodeView, m: Model, allocated, avoid) -> bool:
    """R-3.1 written out once more, plainly, as the oracle for the property test below."""
    p = m.profile
    if n.state != "ready" or n.admin != "active" or n.name in avoid:
        return False
    if p.gpu_class and n.gpu_class != p.gpu_class and not (n.gpu_class is None and n.gpus is None):
        return False
    free = free_gpus(n, allocated)
    if p.gpus and (free is None or len(free) < p.gpus):
        return False
    if p.min_memory_gb is not None and n.memory_bytes is not None and n.memory_bytes < p.min_memory_gb * GB:
        return False
    if any(n.labels.get(k) != v for k, v in p.node_selector.items()):
        return False
    if n.holds is None or m.name not in n.holds:
        path = m.source is not None and not m.source.fetched
        if path and n.holds is not None:
            return False
        if not path and m.disk_bytes is not None and n.cache_free_bytes is not None \
                and n.cache_free_bytes < m.disk_bytes:
            return False
    return engine_fact(n, m)[0]


@settings(max_examples=500, deadline=None)
@given(fleet=fleets(), m=models)
def test_place_and_explain_agree_on_any_fleet(fleet, m):
    nodes, allocated, avoid = fleet
    explanation = explain_placement(m, nodes, allocated, avoid=avoid)
    assert place(m, nodes, allocated, avoid=avoid) == explanation.plan
    assert sorted(v.node for v in explanation.verdicts) == sorted(n.name for n in nodes)
    assert all(v.reasons for v in explanation.verdicts)
    by_name = {n.name: n for n in nodes}
    fits = {v.node for v in explanation.verdicts if v.fits}
    eligible = {n.name for n in nodes if passes_filters(n, m, allocated, avoid)}
    if m.profile.nodes == 1:
        assert fits == eligible
    else:  # a multi-node replica also needs enough partners in one fabric
        assert fits <= eligible
        per_fabric = Counter(by_name[name].fabric for name in eligible if by_name[name].fabric is not None)
        assert (explanation.plan is not None) == any(c >= m.profile.nodes for c in per_fabric.values())
    assert [v.fits for v in explanation.verdicts] == sorted((v.fits for v in explanation.verdicts), reverse=True)
    plan = explanation.plan
    if plan is None:
        assert explanation.summary.startswith(("no node", "fabric "))
        assert m.profile.nodes > 1 or not eligible
        return
    if m.profile.nodes == 1:
        def key(name):
            n = by_name[name]
            free = free_gpus(n, allocated)
            holds = n.holds is not None and m.name in n.holds
            return (not holds, engine_fact(n, m)[1] is not True, 1 << 30 if free is None else len(free), name)
        assert plan.leader.node == min(eligible, key=key)
    for v in explanation.verdicts:
        if v.fits and m.profile.runtime != "host":
            assert v.holds_engine == engine_fact(by_name[v.node], m)[1]
    assert len(plan.shards) == m.profile.nodes
    assert len({s.node for s in plan.shards}) == len(plan.shards)
    assert plan.leader.rank == 0
    for shard in plan.shards:
        n = by_name[shard.node]
        assert shard.node in fits and shard.node not in avoid
        assert n.state == "ready" and n.admin == "active"
        assert len(shard.gpus) == m.profile.gpus
        assert set(shard.gpus) <= set(free_gpus(n, allocated) or ())
        if m.profile.nodes > 1:
            assert n.fabric == plan.fabric is not None


def test_views_derive_nothing_into_their_fields():
    """Cached GPU facts stay out of equality and asdict, which the admin API renders."""
    n = node()
    assert set(dataclasses.asdict(n)) == {f.name for f in dataclasses.fields(NodeView)}
    assert n == dataclasses.replace(n)


# ---------------------------------------------------------------------------------------------
# What the profile's runtime needs of a node, and the engine it may hold.

DAEMON_DOWN = ("docker cannot reach its daemon (DOCKER_HOST=unset): Cannot connect to the Docker daemon at "
               "unix:///var/run/docker.sock. Is the docker daemon running?")
ABSENT = ContainerView(False)
WORKS = ContainerView(True, True, True, {IMAGE: False})
NO_GPU = ContainerView(True, True, False, {IMAGE: False})
DOWN = ContainerView(True, False, error=DAEMON_DOWN)
HUNG = ContainerView(True, None, error="docker info has not answered for 3 s (DOCKER_HOST=unset)")
CONTAINER = dict(runtime="container", image=IMAGE)


def programs(docker: ContainerView = ABSENT, podman: ContainerView = ABSENT) -> dict[str, ContainerView]:
    return {"docker": docker, "podman": podman}


@pytest.mark.parametrize("node_kw,profile,reason,category", [
    pytest.param(dict(containers=programs()), CONTAINER,
                 "no docker or podman on PATH: install docker or podman, or use runtime: host",
                 "has no container program", id="no-container-program"),
    pytest.param(dict(containers=programs()), dict(CONTAINER, container="podman"),
                 "no podman on PATH (the profile's container): install it, or use runtime: host",
                 "has no container program", id="named-program-absent"),
    pytest.param(dict(containers=programs(docker=WORKS)), dict(CONTAINER, container="podman"),
                 "no podman on PATH (the profile's container): install it, or set container: docker, which the node "
                 "has, or use runtime: host", "has no container program", id="named-program-absent-other-there"),
    pytest.param(dict(containers=programs(docker=DOWN)), CONTAINER,
                 f"docker does not work on the node ({DAEMON_DOWN}): start its daemon, or set DOCKER_HOST for the "
                 "node's helper, or use runtime: host", "has a container program that does not work",
                 id="docker-daemon-down"),
    pytest.param(dict(containers=programs(docker=DOWN, podman=WORKS)), CONTAINER,
                 f"docker does not work on the node ({DAEMON_DOWN}): start its daemon, or set DOCKER_HOST for the "
                 "node's helper, or set container: podman, which works there, or use runtime: host",
                 "has a container program that does not work", id="docker-first-on-path-down-podman-works"),
    pytest.param(dict(containers=programs(podman=ContainerView(True, False, error="podman info exited with status 125"))),
                 CONTAINER, "podman does not work on the node (podman info exited with status 125): make `podman info` "
                 "work on the node, or use runtime: host", "has a container program that does not work",
                 id="podman-fails"),
    pytest.param(dict(containers=programs(docker=NO_GPU)), dict(CONTAINER, gpus=2),
                 "docker cannot give containers GPUs (no nvidia runtime, no nvidia-container-runtime-hook), needs 2: "
                 "install the NVIDIA Container Toolkit, or use runtime: host", "cannot give containers GPUs",
                 id="docker-without-nvidia-runtime"),
    pytest.param(dict(containers=programs(podman=NO_GPU)), dict(CONTAINER, gpus=1),
                 "podman cannot give containers GPUs (no CDI spec for nvidia.com/gpu in /etc/cdi or /var/run/cdi), "
                 "needs 1: generate one with `nvidia-ctk cdi generate`, or use runtime: host",
                 "cannot give containers GPUs", id="podman-without-cdi"),
    pytest.param(dict(venvs={VENV_KEY: VenvView(False)}), VENV_RECIPE,
                 "no Python python3.12 on the node for its environment: install it, or set the profile's python to "
                 "one the node has", "does not have the profile's Python", id="venv-interpreter-missing"),
])
def test_each_runtime_shortfall_rejects_in_operator_words(node_kw, profile, reason, category):
    m = model(**profile)
    explanation = explain_placement(m, [node(**node_kw)], {})
    assert verdict(explanation, "gpu01").fits is False
    assert verdict(explanation, "gpu01").reasons == (reason,)
    assert explanation.summary == f"no node fits: 1 {category}"
    assert place(m, [node(**node_kw)], {}) is None


@pytest.mark.parametrize("node_kw,profile,engine_words", [
    pytest.param({}, CONTAINER, "container program not checked yet", id="containers-not-reported"),
    pytest.param(dict(containers={}), CONTAINER, "docker not checked yet", id="program-not-in-the-report"),
    pytest.param(dict(containers=programs(docker=HUNG)), CONTAINER,
                 "docker not checked yet (docker info has not answered for 3 s (DOCKER_HOST=unset))",
                 id="docker-did-not-answer-in-time"),
    pytest.param(dict(containers=programs(docker=ContainerView(True, True, None, None))), dict(CONTAINER, gpus=1),
                 f"image {IMAGE} not checked yet", id="gpu-support-and-images-not-checked"),
    pytest.param(dict(containers=programs(docker=NO_GPU)), CONTAINER, f"pulls image {IMAGE}",
                 id="no-gpu-runtime-is-fine-without-gpus"),
    pytest.param(dict(containers=programs(docker=ContainerView(True, True, True, {}))), CONTAINER,
                 f"image {IMAGE} not checked yet", id="image-not-asked-about"),
    pytest.param(dict(containers=programs(podman=WORKS)), dict(CONTAINER, gpus=1), f"pulls image {IMAGE}",
                 id="podman-with-cdi"),
    pytest.param({}, VENV_RECIPE, "environment not checked yet", id="venvs-not-reported"),
    pytest.param(dict(venvs={}), VENV_RECIPE, "environment not checked yet", id="recipe-not-asked-about"),
    pytest.param(dict(venvs={VENV_KEY: VenvView(None)}), VENV_RECIPE, "Python python3.12 not checked yet",
                 id="interpreter-did-not-answer-in-time"),
    pytest.param(dict(venvs={VENV_KEY: VenvView(True, False)}), VENV_RECIPE, "builds its environment",
                 id="venv-to-build"),
    pytest.param(dict(containers=programs(), venvs={VENV_KEY: VenvView(False)}), {}, None,
                 id="host-runtime-needs-neither"),
])
def test_what_was_not_checked_never_rejects(node_kw, profile, engine_words):
    m = model(**profile)
    explanation = explain_placement(m, [node(**node_kw)], {})
    assert explanation.plan is not None and explanation.plan.leader.node == "gpu01"
    expected = ("fetches the weights",) + ((engine_words,) if engine_words else ()) + (
        f"packs: leaves {8 - m.profile.gpus} GPUs free",)
    assert verdict(explanation, "gpu01").reasons == expected


def test_a_node_holding_the_image_ranks_before_one_that_pulls_it_but_after_one_holding_the_weights():
    m = model(gpus=4, **CONTAINER)
    has_image = ContainerView(True, True, True, {IMAGE: True})
    nodes = [node("a-pulls", containers=programs(docker=WORKS)),
             node("b-has-image", containers=programs(docker=has_image)),
             node("c-unknown", containers=None),
             node("d-weights", containers=programs(docker=WORKS), holds=frozenset({"llama"}))]
    explanation = explain_placement(m, nodes, {"a-pulls": frozenset(range(4))})  # a packs best
    assert [v.node for v in explanation.verdicts] == ["d-weights", "b-has-image", "a-pulls", "c-unknown"]
    assert verdict(explanation, "b-has-image").reasons == (
        "fetches the weights", f"has image {IMAGE}", "packs: leaves 4 GPUs free")
    assert [verdict(explanation, n).holds_engine for n in ("d-weights", "b-has-image", "a-pulls", "c-unknown")] == [
        False, True, False, None]
    assert explanation.plan.leader.node == "d-weights"
    assert place(m, nodes[:3], {"a-pulls": frozenset(range(4))}).leader.node == "b-has-image"


def test_a_node_with_the_environment_built_ranks_before_one_that_builds_it():
    m = model(gpus=0, **VENV_RECIPE)
    nodes = [node("a-builds", venvs={VENV_KEY: VenvView(True, False)}),
             node("b-built", venvs={VENV_KEY: VenvView(True, True)}),
             node("c-other-recipe", venvs={"0" * 16: VenvView(True, True)})]
    explanation = explain_placement(m, nodes, {})
    assert [v.node for v in explanation.verdicts] == ["b-built", "a-builds", "c-other-recipe"]
    assert explanation.plan.reasons == ("fetches the weights", "has its environment", "packs: leaves 8 GPUs free")
    assert verdict(explanation, "c-other-recipe").reasons[1] == "environment not checked yet"


def test_the_estimate_adds_the_fetch_at_the_nodes_rate_and_the_last_provision():
    """R-4.12: how long a fitting node needs before its engine starts, from what fetches and
    provisions took lately; a step not measured makes the whole unknown, never a smaller figure."""
    m = model(gpus=0, disk_gb=70, **VENV_RECIPE)
    nodes = [node("a-ready", holds=frozenset({"llama"}), venvs={VENV_KEY: VenvView(True, True)}),
             node("b-both", venvs={VENV_KEY: VenvView(True, False)}),
             node("c-unmeasured", venvs={VENV_KEY: VenvView(True, False)}),
             node("d-unreported", holds=None, venvs={VENV_KEY: VenvView(True, True)})]
    durations = Durations({"b-both": 350e6, "d-unreported": 1e9}, {VENV_KEY: 143.6})
    explanation = explain_placement(m, nodes, {}, durations=durations)
    by_node = {v.node: v for v in explanation.verdicts}
    assert by_node["a-ready"].prepare_seconds == 0
    assert not any("before its engine starts" in r for r in by_node["a-ready"].reasons)
    assert by_node["b-both"].prepare_seconds == pytest.approx(70e9 / 350e6 + 143.6)
    assert ("before its engine starts: about 6 min (fetch about 4 min at its last measured 350 MB/s; "
            "build about 3 min, as the last build took)") in by_node["b-both"].reasons
    assert by_node["c-unmeasured"].prepare_seconds is None
    assert ("before its engine starts: - (fetch: this node's download rate not measured yet; "
            "build about 3 min, as the last build took)") in by_node["c-unmeasured"].reasons
    assert by_node["d-unreported"].prepare_seconds is None
    assert "before its engine starts: - (fetch: holdings not reported yet)" in by_node["d-unreported"].reasons
    # Without durations nothing is estimated, and the plan is the one place gives.
    plain = explain_placement(m, nodes, {})
    assert all(v.prepare_seconds is None for v in plain.verdicts)
    assert plain.plan == place(m, nodes, {}) and explanation.plan.shards == plain.plan.shards


def test_the_estimate_of_a_pull_and_of_a_host_engine():
    pulled = model(gpus=0, weights=None, **CONTAINER)
    digest = runtime_digest(runtime_spec(pulled.profile))
    pulls = node(containers=programs(docker=WORKS))
    (found,) = explain_placement(pulled, [pulls], {}, durations=Durations({}, {digest: 41.0})).verdicts
    assert found.prepare_seconds == 41.0
    assert "before its engine starts: about 41 s (pull about 41 s, as the last pull took)" in found.reasons
    (unmeasured,) = explain_placement(pulled, [pulls], {}, durations=Durations()).verdicts
    assert unmeasured.prepare_seconds is None and "before its engine starts: - (pull: none measured yet)" in \
        unmeasured.reasons
    (host,) = explain_placement(model(gpus=0, weights=None), [node()], {}, durations=Durations()).verdicts
    assert host.prepare_seconds == 0


def test_the_image_names_which_container_program_holds_it():
    """The helper runs the named program, or the first of docker, podman on PATH: an image podman
    holds does not count when docker would run the container."""
    held = ContainerView(True, True, True, {IMAGE: True})
    m = model(**CONTAINER)
    explanation = explain_placement(m, [node(containers=programs(docker=WORKS, podman=held))], {})
    assert verdict(explanation, "gpu01").holds_engine is False
    named = explain_placement(model(**CONTAINER, container="podman"), [node(containers=programs(WORKS, held))], {})
    assert verdict(named, "gpu01").holds_engine is True


def test_multi_node_prefers_the_fabric_whose_nodes_hold_the_image():
    m = model(gpus=8, nodes=2, **CONTAINER)
    has_image = programs(docker=ContainerView(True, True, True, {IMAGE: True}))
    nodes = [node("a1", fabric="ib-a", containers=programs(docker=WORKS)),
             node("a2", fabric="ib-a", containers=programs(docker=WORKS)),
             node("b1", fabric="ib-b", containers=has_image), node("b2", fabric="ib-b", containers=has_image)]
    plan = place(m, nodes, {})
    assert plan.fabric == "ib-b"
    assert plan.reasons == ("fabric ib-b", "no chosen node holds the weights; each fetches them",
                            f"all 2 nodes have image {IMAGE}", "packs: leaves 0 GPUs free across its 2 nodes")
    assert explain_placement(m, nodes[:2], {}).plan.reasons[2] == (
        f"0 of 2 nodes have image {IMAGE}; the others provision it")


def test_a_missing_container_program_is_not_a_reason_a_model_could_never_fit():
    """A daemon started or a program installed mends it: never_fits (R-10.5) does not refuse on it."""
    assert never_fits(model(**CONTAINER), [node(containers=programs())]) is None
    assert never_fits(model(**VENV_RECIPE), [node(venvs={VENV_KEY: VenvView(False)})]) is None
