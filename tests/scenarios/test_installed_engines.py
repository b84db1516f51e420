"""Engines llmgw installed, seen and collected like weights (R-4.12), on a testbed node: an
environment built for a venv profile (a tiny package from a wheelhouse in the node's home; the
engine double stays the engine) is listed by `ctl engines` with the profile wanting it and the
shard running from it; while a profile wants it `ctl reclaim` leaves it alone; once the profile
leaves the inventory (reload) and its replica is gone, `ctl reclaim` lists it and `--collect`
removes it, on the node. A second environment, unwanted too, goes at the node's low-water mark
with the weights' clean-up, while the one still wanted and running stays.
"""

from __future__ import annotations

import pytest
import yaml

from tests.helper.wheels import probe_wheelhouse
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, sealed_envs, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "bare"


def test_an_environment_is_listed_kept_while_wanted_and_collected_once_unwanted(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec(NODE, mem_gb=32)])
    try:
        probe_wheelhouse(bed.nodes[NODE].home_dir / "wheels")
        profile = {"engine": "vllm", "runtime": "venv", "packages": ["llmgw-probe==1.0"],
                   "find_links": ["/root/wheels"], "python": "/usr/bin/python3"}
        # Another recipe of the same package: another environment.
        other = {**profile, "post_install": ["python -c 'import llmgw_probe'"]}
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", profiles={"probe": profile, "other": other},
                                    models=[{"name": "probed", "profile": "probe", "scaling": {"min": 1}},
                                            {"name": "other", "profile": "other", "scaling": {"min": 1}}])
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        try:
            ctl = Ctl(gateway)

            def serving(model):
                return any(r["model"] == model and r["serving"] for r in ctl.json("replicas")["replicas"])

            def gone(model):
                return not [r for r in ctl.json("replicas")["replicas"] if r["model"] == model and not r["retired"]]
            for model in ("probed", "other"):
                wait_for(lambda: serving(model), 180, f"{model} to serve\n{gateway.log()[-2000:]}")
            assert len(sealed_envs(bed, NODE)) == 2
            (node,) = ctl.json("engines")["nodes"]
            rows = {row["wanted_by"][0]: row for row in node["engines"]}
            assert sorted(rows) == ["other", "probe"]
            row = rows["probe"]
            assert row["kind"] == "venv" and row["state"] == "sealed" and row["name"] in sealed_envs(bed, NODE)
            assert row["what"] == "llmgw-probe==1.0" and row["version"].startswith("python 3.")
            assert row["wanted_by"] == ["probe"] and len(row["used_by"]) == 1
            assert row["bytes"] > 0 and row["last_used"] is not None
            text = ctl.ok("engines").stdout
            assert "llmgw-probe==1.0" in text and "sealed" in text and "probe" in text

            # Wanted: reclaim offers neither.
            listed = ctl.json("reclaim")
            assert not [e for n in listed["nodes"] for e in n["entries"] if e["kind"] == "venv"]

            # `other` leaves the inventory, and a low-water mark the cache is always below is set:
            # its environment goes with the clean-up; probe's, wanted and running, stays.
            doc = yaml.safe_load(inventory.read_text())
            del doc["profiles"]["other"]
            doc["models"] = [m for m in doc["models"] if m["name"] != "other"]
            doc["gateway"]["cache_low_water"] = "10GB"  # more than the whole cache filesystem
            inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            ctl.ok("reload")
            wait_for(lambda: gone("other"), 120, "the replica of other to go")
            wait_for(lambda: sealed_envs(bed, NODE) == [rows["probe"]["name"]], 150,
                     f"the clean-up to remove other's environment\n{gateway.log()[-2000:]}")
            # The node removes it before its answer reaches the control plane, which then records it.
            wait_for(lambda: rows["other"]["name"] in [r["name"] for r in
                                                        ctl.json("storage")["nodes"][0]["cleanup"]["removed"]], 30,
                     f"the clean-up's removal recorded\n{gateway.log()[-2000:]}")
            assert serving("probed")

            # probe leaves too (the mark off again): reclaim lists its environment, --collect removes it.
            del doc["profiles"]["probe"]
            doc["models"] = []
            doc["gateway"]["cache_low_water"] = "off"
            inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            ctl.ok("reload")
            wait_for(lambda: gone("probed"), 120, "the replica of probed to go")

            def offered():
                answer = ctl.json("reclaim")
                found = [e for n in answer["nodes"] for e in n["entries"] if e["kind"] == "venv"]
                return found or None
            (entry,) = wait_for(offered, 60, "the environment offered by reclaim once its shard stopped")
            assert entry["name"] == rows["probe"]["name"] and entry["action"] == "listed"
            assert "1 engine" in ctl.ok("reclaim").stdout
            collected = ctl.json("reclaim", "--collect")
            (removed,) = [e for n in collected["nodes"] for e in n["entries"] if e["kind"] == "venv"]
            assert removed["action"] == "removed", removed
            assert sealed_envs(bed, NODE) == []
            assert ctl.json("engines")["nodes"][0]["engines"] == []
        finally:
            gateway.stop()
    finally:
        bed.close()
