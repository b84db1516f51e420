"""Scaling on load under traffic (R-6.8a, R-6.8b): a burst takes a model from 1 to 3 replicas and,
after the quiet period, back to 1, without a failed request, each decision recorded with its reason.

One testbed node with three GPUs, a model of one GPU per replica with `min: 1, max: 3`, target
3 in flight per replica and short delays (up 3 s, down 8 s). Every request is a stream from the
official `openai` client that lasts a fixed time (25 tokens, `token_delay` apart in the engine
double), so the requests in flight are the clients' count: 10 of them want 4 replicas (3 at
max), one of them wants 1. The quiet period keeps that one stream going, so the replicas scaled
away leave while traffic still flows.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time

import openai
import pytest

from llmgw.admin.client import AdminClient
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.harness import engines_of
from tests.scenarios.operating import Ctl, write_inventory
from tests.scenarios.traffic import Traffic
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "node1"
MODEL = "chat"
TOKEN_DELAY = 0.1
STREAM_TOKENS = 25  # a stream lasts about 2.5 s
SCALING = {"min": 1, "max": 3, "target": 3, "up_delay": "3s", "down_delay": "8s"}
BURST_STREAMS = 10
TIMEOUT = 60.0


@pytest.fixture
def gateway(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec.gpu_node(NODE, 3, mem_gb=64, cache_mb=32, tmp_mb=32)])
    try:
        bed.set_engine_knobs(NODE, token_delay=TOKEN_DELAY, start_delay=0.5)
        bed.weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 64 << 10})
        profiles = {"h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "20s"}}
        models = [{"name": MODEL, "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.001,
                   "scaling": SCALING}]
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=models, profiles=profiles)
        process = GatewayProcess(inventory, tmp_path / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint})
        process.start()
        try:
            yield bed, process
        finally:
            process.stop()
    finally:
        bed.close()


def live(admin: AdminClient) -> list[dict]:
    return [r for r in admin.get("/api/replicas")["replicas"] if not r["retired"] and r["model"] == MODEL]


def model_doc(admin: AdminClient) -> dict:
    return next(m for m in admin.get("/api/models")["models"] if m["name"] == MODEL)


def test_a_burst_scales_1_to_3_and_the_quiet_back_to_1_without_a_failed_request(gateway):
    bed, process = gateway
    key = process.create_key("autoscale")
    admin = AdminClient.discover(state_dir=process.state_dir)
    url = process.url + "/v1"
    wait_for(lambda: len([r for r in live(admin) if r["serving"]]) == 1, TIMEOUT,
             f"one serving replica\n{process.log()[-3000:]}", interval=0.2)
    # The router reads new keys every two seconds: the burst starts once this one is known.
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    wait_for(lambda: client.models.list().data, TIMEOUT, "the router to know the key", interval=0.2)
    assert model_doc(admin)["desired"] == 1

    burst = Traffic(url, key, MODEL, plain=0, streams=BURST_STREAMS, stream_tokens=STREAM_TOKENS, max_seconds=120)
    quiet = Traffic(url, key, MODEL, plain=0, streams=1, stream_tokens=STREAM_TOKENS, max_seconds=120)
    counts: list[tuple[float, int, int]] = []  # (when, live replicas, serving ones), as seen through the API

    def sample() -> list[dict]:
        replicas = live(admin)
        counts.append((time.time(), len(replicas), sum(r["serving"] for r in replicas)))
        return replicas

    with burst:
        burst_at = time.time()
        wait_for(lambda: model_doc(admin)["desired"] == 3, TIMEOUT, f"the scale-up\n{process.log()[-3000:]}",
                 interval=0.2)
        up_at = time.time()
        three = wait_for(lambda: (lambda rs: rs if sum(r["serving"] for r in rs) == 3 else None)(sample()), TIMEOUT,
                         f"three serving replicas\n{process.log()[-3000:]}", interval=0.2)
        serving_at = time.time()
        pids = {e.pid for e in engines_of(bed, NODE)}
        assert len(pids) == 3
        # The new replicas carry traffic before the burst ends.
        burst.wait_for(lambda t: len({o.engine_pid for o in t.succeeded("stream") if o.started > serving_at}) == 3,
                       30, "streams through all three replicas")
    burst_over = time.time()
    with quiet:
        gone = wait_for(lambda: (lambda rs: rs if len(rs) == 1 and model_doc(admin)["desired"] == 1 else None)(
            sample()), TIMEOUT, f"the scale-down\n{process.log()[-3000:]}", interval=0.2)
        down_at = time.time()
        wait_for(lambda: len(engines_of(bed, NODE)) == 1, TIMEOUT, "the engines scaled away to stop", interval=0.2)
        quiet.wait_for(lambda t: len(t.succeeded("stream")) >= 2, 30, "streams after the scale-down")
    stopped_at = time.time()

    print()
    print(burst.account(f"burst: {BURST_STREAMS} streams of {STREAM_TOKENS} tokens"))
    print(quiet.account("quiet: 1 stream at a time"))
    print(f"   scale-up decided {up_at - burst_at:.1f}s after the burst began (up_delay {SCALING['up_delay']}), "
          f"3 serving {serving_at - burst_at:.1f}s after; scale-down decided and done "
          f"{down_at - burst_over:.1f}s after the burst ended (down_delay {SCALING['down_delay']}); "
          f"engines left: 1, {stopped_at - burst_over:.1f}s after; {len(counts)} samples")

    # Not one request failed, out of traffic that crossed both decisions.
    assert burst.failed() == [], burst.account("burst failures")
    assert quiet.failed() == [], quiet.account("quiet failures")
    assert len(burst.outcomes) >= BURST_STREAMS * 3 and len(quiet.outcomes) >= 2
    # Replicas seen: never more than max, three at the top, one at the end, and the survivor is
    # the replica the quiet stream was on or another, but one of the three.
    assert max(n for _, n, _ in counts) == 3 and counts[-1][1] == 1
    assert gone[0]["id"] in {r["id"] for r in three} and gone[0]["serving"]

    # Two decisions, in order, each with its reason: in ctl models, the audit table and the log.
    doc = json.loads(Ctl(process).ok("models", "--json").stdout)["models"][0]
    assert doc["scale_decisions"] == {"up": 1, "down": 1}
    assert re.fullmatch(r"scale 3→1: \d+\.\d in flight over \d+s, target 3", doc["last_scale"]["reason"])
    shown = Ctl(process).ok("models").stdout
    assert doc["last_scale"]["reason"] in shown
    with sqlite3.connect(f"file:{process.state_dir / 'state.db'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT action, target, detail FROM audit WHERE actor = 'autoscaler' ORDER BY ts").fetchall()
    decisions = [(action, target, json.loads(detail)) for action, target, detail in rows]
    assert [(a, t, d["from"], d["to"]) for a, t, d in decisions] == [
        ("model.scale.up", MODEL, 1, 3), ("model.scale.down", MODEL, 3, 1)]
    up_reason, down_reason = decisions[0][2]["reason"], decisions[1][2]["reason"]
    assert re.fullmatch(r"scale 1→3: \d+\.\d in flight over \d+s, target 3(, max 3)?", up_reason), up_reason
    assert down_reason == doc["last_scale"]["reason"]
    log = process.log()
    assert log.index(f"{MODEL}: {up_reason}") < log.index(f"{MODEL}: {down_reason}")
    print(f"   decisions: {up_reason!r}, then {down_reason!r}")
    # The replicas scaled away were retired with the decision's reason.
    assert sum("retiring replica" in line and down_reason in line for line in log.splitlines()) == 2
