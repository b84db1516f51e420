"""Every field of every router feed type travels (R-10.1): a field added to a type but not to its
wire form fails here.

For each dataclass of llmgw.contracts.feed (and Endpoint, which the feed carries), each field in
turn is set to a value other than the base instance's, the instance is carried in a message
through to_wire -> JSON -> from_wire, and the field must come back as it was set. A type or field
without an entry below fails too, saying what to add.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from types import MappingProxyType

import pytest

from llmgw.contracts import feed
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import (Ack, Change, EngineLoad, GatewaySettings, KeyEntry, Lease, Limits, Refusal, Report,
                                  RequestRecord, RoutedModel, RouterCounters, Snapshot, Unapplied, UsageRow, from_wire,
                                  to_wire)

MODEL = RoutedModel("a", "vllm", None, "least-outstanding", False)
LIMITS = Limits(rpm=60)
KEY = KeyEntry("k1", "alice", "1" * 64, "sk-llmgw-1", None)
ENDPOINT = Endpoint("a-r0", "a", "http://10.0.0.1:8000", None)
GATEWAY = GatewaySettings(max_body=1000, request_timeout=60.0, on_demand_wait=10.0)
SNAPSHOT = Snapshot(epoch="e", version=3, models=MappingProxyType({"a": MODEL}),
                    endpoints=MappingProxyType({"a": (ENDPOINT,)}), keys=(KEY,), gateway=GATEWAY,
                    response_secret="0" * 64)
CHANGE = Change(epoch="e", version=4)
USAGE = UsageRow(3600, "k1", "a", 1, 2, 3)
LOAD = EngineLoad("vllm")
COUNTERS = RouterCounters()
UNAPPLIED = Unapplied(epoch="e", version=4, reason="change e/4 does not follow snapshot e/2", at=100.0)
REPORT = Report(router="r/h-0", seq=1, sent_at=10.0)
RECORD = RequestRecord(at=100.0, id="req-1", route="POST /v1/chat/completions", status=200, duration=0.5)
REFUSAL = Refusal("report.usage[0]", "report.usage[0][4]: must be at least 0, got -1")
ACK = Ack(router="r/h-0", seq=1)


def snapshot_with(**fields) -> Snapshot:
    return dataclasses.replace(SNAPSHOT, **fields)


# type -> (its base instance, how to put an instance in a message, how to take it out of the message read back)
CARRIERS = {
    RoutedModel: (MODEL, lambda m: snapshot_with(models={m.name: m}), lambda s: next(iter(s.models.values()))),
    Limits: (LIMITS, lambda lim: snapshot_with(keys=(dataclasses.replace(KEY, limits=lim),)), lambda s: s.keys[0].limits),
    KeyEntry: (KEY, lambda k: snapshot_with(keys=(k,)), lambda s: s.keys[0]),
    Lease: (Lease(0.5), lambda lease: snapshot_with(leases={"r": {"k1": lease}}), lambda s: s.leases["r"]["k1"]),
    Endpoint: (ENDPOINT, lambda e: snapshot_with(endpoints={e.model: (e,)}), lambda s: next(iter(s.endpoints.values()))[0]),
    GatewaySettings: (GATEWAY, lambda g: snapshot_with(gateway=g), lambda s: s.gateway),
    Snapshot: (SNAPSHOT, lambda s: s, lambda s: s),
    Change: (CHANGE, lambda c: c, lambda c: c),
    UsageRow: (USAGE, lambda u: dataclasses.replace(REPORT, usage=(u,)), lambda r: r.usage[0]),
    RequestRecord: (RECORD, lambda rec: dataclasses.replace(REPORT, requests=(rec,)), lambda r: r.requests[0]),
    EngineLoad: (LOAD, lambda load: dataclasses.replace(REPORT, engine_load={"a-r0": load}), lambda r: r.engine_load["a-r0"]),
    RouterCounters: (COUNTERS, lambda c: dataclasses.replace(REPORT, counters=c), lambda r: r.counters),
    Unapplied: (UNAPPLIED, lambda u: dataclasses.replace(REPORT, unapplied=u), lambda r: r.unapplied),
    Report: (REPORT, lambda r: r, lambda r: r),
    Refusal: (REFUSAL, lambda r: dataclasses.replace(ACK, refused=(r,)), lambda a: a.refused[0]),
    Ack: (ACK, lambda a: a, lambda a: a),
}

# (type, field) -> a value other than the base instance's, as from_wire gives it back
SAMPLES = {
    (RoutedModel, "name"): "b", (RoutedModel, "engine"): "sglang", (RoutedModel, "served_name"): "org/a",
    (RoutedModel, "routing"): "prefix", (RoutedModel, "on_demand"): True, (RoutedModel, "fallbacks"): ("b", "c"),
    (RoutedModel, "concurrency"): 8, (RoutedModel, "background_responses"): True,
    (RoutedModel, "responses_store"): True, (RoutedModel, "alias_of"): "b",
    (RoutedModel, "adapter_of"): "base-8b", (RoutedModel, "loadable"): True,
    (Limits, "rpm"): 120, (Limits, "tpm"): 5000, (Limits, "concurrency"): 4,
    (KeyEntry, "id"): "k2", (KeyEntry, "name"): "bob", (KeyEntry, "hash"): "2" * 64, (KeyEntry, "prefix"): "sk-llmgw-2",
    (KeyEntry, "models"): frozenset({"a", "b"}), (KeyEntry, "priority"): -2, (KeyEntry, "weight"): 3,
    (KeyEntry, "limits"): Limits(tpm=1000), (KeyEntry, "model_limits"): {"a": Limits(rpm=5)},
    (Lease, "share"): 0.25,
    (Endpoint, "replica_id"): "a-r9", (Endpoint, "model"): "b", (Endpoint, "url"): "http://10.0.0.2:8001",
    (Endpoint, "api_key"): "engine-key", (Endpoint, "draining"): True, (Endpoint, "revision"): "0123456789ab",
    (Endpoint, "canary"): 25, (Endpoint, "adapters"): ("support-bot", "legal-bot"),
    (Endpoint, "adapter_errors"): (("legal-bot", "LoRA rank 32 is greater than max_lora_rank 16"),), (Endpoint, "node"): "gpu03",
    (GatewaySettings, "max_body"): 2000, (GatewaySettings, "request_timeout"): 30.0,
    (GatewaySettings, "on_demand_wait"): 5.0, (GatewaySettings, "queue_wait"): 7.5,
    (GatewaySettings, "max_waiting_per_key"): 16, (GatewaySettings, "max_answer"): 1024,
    (GatewaySettings, "request_log"): False, (GatewaySettings, "request_log_sample"): 0.25,
    (GatewaySettings, "request_log_path"): "/var/log/llmgw/requests.jsonl",
    (GatewaySettings, "otlp_endpoint"): "http://collector:4318",
    (Snapshot, "epoch"): "e2", (Snapshot, "version"): 9, (Snapshot, "models"): {"b": RoutedModel("b", None, None, "prefix", True)},
    (Snapshot, "endpoints"): {"a": (ENDPOINT, Endpoint("a-r1", "a", "http://10.0.0.3:8000", "k"))},
    (Snapshot, "keys"): (KEY, KeyEntry("k2", "bob", "2" * 64, "sk-llmgw-2", frozenset({"a"}))),
    (Snapshot, "gateway"): GatewaySettings(max_body=5, request_timeout=1.0, on_demand_wait=2.0),
    (Snapshot, "leases"): {"r1": {"k1": Lease(0.5)}, "r2": {"k1": Lease(0.5)}}, (Snapshot, "abandoned"): ("a-r7",),
    (Snapshot, "homes"): {"a": {2**64 - 1: "a-r0"}}, (Snapshot, "response_secret"): "ab" * 32,
    (Change, "epoch"): "e2", (Change, "version"): 12, (Change, "models"): {"a": MODEL},
    (Change, "endpoints"): {"a": (ENDPOINT,), "b": None}, (Change, "keys"): (KEY,), (Change, "gateway"): GATEWAY,
    (Change, "abandon"): ("a-r0",), (Change, "leases"): {"r1": {"k1": Lease(1.0)}},
    (Change, "homes"): {"a": {5: "a-r0", 6: None}},
    (UsageRow, "bucket"): 7200, (UsageRow, "key_id"): "k2", (UsageRow, "model"): "b", (UsageRow, "requests"): 9,
    (UsageRow, "prompt_tokens"): 90, (UsageRow, "completion_tokens"): 900, (UsageRow, "estimated_tokens"): 12,
    (UsageRow, "unmetered"): 1, (UsageRow, "via"): "chat",
    (RequestRecord, "at"): 101.5, (RequestRecord, "id"): "client-id.7", (RequestRecord, "route"): "GET /v1/models",
    (RequestRecord, "status"): 503, (RequestRecord, "duration"): 1.25, (RequestRecord, "key"): "team-a",
    (RequestRecord, "model"): "chat-v2", (RequestRecord, "asked"): "chat", (RequestRecord, "replica"): "chat-v2-r0",
    (RequestRecord, "node"): "gpu03", (RequestRecord, "error"): "no_capacity", (RequestRecord, "attempts"): 3,
    (RequestRecord, "fallback"): "small", (RequestRecord, "queued"): 0.25, (RequestRecord, "ttfb"): 0.125,
    (RequestRecord, "prompt_tokens"): 12, (RequestRecord, "completion_tokens"): 34, (RequestRecord, "estimated"): True,
    (RequestRecord, "stream"): True, (RequestRecord, "client"): "10.0.0.9",
    (RequestRecord, "client_request_id"): "not usable!",
    (EngineLoad, "source"): "sglang", (EngineLoad, "waiting"): 3, (EngineLoad, "running"): 4,
    (EngineLoad, "kv_cache"): 0.5, (EngineLoad, "prefix_hits"): 10, (EngineLoad, "prefix_queries"): 20,
    (EngineLoad, "at"): 99.5, (EngineLoad, "slots"): 8, (EngineLoad, "preemptions"): 2,
    (EngineLoad, "adapters"): ("lora-a", "lora-b"),
    (RouterCounters, "requests"): {("a", "2xx"): 3}, (RouterCounters, "tokens"): {("a", "prompt"): 30},
    (RouterCounters, "retries"): {"a": 1}, (RouterCounters, "ejections"): {"a": 2},
    (RouterCounters, "latency"): {"a": ((1, 0, 2), 1.5)}, (RouterCounters, "replicas"): {("a-r1", "5xx"): 2},
    (Unapplied, "epoch"): "e9", (Unapplied, "version"): 40, (Unapplied, "reason"): "ValueError in the router (see its log)",
    (Unapplied, "at"): 200.5,
    (Report, "router"): "r/h-1", (Report, "seq"): 5, (Report, "sent_at"): 20.5, (Report, "usage"): (USAGE,),
    (Report, "key_use"): {"k1": 5.0}, (Report, "last_used"): {"a-r0": 6.0}, (Report, "inflight"): {"a-r0": 2},
    (Report, "engine_load"): {"a-r0": EngineLoad("vllm", waiting=1)}, (Report, "demand"): ("a",),
    (Report, "snapshot"): ("e", 3), (Report, "counters"): RouterCounters(retries={"a": 1}),
    (Report, "asked"): {"k1": 4}, (Report, "homes"): {"a": {3: "a-r0"}}, (Report, "unapplied"): UNAPPLIED,
    (Report, "requests"): (RECORD,), (Report, "adapter_use"): {"a-r0": {"lora-a": (2, 30.5)}},
    (Refusal, "where"): "report.inflight['a-r0']", (Refusal, "message"): "report.inflight['a-r0']: expected int",
    (Ack, "router"): "r/h-1", (Ack, "seq"): 7, (Ack, "refused"): (REFUSAL,),
}


def test_every_dataclass_of_the_feed_is_carried_here():
    types = {cls for _, cls in inspect.getmembers(feed, inspect.isclass)
             if dataclasses.is_dataclass(cls) and cls.__module__ == feed.__name__}
    assert types | {Endpoint} == set(CARRIERS), "give each feed type a carrier (and samples) above"


@pytest.mark.parametrize("cls", list(CARRIERS), ids=lambda cls: cls.__name__)
def test_every_field_has_a_sample(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    sampled = {name for kind, name in SAMPLES if kind is cls}
    assert sampled == fields, f"{cls.__name__}: add a sample for {sorted(fields - sampled)} (and the field to its wire form)"


@pytest.mark.parametrize("cls,name", list(SAMPLES), ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_r10_1_each_field_survives_the_wire(cls, name):
    base, carry, take = CARRIERS[cls]
    value = SAMPLES[(cls, name)]
    assert getattr(base, name) != value, "a sample must differ from the base, or a field lost on the way passes"
    sent = carry(dataclasses.replace(base, **{name: value}))
    back = take(from_wire(json.loads(json.dumps(to_wire(sent)))))
    assert type(back) is cls
    assert getattr(back, name) == value
