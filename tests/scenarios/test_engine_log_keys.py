"""An engine that prints its key (SGLang prints its server arguments, api_key included) never
shows it through llmgw: `ctl logs` and the stored log tail carry *** instead (R-1.6, R-4.8)."""

from __future__ import annotations

import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]


def test_ctl_logs_of_sglang_shows_no_engine_key(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec.gpu_node("g1", count=1)])
    try:
        profiles = {"sg": {"engine": "sglang", "gpus": 1}}
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", profiles=profiles,
                                    models=[{"name": "chat", "profile": "sg", "scaling": {"min": 1}}])
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        try:
            ctl = Ctl(gateway)
            replica = wait_for(lambda: next((r for r in ctl.json("replicas")["replicas"] if r["serving"]), None),
                               60, f"chat to serve\n{gateway.log()[-2000:]}")
            text = ctl.ok("logs", replica["id"], "-n", "50").stdout
            print(f"\n{next(line for line in text.splitlines() if 'server_args=' in line)}")
            assert "api_key='***'" in text
            assert "llmgw-engine-" not in text, "an engine key reached the operator's terminal"
            engine_log = next(bed.nodes["g1"].dir.rglob("engine.log")).read_text()
            assert "api_key='llmgw-engine-" in engine_log, "the double printed its key, as SGLang does"
        finally:
            gateway.stop()
    finally:
        bed.close()
