"""The scaling decision on fixtures: load, delays, bounds and on-demand models (R-6.8, R-6.8a, R-6.8b)."""

from __future__ import annotations

import pytest

from llmgw.catalog import Catalog
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.control import plan, scaling
from llmgw.control.plan import Launch
from llmgw.control.scaling import Scale, decide, replica_load
from llmgw.control.state import SERVING, Replica, Shard
from llmgw.router.engineload import EngineLoad

T0 = 80_000.0
PROFILES = {"one": ProfileConfig(engine="vllm", gpus=1)}


def model(**scaling_config):
    config = ModelConfig(name="m", profile="one", weights="hf:org/m", scaling=scaling_config)
    return Catalog.build(file_models=[config], profiles=PROFILES).models["m"]


def run(m, state, samples, *, awake=True, current=1):
    """Feed (seconds after T0, load) samples one pass each; the states after every pass."""
    states = []
    for at, load in samples:
        state = decide(m, state, awake=awake, current=current, load=load, now=T0 + at)
        states.append(state)
    return states


def test_up_only_after_the_load_stayed_above_for_the_up_delay():
    m = model(min=1, max=4, up_delay="30s")
    states = run(m, Scale(1), [(0, 6), (10, 6), (20, 6), (29, 6), (30, 6)])
    assert [s.desired for s in states] == [1, 1, 1, 1, 3]
    last = states[-1].last
    assert (last.before, last.after, last.direction) == (1, 3, "up")
    assert last.reason == "scale 1→3: 6.0 in flight over 30s, target 2"
    assert last.at == T0 + 30 and states[-1].ups == 1 and states[-1].downs == 0


def test_a_pass_at_the_present_count_starts_the_up_delay_again():
    m = model(min=1, max=4, up_delay="30s")
    # 2 in flight is what one replica is for (target 2): the trend ends there and starts over.
    states = run(m, Scale(1), [(0, 6), (20, 2), (25, 6), (50, 6), (55, 6)])
    assert [s.desired for s in states] == [1, 1, 1, 1, 3]
    # The mean over the new trend's 30 s, time-weighted: 6 for its whole length.
    assert states[-1].last.reason == "scale 1→3: 6.0 in flight over 30s, target 2"
    assert states[-1].last.at == T0 + 55


def test_up_goes_to_what_the_mean_load_needs():
    m = model(min=1, max=8, up_delay="30s")
    # 4 in flight for 15 s, then 10 for 15 s: mean 7, so 4 replicas at target 2.
    states = run(m, Scale(1), [(0, 4), (15, 10), (30, 10)])
    assert states[-1].desired == 4
    assert states[-1].last.reason == "scale 1→4: 7.0 in flight over 30s, target 2"


def test_down_only_after_the_load_stayed_below_for_the_down_delay_to_what_its_last_up_delay_needs():
    m = model(min=1, max=4, up_delay="30s", down_delay="10m")
    # Every pass wants fewer than 4 for 10 minutes; the last 30 s (0 for 15 s, 5 for 15 s) need 2.
    states = run(m, Scale(4), [(0, 6), (300, 6), (570, 0), (585, 5), (599, 5), (600, 5)])
    assert [s.desired for s in states] == [4, 4, 4, 4, 4, 2]
    assert states[-1].last.reason == "scale 4→2: 2.5 in flight over 30s, target 2"
    assert states[-1].downs == 1
    # The trend keeps only the passes its last 30 s need.
    assert [at for at, _ in states[-2].samples] == [T0 + 300, T0 + 570, T0 + 585, T0 + 599]
    # The load of the quiet period's first minutes (a burst ending) holds no replica.
    states = run(m, Scale(4), [(0, 6), (5, 6), (10, 1), (600, 1)])
    assert states[-1].desired == 1 and states[-1].last.reason == "scale 4→1: 1.0 in flight over 30s, target 2"


def test_clamped_to_min_and_max():
    m = model(min=2, max=3, up_delay="5s", down_delay="5s")
    up = run(m, Scale(2), [(0, 40), (5, 40)])[-1]
    assert up.desired == 3 and up.last.reason == "scale 2→3: 40.0 in flight over 5s, target 2, max 3"
    down = run(m, Scale(3), [(0, 0), (5, 0)])[-1]
    assert down.desired == 2 and down.last.reason == "scale 3→2: 0.0 in flight over 5s, target 2, min 2"
    # Bounds changed under it (ctl scale): applied at once, whatever the load.
    assert decide(m, Scale(5), awake=True, current=5, load=40, now=T0).last.reason == "scale 5→3: max is 3"
    assert decide(m, Scale(0), awake=True, current=0, load=0, now=T0).last.reason == "scale 0→2: min is 2"
    # A load that wants more than max, or less than min, is no trend at all.
    at_max = Scale(3)
    assert decide(m, at_max, awake=True, current=3, load=100, now=T0) is at_max


def test_no_two_decisions_inside_the_up_delay():
    m = model(min=1, max=4, up_delay="30s", down_delay="5s")
    up = run(m, Scale(1), [(0, 8), (30, 8)])[-1]
    assert up.desired == 4
    # The load goes at once; down_delay (5 s) passes, but not up_delay since the last decision.
    states = run(m, up, [(31, 0), (40, 0), (59, 0), (60, 0)])
    assert [s.desired for s in states] == [4, 4, 4, 1]
    assert states[-1].last.at - up.last.at == 30
    assert (states[-1].ups, states[-1].downs) == (1, 1)


def test_first_decision_keeps_the_replicas_it_finds_within_the_bounds():
    m = model(min=1, max=4)
    assert decide(m, None, awake=True, current=3, load=0, now=T0) == Scale(3)
    assert decide(m, None, awake=True, current=9, load=0, now=T0) == Scale(4)
    assert decide(m, None, awake=True, current=0, load=0, now=T0) == Scale(1)


def test_a_model_without_max_does_not_scale_on_load():
    m = model(min=2)
    assert m.max_replicas == 2 and not m.scales
    state = Scale(2)
    assert decide(m, state, awake=True, current=2, load=50, now=T0) is state


def test_unknown_engine_load_counts_only_the_routers_figure():
    assert replica_load(3, None) == 3
    assert replica_load(3, EngineLoad(source="vllm")) == 3  # it reported neither figure
    assert replica_load(3, EngineLoad(source="llama-server", running=2)) == 3  # /slots: no queue
    # The engine's own count where it is larger: requests of other clients, or queued behind.
    assert replica_load(3, EngineLoad(source="vllm", waiting=4, running=2)) == 6
    assert replica_load(0, EngineLoad(source="vllm", waiting=0, running=0)) == 0


@pytest.mark.parametrize("concurrency,waiting,running,load", [
    pytest.param(None, 10**12, 0, 72, id="hostile-default-places-64-and-headroom-8"),
    pytest.param(4, 10**12, 3, 5, id="hostile-profile-concurrency-4-and-headroom-1"),
    pytest.param(None, 30, 10, 40, id="within-the-cap-counted-whole"),
    pytest.param(16, 0, 0, 3, id="the-routers-figure-stays-when-larger"),
])
def test_r6_8a_an_engines_own_count_adds_at_most_what_the_routers_may_send_it(concurrency, waiting, running, load):
    m = Catalog.build(file_models=[ModelConfig(name="m", profile="c", scaling={"min": 1, "max": 100})],
                      profiles={"c": ProfileConfig(engine="vllm", concurrency=concurrency)}).models["m"]
    reading = EngineLoad(source="vllm", waiting=waiting, running=running)
    assert replica_load(3, reading, scaling.engine_cap(m)) == load


def test_r6_8a_a_hostile_engine_does_not_scale_its_model_to_max(caplog):
    from tests.unit.test_reconciler import build
    reconciler, _, holder, _ = build([{"name": "m", "scaling": {"min": 1, "max": 100, "up_delay": "10s"}}])
    m = holder.current.models["m"]
    live = [serving("r1")]

    def outstanding(rid):
        return 1

    def engine_load(rid):
        return EngineLoad(source="vllm", waiting=10**12, running=0)

    loads = reconciler.memory.scaling.loads(m, live, outstanding, engine_load)
    assert loads == {"r1": scaling.engine_cap(m)} == {"r1": 72}
    assert sum("more than the 72 the routers may send it" in r.getMessage() for r in caplog.records) == 1
    reconciler.memory.scaling.loads(m, live, outstanding, engine_load)
    assert sum("more than the 72" in r.getMessage() for r in caplog.records) == 1  # said once while it lasts
    states = run(m, Scale(1), [(0, loads["r1"]), (10, loads["r1"])])
    assert states[-1].desired == 36  # ceil(72 / 2), not max


def serving(rid, created=0.0):
    return Replica(id=rid, model="m", api_key="k", created_at=created, serving_since=T0 - 100,
                   shards=[Shard(id=f"{rid}-0", replica_id=rid, rank=0, node="a", gpus=(0,), state=SERVING)])


def plan_for(m, live, state, now, *, demand=None, last_used=None, load=None):
    inputs = plan.PlanInputs(admin={}, health={}, demand={} if demand is None else {m.name: demand},
                             last_used=last_used or {}, scales={} if state is None else {m.name: state}, started_at=0.0)
    actions = plan.plan_model(m, live, now, inputs, load)
    scaled = [a.scale for a in actions if isinstance(a, plan.Scaled)]
    return (scaled[0] if scaled else state), [a for a in actions if not isinstance(a, plan.Scaled)]


def test_on_demand_scales_zero_to_one_on_demand_then_up_to_max_and_back():
    m = model(min=0, max=3, idle_timeout="60s", up_delay="10s", down_delay="20s")
    asleep = Scale(0)
    # No demand, no replica: nothing at all.
    state, actions = plan_for(m, [], asleep, T0)
    assert state is asleep and actions == [plan.Enough("m")]
    # Asked for: one replica at once, without waiting for any delay.
    state, actions = plan_for(m, [], asleep, T0 + 1, demand=T0 + 1)
    assert state.desired == 1 and state.last.reason == "scale 0→1: asked for with no replica"
    assert actions == [Launch("m", 1)]
    # It serves; load holds 6 in flight for the up-delay: up to max.
    live = [serving("m-1")]
    used = {"m-1": T0 + 2}
    for at in (2, 7, 12):
        state, actions = plan_for(m, live, state, T0 + at, last_used=used, load={"m-1": 6})
    assert state.desired == 3 and state.last.reason == "scale 1→3: 6.0 in flight over 10s, target 2"
    assert actions == [Launch("m", 2)]
    # Quiet for the down-delay: back to one, and after the idle timeout with no use, to none.
    live = [serving("m-1"), serving("m-2", 1.0), serving("m-3", 2.0)]
    for at in (13, 20, 33):
        state, actions = plan_for(m, live, state, T0 + at, last_used=used, load=dict.fromkeys(used, 0))
    assert state.desired == 1 and state.last.reason == "scale 3→1: 0.0 in flight over 10s, target 2"
    assert [a.replica_id for a in actions] == ["m-3", "m-2"]
    state, actions = plan_for(m, [serving("m-1")], state, T0 + 70, last_used=used, load={"m-1": 0})
    assert state.desired == 0 and state.last.reason == "scale 1→0: unused for 60s"
    assert [type(a).__name__ for a in actions] == ["ForgetDemand", "Retire"]
    assert (state.ups, state.downs) == (2, 2)
    # Its max lowered while it runs (ctl scale): the bound, not idleness, is the reason.
    lowered = model(min=0, max=2, idle_timeout="60s")
    assert decide(lowered, Scale(3), awake=True, current=3, load=0, now=T0).last.reason == "scale 3→2: max is 2"


def test_the_scaling_kept_between_passes_is_the_same_object_when_nothing_changes():
    # Most models need nothing on most passes: no new state, no action.
    m = model(min=1, max=4)
    state = Scale(2)
    assert decide(m, state, awake=True, current=2, load=3.5, now=T0) is state
    same, actions = plan_for(m, [serving("m-1"), serving("m-2")], state, T0, load={"m-1": 2, "m-2": 1.5})
    assert same is state and actions == [plan.Enough("m")]
    assert scaling.bounds(model(min=0, max=3), awake=False) == (0, 0)
