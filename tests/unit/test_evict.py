"""Eviction of idle replicas (R-6.8c) and the what-if of explain-placement (R-3.5): the rule, fixture by fixture."""

from __future__ import annotations

import pytest

from llmgw.catalog import Catalog
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.control import evict
from llmgw.control.evict import WhatIf, candidates, choose, eviction_reason, may_evict_for
from llmgw.units import idle_text
from llmgw.control.placement import explain_placement
from llmgw.control.state import SERVING, STARTING, ModelHealth, Replica, Shard
from llmgw.contracts.states import ReplicaPhase
from tests.unit.test_placement import gpus, node, verdict

NOW = 1_000_000.0
MIN = 60.0
GB = 1000**3


def catalog(**overrides):
    """Models on 1-GPU and 2-GPU profiles: on demand unless a scaling is given."""
    profiles = {"one": ProfileConfig(engine="vllm", gpus=1, gpu_class="h100-80gb"),
                "two": ProfileConfig(engine="vllm", gpus=2, gpu_class="h100-80gb"),
                "labelled": ProfileConfig(engine="vllm", gpus=1, node_selector={"zone": "z1"})}
    specs = {
        "big": dict(profile="two", scaling={"min": 0}),
        "small-a": dict(profile="one", scaling={"min": 0, "idle_timeout": "5m"}),
        "small-b": dict(profile="one", scaling={"min": 0, "idle_timeout": "5m"}),
        "forever": dict(profile="one", scaling={"min": 0, "idle_timeout": None}),
        "kept": dict(profile="one", scaling={"min": 1, "max": 3}),
        "kept-evictable": dict(profile="one", scaling={"min": 1, "max": 3, "evictable": True}),
        "shy": dict(profile="one", scaling={"min": 0, "evictable": False}),
        "zoned": dict(profile="labelled", scaling={"min": 0}),
    }
    specs.update(overrides)
    configs = [ModelConfig(name=name, weights=f"hf:org/{name}", disk_gb=38, **spec) for name, spec in specs.items()]
    return Catalog.build(file_models=configs, profiles=profiles).models


MODELS = catalog()


def replica(rid: str, model: str, node_gpus: dict[str, tuple[int, ...]], *, serving_since: float | None = NOW - 3600,
            state=SERVING, phase=ReplicaPhase.ACTIVE) -> Replica:
    shards = [Shard(id=f"{rid}-{rank}", replica_id=rid, rank=rank, node=n, gpus=g, state=state)
              for rank, (n, g) in enumerate(node_gpus.items())]
    return Replica(id=rid, model=model, api_key="k", shards=shards, phase=phase, serving_since=serving_since)


def allocated_of(replicas):
    used: dict[str, set[int]] = {}
    for r in replicas:
        for s in r.shards:
            used.setdefault(s.node, set()).update(s.gpus)
    return used


def ids(found):
    return [c.replica_id for c in found]


# ---------------------------------------------------------------------------------------------
# The default of scaling.evictable.


@pytest.mark.parametrize("name,expected", [
    pytest.param("small-a", True, id="on-demand-by-default"),
    pytest.param("kept", False, id="with-a-min-not-by-default"),
    pytest.param("kept-evictable", True, id="min-with-evictable-true"),
    pytest.param("shy", False, id="on-demand-with-evictable-false"),
])
def test_evictable_default_rule(name, expected):
    assert MODELS[name].evictable is expected


# ---------------------------------------------------------------------------------------------
# Candidates: who may be evicted, in which order.


def test_candidates_longest_idle_first_by_last_use_then_serving_since():
    replicas = [replica("a1", "small-a", {"n1": (0,)}), replica("b1", "small-b", {"n1": (1,)}),
                replica("f1", "forever", {"n1": (2,)}, serving_since=NOW - 7200)]
    used = {"a1": NOW - 10 * MIN, "b1": NOW - 30 * MIN}  # f1 never reported: counts from serving_since
    assert ids(candidates(replicas, MODELS, used, NOW, for_model="big")) == ["f1", "b1", "a1"]


@pytest.mark.parametrize("rep,used,why", [
    pytest.param(replica("a1", "small-a", {"n1": (0,)}), {"a1": NOW - 4 * MIN}, "used within its 5 min idle timeout",
                 id="recently-used"),
    pytest.param(replica("f1", "forever", {"n1": (0,)}), {"f1": NOW - 9 * MIN},
                 "no idle timeout: the default window (10 min) applies", id="default-window"),
    pytest.param(replica("k1", "kept", {"n1": (0,)}), {}, "model with a min, evictable not set", id="has-min"),
    pytest.param(replica("s1", "shy", {"n1": (0,)}), {}, "evictable: false", id="not-evictable"),
    pytest.param(replica("e1", "kept-evictable", {"n1": (0,)}), {}, "would go below its min 1", id="below-min"),
    pytest.param(replica("x1", "big", {"n1": (0, 1)}), {}, "the model being placed", id="same-model"),
    pytest.param(replica("a1", "small-a", {"n1": (0,)}, state=STARTING), {}, "not serving", id="not-serving"),
    pytest.param(replica("a1", "small-a", {"n1": (0,)}, phase=ReplicaPhase.DRAINING), {}, "draining",
                 id="draining"),
    pytest.param(replica("a1", "small-a", {"n1": (0,)}, serving_since=None), {}, "idle since unknown",
                 id="idle-unknown"),
])
def test_not_a_candidate(rep, used, why):
    assert candidates([rep], MODELS, used, NOW, for_model="big") == [], why


def test_an_adopted_replica_counts_from_the_control_planes_start():
    adopted = replica("a1", "small-a", {"n1": (0,)}, serving_since=None)  # serving before a restart
    assert ids(candidates([adopted], MODELS, {}, NOW, for_model="big", started_at=NOW - 10 * MIN)) == ["a1"]
    assert candidates([adopted], MODELS, {}, NOW, for_model="big", started_at=NOW - 2 * MIN) == []


def test_an_evictable_model_with_a_min_gives_only_its_surplus_longest_idle_first():
    replicas = [replica(f"e{i}", "kept-evictable", {"n1": (i,)}) for i in range(3)]
    used = {"e0": NOW - 20 * MIN, "e1": NOW - 50 * MIN, "e2": NOW - 30 * MIN}
    assert ids(candidates(replicas, MODELS, used, NOW, for_model="big")) == ["e1", "e2"]


def test_default_window_is_the_gateways():
    rep = replica("f1", "forever", {"n1": (0,)})
    used = {"f1": NOW - 3 * MIN}
    assert candidates([rep], MODELS, used, NOW, for_model="big") == []
    assert ids(candidates([rep], MODELS, used, NOW, for_model="big", default_idle=2 * MIN)) == ["f1"]
    assert evict.DEFAULT_EVICT_IDLE == 600.0


@pytest.mark.parametrize("name,scaling_config,window", [
    pytest.param("unset", {"min": 0}, 2 * MIN, id="idle-timeout-unset-waits-evict-idle"),
    pytest.param("null", {"min": 0, "idle_timeout": None}, 2 * MIN, id="idle-timeout-null-waits-evict-idle"),
    pytest.param("own", {"min": 0, "idle_timeout": "5m"}, 5 * MIN, id="its-own-idle-timeout"),
    pytest.param("ten", {"min": 0, "idle_timeout": "10m"}, 10 * MIN, id="its-own-even-when-it-is-the-default"),
])
def test_r6_8c_a_model_that_sets_no_idle_timeout_is_evictable_after_the_gateways_evict_idle(name, scaling_config,
                                                                                             window):
    (model,) = catalog_of(name, scaling_config).values()
    assert model.evict_idle(2 * MIN) == window
    rep = replica("r1", name, {"n1": (0,)})
    for idle, expected in ((window - 1, []), (window + 1, ["r1"])):
        assert ids(candidates([rep], {name: model}, {"r1": NOW - idle}, NOW, for_model="big",
                              default_idle=2 * MIN)) == expected, idle
    # Its idle stop is another rule: 10 minutes unless it sets its own (null: never, R-6.8).
    assert model.idle_timeout == {"unset": 600.0, "null": None, "own": 300.0, "ten": 600.0}[name]


def catalog_of(name, scaling_config):
    config = ModelConfig(name=name, weights=f"hf:org/{name}", profile="one", scaling=scaling_config)
    return Catalog.build(file_models=[config], profiles={"one": ProfileConfig(engine="vllm", gpus=1)}).models


def test_no_eviction_for_a_model_in_failure_backoff():
    assert may_evict_for(None, NOW)
    assert may_evict_for(ModelHealth(), NOW)
    assert not may_evict_for(ModelHealth(failures=2, next_attempt=NOW + 30), NOW)
    assert may_evict_for(ModelHealth(failures=2, next_attempt=NOW - 1), NOW)


# ---------------------------------------------------------------------------------------------
# Choosing victims: greedy, longest idle first, until placement fits; fewest stopped.


def test_evicts_exactly_the_longest_idle_replica_that_makes_room():
    nodes = [node("n1", gpus=gpus(2))]
    replicas = [replica("a1", "small-a", {"n1": (0,)}), replica("b1", "small-b", {"n1": (1,)})]
    used = {"a1": NOW - 10 * MIN, "b1": NOW - 40 * MIN}
    pool = candidates(replicas, MODELS, used, NOW, for_model="small-a")
    victims, plan = choose(MODELS["forever"], nodes, allocated_of(replicas), pool)
    assert ids(victims) == ["b1"]
    assert plan.shards[0].node == "n1" and plan.shards[0].gpus == (1,)
    assert eviction_reason("forever", victims[0], NOW) == "evicted for forever (idle 40 min)"


def test_two_gpus_need_two_victims_on_one_node_not_the_longest_idle_elsewhere():
    nodes = [node("n1", gpus=gpus(2)), node("n2", gpus=gpus(2))]
    replicas = [replica("a1", "small-a", {"n1": (0,)}), replica("b1", "small-b", {"n2": (0,)}),
                replica("f1", "forever", {"n2": (1,)}), replica("k1", "kept", {"n1": (1,)})]
    # a1 is the longest idle, but n1's other GPU is held by a model that cannot be evicted: the
    # greedy pass takes a1, b1, f1 and gives a1 back, as n2 fits without it.
    used = {"a1": NOW - 90 * MIN, "b1": NOW - 60 * MIN, "f1": NOW - 30 * MIN, "k1": NOW - 100 * MIN}
    pool = candidates(replicas, MODELS, used, NOW, for_model="big")
    assert ids(pool) == ["a1", "b1", "f1"]
    victims, plan = choose(MODELS["big"], nodes, allocated_of(replicas), pool)
    assert ids(victims) == ["b1", "f1"]
    assert plan.shards[0].node == "n2"


def test_nothing_chosen_when_freeing_every_candidate_still_does_not_fit():
    nodes = [node("n1", gpus=gpus(2), gpu_class="l40s-48gb")]
    replicas = [replica("a1", "small-a", {"n1": (0,)}), replica("b1", "small-b", {"n1": (1,)})]
    pool = candidates(replicas, MODELS, {}, NOW, for_model="big")
    assert len(pool) == 2
    assert choose(MODELS["big"], nodes, allocated_of(replicas), pool) is None
    assert choose(MODELS["big"], [node("n1", gpus=gpus(2))], allocated_of(replicas), []) is None


def test_a_model_that_lacks_more_than_gpus_costs_one_placement_not_one_per_candidate(monkeypatch):
    nodes = [node("n1", gpus=gpus(4), gpu_class="l40s-48gb")]
    replicas = [replica(f"a{i}", "small-a", {"n1": (i,)}) for i in range(4)]
    pool = candidates(replicas, MODELS, {}, NOW, for_model="big")
    calls = []
    real = evict.placement.place
    monkeypatch.setattr(evict.placement, "place", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert choose(MODELS["big"], nodes, allocated_of(replicas), pool) is None
    assert len(pool) == 4 and len(calls) == 1


# ---------------------------------------------------------------------------------------------
# What-if: one change per rejected node, in operator words.


def explain_with_what_if(model, nodes, replicas, used=None, rates=None):
    allocated = allocated_of(replicas)
    pool = candidates(replicas, MODELS, used or {}, NOW, for_model=model.name)
    return explain_placement(model, nodes, allocated, what_if=WhatIf(model, pool, allocated, rates or {}, NOW))


def test_what_if_names_the_replicas_to_stop_and_the_download():
    nodes = [node("n1", gpus=gpus(2)), node("n2", gpus=gpus(2)), node("n3", gpus=gpus(2))]
    replicas = [replica("a1", "small-a", {"n1": (0,)}), replica("b1", "small-b", {"n1": (1,)}),
                replica("f1", "forever", {"n2": (0,)}), replica("k1", "kept", {"n2": (1,)}),
                replica("s1", "shy", {"n3": (0, 1)})]
    used = {"a1": NOW - 42 * MIN, "b1": NOW - 3 * 3600}
    explanation = explain_with_what_if(MODELS["big"], nodes, replicas, used, rates={"n1": 110e6})
    assert explanation.plan is None
    assert verdict(explanation, "n1").what_if == (
        "fits if b1 (idle 3 h) and a1 (idle 42 min) are stopped, "
        "after a 38 GB download (about 6 min at this node's last measured 110 MB/s)")
    assert verdict(explanation, "n2").what_if is None  # k1 may not be evicted
    assert verdict(explanation, "n3").what_if is None  # s1 may not be evicted
    one = explain_with_what_if(MODELS["small-a"], nodes[:1], replicas[:2], used)
    assert verdict(one, "n1").what_if == ("fits if b1 (idle 3 h) is stopped, "
                                          "after a 38 GB download (this node's download rate is not measured yet)")


@pytest.mark.parametrize("node_kw,expected", [
    pytest.param(dict(admin="cordoned"), "fits when uncordoned", id="cordoned"),
    pytest.param(dict(admin="draining"), "fits when uncordoned", id="draining"),
    pytest.param(dict(state="unreachable"), "fits once the node is ready again (now unreachable)", id="unreachable"),
    pytest.param(dict(labels={"zone": "z2"}), "fits if labelled zone=z1", id="labels"),
    pytest.param(dict(cache_free_bytes=30 * GB, holds=frozenset()),
                 "fits with 8 GB more free in its cache, "
                 "after a 38 GB download (about 13 min at this node's last measured 50 MB/s)", id="disk"),
    pytest.param(dict(admin="cordoned", labels={"zone": "z2"}), None, id="two-changes-are-not-one"),
    pytest.param(dict(gpu_class=None, gpus=()), None, id="no-gpus-no-change"),
])
def test_what_if_for_each_kind_of_shortfall(node_kw, expected):
    node_kw = {"labels": {"zone": "z1"}, "holds": frozenset({"zoned"}), **node_kw}
    explanation = explain_with_what_if(MODELS["zoned"], [node("n1", **node_kw)], [], rates={"n1": 50e6})
    assert verdict(explanation, "n1").what_if == expected


def test_what_if_for_a_fabric_short_of_whole_nodes():
    profiles = {"wide": ProfileConfig(engine="vllm", gpus=8, nodes=2, gpu_class="h100-80gb")}
    wide = Catalog.build(file_models=[ModelConfig(name="wide", profile="wide", weights="hf:org/w")],
                         profiles=profiles).models["wide"]
    nodes = [node("n1", fabric="ib-b"), node("n2", fabric="ib-b", admin="cordoned")]
    explanation = explain_placement(wide, nodes, {}, what_if=WhatIf(wide, [], {}, {}, NOW))
    assert verdict(explanation, "n1").what_if == "fabric ib-b would need 1 more free whole node"
    assert verdict(explanation, "n2").what_if == "fits when uncordoned"
    assert explain_placement(wide, nodes, {}).verdicts[0].what_if is None  # only asked for with a hook


@pytest.mark.parametrize("seconds,text", [(42, "42 s"), (42 * 60, "42 min"), (3 * 3600 + 300, "3 h 5 min"),
                                          (3 * 3600, "3 h"), (2 * 86400 + 4 * 3600, "2 d 4 h")])
def test_idle_text(seconds, text):
    assert idle_text(seconds) == text


def test_a_slow_link_and_a_small_download_are_not_worded_as_zero():
    small = Catalog.build(file_models=[ModelConfig(name="tiny", profile="one", weights="hf:org/t", disk_gb=0.002)],
                          profiles={"one": ProfileConfig(engine="vllm", gpus=1)}).models["tiny"]
    explanation = explain_placement(small, [node("n1", admin="cordoned")], {},
                                    what_if=WhatIf(small, [], {}, {"n1": 400e3}, NOW))
    assert verdict(explanation, "n1").what_if == (
        "fits when uncordoned, after a 2.0 MB download (about 5 s at this node's last measured 400.0 KB/s)")
