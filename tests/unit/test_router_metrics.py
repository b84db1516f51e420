"""Router metrics as Prometheus sees them (R-9.7)."""

from __future__ import annotations

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
