"""What `llmgw ctl` prints of what nodes report, run against the real admin app (R-9.4, R-9.6).

A node controls its reasons, errors and engine log lines: printed as they come, an escape
sequence in them would rewrite the operator's terminal (clear it, retitle it, hide lines). The
signed URL of a weights source is a credential: listings show it without its query (R-5.1).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient
from typer.testing import CliRunner

from llmgw.admin import text
from llmgw.cli.main import app
from llmgw.contracts.states import ReplicaPhase
from llmgw.control.state import ModelHealth
from llmgw.control.state import FAILED, Replica, Shard
from tests.unit.admin_gateway import TOKEN, make_gateway, roll_chat_onto_adapters, served_admin

HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[1A\rfake line\x9b31m\x00\x7f"


@pytest.fixture
async def admin(tmp_path):
    gateway = make_gateway(tmp_path)
    gateway.fleet.links["ghost"].reason = f"connect failed {HOSTILE}"
    shard = Shard("bad-1-0", "bad-1", 0, "gpu3", (2,), state=FAILED, reason=f"engine exited {HOSTILE}",
                  log_tail=[f"loading {HOSTILE}", "CUDA out of memory\ttab kept"])
    gateway.reconciler.memory.records.replicas["bad-1"] = Replica("bad-1", "chat", "k", [shard], phase=ReplicaPhase.RETIRING)
    gateway.publish()
    async with served_admin(gateway) as client:
        yield client, gateway


async def ctl(client: TestClient, *args: str):
    runner = CliRunner(env={"COLUMNS": "400", "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None,
                            "LLMGW_STATE_DIR": None})
    address = f"{client.server.host}:{client.server.port}"
    result = await asyncio.to_thread(runner.invoke, app, ["ctl", "--admin", address, "--token", TOKEN, *args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("command", ["nodes", "replicas", "models", "status", "logs bad-1"])
async def test_ctl_prints_no_control_sequences(admin, command):
    client, _ = admin
    out = await ctl(client, *command.split())
    controls = sorted({hex(ord(c)) for c in out if not c.isprintable() and c not in "\n\t"})
    assert controls == [], f"{command} printed control characters {controls}"
    if command == "nodes":
        assert "connect failed" in out and "fake line" in out
    if command == "replicas":
        assert "engine exited" in out and "loading" in out
    if command.startswith("logs"):  # the node cannot be asked here: the shard's recorded tail is shown
        assert out.splitlines() == ["loading fake line", "CUDA out of memory\ttab kept"]


async def test_json_output_keeps_what_the_node_said_escaped(admin):
    client, _ = admin
    out = await ctl(client, "replicas", "--json")
    assert "\x1b" not in out and "\\u001b" in out  # JSON escapes it; the terminal never sees ESC
    bad = next(r for r in json.loads(out)["replicas"] if r["id"] == "bad-1")
    assert bad["shards"][0]["reason"] == f"engine exited {HOSTILE}"


async def test_dashboard_pages_carry_no_control_characters(admin):
    client, _ = admin
    for path in ("/nodes", "/replicas"):
        page = await (await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})).text()
        assert not [c for c in page if not c.isprintable() and c not in "\n\t"], path
        assert "fake line" in page


async def test_listings_show_a_signed_url_without_its_query(admin):
    client, _ = admin
    out = await ctl(client, "models")
    assert "https://example.com/w.gguf?<redacted>" in out
    for path in ("/api/models", "/api/replicas", "/api/status", "/api/storage", "/api/explain/fetched",
                 "/models", "/replicas"):
        body = await (await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})).text()
        assert "s3cr3t" not in body, path


@pytest.mark.parametrize(("raw", "shown"), [
    pytest.param("\x1b[31mred\x1b[0m", "red", id="csi-colour"),
    pytest.param("a\x1b]0;title\x07b", "ab", id="osc-title-bel"),
    pytest.param("a\x1b]8;;https://x\x1b\\link\x1b]8;;\x1b\\b", "alinkb", id="osc-hyperlink-st"),
    pytest.param("x\r\n\x1b[2Jy", "x\ny", id="carriage-return-and-clear"),
    pytest.param("c1\x9b31mX\x85y", "c1Xy", id="eight-bit-csi-and-nel"),
    pytest.param("keep\ttab\nand newline", "keep\ttab\nand newline", id="tab-newline-kept"),
    pytest.param("[GPU is lost] ünï", "[GPU is lost] ünï", id="plain-text-untouched"),
    pytest.param("cut\x1b[12", "cut", id="truncated-csi"),
    pytest.param("x\x1bPdcs\x1b\\y\x1b(B\x7f\x00", "xy", id="dcs-charset-del-nul"),
])
def test_printable(raw, shown):
    assert text.printable(raw) == shown


async def test_a_model_added_with_a_signed_url_keeps_the_query_out_of_the_audit_trail(admin):
    client, gateway = admin
    url = "https://example.com/other.gguf?X-Amz-Signature=an0ther-s3cr3t"
    answer = await client.post("/api/models", json={"yaml": f"name: signed\nprofile: cpu\nweights: {url}\n"},
                               headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status == 201, await answer.text()
    rows = await gateway.store.read(lambda db: (list(db["models"].rows), list(db["audit"].rows)))
    models, audit = rows
    assert url in next(m["definition"] for m in models if m["name"] == "signed")  # still what is fetched
    detail = next(a["detail"] for a in audit if a["target"] == "signed")
    assert "an0ther-s3cr3t" not in detail and "https://example.com/other.gguf?<redacted>" in detail
    assert gateway.holder.current.models["signed"].source.urls == (url,)


async def test_ctl_and_the_dashboard_say_the_same_words(admin):
    client, gateway = admin
    gateway.reconciler.memory.records.replicas["fetched-1"].set_phase(ReplicaPhase.DRAINING)  # still fetching: the mark says it
    health = gateway.reconciler.memory.records.health.setdefault("fetched", ModelHealth())
    health.failures, health.last_failure = 2, "engine exited with status 1"
    health.next_attempt = time.time() + 600
    gateway.publish()
    replicas = json.loads(await ctl(client, "replicas", "--json"))["replicas"]
    models = json.loads(await ctl(client, "models", "--json"))["models"]
    state = text.replica_state(next(r for r in replicas if r["id"] == "fetched-1"))
    problem = text.model_problem(next(m for m in models if m["name"] == "fetched"))
    assert state == "fetching (draining)" and problem.startswith("engine exited with status 1 (next attempt in ")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    shown = {"replicas": await ctl(client, "replicas"), "models": await ctl(client, "models"),
             "/replicas": await (await client.get("/replicas", headers=headers)).text(),
             "/models": await (await client.get("/models", headers=headers)).text()}
    for where in ("replicas", "/replicas"):
        assert state in shown[where], where
    for where in ("models", "/models"):
        assert problem.split(" (next attempt in ")[0] + " (next attempt in " in shown[where], where


async def test_ctl_storage_shows_each_nodes_low_water_mark_and_what_the_clean_up_removed(admin):
    from collections import deque

    from llmgw.config import LowWater
    from llmgw.contracts.views import CacheRemoval

    client, gateway = admin
    cleanup = gateway.reconciler.cleanup
    cleanup.marks["gpu3"] = LowWater(bytes=50 * 1000**3)
    cleanup.last_result["gpu3"] = "removed 1 entry (38.0 GB); 61.0 GB free, mark 50.0 GB"
    cleanup.removed["gpu3"] = deque([CacheRemoval("llmgw-" + "a" * 32, "/cache/llmgw-" + "a" * 32, 38 * 1000**3,
                                                  time.time() - 7200, time.time(), "50.0 GB", 50 * 1000**3)])
    gateway.publish()
    out = await ctl(client, "storage")
    row = next(line for line in out.splitlines() if line.strip().startswith("gpu3"))
    assert "50.0 GB; removed 1 entry (38.0 GB)" in row, out
    assert "Removed by the clean-up at the low-water mark" in out
    removal = next(line for line in out.splitlines() if "/cache/llmgw-" + "a" * 32 in line)
    assert "38.0 GB" in removal and "50.0 GB" in removal
    other = [line for line in out.splitlines() if line.strip().startswith(("gpu1 ", "gpu2 "))]
    assert other and all(line.rstrip().endswith("off") for line in other), out
    document = json.loads(await ctl(client, "storage", "--json"))
    node = next(n for n in document["nodes"] if n["node"] == "gpu3")
    assert node["cleanup"]["mark"] == "50.0 GB" and node["cleanup"]["threshold_bytes"] == 50 * 1000**3
    assert [r["bytes"] for r in node["cleanup"]["removed"]] == [38 * 1000**3]


async def test_the_last_scaling_decision_is_shown_with_its_reason_by_ctl_the_dashboard_and_metrics(admin):
    """R-6.8b: ctl models, the dashboard and /metrics show what scaling wants and why."""
    from prometheus_client.parser import text_string_to_metric_families

    from llmgw.contracts.views import ScaleDecision
    from llmgw.control.scaling import Scale

    client, gateway = admin
    reason = "scale 1→3: 7.5 in flight over 30s, target 2"
    gateway.reconciler.memory.scaling.scales["chat"] = Scale(3, last=ScaleDecision(time.time() - 150, 1, 3, reason), ups=2, downs=1)
    gateway.publish()
    models = {m["name"]: m for m in json.loads(await ctl(client, "models", "--json"))["models"]}
    chat = models["chat"]
    assert chat["desired"] == 3 and chat["scale_decisions"] == {"up": 2, "down": 1}
    assert (chat["last_scale"]["from"], chat["last_scale"]["to"], chat["last_scale"]["direction"]) == (1, 3, "up")
    assert chat["last_scale"]["reason"] == reason
    assert models["fetched"]["desired"] is None and models["fetched"]["last_scale"] is None  # not decided yet
    shown = text.last_scale(chat, time.time())
    assert shown == f"{reason} (2m ago)"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert shown in await ctl(client, "models")
    assert shown in await (await client.get("/models", headers=headers)).text()
    metrics = await (await client.get("/metrics", headers=headers)).text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert samples[("llmgw_model_desired_replicas", (("model", "chat"),))] == 3
    assert samples[("llmgw_model_scale_decisions_total", (("direction", "up"), ("model", "chat")))] == 2
    assert samples[("llmgw_model_scale_decisions_total", (("direction", "down"), ("model", "chat")))] == 1
    assert ("llmgw_model_desired_replicas", (("model", "fetched"),)) not in samples  # unknown: absent


async def test_ctl_replicas_and_the_dashboard_show_the_adapters_each_replica_holds(admin):
    client, gateway = admin
    roll_chat_onto_adapters(gateway)
    listed = {r["id"]: r["adapters"] for r in json.loads(await ctl(client, "replicas", "--json"))["replicas"]}
    assert (listed["chat-1"], listed["chat-0"], listed["fetched-1"]) == (["a", "b"], [], None)
    shown = {line.split()[0]: line for line in (await ctl(client, "replicas")).splitlines() if line[:1] not in " "}
    assert "revision #2 · adapters a, b ·" in shown["chat-1"]
    assert "revision #1 · adapters - ·" in shown["chat-0"]
    assert shown["fetched-1"].endswith("revision gone · adapters -")
    page = await (await client.get("/replicas", headers={"Authorization": f"Bearer {TOKEN}"})).text()
    assert "<th>adapters</th>" in page and "<td>a, b</td>" in page
