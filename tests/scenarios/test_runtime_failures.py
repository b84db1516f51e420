"""Engines llmgw installs, when installing fails: each failure is the replica's reason in `ctl
replicas`, and nothing half-made is left counted as installed (R-4.10, R-4.11).

On a testbed node (the engine double on its PATH, a wheelhouse of a tiny package in its home):
- a venv whose package pip cannot find fails with pip's own last lines, and no environment is
  left under the helper's root;
- a venv built and serving, then changed behind llmgw's back: the next replica of that recipe is
  refused (`integrity`) and the changed environment is kept, never run nor removed.
On the local node, with the suite's Docker daemon (scripts/dockerd):
- an image the node does not have and cannot pull names the image and `docker load`.
"""

from __future__ import annotations

import os

import pytest

from tests.helper.wheels import probe_wheelhouse
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, sealed_envs, write_inventory
from tests.testbed import NodeSpec
from tests.testbed import images

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "bare"


def _failed_shard(ctl: Ctl, model: str):
    for replica in ctl.json("replicas")["replicas"]:
        if replica["model"] == model:
            for shard in replica["shards"]:
                if shard["state"] == "failed":
                    return shard
    return None


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec(NODE, mem_gb=32)])
    probe_wheelhouse(tb.nodes[NODE].home_dir / "wheels")  # /root/wheels inside the node
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runtime-failures")
    base = {"engine": "vllm", "runtime": "venv", "find_links": ["/root/wheels"], "python": "/usr/bin/python3",
            "start_timeout": "1h"}  # far beyond the waits below: a failure seen in time is not a timeout
    profiles = {"absent": {**base, "packages": ["llmgw-absent-package==1.0"]},
                "probe": {**base, "packages": ["llmgw-probe==1.0"]}}
    inventory = write_inventory(bed, tmp / "inventory.yaml", profiles=profiles, models=[
        {"name": "missing-package", "profile": "absent", "scaling": {"min": 1}},
        {"name": "probed", "profile": "probe", "scaling": {"min": 1}}])
    gw = GatewayProcess(inventory, tmp / "state").start()
    yield gw
    gw.stop()


def test_a_package_pip_cannot_find_fails_with_pips_words_and_leaves_no_environment(bed, gateway):
    ctl = Ctl(gateway)
    shard = wait_for(lambda: _failed_shard(ctl, "missing-package"), 120,
                     f"a failed launch of missing-package\n{gateway.log()[-2000:]}")
    print(f"\nshard reason: {shard['reason']}")
    assert "pip" in shard["reason"] and "llmgw-absent-package" in shard["reason"]
    assert "No matching distribution" in shard["reason"] or "Could not find a version" in shard["reason"]
    out = ctl.run("replicas").stdout
    assert "llmgw-absent-package" in out
    # The environment that served `probed` is the only one: the failed build left nothing.
    wait_for(lambda: ctl.json("replicas") and any(
        r["model"] == "probed" and r["serving"] for r in ctl.json("replicas")["replicas"]), 180,
        f"probed to serve\n{gateway.log()[-2000:]}")
    assert len(sealed_envs(bed, NODE)) == 1, sealed_envs(bed, NODE)


def test_a_changed_environment_is_refused_and_kept(bed, gateway):
    ctl = Ctl(gateway)
    (name,) = sealed_envs(bed, NODE)
    # Behind llmgw's back: a file of the sealed environment rewritten (its seal no longer holds).
    changed = bed.run(NODE, ["sh", "-c", f"cd /root/.llmgw/envs/{name} && f=$(ls lib/python3*/site-packages/"
                                          "llmgw_probe/__init__.py) && chmod u+w \"$f\" && echo '# planted' >> \"$f\""
                                          " && echo done"])
    assert changed.stdout.strip() == "done", changed.stderr
    status, answer = gateway.admin("/api/models", "POST", b"name: probed-2\nprofile: probe\nscaling: {min: 1}\n")
    assert status == 201, answer
    shard = wait_for(lambda: _failed_shard(ctl, "probed-2"), 120, f"a refused launch\n{gateway.log()[-2000:]}")
    print(f"\nshard reason: {shard['reason']}")
    assert "is not an environment llmgw built and sealed" in shard["reason"]
    # Refused by provision when it walks the environment, else by the launch right after, which
    # always does (provision answers a seal file it found sealed before from that file alone).
    assert "never run nor removed" in shard["reason"] or "the engine was not started, nothing was removed" in \
        shard["reason"]
    assert sealed_envs(bed, NODE) == [name], "the changed environment is kept for the operator to look at"


def test_an_image_the_node_has_not_and_cannot_pull_names_the_image_and_docker_load(tmp_path):
    reason = images.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the container tests must run under CI: {reason}")
        pytest.skip(reason)
    image = "llmgw-test/absent:1"
    (tmp_path / "inventory.yaml").write_text(
        "nodes: [{name: here, connection: local}]\n"
        f"profiles: {{boxed: {{engine: vllm, runtime: container, image: '{image}', container: docker,"
        " start_timeout: 1h}}\n"
        "models: [{name: boxed-model, profile: boxed, scaling: {min: 1}}]\n")
    gateway = GatewayProcess(tmp_path / "inventory.yaml", tmp_path / "state").start()
    try:
        ctl = Ctl(gateway)
        shard = wait_for(lambda: _failed_shard(ctl, "boxed-model"), 120, f"a failed pull\n{gateway.log()[-2000:]}")
        print(f"\nshard reason: {shard['reason']}")
        assert image in shard["reason"] and "docker load -i" in shard["reason"]
        assert images.docker_client().images.list(name="llmgw-test/absent") == []
    finally:
        gateway.stop()
