"""Drain under load (R-9.5): `llmgw ctl drain` moves a replica without failing a single request.

Two replicas of a model on three single-GPU nodes, steady non-streaming and streaming traffic.
The operator drains a node that holds a replica. The replica must end up on the third node, the
original engine must be stopped only once its replacement serves, and no request may fail.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.gateway import wait_for
from tests.scenarios.harness import MODEL, NODES, PLAIN_TOKENS, START_TIMEOUT, STREAM_TOKENS, Watcher, running_fleet
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path) as fleet:
        yield fleet


def test_drain_under_load_fails_no_request(fleet):
    before = fleet.wait_serving(2, START_TIMEOUT * 3)
    original = before[0]
    victim = original["nodes"][0]
    spare = next(n for n in NODES if n not in {r["nodes"][0] for r in before})
    original_engine = fleet.engine_of(original)
    assert original_engine is not None, f"no engine process for {original['id']} on {victim}"

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=3,
                      plain_tokens=PLAIN_TOKENS, stream_tokens=STREAM_TOKENS)
    with traffic, Watcher(fleet) as watcher:
        # Both replicas carry traffic before anything happens.
        traffic.wait_for(lambda t: {o.engine_pid for o in t.succeeded("stream")} >= {original_engine.pid}
                         and len(t.succeeded("plain")) >= 10, 30, "traffic through both replicas")
        drained_at = time.time()
        done = fleet.ctl("drain", victim)
        assert done.code == 0, done.stderr
        assert f"{victim}: draining" in done.stdout

        def moved():
            serving = fleet.serving()
            on_victim = fleet.engines([victim])[victim]
            nodes = sorted(r["nodes"][0] for r in serving)
            return serving if len(serving) == 2 and victim not in nodes and not on_victim else None

        after = wait_for(moved, START_TIMEOUT * 3, f"the replica on {victim} to move\n{fleet.log_tail()}",
                         interval=0.2)
        replacement = next(r for r in after if r["nodes"][0] == spare)
        new_engine = fleet.engine_of(replacement)
        assert new_engine is not None and new_engine.node == spare
        # Traffic goes on through the new replica for a while before the count is taken.
        traffic.wait_for(lambda t: sum(1 for o in t.succeeded("stream") if o.engine_pid == new_engine.pid) >= 2
                         and sum(1 for o in t.succeeded("plain") if o.engine_pid == new_engine.pid) >= 10,
                         30, f"traffic through the replacement on {spare}")

    print()
    print(traffic.account(f"drain {victim} under load: {original['id']} -> {replacement['id']} on {spare}"))
    outcomes = traffic.outcomes
    overlap = [o for o in outcomes if o.engine_pid == original_engine.pid and o.ended > replacement["serving_since"]]
    print(f"   engines: {victim} pid {original_engine.pid} stopped, {spare} pid {new_engine.pid} serving; "
          f"{len(overlap)} requests on the original finished after its replacement served; "
          f"{len(watcher.samples)} samples of replicas and engines")

    # Zero failed requests, out of a real load that crossed the move.
    assert traffic.failed() == [], traffic.account("failures")
    assert len(outcomes) >= 40
    assert any(o.engine_pid == original_engine.pid and o.started >= drained_at for o in outcomes), \
        "the drained replica took no traffic after the drain began: it was cut at once"
    # The replica ended up elsewhere: the spare node, and the drained one runs nothing.
    final = fleet.ctl_json("replicas")["replicas"]
    live = [r for r in final if not r["retired"]]
    assert sorted(r["nodes"][0] for r in live) == sorted(n for n in NODES if n != victim)
    assert all(r["serving"] for r in live)
    assert replacement["replaces"] == original["id"]
    assert fleet.engines([victim])[victim] == []

    # The original was stopped only after its replacement served. Each sample reads the engines
    # before the API, so "original gone" is never newer than the replica states beside it.
    seen_serving = None
    gone_at = None
    for sample in watcher.samples:
        alive = any(e.pid == original_engine.pid for e in sample.engines[victim])
        if any(r["id"] == replacement["id"] and r["serving"] for r in sample.replicas):
            seen_serving = seen_serving or sample.at
        if not alive and gone_at is None:
            gone_at = sample.at
            assert seen_serving is not None, (
                f"the original engine (pid {original_engine.pid}) was gone at {sample.at:.2f} before its "
                f"replacement {replacement['id']} was seen serving")
    assert gone_at is not None, "the watcher never saw the original engine stop"
    assert replacement["serving_since"] is not None and replacement["serving_since"] < gone_at
