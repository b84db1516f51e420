"""Disk full during a download: the shard fails with a disk-space reason, nothing half-written is
left or mistaken for weights, and the replica goes to a node with room (R-3.1, R-4.2, R-5.1, R-5.2).

Two CPU nodes: `cramped` has a 24 MB tmpfs cache (real ENOSPC), `roomy` 128 MB. Placement ties
between them are broken by name, so a model whose size nobody declared and whose server sends no
length goes to `cramped` first; its download of 48 MB runs out of space there. A second model
declares no size either, but its server sends a Content-Length: the size is learned before
placement, which never sends it to `cramped` at all.
"""

from __future__ import annotations

import os
import threading

import openai
import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

WEIGHTS_BYTES = 48 * 1000**2
COMPLETE_MARKER = ".llmgw-complete"


@pytest.fixture
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("cramped", gpus=None, mem_gb=32, cache_mb=24),
                          NodeSpec("roomy", gpus=None, mem_gb=32, cache_mb=128)])
    yield tb
    tb.close()


class CacheWatch:
    """Every name that appears in a node's cache directory while the scenario runs."""

    def __init__(self, path):
        self.path = path
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.02):
            try:
                self.seen.update(os.listdir(self.path))
            except OSError:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_disk_full_download_fails_cleanly_and_placement_moves_on(bed, tmp_path):
    big_url = bed.weights.add("big/model.gguf", size=WEIGHTS_BYTES, framing="chunked")  # no length to learn
    sized_url = bed.weights.add("sized/model.gguf", size=WEIGHTS_BYTES)
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": "60s"}}
    inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=[], profiles=profiles)
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    try:
        ctl = Ctl(gateway)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.create_key("disk"), max_retries=0)

        def nodes():
            return {n["name"]: n for n in ctl.json("nodes")["nodes"]}

        wait_for(lambda: all(n["state"] == "ready" and n["disk"] for n in nodes().values()), 60,
                 "both nodes ready with their disks reported")
        cramped_cache = bed["cramped"].host_path(bed["cramped"].cache_dir)
        roomy_cache = bed["roomy"].host_path(bed["roomy"].cache_dir)

        # 1. Size unknown: the first try lands on cramped and runs out of space mid-download.
        (tmp_path / "big.yaml").write_text(f"name: big\nprofile: cpu\nweights: {big_url}\nscaling: {{min: 1}}\n")
        with CacheWatch(cramped_cache) as watch:
            ctl.ok("model", "add", "-f", str(tmp_path / "big.yaml"))
            serving = wait_for(lambda: [r for r in ctl.json("replicas")["replicas"]
                                        if r["model"] == "big" and r["serving"]], 120,
                               f"big to serve\n{gateway.log()[-3000:]}")
        replicas = [r for r in ctl.json("replicas")["replicas"] if r["model"] == "big"]
        failed = [r for r in replicas if r["state"] == "failed"]
        cache_name = next(name for name in os.listdir(roomy_cache) if name.startswith("llmgw-"))
        big_requests = [client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}])
                        for _ in range(5)]
        cramped_left = sorted(os.listdir(cramped_cache))
        fs = os.statvfs(cramped_cache)
        cramped_used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        storage = {n["node"]: n for n in ctl.json("storage")["nodes"]}
        text = ctl.ok("replicas").stdout

        print(f"\nbig (48 MB, size not declared): {len(replicas)} launches; "
              + "; ".join(f"{r['shards'][0]['node']}: {r['state']}" + (f" ({r['shards'][0]['reason']})"
                                                                        if r["shards"][0]["reason"] else "")
                          for r in sorted(replicas, key=lambda r: r["created_at"])))
        print(f"cramped cache during the run saw {sorted(watch.seen)}; left now: {cramped_left} "
              f"({cramped_used} bytes used)")
        print(f"roomy cache: {sorted(os.listdir(roomy_cache))}; "
              f"weights server sent big {bed.weights.hits(big_url)} times")
        print(f"big: {len(big_requests)} requests sent, {len(big_requests)} succeeded")

        assert len(replicas) == 2 and len(failed) == 1, replicas
        shard = failed[0]["shards"][0]
        assert shard["node"] == "cramped"
        assert shard["reason"].startswith("not enough disk space: no space left in the cache directory"), shard
        assert "not enough disk space" in text
        assert [r["shards"][0]["node"] for r in serving] == ["roomy"]
        # Written under a temporary name only; the complete name never appeared on cramped.
        assert cache_name not in watch.seen
        assert any(name.startswith(f".tmp-{cache_name}-") for name in watch.seen), watch.seen
        # The partial data is gone, and cramped is not taken to hold weights.
        assert cramped_left == [] and cramped_used < 1 << 20
        assert not storage["cramped"]["holdings"]
        assert [h["model"] for h in storage["roomy"]["holdings"]] == ["big"]
        assert os.path.exists(os.path.join(roomy_cache, cache_name, COMPLETE_MARKER))
        assert bed.weights.hits(big_url) == 2
        assert all(r.choices[0].message.content.startswith("big") for r in big_requests)

        # 2. Size learned from the source: placement knows cramped is too small and never tries it.
        (tmp_path / "sized.yaml").write_text(f"name: sized\nprofile: cpu\nweights: {sized_url}\nscaling: {{min: 1}}\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "sized.yaml"))
        wait_for(lambda: [r for r in ctl.json("replicas")["replicas"] if r["model"] == "sized" and r["serving"]],
                 120, f"sized to serve\n{gateway.log()[-3000:]}")
        sized = [r for r in ctl.json("replicas")["replicas"] if r["model"] == "sized"]
        verdicts = {v["node"]: v for v in ctl.json("explain-placement", "sized")["verdicts"]}
        sized_requests = [client.chat.completions.create(model="sized", messages=[{"role": "user", "content": "hi"}])
                          for _ in range(5)]
        print(f"sized (48 MB learned from Content-Length): {len(sized)} launch on {[r['shards'][0]['node'] for r in sized]}; "
              f"cramped's verdict: {verdicts['cramped']['reasons']}")
        print(f"sized: {len(sized_requests)} requests sent, {len(sized_requests)} succeeded; "
              f"weights server sent it {bed.weights.hits(sized_url)} time(s)")

        assert [(r["shards"][0]["node"], r["state"]) for r in sized] == [("roomy", "serving")]
        assert not verdicts["cramped"]["fits"]
        assert "has 0 GB free in its cache, needs 0.1" in verdicts["cramped"]["reasons"]
        assert bed.weights.hits(sized_url) == 1
        assert sorted(os.listdir(cramped_cache)) == []
        assert all(r.choices[0].message.content.startswith("sized") for r in sized_requests)
    finally:
        gateway.stop()
