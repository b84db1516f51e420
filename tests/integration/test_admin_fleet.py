"""`llmgw ctl`, /metrics and the dashboard on a testbed fleet: real SSH hosts with GPUs.

Two fabrics of H100 nodes (one with an ECC-error GPU, one with a lost GPU, one that reports no
memory), a CPU node downloading weights from a throttled server (with and without a length), a
shared filer mounted by two nodes, and a node that never answers. Checks what the operator sees:
unknown as `-` (R-2.3, R-2.7), unhealthy GPUs apart (R-2.2), shared filers apart and counted
once (R-2.5, R-7.2), progress lines (R-5.4), placement shortfalls (R-3.2, R-3.5), reclaim
(R-5.5), metrics absent when unknown (R-9.7), and the dashboard in a headless browser (R-9.6).
"""

from __future__ import annotations

import re
import time

import pytest
import yaml

from tests.integration.test_admin_support import Browser, Serve, chromium_path, wait_for
from tests.testbed import GPU, NodeSpec

pytestmark = pytest.mark.testbed

STALE_ENTRY = "llmgw-0123456789abcdef0123456789abcdef"
FOREIGN_ENTRY = "someone-elses-model"
MB = 1024 * 1024


def specs() -> list[NodeSpec]:
    h100 = GPU.h100()
    return [
        NodeSpec("gpu1", gpus=[h100, h100, h100, h100.but(ecc_errors=2)], mem_gb=64, fabric="ib-a",
                 labels={"zone": "a", "serves": "chat"}),
        NodeSpec("gpu2", gpus=[h100] * 4, mem_gb=None, fabric="ib-a", labels={"zone": "a"}, shared=True),
        NodeSpec("gpu3", gpus=[h100, h100, h100, h100.but(lost=True)], mem_gb=64, fabric="ib-b",
                 labels={"zone": "b"}, shared=True),
        NodeSpec("cpu1", gpus=None, mem_gb=32, fabric="ib-b", labels={"kind": "cpu"}, cache_mb=512),
    ]


PROFILES = {
    # chat goes to gpu1 whichever node connects first, so that the counts below are known.
    "chat": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "node_selector": {"serves": "chat"}},
    "h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb"},
    "h100-2x4": {"engine": "vllm", "gpus": 4, "nodes": 2, "gpu_class": "h100-80gb"},
    "h100-big-memory": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "min_memory_gb": 100},
    "cpu": {"engine": "llama-server", "node_selector": {"kind": "cpu"}},
}


@pytest.fixture(scope="module")
def fleet(testbed_factory, tmp_path_factory):
    tb = testbed_factory(specs())
    tmp = tmp_path_factory.mktemp("admin-fleet")
    # Throttled downloads that outlast the module: one with a length, one without.
    with_length = tb.weights.add("slow/with-length.gguf", size=200 * MB, throttle=256 * 1024)
    no_length = tb.weights.add("slow/no-length.gguf", size=200 * MB, throttle=256 * 1024, framing="chunked")
    models = [
        {"name": "chat", "profile": "chat"},
        {"name": "big", "profile": "h100-2x4"},
        {"name": "slow-length", "profile": "cpu", "weights": with_length},
        {"name": "slow-chunked", "profile": "cpu", "weights": no_length},
        {"name": "on-filer", "profile": "h100-1", "weights": "filer-model", "scaling": {"min": 0}},
        {"name": "on-disk", "profile": "h100-1", "weights": "disk-model", "scaling": {"min": 0}},
        {"name": "hungry", "profile": "h100-big-memory", "scaling": {"min": 0}},
    ]
    (tb.shared_dir / "filer-model").mkdir()
    (tb.shared_dir / "filer-model" / "model.safetensors").write_bytes(b"w" * 4096)
    disk_model = tb.node("gpu3").host_path(tb.node("gpu3").models_dir / "disk-model")
    disk_model.mkdir()
    (disk_model / "model.safetensors").write_bytes(b"w" * 4096)
    cache = tb.node("gpu3").host_path(tb.node("gpu3").cache_dir)
    (cache / STALE_ENTRY).mkdir()
    (cache / STALE_ENTRY / "model.gguf").write_bytes(b"x" * 65536)
    (cache / STALE_ENTRY / ".llmgw-complete").write_text("")
    (cache / FOREIGN_ENTRY).mkdir()
    (cache / FOREIGN_ENTRY / "model.gguf").write_bytes(b"y" * 1024)

    document = tb.inventory(models, PROFILES)
    document["gateway"] = {"tick": "0.5s"}
    # A node that never answers: everything about it is unknown.
    document["nodes"].append({"name": "ghost", "host": f"{tb.subnet_prefix}.250", "fabric": "ib-b",
                              "ports": tb.ports})
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    serve = Serve(path, tmp / "state")
    try:
        serve.start()
        serve.testbed = tb
        wait_for(lambda: sum(n["state"] == "ready" for n in serve.ctl_json("nodes")["nodes"]) == 4, 60,
                 "the four testbed nodes to be ready")
        wait_for(lambda: _model(serve, "chat")["state"] == "serving", 60, "chat to serve")
        wait_for(lambda: _model(serve, "big")["unplaceable"], 30, "big to be found unplaceable")
        yield serve
        serve.stop()
    finally:
        if serve.process is not None and serve.process.poll() is None:
            serve.process.kill()
        tb.close()


def _model(serve: Serve, name: str) -> dict:
    return next(m for m in serve.ctl_json("models")["models"] if m["name"] == name)


def rows(output: str) -> dict[str, str]:
    """Table rows by their first word (continuation lines of a cell are appended to the row)."""
    table: dict[str, str] = {}
    last = None
    for line in output.splitlines()[1:]:
        if line and not line[0].isspace():
            last = line.split()[0]
            table[last] = line
        elif last is not None:
            table[last] += "\n" + line
    return table


# -- nodes (R-2.2, R-2.3, R-2.5, R-2.7) -----------------------------------------------------------


def test_nodes_table(fleet):
    out = fleet.ctl("nodes").stdout
    table = rows(out)
    assert set(table) == {"gpu1", "gpu2", "gpu3", "cpu1", "ghost"}
    gpu1 = table["gpu1"].split()
    assert gpu1[:5] == ["gpu1", "ready", "active", "ib-a", "serves=chat,"]
    assert gpu1[6:12] == ["4", "×", "h100-80gb", "1", "2", "1"]  # 1 used (chat), 2 free, 1 unhealthy
    assert "GPU 3: 2 uncorrected ECC errors (volatile)" in table["gpu1"]
    assert "GPU 3: " in table["gpu3"] and "[GPU is lost]" in table["gpu3"]  # rendered as text, not markup
    gpu2 = table["gpu2"].split()
    assert gpu2[gpu2.index("h100-80gb") + 4] == "-"  # MEM: reported nothing, shows `-`, never 0
    ghost = table["ghost"].split("\n")[0]
    assert re.search(r"ghost\s+(connecting|unreachable).*\s-\s+-\s+-\s+-\s+-\s+-\s+-\s*$", ghost), ghost
    cpu = table["cpu1"].split()
    assert cpu[cpu.index("kind=cpu") + 1:cpu.index("kind=cpu") + 5] == ["none", "0", "0", "0"]


def test_nodes_json(fleet):
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    gpu1 = nodes["gpu1"]["gpus"]
    assert (gpu1["total"], gpu1["used"], gpu1["free"], gpu1["unhealthy"]) == (4, 1, 2, 1)
    assert gpu1["devices"][3]["reasons"] == ["2 uncorrected ECC errors (volatile)"]
    assert nodes["gpu2"]["memory_bytes"] is None and nodes["gpu1"]["memory_bytes"] == 64 * 1024**3
    ghost = nodes["ghost"]
    assert ghost["gpus"] is None and ghost["memory_bytes"] is None and ghost["disk"] is None
    assert nodes["cpu1"]["gpus"]["total"] == 0 and nodes["cpu1"]["gpus"]["nvidia_smi"] == "absent"
    shared = nodes["gpu2"]["disk"]["shared"]
    assert [fs["mount_point"] for fs in shared] == [str(fleet.testbed.shared_dir)]
    local = nodes["gpu2"]["disk"]["local"]
    assert {fs["mount_point"] for fs in local} == {str(fleet.testbed.node("gpu2").models_dir),
                                                   str(fleet.testbed.node("gpu2").cache_dir)}
    # The shared filer is never part of the node's own totals.
    assert nodes["gpu2"]["disk"]["local_total_bytes"] == sum(fs["total_bytes"] for fs in local)


# -- status (R-7.2) -------------------------------------------------------------------------------


def test_status(fleet):
    out = fleet.ctl("status").stdout
    capacity = next(line for line in out.splitlines() if line.startswith("h100-80gb"))
    bar = capacity.split()[1]
    assert bar == "█" + "░" * 9 + "✗" * 2  # 1 used, 9 free, 2 unhealthy of 12
    assert capacity.split()[2:6] == ["1", "9", "2", "3"]
    assert "GPUs not reported yet: ghost" in out
    assert "free whole nodes per fabric: ib-a 1, ib-b 0" in out
    assert re.search(r"big\s+fabric ib-a has 1 free whole node, needs 2", out)
    fabrics = rows(out[out.index("What each fabric holds"):])
    assert "on-filer (shared filer)" in fabrics["ib-a"] and "on-filer (shared filer)" in fabrics["ib-b"]
    assert "on-disk on gpu3" in fabrics["ib-b"] and "on-disk" not in fabrics["ib-a"]
    assert fabrics["ib-a"].count(str(fleet.testbed.shared_dir)) == 1
    status = fleet.ctl_json("status")
    assert status["capacity"] == [{"gpu_class": "h100-80gb", "nodes": 3, "total": 12, "used": 1, "free": 9,
                                   "unhealthy": 2}]
    # The same numbers as the node listing: one snapshot, one derivation.
    nodes = [n for n in fleet.ctl_json("nodes")["nodes"] if n["gpus"]]
    for key in ("used", "free", "unhealthy", "total"):
        assert status["capacity"][0][key] == sum(n["gpus"][key] for n in nodes)
    ib_b = next(f for f in status["fabrics"] if f["fabric"] == "ib-b")
    assert len(ib_b["shared_filers"]) == 1 and ib_b["shared_filers"][0]["nodes"] == ["gpu3"]


# -- replicas: progress lines (R-5.4) ---------------------------------------------------------------


def test_download_progress_is_a_line_under_the_replica(fleet):
    def both_downloading():
        out = fleet.ctl("replicas").stdout
        ok = re.search(r"downloading [\d.]+ [KMG]?B of 209\.7 MB \(\d+%\)", out) and \
            re.search(r"downloading [\d.]+ [KMG]?B so far", out)
        return out if ok else None
    out = wait_for(both_downloading, 45, "progress lines for both downloads")
    lines = out.splitlines()
    for model, pattern in (("slow-length", r"^    downloading [\d.]+ [KMG]?B of 209\.7 MB \(\d+%\)$"),
                           ("slow-chunked", r"^    downloading [\d.]+ [KMG]?B so far$")):
        head = next(i for i, line in enumerate(lines) if re.match(rf"^{model}-\w+  {model}  fetching", line))
        assert lines[head + 1].startswith("  shard 0 on cpu1 (no GPUs)")
        assert ": fetching since " in lines[head + 1]
        assert re.match(pattern, lines[head + 2]), lines[head + 2]
    replicas = {r["model"]: r for r in fleet.ctl_json("replicas")["replicas"]}
    chunked = replicas["slow-chunked"]["shards"][0]["progress"]
    assert chunked["total"] is None and "%" not in chunked["line"]  # no length: no invented percentage
    sized = replicas["slow-length"]["shards"][0]["progress"]
    assert sized["total"] == 200 * MB and 0 < sized["bytes"] < sized["total"]


# -- placement (R-3.2, R-3.5) ---------------------------------------------------------------------


def test_explain_placement_names_shortfalls(fleet):
    out = fleet.ctl("explain-placement", "big").stdout
    assert out.startswith("big: fabric ib-a has 1 free whole node, needs 2")
    assert "plan: no plan: nothing fits" in out
    table = rows(out[out.index("NODE"):])
    assert "2 of 4 GPUs free (1 unhealthy: 2 uncorrected ECC errors (volatile)), needs 4" in table["gpu1"]
    assert "fabric ib-a has 1 free whole node, needs 2" in table["gpu2"]
    assert "has no GPUs, needs 4 of class h100-80gb" in table["cpu1"]
    assert re.search(r"ghost\s+rejected\s+-\s+-\s+(connecting|unreachable)", table["ghost"])
    explained = fleet.ctl_json("explain-placement", "hungry")
    verdicts = {v["node"]: v for v in explained["verdicts"]}
    assert "has 68.7 GB of memory, needs 100" in verdicts["gpu1"]["reasons"]
    assert verdicts["gpu2"]["fits"]  # unknown memory is not small: it stays placeable
    assert explained["plan"]["shards"][0]["node"] == "gpu2"
    on_disk = fleet.ctl_json("explain-placement", "on-disk")
    assert on_disk["plan"]["shards"][0]["node"] == "gpu3" and "holds the weights" in on_disk["plan"]["reasons"]


def test_placement_failures_page_and_cordon(fleet):
    cordoned = fleet.ctl_json("cordon", "gpu3")
    assert cordoned["admin"] == "cordoned"
    try:
        verdict = next(v for v in fleet.ctl_json("explain-placement", "on-disk")["verdicts"] if v["node"] == "gpu3")
        assert not verdict["fits"] and "cordoned" in verdict["reasons"]
        assert "cordoned" in rows(fleet.ctl("nodes").stdout)["gpu3"]
    finally:
        assert fleet.ctl("uncordon", "gpu3").exit_code == 0


# -- storage and reclaim (R-2.5, R-5.5) ----------------------------------------------------------------


def test_storage(fleet):
    storage = fleet.ctl_json("storage")
    filers = storage["shared_filers"]
    assert len(filers) == 1 and filers[0]["nodes"] == ["gpu2", "gpu3"]  # one filer, counted once
    nodes = {n["node"]: n for n in storage["nodes"]}
    assert [h["model"] for h in nodes["gpu3"]["holdings"]] == ["on-disk", "on-filer"]
    assert nodes["ghost"]["holdings"] is None and nodes["ghost"]["disk"] is None
    out = fleet.ctl("storage").stdout
    assert "Shared filers (each counted once)" in out
    assert re.search(r"ghost\s+(connecting|unreachable)\s+\S+\s+-\s+-\s+-", out)


def test_reclaim_lists_then_asks_to_remove_only_what_llmgw_fetched(fleet):
    listed = fleet.ctl_json("reclaim")
    entries = {(n["node"], e["name"]) for n in listed["nodes"] for e in n["entries"]}
    assert ("gpu3", STALE_ENTRY) in entries
    assert not any(name == FOREIGN_ENTRY for _, name in entries)
    out = fleet.ctl("reclaim").stdout
    assert STALE_ENTRY in out and "`llmgw ctl reclaim --collect` asks the nodes to remove it" in out
    collected = fleet.ctl("reclaim", "--collect")
    assert collected.exit_code == 0
    assert re.search(r"asked to remove 1 cache entry \(65\.\d KB\) on 1 node; the nodes report 1 removed",
                     collected.stdout), collected.stdout
    cache = fleet.testbed.node("gpu3").host_path(fleet.testbed.node("gpu3").cache_dir)
    assert not (cache / STALE_ENTRY).exists() and (cache / FOREIGN_ENTRY).exists()
    assert fleet.ctl_json("reclaim")["nodes"] and not any(
        e["name"] == STALE_ENTRY for n in fleet.ctl_json("reclaim")["nodes"] for e in n["entries"])


# -- metrics (R-9.7) ------------------------------------------------------------------------------


def test_metrics_are_absent_when_unknown(fleet):
    status, text = fleet.api("/metrics")
    assert status == 200
    assert 'llmgw_node_memory_bytes{node="gpu1"} 6.8719476736e+10' in text
    assert 'llmgw_node_memory_bytes{node="gpu2"}' not in text
    assert not re.search(r'^llmgw_node_(gpus|memory|disk)\w*\{[^}]*node="ghost"', text, re.MULTILINE)
    assert 'llmgw_node_gpus_unhealthy{gpu_class="h100-80gb",node="gpu3"} 1.0' in text
    assert re.search(r'llmgw_node_gpus\{gpu_class="",node="cpu1"\} 0\.0', text)  # reported none: a known 0
    shared = re.findall(r'^llmgw_node_disk_free_bytes\{[^}]*node="(\w+)"[^}]*shared="true"', text, re.MULTILINE)
    assert sorted(shared) == ["gpu2", "gpu3"]
    assert 'llmgw_replicas{model="chat",state="serving"} 1.0' in text
    assert 'llmgw_model_unplaceable{model="big"} 1.0' in text


# -- the dashboard in a browser (R-9.6) ---------------------------------------------------------------


def test_dashboard_in_headless_chromium(fleet, tmp_path):
    if chromium_path() is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium)")
    url = fleet.ctl("dashboard").stdout.strip()
    base = url.split("/?", 1)[0]
    with Browser(tmp_path / "chromium") as browser:
        first = browser.load(url)
        assert [(u.split("?")[0], s) for u, s, _ in first.responses[:2]] == [(base + "/", 303), (base + "/", 200)]
        expected = {"/": ["h100-80gb", "big", "fabric ib-a has 1 free whole node, needs 2", "on-filer"],
                    "/nodes": ["gpu1", "gpu2", "gpu3", "cpu1", "ghost", "2 uncorrected ECC errors"],
                    "/models": ["chat", "big", "slow-length", "hungry"],
                    "/replicas": ["chat", "downloading", "so far"],
                    "/engines": ["no engine installed by llmgw on any node"],
                    "/placement": ["big", "has no GPUs, needs 4 of class h100-80gb"],
                    "/usage": ["By model", "By key"]}
        for path, words in expected.items():
            load = first if path == "/" else browser.load(base + path)
            assert load.failures == [], (path, load.failures)
            assert all(status < 400 for _, status, _ in load.responses), (path, load.responses)
            assert any(u == base + "/static/style.css" and s == 200 for u, s, _ in load.responses)
            assert load.scripts == 0 and not any(kind == "Script" for _, _, kind in load.responses)
            for word in words:
                assert word in load.html, (path, word)
        browser.clear_cookies()
        refused = browser.load(base + "/nodes")
        assert [s for u, s, _ in refused.responses if u == base + "/nodes"] == [401]
        assert "gpu1" not in refused.html and "llmgw ctl dashboard" in refused.html


def test_ghost_stays_unknown_after_a_while(fleet):
    """Still nothing known about the node that never answered, and its state says why."""
    ghost = next(n for n in fleet.ctl_json("nodes")["nodes"] if n["name"] == "ghost")
    assert ghost["state"] in ("connecting", "unreachable") and ghost["since"] <= time.time()
    assert (ghost["gpus"], ghost["memory_bytes"], ghost["disk"], ghost["stale"]) == (None, None, None, False)
