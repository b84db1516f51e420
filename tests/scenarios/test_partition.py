"""Partition and return (R-4.1, R-4.4, R-4.5, R-6.6): no duplicate replica survives the node's return.

Two replicas on three single-GPU nodes, steady traffic. The link of a node holding a replica is
cut for longer than the settling window: its replica is given up and replaced on the third node,
while its engine, out of reach, keeps running. When the link comes back, that engine must be
stopped: once settled, exactly the intended number of engines run on the nodes and only they
answer requests. Requests waiting on the cut-off engine are retried on the other replica once
its replica is given up; a stream caught mid-answer there ends with an error rather than hanging.
The same holds when `llmgw serve` is restarted while the node is cut off: the new process must
still stop the engine it finds there on the return (clients retry through the restart).
"""

from __future__ import annotations

import time

import pytest

from tests.integration.gateway import wait_for
from tests.scenarios.harness import MODEL, NODES, PLAIN_TOKENS, SETTLING_WINDOW, START_TIMEOUT, STREAM_TOKENS, TICK, \
    running_fleet
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

REPLICAS = 2


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path, replicas=REPLICAS) as fleet:
        yield fleet


def _settled(fleet, victim):
    serving = fleet.serving()
    live = fleet.replicas()
    engines = fleet.engines()
    if len(serving) == REPLICAS and len(live) == REPLICAS and not engines[victim] \
            and sum(len(e) for e in engines.values()) == REPLICAS:
        return serving, engines
    return None


@pytest.mark.parametrize("restart", [False, True], ids=["return", "restart-while-cut"])
def test_partition_and_return_leaves_no_duplicate(fleet, restart):
    before = fleet.wait_serving(REPLICAS, START_TIMEOUT * 3)
    cut_replica = before[0]
    victim = cut_replica["nodes"][0]
    spare = next(n for n in NODES if n not in {r["nodes"][0] for r in before})
    cut_engine = fleet.engine_of(cut_replica)
    assert cut_engine is not None

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=2, plain_tokens=PLAIN_TOKENS,
                      stream_tokens=STREAM_TOKENS, client_timeout=90, retry_for=60 if restart else None)
    with traffic:
        traffic.wait_for(lambda t: {o.engine_pid for o in t.succeeded()} >= {cut_engine.pid}
                         and len(t.succeeded("plain")) >= 10, 30, "traffic through both replicas")
        cut_at = time.time()
        fleet.bed.cut(victim)

        def replaced():
            serving = fleet.serving()
            return next((r for r in serving if r["nodes"][0] == spare), None) if len(serving) == REPLICAS else None

        replacement = wait_for(replaced, START_TIMEOUT * 3, f"a replacement on {spare}\n{fleet.log_tail()}",
                               interval=0.2)
        # While cut off, the node's engine runs on: one more engine than wanted, out of reach.
        during = fleet.engines()
        assert cut_engine in during[victim]
        assert sum(len(e) for e in during.values()) == REPLICAS + 1
        if restart:
            term_at = time.time()
            assert fleet.gateway.stop() == 0, fleet.log_tail()
            exited_at = time.time()
            fleet.start()
            ready_at = time.time()
        assert time.time() - cut_at > SETTLING_WINDOW
        restored_at = time.time()
        fleet.bed.restore(victim)

        serving, engines = wait_for(lambda: _settled(fleet, victim), 60,
                                    f"the engine left on {victim} to be stopped\n{fleet.log_tail()}", interval=0.2)
        settled_at = time.time()
        # It stays that way for a few reconcile passes: nothing comes back, nothing is started twice.
        holds_until = time.monotonic() + 3 * TICK
        while time.monotonic() < holds_until:
            assert _settled(fleet, victim), f"the fleet changed again after it settled:\n{fleet.log_tail()}"
            time.sleep(TICK / 4)
        intended = {e.pid for node_engines in engines.values() for e in node_engines}
        traffic.wait_for(lambda t: {o.engine_pid for o in t.succeeded("stream") if o.started > settled_at} == intended
                         and sum(1 for o in t.succeeded("plain") if o.started > settled_at) >= 20,
                         30, "traffic through both replicas after the return")

    print()
    title = f"partition of {victim} (replica {cut_replica['id']}, engine pid {cut_engine.pid})"
    print(traffic.account(title + (", llmgw serve restarted while it was cut off" if restart else "")))
    print(f"   cut for {restored_at - cut_at:.1f}s (settling window {SETTLING_WINDOW:.0f}s); replaced by "
          f"{replacement['id']} on {spare}; settled {settled_at - restored_at:.1f}s after the return with "
          f"{len(intended)} engines (pids {sorted(intended)}) on {sorted(n for n, e in engines.items() if e)}")

    outcomes = traffic.outcomes
    if restart:
        print(f"   restart window {ready_at - term_at:.1f}s (the old process exited after {exited_at - term_at:.1f}s)")
    caught = [o for o in outcomes if o.engine_pid == cut_engine.pid and o.started < restored_at < o.ended]
    if caught:
        print(f"   {len(caught)} requests caught on the engine cut off waited for the return "
              f"(longest {max(o.ended - o.started for o in caught):.1f}s), "
              f"{sum(1 for o in caught if o.ok)} of them then succeeded")
    assert len(outcomes) >= 40
    # No duplicate survived: the engine cut off is gone, exactly the intended replicas remain.
    assert sorted(r["nodes"][0] for r in serving) == sorted(n for n in NODES if n != victim)
    assert not engines[victim] and cut_engine.pid not in intended
    # Nothing served beyond the intended count once settled: only the intended engines answered.
    after = [o for o in outcomes if o.started > settled_at]
    assert after and all(o.ok for o in after), traffic.account("after the return")
    assert {o.engine_pid for o in after} == intended
    if restart:
        # Clients retried through the restart; only tries inside the restart window failed.
        assert traffic.failed() == [], traffic.account("failures")
        # A stream caught mid-answer on the engine that was cut off ends with an error once the
        # control plane gives its replica up (waiting up to request_timeout would help no one).
        outside = [(round(at - term_at, 2), reason) for o in outcomes for at, reason in o.attempts
                   if not term_at <= at <= ready_at
                   and not (at >= cut_at and "upstream_interrupted" in reason)]
        assert outside == [], f"tries failed outside the restart window [0, {ready_at - term_at:.2f}]: {outside}"
    # Before the return, a request failed only if it was caught on the engine that was cut off.
    for outcome in traffic.failed():
        assert outcome.started < restored_at and outcome.engine_pid in (None, cut_engine.pid), outcome
        assert cut_replica["id"] in (outcome.detail or "") or outcome.engine_pid == cut_engine.pid, outcome
