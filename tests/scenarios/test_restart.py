"""Control-plane restart under traffic (R-4.5, R-4.4, R-9.1): engines run on, clients retry through.

Two replicas on three single-GPU nodes, steady traffic from clients that retry a failed request.
`llmgw serve` gets SIGTERM and is started again with the same state directory. No engine may be
restarted (same pids, same start times, same ports); the same replicas serve after the restart;
requests fail only between the SIGTERM and the moment the new process answers, and every client
that retried through that window got its answer.
"""

from __future__ import annotations

import time

import pytest

from tests.scenarios.harness import MODEL, PLAIN_TOKENS, START_TIMEOUT, STREAM_TOKENS, running_fleet
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

RETRY_FOR = 60.0  # how long a client keeps retrying one request


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path) as fleet:
        yield fleet


def test_restart_under_traffic_restarts_no_engine(fleet):
    before = fleet.wait_serving(2, START_TIMEOUT * 3)
    engines_before = fleet.engines()
    assert sum(len(e) for e in engines_before.values()) == 2

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=2, plain_tokens=PLAIN_TOKENS,
                      stream_tokens=STREAM_TOKENS, retry_for=RETRY_FOR)
    with traffic:
        pids = {e.pid for engines in engines_before.values() for e in engines}
        traffic.wait_for(lambda t: {o.engine_pid for o in t.succeeded("stream")} >= pids
                         and len(t.succeeded("plain")) >= 10, 30, "traffic through both replicas")
        # SIGTERM while streams are in the middle of their answers.
        traffic.wait_for(lambda t: [o for o in t.snapshot()[1]
                                    if o.kind == "stream" and 1 <= o.tokens <= STREAM_TOKENS // 2],
                         30, "a stream in the middle of its answer")
        _, in_flight = traffic.snapshot()
        streaming_at_term = [o for o in in_flight if o.kind == "stream" and o.first_token is not None]
        term_at = time.time()
        assert fleet.gateway.stop() == 0, fleet.log_tail()
        exited_at = time.time()
        fleet.start()
        ready_at = time.time()
        traffic.wait_for(lambda t: sum(1 for o in t.succeeded("stream") if o.started > ready_at) >= 4
                         and sum(1 for o in t.succeeded("plain") if o.started > ready_at) >= 20,
                         30, "traffic after the restart")
    after = fleet.serving()
    engines_after = fleet.engines()

    outcomes = traffic.outcomes
    retried = [o for o in outcomes if o.attempts]
    failed_tries = [(at, reason) for o in outcomes for at, reason in o.attempts]
    print()
    print(traffic.account("SIGTERM and restart of llmgw serve under traffic"))
    print(f"   restart window {ready_at - term_at:.1f}s (old process exited after {exited_at - term_at:.1f}s); "
          f"streams mid-answer at the SIGTERM: {len(streaming_at_term)}, "
          f"{sum(1 for o in streaming_at_term if not o.attempts)} of them finished without a retry; "
          f"engines before and after: {_pids(engines_before)} / {_pids(engines_after)}")

    # No engine was restarted: same processes (pid and start time), same ports, same replicas.
    assert engines_after == engines_before
    assert sorted(r["id"] for r in after) == sorted(r["id"] for r in before)
    # Every request got its answer, and only tries inside the restart window failed.
    assert len(outcomes) >= 40
    assert traffic.failed() == [], traffic.account("failures")
    assert retried, "no client had to retry: the restart did not happen under traffic"
    outside = [(round(at - term_at, 2), reason) for at, reason in failed_tries if not term_at <= at <= ready_at]
    assert outside == [], f"tries failed outside the restart window [0, {ready_at - term_at:.2f}]: {outside}"
    # Requests in flight at the SIGTERM were let finish by the old process.
    assert streaming_at_term and all(not o.attempts for o in streaming_at_term)


def _pids(engines) -> str:
    return ", ".join(f"{node} {[e.pid for e in found]}" for node, found in engines.items() if found)
