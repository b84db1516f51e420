"""Reload without restart (R-10.5) on real SSH nodes: `llmgw ctl reload` and SIGHUP re-read the file.

Two testbed nodes, a real `llmgw serve` started with an inventory that names only node1. The
operator edits the file: node2 added (and the model's minimum raised, so a replica lands there),
then node1 removed while the official openai client sends traffic (its replica is drained to
node2 first, then node1 is forgotten), then broken files (refused with file:line:field, nothing
changes), then a label added and SIGHUP sent instead of `ctl reload`.
"""

from __future__ import annotations

import copy
import os
import signal
import sqlite3
import time

import pytest
import yaml

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.harness import engines_of
from tests.scenarios.operating import SCENARIO_GATEWAY, Ctl, helper_session_pids
from tests.scenarios.traffic import Traffic
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

MODEL = "chat"
START_TIMEOUT = 20.0
WAIT = 60.0


@pytest.fixture
def setup(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec.gpu_node("node1", 1, mem_gb=64, cache_mb=32, tmp_mb=32),
                           NodeSpec.gpu_node("node2", 2, mem_gb=64, cache_mb=32, tmp_mb=32)])
    for node in ("node1", "node2"):
        bed.set_engine_knobs(node, token_delay=0.05, start_delay=1.0)
    bed.weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 64 << 10})
    full = bed.inventory(models=[{"name": MODEL, "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.001,
                                  "scaling": {"min": 1}}],
                         profiles={"h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb",
                                              "start_timeout": f"{START_TIMEOUT:.0f}s"}})
    full = {"gateway": dict(SCENARIO_GATEWAY), **full}
    path = tmp_path / "inventory.yaml"
    gateway = GatewayProcess(path, tmp_path / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint})
    yield bed, full, path, gateway
    gateway.stop()


def write(path, full: dict, nodes: tuple[str, ...], *, min_replicas: int = 1, extra: dict | None = None) -> dict:
    doc = copy.deepcopy(full)
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] in nodes]
    for node in doc["nodes"]:
        node.update((extra or {}).get(node["name"], {}))
    doc["models"][0]["scaling"]["min"] = min_replicas
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


def nodes_of(ctl: Ctl) -> dict[str, dict]:
    return {n["name"]: n for n in ctl.json("nodes")["nodes"]}


def live(ctl: Ctl) -> list[dict]:
    return [r for r in ctl.json("replicas")["replicas"] if not r["retired"] and r["model"] == MODEL]


def serving_on(ctl: Ctl) -> list[str]:
    return sorted(r["shards"][0]["node"] for r in live(ctl) if r["serving"])


def settled_state(ctl: Ctl) -> tuple:
    """What a refused reload must leave as it was: nodes, their settings and admin, models, replicas."""
    nodes = tuple(sorted((n["name"], n["host"], tuple(sorted(n["labels"].items())), n["admin"]["state"])
                         for n in nodes_of(ctl).values()))
    models = tuple(sorted((m["name"], m["profile"], m["weights"], m["scaling"]["min"], m["scaling"]["max"])
                          for m in ctl.json("models")["models"]))
    replicas = tuple(sorted(r["id"] for r in live(ctl)))
    return nodes, models, replicas


def test_reload_adds_and_removes_nodes_under_traffic_and_refuses_broken_files(setup):
    bed, full, path, gateway = setup
    write(path, full, ("node1",))
    gateway.start()
    ctl = Ctl(gateway)
    key = gateway.create_key("reload")
    wait_for(lambda: serving_on(ctl) == ["node1"], WAIT, f"a replica on node1\n{gateway.log()[-3000:]}")
    assert list(nodes_of(ctl)) == ["node1"]

    # node2 added and a second replica wanted: the dry run shows it and changes nothing.
    write(path, full, ("node1", "node2"), min_replicas=2)
    dry = ctl.ok("reload", "--dry-run")
    print("\n" + dry.stdout)
    assert "dry run: nothing applied" in dry.stdout
    assert "node2" in dry.stdout and "added" in dry.stdout and "a link is made" in dry.stdout
    document = ctl.json("reload", "--dry-run")
    assert document["dry_run"] is True and document["applied"] is False and document["nodes_added"] == ["node2"]
    assert {(c["section"], c["name"], c["change"]) for c in document["changes"]} == {
        ("node", "node2", "added"), ("model", MODEL, "changed")}
    assert list(nodes_of(ctl)) == ["node1"] and len(live(ctl)) == 1

    applied = ctl.ok("reload")
    print(applied.stdout)
    assert "2 changes applied" in applied.stdout
    wait_for(lambda: nodes_of(ctl).get("node2", {}).get("state") == "ready", WAIT, "node2 connected")
    wait_for(lambda: serving_on(ctl) == ["node1", "node2"], WAIT,
             f"a replica placed on node2\n{gateway.log()[-3000:]}")
    original = next(r for r in live(ctl) if r["shards"][0]["node"] == "node1")

    # node1 removed from the file while traffic flows: drained to node2 first, then forgotten.
    write(path, full, ("node2",), min_replicas=2)
    traffic = Traffic(gateway.url + "/v1", key, MODEL, plain=2, streams=2, plain_tokens=4, stream_tokens=20)
    with traffic:
        traffic.wait_for(lambda t: len(t.succeeded()) >= 10, 30, "traffic before the removal")
        removed = ctl.ok("reload")
        print(removed.stdout)
        assert "node1" in removed.stdout and "removed" in removed.stdout and "drained" in removed.stdout
        # Drained first: listed as draining until its replica has a replacement (the log and the
        # audit below show the order even if the move is over before ctl looks).
        still = nodes_of(ctl).get("node1")
        assert still is None or still["admin"]["state"] == "draining"
        wait_for(lambda: "node1" not in nodes_of(ctl), WAIT, f"node1 forgotten\n{gateway.log()[-3000:]}",
                 interval=0.2)
        forgotten_at = time.time()
        wait_for(lambda: serving_on(ctl) == ["node2", "node2"], WAIT, "both replicas on node2")
        traffic.wait_for(lambda t: sum(1 for o in t.succeeded() if o.started > forgotten_at) >= 10, 30,
                         "traffic after node1 was forgotten")
    print(traffic.account("reload: node1 removed under traffic"))
    assert traffic.failed() == [], traffic.account("failures")
    assert len(traffic.outcomes) >= 20
    replicas = live(ctl)
    replacement = next(r for r in replicas if r.get("replaces") == original["id"])
    assert replacement["serving"] and replacement["shards"][0]["node"] == "node2"
    assert engines_of(bed, "node1") == []  # its engine was stopped before the node was forgotten
    log = gateway.log()
    assert log.index("node1: left the inventory") < log.index(f"retiring replica {original['id']}") \
        < log.index("node1: drained and forgotten")

    # Broken files: refused with file:line:field; nothing changes.
    before = settled_state(ctl)
    good = path.read_text()
    broken = {
        "yaml": good.replace("nodes:", "nodes: [", 1),
        "unknown profile": good.replace("profile: h100-1", "profile: h100-9"),
    }
    for what, text in broken.items():
        path.write_text(text)
        refused = ctl.run("reload")
        print(f"{what}: exit {refused.code}: {refused.stderr.strip()}")
        assert refused.code == 1, refused.stdout
        assert f"{path}:" in refused.stderr
        if what == "unknown profile":
            line = next(i for i, text_line in enumerate(text.splitlines(), 1) if "h100-9" in text_line)
            assert f"{path}:{line}: models[0].profile: unknown profile 'h100-9'" in refused.stderr
        else:
            assert "not valid YAML" in refused.stderr
        assert settled_state(ctl) == before
    # SIGHUP with a broken file: the problem logged at error, nothing changed.
    os.kill(gateway.proc.pid, signal.SIGHUP)
    refusal = f"ERROR llmgw.control.service: SIGHUP: reload refused, nothing changed: {path}:"
    wait_for(lambda: refusal in gateway.log(), 10, f"the refused SIGHUP reload logged\n{gateway.log()[-2000:]}")
    assert settled_state(ctl) == before
    path.write_text(good)

    # SIGHUP with a valid change applies it, and says so in the log: a label (the next placements)
    # and the node's own SSH user (the same account, so the link reconnects and finds its engines).
    sessions = helper_session_pids(bed, "node2")
    engines = sorted((e.pid, e.start_time) for e in engines_of(bed, "node2"))
    assert len(sessions) == 1 and len(engines) == 2
    write(path, full, ("node2",), min_replicas=2, extra={"node2": {"labels": {"zone": "blue"}, "user": "root"}})
    os.kill(gateway.proc.pid, signal.SIGHUP)
    wait_for(lambda: nodes_of(ctl)["node2"]["labels"] == {"zone": "blue"}, WAIT, "the label applied on SIGHUP")
    wait_for(lambda: "SIGHUP: reloaded" in gateway.log(), 10, "the SIGHUP reload logged")
    log = gateway.log()
    assert "reload: node node2 changed: user - -> root; labels {} -> {zone: blue}: user: its link reconnects" in log
    wait_for(lambda: (helper_session_pids(bed, "node2") not in ([], sessions)
                      and nodes_of(ctl)["node2"]["state"] == "ready"), WAIT, "node2 reconnected with a new session")
    assert sorted((e.pid, e.start_time) for e in engines_of(bed, "node2")) == engines  # its engines ran on
    assert serving_on(ctl) == ["node2", "node2"]  # and serve: nothing moved, nothing restarted
    print(f"SIGHUP: node2 helper session {sessions} -> {helper_session_pids(bed, 'node2')}; engines {engines} kept")

    # Each applied reload is audited (the refused ones changed nothing, the audit log included).
    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        audited = db.execute("SELECT actor, action, target FROM audit WHERE action IN "
                             "('reload', 'node.forget', 'draining') ORDER BY ts").fetchall()
    assert [row[1:] for row in audited] == [("reload", "inventory"), ("draining", "node1"), ("reload", "inventory"),
                                            ("node.forget", "node1"), ("reload", "inventory")]
    assert audited[-1][0] == "SIGHUP"
