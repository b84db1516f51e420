"""Traces through a running gateway on the testbed (R-6.21).

`llmgw serve` with `gateway.tracing.otlp_endpoint` pointed at the test's OTLP/HTTP receiver, which
listens on the testbed network's host address so that both the router workers (on this host) and
the engines (in the nodes) reach it. The vLLM replicas are engine doubles, which export an
`llm_request` span as vLLM does when launched with `--otlp-traces-endpoint` (and only with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, as a collector of OTLP/HTTP needs).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.integration import real_engines as rt
from tests.otlp_receiver import ThreadedReceiver
from tests.testbed import NodeSpec

pytestmark = pytest.mark.testbed

CHAT = "chat"
# Spans leave each exporter in batches: a short delay keeps the test short (the default is 5 s).
EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("node1", mem_gb=16)])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def traces(bed):
    with ThreadedReceiver(host=bed.bridge_address) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def gateway(bed, traces, tmp_path_factory):
    profiles = {"vllm": {"engine": "vllm", "start_timeout": "60s"}}
    models = [{"name": CHAT, "profile": "vllm", "scaling": {"min": 1}}]
    gw = rt.start_gateway(bed, tmp_path_factory.mktemp("traces"), models=models, profiles=profiles,
                          gateway={"tracing": {"otlp_endpoint": traces.url}}, env=EXPORT_ENV)
    try:
        rt.wait_serving(gw, CHAT, 60)
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return rt.new_client(gateway, "tracer")[0]


def engine_argv(bed, node: str) -> list[str]:
    [pid] = bed.engine_pids(node)
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def test_vllm_is_launched_exporting_to_the_gateways_collector(bed, gateway, traces):
    argv = engine_argv(bed, "node1")
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == traces.url + "/v1/traces"


def test_a_request_is_one_trace_from_the_client_through_the_router_into_the_engine(client, traces):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                   extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    traces.wait_sync(lambda: {s.service for s in traces.trace(trace_id)} >= {"llmgw-router", "vllm"},
                     what="the router's and the engine's spans")
    spans = traces.trace(trace_id)
    [request] = [s for s in spans if s.kind == "SERVER" and s.service == "llmgw-router"]
    assert (request.name, request.parent_id) == ("POST /v1/chat/completions", parent)
    assert request.attributes["gen_ai.request.model"] == CHAT and request.attributes["llmgw.key"] == "tracer"
    [attempt] = [s for s in spans if s.kind == "CLIENT"]
    assert attempt.parent_id == request.span_id and attempt.name == f"POST {attempt.attributes['llmgw.replica']}"
    [engine] = [s for s in spans if s.service == "vllm"]
    assert (engine.name, engine.kind, engine.parent_id) == ("llm_request", "SERVER", attempt.span_id)


def test_without_a_traceparent_the_router_starts_the_trace_the_engine_joins(client, traces):
    before = {s.trace_id for s in traces.spans}
    client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    def joined():
        new = [s for s in traces.spans if s.trace_id not in before]
        return {s.service for s in new} >= {"llmgw-router", "vllm"} and new
    new = traces.wait_sync(joined, what="a new trace with the router's and the engine's spans")
    [request] = [s for s in new if s.kind == "SERVER" and s.service == "llmgw-router"]
    assert request.parent_id is None
    [engine] = [s for s in new if s.service == "vllm"]
    assert engine.trace_id == request.trace_id
    assert engine.parent_id in {s.span_id for s in new if s.kind == "CLIENT"}
