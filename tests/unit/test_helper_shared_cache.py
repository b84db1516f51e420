"""Reclaim on a cache directory several nodes share (R-5.5): another node's download in
progress is never listed as a leftover nor removed; a download that died is."""

import json
import os
import socket
import subprocess
import sys
import time

from tests.helper.client import load_helper, wait_until

helper = load_helper()
NAME = "llmgw-" + "ab12" * 8
TEMP = ".tmp-%s-q7w8e9" % NAME


def _temp_with_lease(cache, age=0.0, **lease):
    temp = cache / TEMP
    (temp / "part").mkdir(parents=True)
    (temp / "part" / "w.bin").write_bytes(b"w" * 100)
    record = {"hostname": "gpu7", "boot_id": "another-boot", "pid": 4242, "started_at": time.time()}
    record.update(lease)
    (temp / ".llmgw-lease").write_text(json.dumps(record))
    then = time.time() - age
    os.utime(temp / ".llmgw-lease", (then, then))
    os.utime(temp, (time.time() - 3600, time.time() - 3600))
    return temp


def test_another_nodes_download_in_progress_is_left_alone(tmp_path):
    temp = _temp_with_lease(tmp_path, age=20)
    assert helper.reclaim_entries(str(tmp_path), None, collect=False) == []
    entries = helper.reclaim_entries(str(tmp_path), [TEMP, NAME], collect=True)
    assert [e["action"] for e in entries] == ["refused", "refused"]
    assert "download on gpu7 (pid 4242" in entries[0]["reason"]
    assert (temp / "part" / "w.bin").exists()


def test_a_lease_not_renewed_for_long_is_a_leftover(tmp_path):
    temp = _temp_with_lease(tmp_path, age=helper.LEASE_FRESH + 60)
    [listed] = helper.reclaim_entries(str(tmp_path), None, collect=False)
    assert listed["name"] == TEMP and "interrupted" in listed["reason"]
    [entry] = helper.reclaim_entries(str(tmp_path), [TEMP], collect=True)
    assert entry["action"] == "removed" and not temp.exists()


def test_a_download_of_this_node_whose_process_ended_is_a_leftover(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(ended.stdout)
    _temp_with_lease(tmp_path, hostname=socket.gethostname(), boot_id=helper.read_boot_id(), pid=dead_pid)
    [entry] = helper.reclaim_entries(str(tmp_path), [TEMP], collect=True)
    assert entry["action"] == "removed"


def test_a_download_of_this_node_still_running_is_left_alone(tmp_path):
    _temp_with_lease(tmp_path, hostname=socket.gethostname(), boot_id=helper.read_boot_id(), pid=os.getpid())
    [entry] = helper.reclaim_entries(str(tmp_path), [TEMP], collect=True)
    assert entry["action"] == "refused" and "pid %d" % os.getpid() in entry["reason"]


def test_a_temp_dir_just_made_without_a_lease_yet_is_left_alone(tmp_path):
    (tmp_path / TEMP).mkdir()
    [entry] = helper.reclaim_entries(str(tmp_path), [TEMP], collect=True)
    assert entry["action"] == "refused" and "just starting" in entry["reason"]


def test_a_lease_is_renewed_while_its_download_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(helper, "LEASE_RENEW", 0.02)
    node = helper.Node(str(tmp_path / "root"), str(tmp_path / "helper.py"))
    temp = tmp_path / "cache" / TEMP
    temp.mkdir(parents=True)
    stop = node.fetch._hold_lease(None, str(temp))
    try:
        lease = temp / ".llmgw-lease"
        record = json.loads(lease.read_text())
        assert record["pid"] == os.getpid() and record["hostname"] == socket.gethostname()
        old = time.time() - 1000
        os.utime(lease, (old, old))
        wait_until(lambda: lease.stat().st_mtime > old + 500, timeout=10, message="the lease renewed")
    finally:
        stop.set()
