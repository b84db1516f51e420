"""A profile whose runtime this control plane does not launch yet (R-4.9, R-4.10, R-4.11): its
replica fails with that reason on a real local node, and nothing is started from the node's PATH."""

from __future__ import annotations

import yaml

from tests.integration.gateway import GatewayProcess, wait_for


def test_a_container_profile_fails_its_replica_with_the_reason_and_starts_nothing(tmp_path):
    inventory = {
        "nodes": [{"name": "here", "connection": "local"}],
        # The engine's program exists on this PATH: run from the host, it would start.
        "engines": {"sleeper": {"command": ["sleep", "300"], "health": "/health"}},
        "profiles": {"boxed": {"engine": "sleeper", "runtime": "container", "image": "example/engine:1"}},
        "models": [{"name": "boxed-model", "profile": "boxed", "scaling": {"min": 1}}],
    }
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inventory))
    gateway = GatewayProcess(path, tmp_path / "state").start()
    try:
        def failed():
            status, answer = gateway.admin("/api/replicas")
            assert status == 200, answer
            shards = [s for r in answer["replicas"] if r["model"] == "boxed-model" for s in r["shards"]]
            return next((s for s in shards if s["state"] == "failed"), None)
        shard = wait_for(failed, 60, "the replica of the container profile to fail")
        assert "runtime: container is not supported" in shard["reason"], shard
        assert shard["port"] is None
    finally:
        gateway.stop()
