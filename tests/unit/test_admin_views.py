"""The admin listings computed from gateway state (R-2.2, R-2.3, R-2.5, R-2.7, R-5.4, R-7.1, R-7.2, R-8.8)."""

from __future__ import annotations

import time

import pytest

from llmgw.admin import text
from llmgw.admin.text import progress_line
from llmgw.admin.views import explanation_json, listings
from llmgw.contracts.states import ReplicaPhase
from llmgw.control.state import FAILED, STOPPED, Replica, Shard
from tests.unit.admin_gateway import GB, make_gateway, roll_chat_onto_adapters


@pytest.fixture
def gateway(tmp_path):
    gw = make_gateway(tmp_path)
    yield gw
    gw.store.close()


def by_name(entries, key="name"):
    return {e[key]: e for e in entries}


@pytest.mark.parametrize(("done", "total", "line"), [
    pytest.param(1_200_000_000, 4_000_000_000, "downloading 1.2 GB of 4.0 GB (30%)", id="with-length"),
    pytest.param(1_200_000_000, None, "downloading 1.2 GB so far", id="no-length-no-percentage"),
    pytest.param(0, 0, "downloading 0 B so far", id="zero-length-is-no-length"),
    pytest.param(5_000, 4_000, "downloading 5.0 KB of 4.0 KB (100%)", id="capped"),
])
def test_progress_line(done, total, line):
    assert progress_line(done, total) == line


def test_unhealthy_gpu_is_neither_used_nor_free(gateway):
    gpu1 = by_name(listings(gateway.admin_dependencies()).nodes())["gpu1"]["gpus"]
    assert (gpu1["total"], gpu1["used"], gpu1["free"], gpu1["unhealthy"]) == (4, 1, 2, 1)
    assert text.unhealthy_reasons(gpu1) == ["GPU 3: 2 uncorrected ECC errors"]
    device = gpu1["devices"][0]
    assert (device["state"], device["replica"]) == ("used", "chat-1")


def test_unknown_is_null_not_zero(gateway):
    nodes = by_name(listings(gateway.admin_dependencies()).nodes())
    assert nodes["gpu2"]["memory_bytes"] is None
    ghost = nodes["ghost"]
    assert (ghost["gpus"], ghost["memory_bytes"], ghost["disk"], ghost["cpus"]) == (None, None, None, None)
    assert text.gpu_counts(ghost["gpus"]) == ("-", "-", "-")
    assert ghost["state"] == "unreachable" and not ghost["stale"]
    assert "unreachable since" in text.node_state(ghost, time.time())


def test_stale_facts_of_an_unreachable_node_are_kept_and_marked(gateway):
    gateway.fleet.links["gpu3"].cut()
    gateway.publish()
    gpu3 = by_name(listings(gateway.admin_dependencies()).nodes())["gpu3"]
    assert gpu3["stale"] and gpu3["gpus"]["total"] == 4
    assert "stale facts from" in text.node_state(gpu3, time.time())


def test_shared_filers_are_apart_and_never_in_a_nodes_own_total(gateway):
    gpu2 = by_name(listings(gateway.admin_dependencies()).nodes())["gpu2"]["disk"]
    assert [fs["mount_point"] for fs in gpu2["shared"]] == ["/mnt/filer"]
    assert gpu2["local_free_bytes"] == 50 * GB and gpu2["local_total_bytes"] == 200 * GB
    storage = listings(gateway.admin_dependencies()).storage()
    # Mounted by two nodes (with different device numbers): one filer.
    assert [(f["mount_point"], f["free_bytes"], f["nodes"]) for f in storage["shared_filers"]] == [
        ("/mnt/filer", 400 * GB, ["gpu2", "gpu3"])]


def test_status_agrees_with_the_other_listings(gateway):
    snapshot = listings(gateway.admin_dependencies())
    status, nodes, replicas = snapshot.status(), snapshot.nodes(), snapshot.replicas()
    capacity = status["capacity"][0]
    known = [n["gpus"] for n in nodes if n["gpus"]]
    for key in ("total", "used", "free", "unhealthy"):
        assert capacity[key] == sum(g[key] for g in known)
    assert capacity["used"] + capacity["free"] + capacity["unhealthy"] == capacity["total"]
    assert status["gpus_unknown"] == ["ghost"]
    assert status["replicas"]["total"] == len(replicas)
    assert status["nodes"]["by_state"] == {"ready": 3, "unreachable": 1}
    # gpu1 has an unhealthy GPU and a replica: not whole. gpu2 is. gpu3 runs a replica.
    assert status["free_whole_nodes"] == {"ib-a": 1, "ib-b": 0}
    assert status["unplaceable"] == [{"model": "big", "reason": gateway.reconciler.memory.placing.unplaceable["big"].summary}]
    assert "fabric ib-a has 1 free whole node, needs 2" in status["unplaceable"][0]["reason"]


def test_unasked_for_longest_first_and_unknown_last_use_apart(gateway):
    idle = listings(gateway.admin_dependencies()).status()["idle"]
    assert [i["replica"] for i in idle] == ["chat-0", "chat-1"]
    assert idle[0]["idle_seconds"] == pytest.approx(300, abs=5)
    assert idle[1]["last_used"] is None and text.idle_for(idle[1]) == "-"


def test_fabric_holdings_count_a_shared_filer_once(gateway):
    fabrics = by_name(listings(gateway.admin_dependencies()).status()["fabrics"], "fabric")
    assert [(m["model"], m["on_shared"]) for m in fabrics["ib-a"]["models"]] == [("shared", True)]
    assert [f["mount_point"] for f in fabrics["ib-b"]["shared_filers"]] == ["/mnt/filer"]
    assert fabrics["ib-a"]["local_free_bytes"] == 170 * GB
    assert fabrics["ib-b"]["local_free_bytes"] is None  # gpu3 has only the filer, ghost never reported


def test_progress_rides_on_the_shard(gateway):
    fetched = by_name(listings(gateway.admin_dependencies()).replicas(), "id")["fetched-1"]
    assert fetched["shards"][0]["progress"] == {"bytes": 1_200_000_000, "total": 4_000_000_000,
                                                "line": "downloading 1.2 GB of 4.0 GB (30%)"}
    models = by_name(listings(gateway.admin_dependencies()).models())
    assert models["fetched"]["state"] == "fetching"
    assert models["big"]["state"] == "cannot be placed"
    assert models["shared"]["state"] == "idle (on demand)"


def test_a_failed_replica_stays_listed_with_its_log_tail(gateway):
    shard = Shard("bad-1-0", "bad-1", 0, "gpu3", (2,), state=FAILED, reason="engine exited with status 1",
                  log_tail=["loading", "CUDA out of memory"])
    gateway.reconciler.memory.records.retired.append((time.time(), Replica("bad-1", "chat", "k", [shard], phase=ReplicaPhase.RETIRING)))
    gateway.publish()
    listed = by_name(listings(gateway.admin_dependencies()).replicas(), "id")["bad-1"]
    assert listed["retired"] and listed["state"] == "failed"
    assert listed["shards"][0]["log_tail"] == ["loading", "CUDA out of memory"]
    assert listings(gateway.admin_dependencies()).status()["replicas"]["failed_recently"] == 1


def test_an_evicted_replica_stays_listed_with_its_reason_and_is_not_a_failure(gateway):
    shard = Shard("idle-1-0", "idle-1", 0, "gpu3", (2,), state=STOPPED)
    replica = Replica("idle-1", "chat", "k", [shard], phase=ReplicaPhase.RETIRING, reason="evicted for big (idle 42 min)")
    gateway.reconciler.memory.records.retired.append((time.time(), replica))
    gateway.reconciler.memory.placing.evicted["idle-1"] = "big"
    gateway.publish()
    listed = by_name(listings(gateway.admin_dependencies()).replicas(), "id")["idle-1"]
    assert listed["retired"] and listed["state"] == "stopped" and listed["reason"] == "evicted for big (idle 42 min)"
    assert listings(gateway.admin_dependencies()).status()["replicas"]["failed_recently"] == 0


def test_each_replica_lists_the_adapters_of_its_own_revision(gateway):
    roll_chat_onto_adapters(gateway)
    listed = by_name(listings(gateway.admin_dependencies()).replicas(), "id")
    assert listed["chat-1"]["adapters"] == ["a", "b"]  # in launch order, whatever the catalog says now
    assert listed["chat-0"]["adapters"] == []
    assert listed["fetched-1"]["adapters"] is None  # its revision is not known: neither is what it holds
    assert [text.replica_adapters(listed[r]) for r in ("chat-1", "chat-0", "fetched-1")] == ["a, b", "-", "-"]


def test_explanation_carries_a_what_if_per_node_null_when_none(gateway):
    verdicts = by_name(explanation_json(gateway.control.explain("big"))["verdicts"], "node")
    assert all("what_if" in v for v in verdicts.values())
    assert verdicts["gpu1"]["what_if"] is None  # short of GPUs, and nothing there may be evicted


def test_explanation_names_every_node(gateway):
    explained = explanation_json(gateway.control.explain("big"))
    assert explained["plan"] is None and not explained["placeable"]
    verdicts = by_name(explained["verdicts"], "node")
    assert set(verdicts) == {"gpu1", "gpu2", "gpu3", "ghost"}
    assert "2 of 4 GPUs free (1 unhealthy: 2 uncorrected ECC errors), needs 4" in verdicts["gpu1"]["reasons"]
    chat = explanation_json(gateway.control.explain("chat"))
    assert chat["plan"]["shards"][0]["node"] in {"gpu1", "gpu2", "gpu3"}
    assert text.plan_line(chat["plan"]).startswith("would place: ")


@pytest.mark.parametrize(("used", "free", "unhealthy", "width"), [
    pytest.param(1, 1000, 1, 40, id="small-parts-still-show"),
    pytest.param(3, 5, 0, 40, id="fewer-gpus-than-cells"),
    pytest.param(50, 30, 20, 40, id="proportional"),
    pytest.param(0, 0, 0, 40, id="empty"),
    pytest.param(1, 1, 1, 2, id="narrower-than-parts"),
])
def test_bar_cells(used, free, unhealthy, width):
    cells = text.bar_cells(used, free, unhealthy, width)
    total = used + free + unhealthy
    assert sum(cells) == min(width, total)
    if total and width >= 3:
        assert all(c > 0 for c, part in zip(cells, (used, free, unhealthy)) if part)
    assert all(c == 0 for c, part in zip(cells, (used, free, unhealthy)) if not part)


def test_reclaim_summary_says_asked_to_remove():
    answer = {"collect": True, "asked_to_remove": 2, "nodes": [
        {"node": "a", "entries": [{"name": "llmgw-1", "bytes": 10 * GB, "action": "removed"},
                                  {"name": "llmgw-2", "bytes": GB, "action": "refused", "reason": "a link"}],
         "error": None}]}
    line = text.reclaim_summary(answer)
    assert line.startswith("asked to remove 2 cache entries (11.0 GB) on 1 node")
    assert "1 removed" in line and "decides" in line


def test_a_model_below_its_minimum_is_partly_serving(gateway):
    from llmgw.catalog import Catalog
    from llmgw.config import ModelConfig
    from tests.unit.admin_gateway import PROFILES

    current = gateway.holder.current
    configs = [m.config if m.name != "chat" else ModelConfig(name="chat", profile="one", scaling={"min": 3})
               for m in current.models.values()]
    gateway.holder.swap(Catalog.build(file_models=configs, profiles=PROFILES, version=current.version + 1))
    gateway.publish()
    chat = by_name(listings(gateway.admin_dependencies()).models())["chat"]
    assert chat["state"] == "partly serving" and chat["replicas"] == {"total": 2, "serving": 2}


def test_r6_8c_ctl_models_says_when_an_idle_replica_may_be_evicted(gateway):
    """An on-demand model that sets no idle_timeout stops after the default 10 minutes but may be
    evicted after gateway.evict_idle, and the listing says both; one that sets its own uses it for both."""
    from llmgw.catalog import Catalog
    from llmgw.config import GatewayConfig, ModelConfig
    from tests.unit.admin_gateway import PROFILES

    current = gateway.holder.current
    configs = [*(m.config for m in current.models.values()),
               ModelConfig(name="own", profile="one", scaling={"min": 0, "idle_timeout": "5m"})]
    gateway.holder.swap(Catalog.build(file_models=configs, profiles=PROFILES, version=current.version + 1))
    gateway.reconciler.configure(GatewayConfig(evict_idle="2m"))
    gateway.publish()
    models = by_name(listings(gateway.admin_dependencies()).models())
    shared, own, chat = models["shared"]["scaling"], models["own"]["scaling"], models["chat"]["scaling"]
    assert (shared["idle_timeout"], shared["evict_idle"]) == (600.0, 120.0)
    assert (own["idle_timeout"], own["evict_idle"]) == (300.0, 300.0)
    assert chat["evict_idle"] is None and not chat["evictable"]
    assert text.scaling_listed(shared) == "on demand (max 1), stops after 10m idle, evictable after 2m idle"
    assert text.scaling_listed(own) == "on demand (max 1), stops after 5m idle, evictable after 5m idle"
    assert text.scaling_listed(chat) == "min 1, max 1"
