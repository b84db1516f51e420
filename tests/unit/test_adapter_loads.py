"""LoRA adapters loaded on demand (R-8.8): where one is loaded and what makes room for it, what
the control plane remembers, what the routers report of them and how the engine's list is read."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import EngineLoad, Report
from llmgw.control.adapters import RETRY_SECONDS, AdapterMemory, Candidate, Choice, Loaded, _engine_message, choose
from llmgw.control.feed.changelog import ChangeLog
from llmgw.control.feed.routers import RouterTable
from llmgw.router.balancer import Balancer
from llmgw.router.engineload import Malformed, parse_adapters


def candidate(replica_id="r1", busy=0, launched=(), loaded=(), use=None, capacity=2):
    return Candidate(replica_id, busy, tuple(launched), {name: Loaded(since) for name, since in dict(loaded).items()},
                     use or {}, capacity)


# -- where an adapter is loaded -----------------------------------------------------------------


@pytest.mark.parametrize("candidates, expected", [
    pytest.param([candidate("r1", busy=3), candidate("r2", busy=1)], Choice("r2", None), id="least-busy-with-room"),
    pytest.param([candidate("r1", busy=0, loaded={"x": 1.0, "y": 2.0}), candidate("r2", busy=5)], Choice("r2", None),
                 id="room-before-an-unload"),
    pytest.param([candidate("r1", loaded={"x": 1.0, "y": 2.0}, use={"x": (0, 50.0), "y": (0, 10.0)})],
                 Choice("r1", "y"), id="least-recently-used-goes"),
    pytest.param([candidate("r1", loaded={"x": 1.0, "y": 2.0}, use={"x": (0, 50.0), "y": (1, 10.0)})],
                 Choice("r1", "x"), id="never-one-in-use"),
    pytest.param([candidate("r1", launched=("p",), loaded={"x": 1.0})], Choice("r1", "x"), id="launched-ones-count"),
    pytest.param([candidate("r1", launched=("p", "q"))], "every replica that could load it holds its max_adapters",
                 id="only-launched-ones"),
    pytest.param([candidate("r1", loaded={"x": 1.0, "y": 2.0}, use={"x": (2, 0.0), "y": (1, 0.0)})],
                 "each with requests in flight (1 replica)", id="all-in-use"),
    pytest.param([candidate("r1", loaded={"a": 1.0})], "no serving replica of its base can load it now",
                 id="already-held"),
    pytest.param([], "no serving replica of its base can load it now", id="no-replica"),
])
def test_where_an_adapter_is_loaded(candidates, expected):
    decision = choose("a", candidates)
    if isinstance(expected, str):
        assert isinstance(decision, str) and expected in decision
    else:
        assert decision == expected


def test_an_adapter_never_used_is_the_least_recently_used():
    decision = choose("a", [candidate("r1", loaded={"x": 1.0, "y": 2.0}, use={"x": (0, 5.0)})])
    assert decision == Choice("r1", "y")


# -- what the control plane remembers -----------------------------------------------------------


def test_an_unloading_adapter_is_no_longer_held_and_a_failure_is_kept_a_while():
    memory = AdapterMemory()
    memory.loaded["r1"] = {"b": Loaded(1.0), "a": Loaded(2.0, unloading=True)}
    assert memory.held("r1") == ("b",)
    memory.failed["r1"] = {"big": (100.0, "rank 32 is greater than 16")}
    assert memory.errors("r1", now=101.0) == (("big", "rank 32 is greater than 16"),)
    assert memory.failure("big", 101.0) == "rank 32 is greater than 16"
    assert memory.errors("r1", now=100.0 + RETRY_SECONDS) == ()
    assert memory.failure("big", 100.0 + RETRY_SECONDS) is None
    memory.changed_at["r2"] = 5.0
    memory.forget_replicas(["r1"])
    assert set(memory.loaded) == {"r1"} and "r2" not in memory.changed_at


@pytest.mark.parametrize("text, message", [
    ('{"error": {"message": "LoRA rank 32 is greater than max_lora_rank 8.", "type": "BadRequestError"}}',
     "LoRA rank 32 is greater than max_lora_rank 8."),
    ('{"message": "The lora adapter \'x\' has already been loaded."}', "The lora adapter 'x' has already been loaded."),
    ('{"detail": "Not Found"}', "Not Found"),
    ("Internal Server Error", "Internal Server Error"),
])
def test_the_engines_reason_is_its_message(text, message):
    assert _engine_message(text) == message


# -- what the routers report ----------------------------------------------------------------------


def _table():
    changes = ChangeLog("e", models={}, static={}, keys=(), gateway=None, response_secret="0" * 64)
    now = [100.0]
    return changes, RouterTable(changes, lambda: now[0]), now


def test_adapter_use_is_summed_over_the_routers_heard_lately():
    _, table, now = _table()
    table.take(Report("a", 1, 0.0, adapter_use={"r1": {"x": (1, 10.0), "y": (0, 30.0)}}))
    table.take(Report("b", 1, 0.0, adapter_use={"r1": {"x": (2, 20.0)}, "r2": {"x": (0, 5.0)}}))
    assert table.adapter_use() == {"r1": {"x": (3, 20.0), "y": (0, 30.0)}, "r2": {"x": (0, 5.0)}}
    now[0] += 60  # both silent too long: their figures no longer count
    assert table.adapter_use() == {}


def test_an_adapter_is_quiet_once_every_router_routes_without_it_and_has_none_in_flight():
    _, table, _ = _table()
    table.take(Report("a", 1, 0.0, snapshot=("e", 4), adapter_use={"r1": {"x": (0, 10.0)}}))
    table.take(Report("b", 1, 0.0, snapshot=("e", 6), adapter_use={"r1": {"x": (1, 20.0)}}))
    assert not table.adapter_quiet("r1", "x", 5)  # a behind, b has one in flight
    table.take(Report("a", 2, 0.0, snapshot=("e", 6)))
    assert not table.adapter_quiet("r1", "x", 5)
    table.take(Report("b", 2, 0.0, snapshot=("e", 6), adapter_use={"r1": {"x": (0, 20.0)}}))
    assert table.adapter_quiet("r1", "x", 5)
    assert not table.adapter_quiet("r1", "x", 7)  # nobody routes with a version that new yet


# -- the router's side --------------------------------------------------------------------------


def test_the_engines_adapters_are_the_entries_with_a_parent():
    text = ('{"object": "list", "data": [{"id": "base", "parent": null}, {"id": "b", "parent": "base"},'
            ' {"id": "a", "parent": "base", "root": "/cache/a"}]}')
    assert parse_adapters(text) == ("a", "b")
    for bad in ("not json", '{"data": 3}'):
        with pytest.raises(Malformed):
            parse_adapters(bad)
    load = dataclasses.replace(EngineLoad("vllm"), adapters=("a",))
    assert load.as_dict()["adapters"] == ["a"] and "adapters" not in EngineLoad("vllm").as_dict()


def _endpoint(replica_id, adapters=(), errors=()):
    return Endpoint(replica_id=replica_id, model="base", url=f"http://{replica_id}:1", api_key="k",
                    adapters=tuple(adapters), adapter_errors=tuple(errors))


def test_a_replica_that_loads_an_adapter_keeps_its_counters_and_joins_the_adapters_pool():
    balancer = Balancer()
    balancer.replace({"base": [_endpoint("r1"), _endpoint("r2")]})
    up = balancer.acquire("base", 0.0)
    assert not balancer.has_endpoints("x")
    balancer.replace({"base": [_endpoint("r1", ["x"]) if up.replica_id == "r1" else _endpoint("r1"),
                               _endpoint("r2", ["x"]) if up.replica_id == "r2" else _endpoint("r2")]})
    [holder] = balancer.endpoints("x")
    assert holder is up and holder.outstanding == 1 and holder.adapters == ("x",)
    balancer.replace({"base": [_endpoint("r1", errors=[("y", "too big")]), _endpoint("r2")]})
    assert balancer.adapter_error("y") == "too big" and balancer.adapter_error("x") is None
    assert not balancer.has_endpoints("x")


def test_an_adapter_is_pressed_when_every_holder_is_over_the_load_bound():
    balancer = Balancer()
    balancer.replace({"base": [_endpoint("r1", ["x"]), _endpoint("r2")]})
    assert not balancer.adapter_pressed("x", "base")
    for _ in range(4):
        balancer.acquire("x", 0.0)
    assert balancer.adapter_pressed("x", "base")  # r1 has 4, r2 none: another replica should load it
    balancer.replace({"base": [_endpoint("r1", ["x"]), _endpoint("r2", ["x"])]})
    assert not balancer.adapter_pressed("x", "base")  # every replica holds it already


# -- carrying out: loads, unloads, failures (the engine's routes faked) ---------------------------


class _Fleet:
    def __init__(self):
        from llmgw.config import NodeConfig
        self.nodes = {"n1": NodeConfig(name="n1", host="10.0.0.1"), "n2": NodeConfig(name="n2", host="10.0.0.2")}


class _Actions:
    def __init__(self):
        self.fleet = _Fleet()
        self.fetched: list[tuple[str, str]] = []

    async def adapter_path(self, replica, adapter):
        self.fetched.append((replica.id, adapter.name))
        return f"/cache/llmgw-{adapter.name}"


def _loads(max_adapters=1, replicas=("r1",), quiet=lambda replica, adapter, version: True):
    from llmgw.catalog import Catalog
    from llmgw.config import ModelConfig, ProfileConfig
    from llmgw.control.adapters import AdapterLoads
    from llmgw.control.rollouts import RolloutMemory
    from llmgw.control.routers import Routers
    from llmgw.control.state import SERVING, Records, Replica, Shard

    catalog = Catalog.build(file_models=[ModelConfig(name="base", profile="v", weights="hf:org/m"),
                                         *(ModelConfig(name=n, base="base", adapter=f"loras/{n}") for n in "abc")],
                            profiles={"v": ProfileConfig(engine="vllm", max_adapters=max_adapters)})
    rollouts = RolloutMemory()
    revision = rollouts.note(catalog.models["base"], 0.0)
    records = Records(revision_adapters=rollouts.adapters)
    for i, replica_id in enumerate(replicas):
        shard = Shard(f"{replica_id}-0", replica_id, 0, f"n{i + 1}", (), state=SERVING, port=20000 + i)
        records.replicas[replica_id] = Replica(replica_id, "base", f"key-{replica_id}", [shard],
                                               revision=revision.id, serving_since=1.0)
    memory = AdapterMemory()
    records.runtime_adapters, records.adapter_errors = memory.held, memory.errors
    pushed: list[dict] = []
    routers = Routers(push_endpoints=pushed.append, adapter_quiet=quiet, version=lambda: len(pushed),
                      outstanding=lambda replica_id: 0, adapter_use=lambda: {})
    loads = AdapterLoads(memory, records, rollouts, _Actions(), routers, lambda: None)
    return loads, catalog, pushed


async def _settled(loads):
    """Until no load or unload is under way (one may start another as it ends)."""
    while loads.tasks:
        await asyncio.gather(*list(loads.tasks))
        await asyncio.sleep(0)  # the ended tasks' callbacks take them out


async def test_a_wanted_adapter_is_fetched_loaded_and_put_on_the_endpoint(monkeypatch):
    calls = []

    async def call(url, key, path, body):
        calls.append((url, key, path, body))
    loads, catalog, pushed = _loads()
    monkeypatch.setattr(loads.engine, "call", call)
    loads.want("a", catalog)
    loads.want("a", catalog)  # one load under way per adapter
    await _settled(loads)
    assert calls == [("http://10.0.0.1:20000", "key-r1", "/v1/load_lora_adapter",
                      {"lora_name": "a", "lora_path": "/cache/llmgw-a"})]
    assert loads.actions.fetched == [("r1", "a")]
    assert pushed[-1]["base"][0].adapters == ("a",)
    assert loads.memory.loads == {"a": 1}


async def test_room_is_made_by_unloading_the_idle_one_once_the_routers_are_quiet(monkeypatch):
    calls, asked = [], []

    async def call(url, key, path, body):
        calls.append((path, body["lora_name"]))

    def quiet(replica, adapter, version):
        asked.append((replica, adapter, version))
        return len(asked) > 2  # the routers catch up on the third look
    loads, catalog, pushed = _loads(quiet=quiet)
    monkeypatch.setattr(loads.engine, "call", call)
    loads.want("a", catalog)
    await _settled(loads)
    loads.memory.last_load["b"] = float("-inf")
    loads.want("b", catalog)
    await _settled(loads)
    # b loaded first (a refused load would unload nothing), then a taken off the endpoint, and the
    # routers asked about the version that did it before it is unloaded.
    assert calls == [("/v1/load_lora_adapter", "a"), ("/v1/load_lora_adapter", "b"), ("/v1/unload_lora_adapter", "a")]
    withdrawn = next(i for i, table in enumerate(pushed) if table["base"][0].adapters == ("b",))
    assert pushed[withdrawn - 1]["base"][0].adapters == ("a", "b")
    assert asked[0] == ("r1", "a", withdrawn + 1)
    assert pushed[-1]["base"][0].adapters == ("b",)
    assert (loads.memory.unloads, loads.memory.loads) == ({"a": 1}, {"a": 1, "b": 1})


async def test_a_refused_load_is_on_the_endpoint_and_not_tried_again_at_once(monkeypatch):
    from llmgw.control.adapters import AdapterLoadFailed
    calls = []

    async def call(url, key, path, body):
        calls.append(body["lora_name"])
        raise AdapterLoadFailed("the engine answered 500: LoRA rank 32 is greater than max_lora_rank 8.")
    loads, catalog, pushed = _loads()
    monkeypatch.setattr(loads.engine, "call", call)
    loads.want("a", catalog)
    await _settled(loads)
    loads.memory.last_load.clear()
    loads.want("a", catalog)
    await _settled(loads)
    assert calls == ["a"]
    assert pushed[-1]["base"][0].adapter_errors == (("a", "the engine answered 500: LoRA rank 32 is greater than "
                                                          "max_lora_rank 8."),)
    assert loads.memory.load_failures == {"a": 1} and loads.memory.held("r1") == ()


async def test_a_want_that_finds_every_replica_busy_is_carried_out_after(monkeypatch):
    calls = []

    async def call(url, key, path, body):
        calls.append((url, body["lora_name"]))
    loads, catalog, _ = _loads(max_adapters=2)
    monkeypatch.setattr(loads.engine, "call", call)
    loads.want("a", catalog)
    loads.want("b", catalog)  # its one replica is busy loading a: kept
    assert loads.memory.wanted.keys() == {"b"}
    await _settled(loads)
    await _settled(loads)
    assert [name for _, name in calls] == ["a", "b"] and not loads.memory.wanted


def test_a_load_for_more_room_takes_no_other_adapters_place():
    full = candidate("r2", loaded={"x": 1.0, "y": 2.0})
    assert choose("a", [full], {"a": 1, "x": 1, "y": 1}) == \
        "its holders are busy, and every other replica holds its max_adapters adapters"
    assert choose("a", [full, candidate("r3", loaded={"x": 1.0})], {"a": 1, "x": 2, "y": 1}) == Choice("r3", None)
    assert choose("a", [full], {"x": 1, "y": 1}) == Choice("r2", "x")  # no holder at all: room is made


def test_a_second_copy_goes_before_an_only_one():
    c = candidate("r1", loaded={"x": 1.0, "y": 2.0}, use={"x": (0, 5.0), "y": (0, 50.0)})
    assert choose("a", [c], {"x": 1, "y": 2}) == Choice("r1", "y")  # y is held elsewhere too
    assert choose("a", [c], {"x": 1, "y": 1}) == Choice("r1", "x")


def test_what_the_engines_list_is_adopted_and_what_they_dropped_forgotten():
    loads, catalog, _ = _loads(max_adapters=3)
    readings = {}
    loads.routers.engine_load = readings.get
    memory = loads.memory
    memory.loaded["r1"] = {"b": Loaded(5.0)}
    readings["r1"] = dataclasses.replace(EngineLoad("vllm"), at=10.0, adapters=("a", "c", "not-in-the-catalog"))
    loads.learn(catalog)  # after a restart: the engine's word, for what the catalog names
    assert memory.held("r1") == ("a", "c")
    memory.changed_at["r1"] = 20.0  # a load or unload ended after the reading: it says nothing
    readings["r1"] = dataclasses.replace(EngineLoad("vllm"), at=15.0, adapters=())
    loads.learn(catalog)
    assert memory.held("r1") == ("a", "c")
    readings["r1"] = dataclasses.replace(EngineLoad("vllm"), at=25.0, adapters=("c",))
    loads.learn(catalog)
    assert memory.held("r1") == ("c",)
