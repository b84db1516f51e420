"""Engines llmgw installed, seen and collected like weights (R-4.12), on a testbed node: an
environment built for a venv profile (a tiny package from a wheelhouse in the node's home; the
engine double stays the engine) is listed by `ctl engines` with the profile wanting it and the
shard running from it; while a profile wants it `ctl reclaim` leaves it alone; once the profile
leaves the inventory (reload) and its replica is gone, `ctl reclaim` lists it and `--collect`
removes it, on the node.
"""

from __future__ import annotations

import pytest
import yaml

from tests.helper.wheels import probe_wheelhouse
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "bare"


def _sealed(bed) -> list[str]:
    found = bed.run(NODE, ["sh", "-c", "cd /root/.llmgw/envs 2>/dev/null && for d in venv-*; do "
                                       "[ -f \"$d/.llmgw-complete\" ] && echo \"$d\"; done; true"])
    return found.stdout.split()


def test_an_environment_is_listed_kept_while_wanted_and_collected_once_unwanted(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec(NODE, mem_gb=32)])
    try:
        probe_wheelhouse(bed.nodes[NODE].home_dir / "wheels")
        profile = {"engine": "vllm", "runtime": "venv", "packages": ["llmgw-probe==1.0"],
                   "find_links": ["/root/wheels"], "python": "/usr/bin/python3"}
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", profiles={"probe": profile, "plain": {"engine": "vllm"}},
                                    models=[{"name": "probed", "profile": "probe", "scaling": {"min": 1}}])
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        try:
            ctl = Ctl(gateway)
            wait_for(lambda: any(r["model"] == "probed" and r["serving"] for r in ctl.json("replicas")["replicas"]),
                     180, f"probed to serve\n{gateway.log()[-2000:]}")
            (name,) = _sealed(bed)
            (node,) = ctl.json("engines")["nodes"]
            (row,) = node["engines"]
            assert row["kind"] == "venv" and row["name"] == name and row["state"] == "sealed"
            assert row["what"] == "llmgw-probe==1.0" and row["version"].startswith("python 3.")
            assert row["wanted_by"] == ["probe"] and len(row["used_by"]) == 1
            assert row["bytes"] > 0 and row["last_used"] is not None
            text = ctl.ok("engines").stdout
            assert "llmgw-probe==1.0" in text and "sealed" in text and "probe" in text

            # Wanted: reclaim offers nothing of it.
            listed = ctl.json("reclaim")
            assert not [e for n in listed["nodes"] for e in n["entries"] if e["kind"] == "venv"]

            # The profile leaves the inventory with its model: the environment is wanted by nobody.
            doc = yaml.safe_load(inventory.read_text())
            del doc["profiles"]["probe"]
            doc["models"] = []
            inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            ctl.ok("reload")
            wait_for(lambda: not [r for r in ctl.json("replicas")["replicas"] if r["model"] == "probed"
                                  and not r["retired"]], 120, "the replica of probed to go")

            def offered():
                answer = ctl.json("reclaim")
                found = [e for n in answer["nodes"] for e in n["entries"] if e["kind"] == "venv"]
                return found or None
            (entry,) = wait_for(offered, 60, "the environment offered by reclaim once its shard stopped")
            assert entry["name"] == name and entry["action"] == "listed"
            assert "1 engine" in ctl.ok("reclaim").stdout
            collected = ctl.json("reclaim", "--collect")
            (removed,) = [e for n in collected["nodes"] for e in n["entries"] if e["kind"] == "venv"]
            assert removed["action"] == "removed", removed
            assert _sealed(bed) == []
            assert ctl.json("engines")["nodes"][0]["engines"] == []
        finally:
            gateway.stop()
    finally:
        bed.close()
