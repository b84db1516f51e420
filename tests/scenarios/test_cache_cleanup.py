"""A cache filled past its low-water mark is cleaned down to the mark, least recently used first,
without touching wanted or pinned entries (R-5.5).

One CPU node, `disk`, with a 40 MiB tmpfs cache and a mark of 20 MB free. Three models with 6 MB
of weights each are added and serve one after the other (`pinned`, whose source the gateway pins,
then `older`, then `newer`: each launch marks its entry as used), then all three are removed, so
their entries are unwanted and the cache still has about 24 MB free. A fourth model, `wanted`,
is added: its download takes the free space below the mark, and the clean-up removes exactly the
oldest entry that is neither wanted nor pinned, `older`, which brings the filesystem back above
the mark.
"""

from __future__ import annotations

import os
import sqlite3
import time

import pytest
import yaml

from llmgw.weights import parse_weights
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

WEIGHTS_BYTES = 6 * 1000**2
MARK = "20MB"


@pytest.fixture
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("disk", gpus=None, mem_gb=32, cache_mb=40)])
    yield tb
    tb.close()


def test_cache_past_the_low_water_mark_is_cleaned_down_to_it(bed, tmp_path):
    urls = {name: bed.weights.add(f"{name}/model.gguf", size=WEIGHTS_BYTES)
            for name in ("pinned", "older", "newer", "wanted")}
    names = {name: parse_weights(url).cache_name for name, url in urls.items()}
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": "60s"}}
    inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=[], profiles=profiles)
    doc = yaml.safe_load(inventory.read_text())
    doc["gateway"].update({"cache_low_water": MARK, "pinned_weights": [urls["pinned"]]})
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    cache = bed["disk"].host_path(bed["disk"].cache_dir)

    def free():
        fs = os.statvfs(cache)
        return fs.f_bavail * fs.f_frsize

    def serving(model):
        return [r for r in ctl.json("replicas")["replicas"] if r["model"] == model and r["serving"]]

    def storage():
        return ctl.json("storage")["nodes"][0]

    try:
        ctl = Ctl(gateway)
        wait_for(lambda: storage()["disk"], 60, "the node's disk reported")
        started = time.monotonic()
        for model in ("pinned", "older", "newer"):
            (tmp_path / f"{model}.yaml").write_text(
                f"name: {model}\nprofile: cpu\nweights: {urls[model]}\nscaling: {{min: 1}}\n")
            ctl.ok("model", "add", "-f", str(tmp_path / f"{model}.yaml"))
            wait_for(lambda: serving(model), 60, f"{model} to serve\n{gateway.log()[-3000:]}")
        used = {model: os.stat(cache / names[model] / ".llmgw-complete").st_mtime for model in ("pinned", "older", "newer")}
        for model in ("pinned", "older", "newer"):
            ctl.ok("model", "remove", model)
        wait_for(lambda: not ctl.json("replicas")["replicas"], 60, "the removed models' replicas to stop")
        free_before = free()
        cleanup_before = storage()["cleanup"]

        (tmp_path / "wanted.yaml").write_text(f"name: wanted\nprofile: cpu\nweights: {urls['wanted']}\nscaling: {{min: 1}}\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "wanted.yaml"))
        wait_for(lambda: serving("wanted"), 60, f"wanted to serve\n{gateway.log()[-3000:]}")
        cleanup = wait_for(lambda: storage()["cleanup"]["removed"] and storage()["cleanup"], 90,
                           f"the clean-up to run\n{gateway.log()[-3000:]}")
        elapsed = time.monotonic() - started
        left = sorted(n for n in os.listdir(cache) if n.startswith("llmgw-"))
        text = ctl.ok("storage").stdout
        with sqlite3.connect(tmp_path / "state" / "state.db") as db:
            audit = db.execute("SELECT actor, action, target, detail FROM audit WHERE actor = 'cleanup'").fetchall()

        by_name = {v: k for k, v in names.items()}
        print("\nlast use (marker mtime, s after pinned's): "
              + ", ".join(f"{m} +{used[m] - used['pinned']:.1f}" for m in ("pinned", "older", "newer")))
        print(f"free before wanted: {free_before} bytes (mark {MARK}); after the clean-up: {free()} bytes")
        print(f"removed: {[(by_name.get(r['name']), r['bytes'], r['mark']) for r in cleanup['removed']]}; "
              f"left: {[by_name.get(n) for n in left]}; result: {cleanup['last_result']}; {elapsed:.1f} s in all")
        print(f"audit: {audit}")

        assert used["pinned"] < used["older"] < used["newer"]
        assert free_before >= 20 * 1000**2 and cleanup_before["removed"] == []  # above the mark: nothing yet
        assert cleanup["mark"] == "20.0 MB" and cleanup["threshold_bytes"] == 20 * 1000**2
        assert [r["name"] for r in cleanup["removed"]] == [names["older"]]
        assert left == sorted([names["pinned"], names["newer"], names["wanted"]])
        assert free() >= 20 * 1000**2
        assert [(a, b, c) for a, b, c, _ in audit] == [("cleanup", "cache.remove", "disk")]
        assert names["older"] in audit[0][3] and '"mark": "20.0 MB"' in audit[0][3]
        assert "Removed by the clean-up" in text and names["older"] in text
    finally:
        gateway.stop()
