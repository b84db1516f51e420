"""The router feed's messages in their wire form (R-10.1): a snapshot read from a peer or from disk is
input like any other, so every field is checked and a wrong one named; what passes the checks is
the contract's own frozen dataclasses, however the wire path builds them."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import re
from types import MappingProxyType

import pytest

from llmgw.contracts import feed
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import (FeedError, GatewaySettings, KeyEntry, Limits, RoutedModel, Snapshot, from_wire,
                                  to_wire)

ENGINE_KEY = "engine-key-of-a"
KEY_HASH = "1" * 64


def make_snapshot(limited: bool = True) -> Snapshot:
    models = {"a": RoutedModel("a", "vllm", "org/a", "prefix", False, ("b",), 4),
              "b": RoutedModel("b", None, None, "least-outstanding", True)}
    endpoints = {"a": (Endpoint("a-r0", "a", "http://10.0.0.1:8000", ENGINE_KEY),
                       Endpoint("a-r1", "a", "http://10.0.0.2:8000", None, draining=True)),
                 "b": ()}
    keys = [KeyEntry("k0", "plain", "0" * 64, "sk-llmgw-0", None),
            KeyEntry("k1", "two models", KEY_HASH, "sk-llmgw-1", frozenset({"a", "b"})),
            KeyEntry("k2", "classed", "2" * 64, "sk-llmgw-2", frozenset({"a"}), priority=-1, weight=3)]
    if limited:
        keys.append(KeyEntry("k3", "limited", "3" * 64, "sk-llmgw-3", None, limits=Limits(rpm=60),
                             model_limits=MappingProxyType({"a": Limits(tpm=1000)})))
    return Snapshot(epoch="e", version=7, models=MappingProxyType(models), endpoints=MappingProxyType(endpoints),
                    keys=tuple(keys), gateway=GatewaySettings(max_body=1000, request_timeout=60.0, on_demand_wait=10.0))


def read_back(snapshot: Snapshot) -> Snapshot:
    return from_wire(json.loads(json.dumps(to_wire(snapshot))))


def test_r10_1_a_snapshot_read_back_holds_the_dataclasses_own_frozen_entries():
    original = make_snapshot()
    back = read_back(original)
    assert back == original
    pairs = [*zip(back.keys, original.keys), *zip(back.endpoints["a"], original.endpoints["a"]),
             *zip(back.models.values(), original.models.values())]
    assert len(pairs) == 8
    for entry, expected in pairs:
        assert type(entry) is type(expected)
        assert entry == expected and hash(entry) == hash(expected) and repr(entry) == repr(expected)
        assert dataclasses.replace(entry) == expected
        first = dataclasses.fields(entry)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(entry, first, "changed")
        assert getattr(entry, first) == getattr(expected, first)
    assert KEY_HASH not in repr(back.keys) and ENGINE_KEY not in repr(back.endpoints)
    assert back.response_secret == original.response_secret and original.response_secret not in repr(back)


def counting_init(monkeypatch, cls, calls: list) -> None:
    init = cls.__init__

    def counted(self, *args, **kwargs):
        calls.append(cls.__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counted)


def test_r10_1_keys_and_endpoints_are_built_without_their_frozen_init(monkeypatch):
    """A frozen dataclass's __init__ sets each field through object.__setattr__: for a snapshot of
    10,000 keys that cost more than decoding and checking them (bench/feed_apply.py)."""
    line = json.dumps(to_wire(make_snapshot(limited=False)))
    calls: list[str] = []
    counting_init(monkeypatch, KeyEntry, calls)
    counting_init(monkeypatch, Endpoint, calls)
    back = from_wire(json.loads(line))
    assert calls == []
    assert len(back.keys) == 3 and len(back.endpoints["a"]) == 2
    assert [type(k) for k in back.keys] == [KeyEntry] * 3
    KeyEntry("k9", "made here", "9" * 64, "sk-llmgw-9", None)
    assert calls == ["KeyEntry"], "the counting itself works"


@pytest.mark.parametrize("builder,cls,args", [
    (feed._KeyEntryFields, KeyEntry, ("k1", "alice", KEY_HASH, "sk-llmgw-1", frozenset({"a"}), -1, 3)),
    (feed._EndpointFields, Endpoint, ("a-r0", "a", "http://10.0.0.1:8000", ENGINE_KEY, True, "0123456789ab", "gpu03")),
])
def test_the_wire_path_builders_set_every_field_of_their_dataclass(builder, cls, args):
    built = builder(*args)
    assert type(built) is cls
    assert [getattr(built, f.name) for f in dataclasses.fields(cls)]  # no slot left unset
    # Every field, those the builder's parameters leave out at their defaults (its parameters are
    # named as the fields, in their order but for those it leaves out).
    names = list(inspect.signature(builder).parameters)
    assert built == cls(**dict(zip(names, args)))


DELETE = object()
WIRE = to_wire(make_snapshot())


def set_at(document: dict, path: tuple, value) -> None:
    """Set (or, for value DELETE, remove) document[path[0]][path[1]]...."""
    *parents, last = path
    for step in parents:
        document = document[step]
    if value is DELETE:
        del document[last]
    else:
        document[last] = value


@pytest.mark.parametrize("path,value,names", [
    # keys: the entries of the fast path, and those it hands to the checks
    pytest.param(("keys", 0), "k0", "snapshot.keys[0]: expected dict, got str", id="key-not-an-object"),
    pytest.param(("keys", 1, "id"), 5, "snapshot.keys[1].id: expected str, got int", id="key-id"),
    pytest.param(("keys", 1, "name"), None, "snapshot.keys[1].name: expected str, got NoneType", id="key-name"),
    pytest.param(("keys", 0, "hash"), 12, "snapshot.keys[0].hash: expected str, got int", id="key-hash"),
    pytest.param(("keys", 1, "prefix"), [], "snapshot.keys[1].prefix: expected str, got list", id="key-prefix"),
    pytest.param(("keys", 1, "hash"), DELETE, "snapshot.keys[1]: 'hash' is missing", id="key-hash-missing"),
    pytest.param(("keys", 1, "models"), "a", "snapshot.keys[1].models: expected list, got str", id="key-models"),
    pytest.param(("keys", 1, "models", 1), 3, "snapshot.keys[1].models[1]: expected str, got int",
                 id="key-models-item"),
    pytest.param(("keys", 2, "priority"), True, "snapshot.keys[2].priority: expected int, got bool",
                 id="key-priority"),
    pytest.param(("keys", 2, "weight"), 0, "snapshot.keys[2].weight: must be at least 1, got 0", id="key-weight"),
    pytest.param(("keys", 0, "weight"), "2", "snapshot.keys[0].weight: expected int, got str", id="key-weight-type"),
    pytest.param(("keys", 3, "limits", "rpm"), -1, "snapshot.keys[3].limits.rpm: must be at least 1, got -1",
                 id="key-limits"),
    # endpoints
    pytest.param(("endpoints", "a"), {}, "snapshot.endpoints['a']: expected list, got dict", id="endpoint-list"),
    pytest.param(("endpoints", "a", 1, "replica"), 1, "snapshot.endpoints['a'][1].replica: expected str, got int",
                 id="endpoint-replica"),
    pytest.param(("endpoints", "a", 0, "model"), None, "snapshot.endpoints['a'][0].model: expected str",
                 id="endpoint-model"),
    pytest.param(("endpoints", "a", 1, "url"), DELETE, "snapshot.endpoints['a'][1]: 'url' is missing",
                 id="endpoint-url-missing"),
    pytest.param(("endpoints", "a", 0, "key"), 5, "snapshot.endpoints['a'][0].key: expected str or null, got int",
                 id="endpoint-key"),
    pytest.param(("endpoints", "a", 1, "draining"), 1, "snapshot.endpoints['a'][1].draining: expected bool, got int",
                 id="endpoint-draining"),
    # models
    pytest.param(("response_secret",), DELETE, "snapshot: 'response_secret' is missing", id="response-secret-missing"),
    pytest.param(("response_secret",), "short", "snapshot.response_secret: expected 64 hex digits",
                 id="response-secret"),
    pytest.param(("models", 1, "name"), 1, "snapshot.models[1].name: expected str, got int", id="model-name"),
    pytest.param(("models", 0, "engine"), "vllm2", "snapshot.models[0].engine: 'vllm2' is not one of", id="model-engine"),
    pytest.param(("models", 0, "engine"), ["vllm"], "snapshot.models[0].engine: expected str or null, got list",
                 id="model-engine-type"),
    pytest.param(("models", 0, "served_name"), 1, "snapshot.models[0].served_name: expected str or null",
                 id="model-served-name"),
    pytest.param(("models", 1, "routing"), "random", "snapshot.models[1].routing: 'random' is not one of",
                 id="model-routing"),
    pytest.param(("models", 0, "routing"), DELETE, "snapshot.models[0]: 'routing' is missing", id="model-routing-missing"),
    pytest.param(("models", 1, "on_demand"), 1, "snapshot.models[1].on_demand: expected bool, got int",
                 id="model-on-demand"),
    pytest.param(("models", 0, "fallbacks"), "b", "snapshot.models[0].fallbacks: expected list, got str",
                 id="model-fallbacks"),
    pytest.param(("models", 0, "fallbacks", 0), None, "snapshot.models[0].fallbacks[0]: expected str",
                 id="model-fallbacks-item"),
    pytest.param(("models", 0, "concurrency"), 0, "snapshot.models[0].concurrency: must be at least 1, got 0",
                 id="model-concurrency"),
    pytest.param(("models", 0, "concurrency"), 1.5, "snapshot.models[0].concurrency: expected int, got float",
                 id="model-concurrency-type"),
    # gateway settings
    pytest.param(("gateway", "max_waiting_per_key"), 0, "snapshot.gateway.max_waiting_per_key: must be at least 1",
                 id="gateway-max-waiting-per-key"),
    pytest.param(("gateway", "max_answer"), "64MiB", "snapshot.gateway.max_answer: expected int, got str",
                 id="gateway-max-answer"),
])
def test_r10_1_a_wrong_field_of_a_snapshot_is_named(path, value, names):
    document = copy.deepcopy(WIRE)
    set_at(document, path, value)
    with pytest.raises(FeedError) as refused:
        from_wire(document)
    assert names in str(refused.value)


@pytest.mark.parametrize("path,check", [
    pytest.param(("keys", 0, "models"), lambda s: s.keys[0].models is None, id="key-without-models-every-model"),
    pytest.param(("endpoints", "a", 1, "draining"), lambda s: s.endpoints["a"][1].draining is False,
                 id="endpoint-without-draining"),
    pytest.param(("endpoints", "a", 0, "key"), lambda s: s.endpoints["a"][0].api_key is None,
                 id="endpoint-without-key"),
    pytest.param(("models", 0, "fallbacks"), lambda s: s.models["a"].fallbacks == (), id="model-without-fallbacks"),
    pytest.param(("gateway", "max_waiting_per_key"), lambda s: s.gateway.max_waiting_per_key == 256,
                 id="gateway-without-max-waiting-per-key"),
    pytest.param(("gateway", "max_answer"), lambda s: s.gateway.max_answer == 64 * 1024**2,
                 id="gateway-without-max-answer"),
])
def test_r10_1_a_field_left_out_takes_its_default(path, check):
    document = copy.deepcopy(WIRE)
    set_at(document, path, DELETE)
    assert check(from_wire(document))


def test_r6_5d_homes_travel_as_hex_points_and_a_bad_one_is_named():
    """A ring point is 64 bits, beyond what every JSON reader holds as a number: 16 hex digits."""
    big = 2**64 - 1
    snapshot = dataclasses.replace(make_snapshot(), homes=MappingProxyType({"a": MappingProxyType({big: "a-r0", 3: "a-r1"})}))
    wire = to_wire(snapshot)
    assert wire["homes"] == {"a": [["ffffffffffffffff", "a-r0"], ["0000000000000003", "a-r1"]]}
    assert dict(read_back(snapshot).homes["a"]) == {big: "a-r0", 3: "a-r1"}
    change = feed.Change(epoch="e", version=8, homes=MappingProxyType({"a": {3: None, 4: "a-r0"}}))
    back = from_wire(json.loads(json.dumps(to_wire(change))))
    assert dict(back.homes["a"]) == {3: None, 4: "a-r0"}
    assert dict(snapshot.apply(back).homes["a"]) == {big: "a-r0", 4: "a-r0"}
    for bad, names in ((["3", "a-r0"], "snapshot.homes['a'][0][0]"), ([3, "a-r0"], "snapshot.homes['a'][0][0]"),
                       (["0000000000000003", None], "snapshot.homes['a'][0][1]")):
        wire["homes"] = {"a": [bad]}
        with pytest.raises(FeedError, match=re.escape(names)):
            from_wire(json.loads(json.dumps(wire)))
    report = feed.Report(router="r", seq=1, sent_at=0.0, homes={"a": {5: "a-r0"}, "b": {6: "x"}})
    document = json.loads(json.dumps(to_wire(report)))
    document["homes"]["b"] = [["zz", "x"]]
    taken, refused = feed.read_report(document)
    assert {m: dict(e) for m, e in taken.homes.items()} == {"a": {5: "a-r0"}}
    assert [r.where for r in refused] == ["report.homes['b']"]
