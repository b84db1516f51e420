"""Eviction under traffic (R-6.8c): an on-demand request on a full node stops exactly the longest idle
replica, is answered by its fallback meanwhile, and then by its own replica.

One testbed node with two GPUs of the double and three on-demand models of one GPU each that never
stop on their own (`idle_timeout: null`), so the gateway's `evict_idle` (2 s here) is the idle
window. `old` and then `recent` are loaded and go idle; a request for `wanted` (fallback `recent`)
finds no free GPU. Every request is counted, from the official `openai` client.
"""

from __future__ import annotations

import sqlite3
import time

import openai
import pytest
import yaml

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.harness import engines_of
from tests.scenarios.operating import Ctl, write_inventory
from tests.scenarios.traffic import Traffic
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "node1"
EVICT_IDLE = 2.0  # seconds: gateway.evict_idle, the idle window of a model without idle_timeout
START_DELAY = 1.0  # the engine double's load time: the fallback serves for at least this long


def test_on_demand_request_on_a_full_node_evicts_the_longest_idle_replica(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec.gpu_node(NODE, 2, mem_gb=64, cache_mb=32, tmp_mb=32)])
    try:
        bed.set_engine_knobs(NODE, token_delay=0.02, start_delay=START_DELAY)
        for name in ("old", "recent", "wanted"):
            bed.weights.add_hf_repo(f"org/{name}", {"config.json": b"{}", "model.safetensors": 64 << 10})
        profiles = {"h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "20s"}}
        models = [{"name": name, "profile": "h100-1", "weights": f"hf:org/{name}", "disk_gb": 0.001,
                   "scaling": {"min": 0, "idle_timeout": None}, **extra}
                  for name, extra in (("old", {}), ("recent", {}), ("wanted", {"fallback": "recent"}))]
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=models, profiles=profiles)
        doc = yaml.safe_load(inventory.read_text())
        doc["gateway"]["evict_idle"] = f"{EVICT_IDLE:.0f}s"
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        gateway = GatewayProcess(inventory, tmp_path / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint})
        gateway.start()
        try:
            run(bed, gateway)
        finally:
            gateway.stop()
    finally:
        bed.close()


def run(bed, gateway: GatewayProcess) -> None:
    ctl = Ctl(gateway)
    key = gateway.create_key("scenario")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def key_known():  # the router reloads its keys every couple of seconds
        try:
            return client.models.list() is not None
        except openai.AuthenticationError:
            return None

    wait_for(key_known, 30, "the router to know the new key", interval=0.2)
    answers: dict[str, str] = {}
    began = time.time()
    for name in ("old", "recent"):  # each loads on its request and answers it
        answers[name] = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2).id
    loaded = time.time() - began

    def replicas():
        return {r["model"]: r for r in ctl.json("replicas")["replicas"] if not r["retired"]}

    before = replicas()
    assert sorted(before) == ["old", "recent"] and all(r["serving"] for r in before.values())
    old, recent = before["old"], before["recent"]
    engines = {e.port: e.pid for e in engines_of(bed, NODE)}
    recent_pid = engines[recent["shards"][0]["port"]]
    old_pid = engines[old["shards"][0]["port"]]
    models = {m["name"]: m for m in ctl.json("models")["models"]}
    assert all(models[n]["scaling"]["evictable"] for n in ("old", "recent", "wanted"))  # on demand: by default
    assert "on demand (max 1), evictable" in ctl.run("models").stdout

    # Both go idle past the window; then explain-placement already names the one change.
    wait_for(lambda: all((r["idle_seconds"] or 0) > EVICT_IDLE + 0.5 for r in replicas().values()), 30,
             "both replicas idle past the eviction window", interval=0.2)
    what_if = ctl.json("explain-placement", "wanted")["verdicts"][0]["what_if"]
    print(f"\nwhat-if before the request: {what_if}")
    assert what_if.startswith(f"fits if {old['id']} (idle ") and " is stopped, after a 1.0 MB download" in what_if
    assert "this node's last measured" in what_if  # the node's fetches of old and recent were measured

    traffic = Traffic(gateway.url + "/v1", key, "wanted", plain=1, streams=1, plain_tokens=4, stream_tokens=10,
                      fallbacks=("recent",))
    with traffic:
        asked = time.time()
        traffic.wait_for(lambda t: any(o.engine_pid not in (None, recent_pid) for o in t.succeeded("plain"))
                         and any(o.engine_pid not in (None, recent_pid) for o in t.succeeded("stream")), 60,
                         f"answers for wanted from its own replica\n{gateway.log()[-3000:]}")
    outcomes = traffic.outcomes

    # An evicted replica is listed live (retiring) until its engine has exited, then retired:
    # wait for that event rather than read whichever a moment shows.
    after = wait_for(lambda: (listed := ctl.json("replicas")["replicas"])
                     and any(r["retired"] for r in listed)
                     and not any(r["retiring"] for r in listed if not r["retired"]) and listed, 60,
                     f"the evicted replica to be stopped\n{gateway.log()[-3000:]}", interval=0.2)
    live = {r["model"]: r for r in after if not r["retired"]}
    retired = [r for r in after if r["retired"]]
    wanted = live["wanted"]
    wanted_pid = next(e.pid for e in engines_of(bed, NODE) if e.port == wanted["shards"][0]["port"])
    with sqlite3.connect(f"file:{gateway.state_dir / 'state.db'}?mode=ro", uri=True) as db:
        evictions = db.execute("SELECT ts, action, target, detail FROM audit WHERE actor = 'evictor'").fetchall()
    listed = ctl.run("replicas").stdout

    by_fallback = [o for o in outcomes if o.engine_pid == recent_pid]
    by_own = [o for o in outcomes if o.engine_pid == wanted_pid]
    print(traffic.account("on-demand request on a full node"))
    print(f"   loading old and recent on request: {loaded:.1f} s; request for wanted -> eviction "
          f"{evictions[0][0] - asked:.1f} s -> wanted placed {wanted['created_at'] - asked:.1f} s -> serving "
          f"{wanted['serving_since'] - asked:.1f} s; {len(by_fallback)} answered by the fallback, "
          f"{len(by_own)} by wanted's own replica")
    print(f"   evicted: {retired[0]['id']}: {retired[0]['reason']}")

    # Exactly the longest idle replica was evicted, for wanted, with its reason kept and shown.
    assert [r["id"] for r in retired] == [old["id"]]
    assert retired[0]["reason"].startswith("evicted for wanted (idle ") and retired[0]["state"] == "stopped"
    assert "evicted for wanted (idle " in listed and old["id"] in listed
    assert [(e[1], e[2]) for e in evictions] == [("evict", old["id"])]
    assert sorted(live) == ["recent", "wanted"] and live["recent"]["id"] == recent["id"]
    assert all(r["serving"] for r in live.values())
    # On the node: old's engine is gone, recent's is the same process, wanted's is new.
    pids = sorted(e.pid for e in engines_of(bed, NODE))
    assert old_pid not in pids and recent_pid in pids and len(pids) == 2
    # The order: eviction, then wanted placed, then serving; the fallback answered before that.
    assert evictions[0][0] <= wanted["created_at"] <= wanted["serving_since"]
    assert by_fallback and by_own
    assert min(o.started for o in by_fallback) < wanted["serving_since"]
    assert all(o.ended >= wanted["serving_since"] for o in by_own)
    # Every request was answered whole: none failed while the room was being made.
    assert traffic.failed() == [], traffic.account("failures")
    assert len(by_fallback) + len(by_own) == len(outcomes)
