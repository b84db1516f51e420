"""Node crash under traffic (R-6.6, R-4.1, R-1.1): only streams caught on the node fail.

Two replicas on three single-GPU nodes, steady traffic. Every process of a node holding one
replica is killed (sshd, the helper, the engine) while a stream is in the middle of its answer
there. Non-streaming requests never fail: those sent to the dead engine are retried on the other
replica before anything reached the client. Streams that were mid-flight on the node end with
a clear error event; every other stream succeeds. A replacement serves on the third node within
the start timeout plus the detection bound.
"""

from __future__ import annotations

import time

import pytest

from llmgw.control.state import FAILURE_BACKOFF_BASE
from tests.integration.gateway import wait_for
from tests.scenarios.harness import (KEEPALIVE_COUNT, KEEPALIVE_INTERVAL, MODEL, NODES, PLAIN_TOKENS, SETTLING_WINDOW,
                                     START_TIMEOUT, STREAM_TOKENS, TICK, running_fleet)
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

# Losing the node is noticed within the keepalive bound (sooner here: the kernel closes the
# node's connections), its replicas are given up after the settling window, and the first
# replacement waits at most one failure backoff; a tick or two of slack for the passes.
DETECTION_BOUND = KEEPALIVE_INTERVAL * KEEPALIVE_COUNT + SETTLING_WINDOW
REPLACEMENT_BOUND = START_TIMEOUT + DETECTION_BOUND + FAILURE_BACKOFF_BASE + 2 * TICK
CLEAR_ERROR = "the engine stopped in the middle of the answer"


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path) as fleet:
        yield fleet


def _retries(fleet) -> float:
    text = fleet.admin.text("GET", "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmgw_router_retries_total") and f'model="{MODEL}"' in line)


def test_node_crash_fails_only_streams_caught_on_it(fleet):
    before = fleet.wait_serving(2, START_TIMEOUT * 3)
    victim_replica = before[0]
    victim = victim_replica["nodes"][0]
    survivor = next(r["nodes"][0] for r in before if r is not victim_replica)
    spare = next(n for n in NODES if n not in (victim, survivor))
    victim_engine = fleet.engine_of(victim_replica)
    assert victim_engine is not None

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=4,
                      plain_tokens=PLAIN_TOKENS, stream_tokens=STREAM_TOKENS)
    with traffic:
        # Crash the node while a stream there has sent some of its answer and has most of it to go.
        def caught_stream(t):
            _, in_flight = t.snapshot()
            return [o for o in in_flight if o.kind == "stream" and o.engine_pid == victim_engine.pid
                    and 1 <= o.tokens <= STREAM_TOKENS // 2]
        traffic.wait_for(lambda t: caught_stream(t) and len(t.succeeded("plain")) >= 10, 30,
                         f"a stream in the middle of its answer on {victim}")
        retries_before = _retries(fleet)
        _, in_flight = traffic.snapshot()
        mid_flight = [o for o in in_flight if o.kind == "stream" and o.engine_pid == victim_engine.pid]
        crashed_at = time.time()
        fleet.bed.crash(victim)
        crash_done = time.time()

        # The control plane gives the replica up within the detection bound: the node is lost
        # (here at once: the kernel closed its connections) and stays lost past the settling window.
        wait_for(lambda: all(r["id"] != victim_replica["id"] for r in fleet.serving()),
                 DETECTION_BOUND + 2 * TICK + 10, f"{victim_replica['id']} to be given up")
        given_up = time.time()

        def replaced():
            serving = fleet.serving()
            spare_replica = next((r for r in serving if r["nodes"][0] == spare), None)
            return spare_replica if spare_replica is not None and len(serving) == 2 else None

        replacement = wait_for(replaced, REPLACEMENT_BOUND + 30,
                               f"a replacement on {spare}\n{fleet.log_tail()}", interval=0.2)
        new_engine = fleet.engine_of(replacement)
        assert new_engine is not None
        first = traffic.wait_for(
            lambda t: sorted(o.ended for o in t.succeeded() if o.engine_pid == new_engine.pid),
            30, f"a request answered by the replacement on {spare}")[0]
        traffic.wait_for(lambda t: sum(1 for o in t.succeeded("stream") if o.engine_pid == new_engine.pid) >= 2,
                         30, "streams through the replacement")
    retries = _retries(fleet) - retries_before

    print()
    print(traffic.account(f"crash of {victim} (replica {victim_replica['id']}, engine pid {victim_engine.pid})"))
    print(f"   {len(mid_flight)} streams were mid-flight on {victim} at the crash; the router retried "
          f"{retries:.0f} requests on another endpoint; the replica was given up {given_up - crashed_at:.1f}s "
          f"after the crash (bound {DETECTION_BOUND + 2 * TICK:.0f}s), its replacement {replacement['id']} on "
          f"{spare} answered {first - crashed_at:.1f}s after the crash (bound {REPLACEMENT_BOUND:.0f}s)")

    outcomes = traffic.outcomes
    assert len(outcomes) >= 40
    # Non-streaming requests never fail: those that met the dead engine were retried elsewhere.
    assert traffic.failed("plain") == [], traffic.account("plain failures")
    assert retries >= 1, "no request was retried on another endpoint, so none met the dead engine"
    assert any(o.kind == "plain" and o.ok and o.started >= crashed_at and o.engine_pid != new_engine.pid
               for o in outcomes), "no request was served by the surviving replica after the crash"
    # Streams fail only where they were caught mid-flight on the crashed node, with a clear error.
    failed_streams = traffic.failed("stream")
    assert failed_streams, "the stream caught mid-answer on the crashed node did not fail"
    for outcome in failed_streams:
        assert outcome.engine_pid == victim_engine.pid and outcome.started < crash_done, \
            f"a stream that was not mid-flight on {victim} failed: {outcome}"
        assert outcome.reason == "stream error upstream_interrupted" and CLEAR_ERROR in outcome.detail, outcome
        assert outcome.tokens < STREAM_TOKENS
    assert all(o in failed_streams for o in mid_flight if not o.ok)
    assert any(not o.ok for o in mid_flight)
    assert all(o.ok for o in outcomes if o.kind == "stream" and o.started >= crash_done)
    # Given up within the detection bound (plus a pass), replaced within the start timeout plus that.
    assert given_up - crashed_at <= DETECTION_BOUND + 2 * TICK
    assert first - crashed_at <= REPLACEMENT_BOUND
    assert sorted(r["nodes"][0] for r in fleet.serving()) == sorted([survivor, spare])
