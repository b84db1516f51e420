"""The engines' own traces (R-6.21): with gateway.tracing set, vLLM is launched exporting its spans to
the same collector over OTLP/HTTP; a gateway setting, so changing it rolls no model (R-8.6) and the
replicas launched after the change get it.
"""

from __future__ import annotations

import pytest

from llmgw.config import EngineConfig, GatewayConfig, TracingConfig
from llmgw.engines import BUILTIN_ENGINES, CustomEngine, ShardVars
from tests.unit.test_reconciler import build, serving, settle, until

COLLECTOR = "http://collector.example:4318"


def shard(rank: int = 0, nnodes: int = 1) -> ShardVars:
    return ShardVars(model="/w/chat", name="chat", host="0.0.0.0", port=20001, gpus_per_node=1, nnodes=nnodes,
                     node_rank=rank, leader_addr="10.0.0.1", leader_port=29500)


def traced(engine, v: ShardVars, args=(), env=None):
    return engine.traced(engine.render(v, list(args), dict(env or {}), "engine-key"), COLLECTOR)


def test_vllm_exports_to_the_collector_over_otlp_http():
    spec = traced(BUILTIN_ENGINES["vllm"], shard())
    assert spec.argv[-2:] == ["--otlp-traces-endpoint", COLLECTOR + "/v1/traces"]
    assert spec.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default is gRPC
    assert spec.env["OTEL_SERVICE_NAME"] == "vllm"
    assert spec.env["VLLM_API_KEY"] == "engine-key" and "engine-key" not in spec.argv


@pytest.mark.parametrize("args, env, flag, protocol", [
    pytest.param(["--otlp-traces-endpoint", "http://own:4318/v1/traces"], {}, "http://own:4318/v1/traces", "http/protobuf",
                 id="the-profiles-flag"),
    pytest.param(["--otlp-traces-endpoint=http://own:4317"], {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, None, "grpc",
                 id="the-profiles-flag-and-env"),
])
def test_a_profile_that_names_its_own_collector_keeps_it(args, env, flag, protocol):
    spec = traced(BUILTIN_ENGINES["vllm"], shard(), args, env)
    assert spec.argv.count("--otlp-traces-endpoint") == (1 if flag else 0)
    assert COLLECTOR + "/v1/traces" not in spec.argv
    assert spec.env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf") == protocol


def test_the_protocol_the_profile_sets_wins():
    spec = traced(BUILTIN_ENGINES["vllm"], shard(), env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "chat"})
    assert spec.argv[-1] == COLLECTOR + "/v1/traces"
    assert (spec.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"], spec.env["OTEL_SERVICE_NAME"]) == ("grpc", "chat")


@pytest.mark.parametrize("engine, v", [
    pytest.param(BUILTIN_ENGINES["vllm"], shard(rank=1, nnodes=2), id="vllm-headless-worker"),
    pytest.param(BUILTIN_ENGINES["llama-server"], shard(), id="llama-server"),
    pytest.param(BUILTIN_ENGINES["sglang"], shard(), id="sglang"),
    pytest.param(CustomEngine("mine", EngineConfig(command=["mine", "--port", "{port}"])), shard(), id="custom"),
])
def test_other_launches_are_left_as_they_are(engine, v):
    plain = engine.render(v, [], {}, "engine-key")
    assert traced(engine, v) == plain


async def test_a_changed_collector_rolls_nothing_and_later_launches_get_it():
    reconciler, fleet, _, _ = build([{"name": "m"}])
    await settle(reconciler, fleet)
    [first] = serving(reconciler, "m")

    def launches():
        return [c[2] for c in fleet.calls if c[1] == "launch"]

    assert "--otlp-traces-endpoint" not in launches()[0]["argv"]
    reconciler.configure(GatewayConfig(settling_window=0.3, tracing=TracingConfig(otlp_endpoint=COLLECTOR)))
    await settle(reconciler, fleet)
    assert serving(reconciler, "m") == [first] and len(launches()) == 1  # the running replica stays
    fleet.crash_engine(first.leader.node, first.leader.id, code=1)
    reconciler.memory.records.health.clear()  # no backoff to wait out: the relaunch is what is checked
    await until(lambda: serving(reconciler, "m") and serving(reconciler, "m") != [first], reconciler, fleet,
                what="the replacement")
    latest = launches()[-1]
    assert latest["argv"][-2:] == ["--otlp-traces-endpoint", COLLECTOR + "/v1/traces"]
    assert latest["env"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert {r.revision for r in serving(reconciler, "m")} == {first.revision}
