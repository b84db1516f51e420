"""Router metrics for the admin listener's /metrics (R-9.7).

The request path only adds to plain integers in dicts; the Prometheus families are built when
/metrics is scraped. That keeps a request's accounting to a few dict operations instead of a
labelled child lookup and a lock per counter.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from llmgw.contracts.feed import RouterCounters
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
NO_MODEL = "-"  # requests refused before a catalog model was known: never the client's string
_STATUS_CLASS = {n: f"{n}xx" for n in range(1, 6)}


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0


class RouterMetrics:
    """Counters kept as plain numbers, exposed through a collector registered on `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 outstanding: Callable[[], dict[str, int]] | None = None,
                 upstreams: Callable[[], list] | None = None,
                 waiting: Callable[[], dict[str, int]] | None = None):
        self.requests: dict[tuple[str, str], int] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.ejections: dict[str, int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.replicas: dict[tuple[str, str], int] = {}  # (replica id, status class) -> attempts answered so
        self._outstanding = outstanding
        self._upstreams = upstreams
        self._waiting = waiting
        if registry is not None:
            registry.register(self)

    # -- the request path --------------------------------------------------------------------

    def request(self, model: str, status: int) -> None:
        label = (model, _STATUS_CLASS.get(status // 100, "other"))
        self.requests[label] = self.requests.get(label, 0) + 1

    def answered(self, replica_id: str, status: int) -> None:
        """An attempt on a replica ended with `status` (R-4.13: revisions compared by their replicas)."""
        label = (replica_id, _STATUS_CLASS.get(status // 100, "other"))
        self.replicas[label] = self.replicas.get(label, 0) + 1

    def upstream_latency(self, model: str, seconds: float) -> None:
        histogram = self.latency.get(model)
        if histogram is None:
            histogram = self.latency[model] = _Histogram()
        histogram.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        histogram.total += seconds

    def add_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            label = (model, "prompt")
            self.tokens[label] = self.tokens.get(label, 0) + prompt
        if completion:
            label = (model, "completion")
            self.tokens[label] = self.tokens.get(label, 0) + completion

    def retry(self, model: str) -> None:
        self.retries[model] = self.retries.get(model, 0) + 1

    def ejection(self, model: str) -> None:
        self.ejections[model] = self.ejections.get(model, 0) + 1

    # -- across processes --------------------------------------------------------------------

    def counters(self) -> RouterCounters:
        """The counters so far, for this router's reports (R-9.7)."""
        return RouterCounters(requests=dict(self.requests), tokens=dict(self.tokens), retries=dict(self.retries),
                              ejections=dict(self.ejections),
                              latency={m: (tuple(h.counts), h.total) for m, h in list(self.latency.items())},
                              replicas=dict(self.replicas))

    @classmethod
    def summed(cls, reported: list[RouterCounters]) -> RouterMetrics:
        """What several routers counted, added up (a histogram of another bucket layout is left out)."""
        total = cls()
        for counters in reported:
            for target, source in ((total.requests, counters.requests), (total.tokens, counters.tokens),
                                   (total.retries, counters.retries), (total.ejections, counters.ejections),
                                   (total.replicas, counters.replicas)):
                for label, value in source.items():
                    target[label] = target.get(label, 0) + value
            for model, (counts, seconds) in counters.latency.items():
                if len(counts) != len(LATENCY_BUCKETS) + 1:
                    continue
                histogram = total.latency.get(model)
                if histogram is None:
                    histogram = total.latency[model] = _Histogram()
                histogram.counts = [a + b for a, b in zip(histogram.counts, counts)]
                histogram.total += seconds
        return total

    # -- the scrape --------------------------------------------------------------------------

    def describe(self):
        return []  # families are built on collect; nothing to check at registration

    def collect(self):
        requests = CounterMetricFamily("llmgw_router_requests", "Client requests answered, by model and "
                                       "status class", labels=["model", "code"])
        for (model, code), value in list(self.requests.items()):
            requests.add_metric([model, code], value)
        yield requests

        tokens = CounterMetricFamily("llmgw_router_tokens", "Tokens reported by engines, by model and "
                                     "kind (prompt, completion)", labels=["model", "kind"])
        for (model, kind), value in list(self.tokens.items()):
            tokens.add_metric([model, kind], value)
        yield tokens

        retries = CounterMetricFamily("llmgw_router_retries", "Requests sent again to another endpoint "
                                      "before their first byte", labels=["model"])
        for model, value in list(self.retries.items()):
            retries.add_metric([model], value)
        yield retries

        ejections = CounterMetricFamily("llmgw_router_ejections", "Endpoints ejected for a cool-down after "
                                        "a failure", labels=["model"])
        for model, value in list(self.ejections.items()):
            ejections.add_metric([model], value)
        yield ejections

        latency = HistogramMetricFamily("llmgw_router_upstream_seconds", "Time from sending a request to "
                                        "an engine to its response headers", labels=["model"])
        for model, histogram in list(self.latency.items()):
            buckets, running = [], 0
            for bound, count in zip(LATENCY_BUCKETS, histogram.counts):
                running += count
                buckets.append((repr(bound), running))
            running += histogram.counts[-1]
            buckets.append(("+Inf", running))
            latency.add_metric([model], buckets, histogram.total)
        yield latency

        if self._outstanding is not None:
            outstanding = GaugeMetricFamily("llmgw_router_outstanding", "Requests in flight to engines, "
                                            "by model", labels=["model"])
            for model, value in self._outstanding().items():
                outstanding.add_metric([model], value)
            yield outstanding

        if self._waiting is not None:
            waiting = GaugeMetricFamily("llmgw_router_queued", "Requests waiting in the router for a place of "
                                        "a saturated model, by model", labels=["model"])
            for model, value in self._waiting().items():
                waiting.add_metric([model], value)
            yield waiting

        if self._upstreams is not None:
            # Engine-reported load: a replica whose engine did not say has no sample.
            families = {field: GaugeMetricFamily(name, text, labels=["model", "replica"])
                        for field, name, text in (
                            ("waiting", "llmgw_engine_waiting", "Requests waiting in the engine's queue"),
                            ("running", "llmgw_engine_running", "Requests the engine is running"),
                            ("kv_cache", "llmgw_engine_kv_cache_usage", "Fraction of the engine's KV cache in use"))}
            for up in self._upstreams():
                load = up.engine
                if load is None:
                    continue
                for field, family in families.items():
                    value = getattr(load, field)
                    if value is not None:
                        family.add_metric([up.model, up.replica_id], value)
            yield from families.values()


class ReportedRouterMetrics:
    """A collector of the router metrics that router processes reported (`reported()`: each
    router's latest counters), for a control plane whose routers run apart (R-9.7)."""

    def __init__(self, reported: Callable[[], list[RouterCounters]]):
        self._reported = reported

    def describe(self):
        return []

    def collect(self):
        yield from RouterMetrics.summed(self._reported()).collect()
