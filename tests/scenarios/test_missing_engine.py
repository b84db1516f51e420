"""A node without the engine's program: the replica fails at once, and says which program is
missing and how to install it (R-4.2, R-4.8)."""

from __future__ import annotations

import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]


def test_a_node_without_the_engine_fails_the_replica_with_how_to_install_it(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec("bare", gpus=None, mem_gb=32)])
    try:
        (bed.nodes["bare"].bin_dir / "llama-server").unlink()  # this node never had llama.cpp
        # A start timeout far beyond the wait below: a failure seen in time was not a timeout.
        profiles = {"cpu": {"engine": "llama-server", "start_timeout": "1h"}}
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", profiles=profiles,
                                    models=[{"name": "chat", "profile": "cpu", "scaling": {"min": 1}}])
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        try:
            ctl = Ctl(gateway)

            def failed_shard():
                for replica in ctl.json("replicas")["replicas"]:
                    for shard in replica["shards"]:
                        if shard["state"] == "failed":
                            return shard
                return None

            shard = wait_for(failed_shard, 60, f"a failed launch of chat\n{gateway.log()[-2000:]}")
            print(f"\nshard reason: {shard['reason']}")
            assert shard["reason"].startswith("engine llama-server is not installed on bare: llama-server is not on PATH=")
            assert "build llama.cpp's llama-server on the node" in shard["reason"]
            assert shard["log_tail"] is None, "nothing was started, so there is no engine log"
        finally:
            gateway.stop()
    finally:
        bed.close()
