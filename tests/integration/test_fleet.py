"""Fleet links against real SSH hosts (SPEC §1, §2): deployment, verification, facts, faults."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time

import pytest

from llmgw.config import load_inventory
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import READY, UNHEALTHY, UNREACHABLE, SSHLink, helper_code
from llmgw.fleet.session import NodeError
from tests.testbed import GPU, NodeSpec

pytestmark = pytest.mark.testbed

SPECS = [
    NodeSpec.gpu_node("gpu1", 8, fabric="ib-a", mem_gb=512, cache_mb=64),
    NodeSpec("gpu2", gpus=[GPU.h100(), GPU.h100(ecc_errors=3), GPU.h100(lost=True), GPU.h100(apps=((4242, 4096),))],
             fabric="ib-a", mem_gb=None),
    NodeSpec("cpu1", gpus=None, mem_gb=8, cache_mb=32),
    NodeSpec.gpu_node("l40s1", 2, gpu=GPU.l40s(), fabric="ib-b", mem_gb=128),
]


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory(SPECS)
    yield tb
    tb.close()


@pytest.fixture
def inventory(bed, tmp_path):
    path = bed.write_inventory(tmp_path / "inventory.yaml")
    inv, _ = load_inventory(path)
    return inv


async def poll(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_facts_from_every_node(bed, inventory, tmp_path):
    """R-2.1–R-2.4: GPUs, memory (unknown stays None) and storage per filesystem."""
    fleet = Fleet(inventory, tmp_path)
    await fleet.start()
    try:
        assert await fleet.wait_connected(30), {n: (link.state, link.reason) for n, link in fleet.links.items()}
        await fleet.refresh()
        gpu1, gpu2, cpu1 = (fleet.facts[n] for n in ("gpu1", "gpu2", "cpu1"))
        assert len(gpu1.inventory.gpus) == 8 and all(g.healthy for g in gpu1.inventory.gpus)
        assert gpu1.inventory.gpu_class == "h100-80gb"
        assert gpu1.inventory.memory_bytes == 512 * 1024**3
        assert gpu2.inventory.memory_bytes is None  # no MemTotal is unknown, not 0
        health = [(g.healthy, " ".join(g.reasons)) for g in gpu2.inventory.gpus]
        assert health[0] == (True, "")
        assert not health[1][0] and "ECC" in health[1][1]
        assert not health[2][0] and "lost" in health[2][1].lower()
        assert not health[3][0] and "4242" in health[3][1]  # memory held by a foreign process
        assert cpu1.inventory.gpus == () and cpu1.inventory.nvidia_smi == "absent"
        assert fleet.facts["l40s1"].inventory.gpu_class == "l40s-48gb"
        cache = gpu1.storage.filesystem_of(str(bed["gpu1"].cache_dir))
        assert cache is not None and cache.fstype == "tmpfs" and not cache.shared
        assert cache.total_bytes == 64 * 1024**2
    finally:
        await fleet.close()


async def test_helper_deployed_under_its_hash_in_a_private_directory(bed, inventory, tmp_path):
    """R-1.3: the remote copy's path contains the hash; its directory is 0700."""
    fleet = Fleet(inventory, tmp_path)
    await fleet.start()
    try:
        assert await fleet.wait_connected(30)
        code = helper_code()
        remote = bed["cpu1"].host_path(f"/root/.llmgw/helper/{code.filename}")
        assert remote.read_bytes() == code.text
        assert stat.S_IMODE(os.stat(remote.parent).st_mode) == 0o700
        assert fleet.links["cpu1"].hello.sha256 == code.sha256
    finally:
        await fleet.close()


async def test_tampered_helper_is_replaced_and_bad_directory_is_unhealthy(bed, inventory, tmp_path):
    """R-1.3: a copy failing verification is re-uploaded; one that still cannot run is unhealthy."""
    code = helper_code()
    node = inventory.node("cpu1")
    link = SSHLink(node, inventory.ssh)
    link.start()
    try:
        assert await link.wait_ready(30)
        remote = bed["cpu1"].host_path(f"/root/.llmgw/helper/{code.filename}")
        data = bytearray(remote.read_bytes())
        data[len(data) // 2] ^= 0x01
        remote.write_bytes(bytes(data))
        connects = link.connects
        assert bed.kill_matching("cpu1", r"llmgw_helper-.*serve")  # the session drops; the link reconnects
        await poll(lambda: link.connects > connects and link.state == READY, 30, "reconnect after tampering")
        assert remote.read_bytes() == code.text
        assert (await link.call("ping"))["time"] > 0

        os.chmod(remote.parent, 0o755)  # a helper directory others can read: refused, not fixed silently
        assert bed.kill_matching("cpu1", r"llmgw_helper-.*serve")
        await poll(lambda: link.state == UNHEALTHY, 30, "unhealthy helper directory")
        assert "0755" in link.reason or "permission" in link.reason.lower()
        with pytest.raises(NodeError, match="not connected"):
            await link.call("inventory")
    finally:
        await link.close()
        os.chmod(bed["cpu1"].host_path("/root/.llmgw/helper"), 0o700)


async def test_changed_host_key_is_refused_with_fingerprint(bed, inventory, tmp_path):
    """R-1.5: a changed host key refuses the connection, naming node and fingerprint."""
    known = tmp_path / "known_hosts"
    address = bed["gpu1"].address
    other = bed["cpu1"].host_key_pub.split()[:2]  # a real key, but the wrong one for this host
    known.write_text(f"{address} {other[0]} {other[1]}\n")
    ssh = inventory.ssh.model_copy(update={"known_hosts": str(known)})
    link = SSHLink(inventory.node("gpu1"), ssh)
    link.start()
    try:
        await poll(lambda: link.state == UNHEALTHY, 20, "host key refusal")
        assert "gpu1" in link.reason and "changed" in link.reason
        assert "SHA256:" in link.reason and f"ssh-keygen -R {address}" in link.reason
        assert link.connects == 0
    finally:
        await link.close()


async def test_cut_node_is_unreachable_in_flight_calls_fail_and_it_returns(bed, inventory, tmp_path):
    """R-1.1: keepalives notice a dead link; nothing hangs; the link comes back on its own."""
    link = SSHLink(inventory.node("gpu2"), inventory.ssh)
    link.start()
    try:
        assert await link.wait_ready(30)
        follow = asyncio.create_task(link.call("logs", {"shard_id": "none", "follow": True}, timeout=None))
        bed.cut("gpu2")
        cut_at = time.monotonic()
        await poll(lambda: link.state == UNREACHABLE, 20, "unreachable")
        detected = time.monotonic() - cut_at
        with pytest.raises(NodeError):
            await asyncio.wait_for(follow, 10)
        print(f"cut noticed after {detected:.1f}s (keepalive 1s x 3)")
        bed.restore("gpu2")
        link.reconnect_now()
        await poll(lambda: link.state == READY, 60, "ready again after restore")
        assert (await link.call("ping"))["time"] > 0
    finally:
        bed.restore("gpu2")
        await link.close()


def test_helper_run_and_check_commands(bed, tmp_path):
    """R-1.8, R-9.8: the operator's tools go through the same code path."""
    path = bed.write_inventory(tmp_path / "inventory.yaml")
    env = {**os.environ, "LLMGW_STATE_DIR": str(tmp_path / "state")}
    run = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "helper", "run", "cpu1", "storage", "-i", str(path),
                          "--arg", json.dumps({"path": "/nonexistent", "shared": False}).join(["dirs=[", "]"])],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["missing"] == ["/nonexistent"]
    check = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i", str(path)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "gpu1" in check.stdout and "ready" in check.stdout
    bed.cut("cpu1")
    try:
        check = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i", str(path), "--timeout", "3"],
                               capture_output=True, text=True, env=env, timeout=120)
    finally:
        bed.restore("cpu1")
    assert check.returncode == 1
    assert "cpu1" in check.stdout and "unreachable" in check.stdout


async def test_engine_survives_the_link_dropping_and_is_seen_again(bed, inventory):
    """R-4.4: engines run detached from the SSH session and are recognised after a reconnect."""
    link = SSHLink(inventory.node("l40s1"), inventory.ssh)
    link.start()
    try:
        assert await link.wait_ready(30)
        launched = await link.call("launch", {
            "shard_id": "survivor-0", "argv": ["vllm", "serve", "m", "--port", "20050", "--served-model-name", "m"],
            "env": {"VLLM_API_KEY": "k"}, "port": 20050, "host": "0.0.0.0",
            "health_url": "http://127.0.0.1:20050/health", "gpus": [0]})
        connects = link.connects
        assert bed.kill_matching("l40s1", r"sshd: root@notty")  # the SSH session is gone, helper with it
        await poll(lambda: link.connects > connects and link.state == READY, 30, "reconnect")
        deadline = time.monotonic() + 30
        while True:
            status = await link.call("status", {"probe": True})
            shard = next(s for s in status["shards"] if s["shard_id"] == "survivor-0")
            if shard["health"] and shard["health"]["status"] == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert shard["alive"] and shard["pid"] == launched["pid"] and shard["start_time"] == launched["start_time"]
        assert shard["health"]["status"] == 200
        stopped = await link.call("stop", {"shard_id": "survivor-0", "grace": 5})
        assert stopped["was_alive"] and stopped["stopped"]
        await link.call("forget", {"shard_id": "survivor-0"})
    finally:
        await link.close()


async def test_node_without_cache_dir_fetches_into_its_default_cache(bed, inventory, tmp_path):
    """A node declared without cache_dir gets ROOT/cache, as an absolute path on that node."""
    url = bed.weights.add("default-cache/w.bin", size=4096)
    node = inventory.node("cpu1").model_copy(update={"cache_dir": None, "model_dirs": ["~/models"]})
    fleet = Fleet(inventory.model_copy(update={"nodes": [node]}), tmp_path)
    await fleet.start()
    try:
        assert await fleet.wait_connected(30)
        paths = fleet.paths("cpu1")
        assert paths.cache_dir == "/root/.llmgw/cache" and paths.model_dirs == ("/root/models",)
        result = await fleet.call("cpu1", "fetch", {"source": {"kind": "https", "urls": [url]},
                                                    "cache_dir": paths.cache_dir, "name": "llmgw-" + "ab" * 16})
        assert result["path"].startswith("/root/.llmgw/cache/llmgw-")
        await fleet.refresh()
        assert fleet.facts["cpu1"].storage.filesystem_of(paths.cache_dir) is not None
    finally:
        await fleet.close()


async def test_a_helper_root_under_a_home_others_can_write_is_unhealthy(bed, inventory, tmp_path):
    """R-1.3: StrictModes-like checks above ROOT; the fleet secret reaches the node in the session."""
    fleet = Fleet(inventory.model_copy(update={"nodes": [inventory.node("cpu1")]}), tmp_path)
    home = bed["cpu1"].home_dir
    mode = stat.S_IMODE(os.stat(home).st_mode)
    await fleet.start()
    link = fleet.links["cpu1"]
    try:
        assert await fleet.wait_connected(30)
        kept = bed["cpu1"].host_path("/root/.llmgw/fleet.key")
        assert kept.read_text().strip() == (tmp_path / "fleet.key").read_text().strip()
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600
        os.chmod(home, 0o777)  # anyone on the node could now swap ~/.llmgw for their own
        assert bed.kill_matching("cpu1", r"llmgw_helper-.*serve")
        await poll(lambda: link.state == UNHEALTHY, 30, "unhealthy helper root")
        assert "/root" in link.reason and "0777" in link.reason, link.reason
    finally:
        os.chmod(home, mode)
        await fleet.close()
