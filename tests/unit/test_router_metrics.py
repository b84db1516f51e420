"""Router metrics as Prometheus sees them (R-9.7)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.router.metrics import RouterMetrics


def test_r9_7_counters_histogram_and_gauge():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, lambda: {"m": 2})
    metrics.request("m", 200)
    metrics.request("m", 201)
    metrics.request("-", 401)
    metrics.add_tokens("m", 3, 5)
    metrics.retry("m")
    metrics.ejection("m")
    metrics.upstream_latency("m", 0.003)
    metrics.upstream_latency("m", 0.2)
    metrics.upstream_latency("m", 1000.0)
    value = registry.get_sample_value
    assert value("llmgw_router_requests_total", {"model": "m", "code": "2xx"}) == 2
    assert value("llmgw_router_requests_total", {"model": "-", "code": "4xx"}) == 1
    assert value("llmgw_router_tokens_total", {"model": "m", "kind": "completion"}) == 5
    assert value("llmgw_router_retries_total", {"model": "m"}) == 1
    assert value("llmgw_router_ejections_total", {"model": "m"}) == 1
    assert value("llmgw_router_upstream_seconds_bucket", {"model": "m", "le": "0.005"}) == 1
    assert value("llmgw_router_upstream_seconds_bucket", {"model": "m", "le": "0.25"}) == 2
    assert value("llmgw_router_upstream_seconds_bucket", {"model": "m", "le": "+Inf"}) == 3
    assert value("llmgw_router_upstream_seconds_count", {"model": "m"}) == 3
    assert value("llmgw_router_outstanding", {"model": "m"}) == 2
    assert b"llmgw_router_requests_total" in generate_latest(registry)


def test_r9_7_counters_cross_the_feed_and_add_up_over_router_processes():
    import json

    from llmgw.contracts.feed import Report, from_wire, to_wire
    from llmgw.router.metrics import ReportedRouterMetrics

    one, two = RouterMetrics(), RouterMetrics()
    one.request("chat", 200)
    one.add_tokens("chat", 3, 5)
    one.upstream_latency("chat", 0.02)
    one.retry("chat")
    two.request("chat", 200)
    two.request("chat", 502)
    sent = Report(router="r1", seq=1, sent_at=0.0, counters=one.counters())
    reported = [from_wire(json.loads(json.dumps(to_wire(sent)))).counters, two.counters()]
    total = RouterMetrics.summed(reported)
    assert total.requests == {("chat", "2xx"): 2, ("chat", "5xx"): 1}
    assert total.tokens == {("chat", "prompt"): 3, ("chat", "completion"): 5}
    assert total.retries == {"chat": 1} and sum(total.latency["chat"].counts) == 1
    registry = CollectorRegistry()
    registry.register(ReportedRouterMetrics(lambda: reported))
    text = generate_latest(registry).decode()
    assert 'llmgw_router_requests_total{code="2xx",model="chat"} 2.0' in text


def test_r9_7_reported_counters_of_the_wrong_type_are_refused_naming_the_field():
    from llmgw.contracts.feed import FeedError, Report, from_wire, to_wire

    metrics = RouterMetrics()
    metrics.request("chat", 200)
    wire = to_wire(Report(router="r1", seq=1, sent_at=0.0, counters=metrics.counters()))
    wire["counters"]["requests"] = [["chat", "2xx", "two"]]
    with pytest.raises(FeedError, match=r"report\.counters\.requests\[0\]\[2\]"):
        from_wire(wire)
