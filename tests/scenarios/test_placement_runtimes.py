"""Placement knows the runtime, on real testbed nodes (R-4.12): `explain-placement` names what a
node lacks for a profile's runtime and what would make it fit, and a node that holds the
environment ranks before one that must build it.

- `a-cli`: the host's docker program is on its PATH, and no daemon answers it there (the node has
  no docker socket): docker is there and does not work.
- `b-nodocker`: no docker program at all (the host's are hidden inside this node).
A container profile fits neither; a venv profile whose interpreter no node has fits neither; a
venv profile built on `b-nodocker` (a model pinned there) then ranks `b-nodocker` first for a
second model of the same recipe, though `a-cli` comes first by name.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.helper.wheels import probe_wheelhouse
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

DOCKER_PROGRAMS = ("/usr/local/bin/docker", "/usr/bin/docker")


@pytest.fixture(scope="module")
def bed(testbed_factory):
    if shutil.which("docker") is None:
        pytest.skip("no docker program on this machine: a node with docker on its PATH cannot be made")
    tb = testbed_factory([NodeSpec("a-cli", mem_gb=32), NodeSpec("b-nodocker", mem_gb=32, labels={"role": "first"})])
    # Inside b-nodocker only (its mount namespace is private): each docker program is covered by
    # a file that is not executable, so the node has no docker on its PATH.
    stand_in = tb.nodes["b-nodocker"].dir / "not-docker"
    stand_in.write_text("")
    stand_in.chmod(0o644)
    for program in DOCKER_PROGRAMS:
        hidden = tb.run("b-nodocker", ["sh", "-c", f"[ ! -e {program} ] || mount --bind {stand_in} {program}; "
                                                   "command -v docker || echo none"])
        assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.strip() == "none", hidden.stdout
    seen = tb.run("a-cli", ["sh", "-c", "command -v docker; docker info --format '{{json .Runtimes}}'"])
    print(f"\na-cli sees docker at {seen.stdout.splitlines()[0]}: exit {seen.returncode}, {seen.stderr.strip()}")
    assert seen.returncode != 0, "a-cli must have a docker program whose daemon does not answer"
    probe_wheelhouse(tb.nodes["b-nodocker"].home_dir / "wheels")  # /root/wheels inside the node
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement-runtimes")
    probe = {"engine": "vllm", "runtime": "venv", "packages": ["llmgw-probe==1.0"], "find_links": ["/root/wheels"],
             "python": "/usr/bin/python3", "start_timeout": "1h"}
    profiles = {"boxed": {"engine": "vllm", "runtime": "container", "image": "llmgw-test/absent:1"},
                "far-python": {**probe, "python": "python3.0-absent"},
                "probe-pinned": {**probe, "node_selector": {"role": "first"}},
                "probe": probe}
    inventory = write_inventory(bed, tmp / "inventory.yaml", profiles=profiles, models=[
        {"name": "boxed-model", "profile": "boxed", "scaling": {"min": 0}},
        {"name": "far-model", "profile": "far-python", "scaling": {"min": 0}},
        {"name": "probed", "profile": "probe-pinned", "scaling": {"min": 1}},
        {"name": "probed-too", "profile": "probe", "scaling": {"min": 0}}])
    gw = GatewayProcess(inventory, tmp / "state").start()
    yield gw
    gw.stop()


def _verdicts(ctl: Ctl, model: str) -> dict:
    return {v["node"]: v for v in ctl.json("explain-placement", model)["verdicts"]}


def test_a_container_profile_names_the_missing_program_and_the_daemon_that_does_not_answer(gateway):
    ctl = Ctl(gateway)
    # Until both nodes' inventories are in, a node is "not checked yet" and fits.
    verdicts = wait_for(lambda: (v := _verdicts(ctl, "boxed-model")) and len(v) == 2
                        and not any(x["fits"] for x in v.values()) and v, 60,
                        f"both nodes judged for boxed-model\n{gateway.log()[-2000:]}")
    print(f"\na-cli: {verdicts['a-cli']['reasons']}\nb-nodocker: {verdicts['b-nodocker']['reasons']}")
    assert verdicts["b-nodocker"]["reasons"] == [
        "no docker or podman on PATH: install docker or podman, or use runtime: host"]
    (reason,) = verdicts["a-cli"]["reasons"]
    assert reason.startswith("docker does not work on the node (docker cannot reach its daemon (DOCKER_HOST=unset): ")
    assert "Cannot connect to the Docker daemon" in reason
    assert reason.endswith("start its daemon, or set DOCKER_HOST for the node's helper, or use runtime: host")
    explanation = ctl.json("explain-placement", "boxed-model")
    assert explanation["placeable"] is False
    assert explanation["summary"] == ("no node fits: 1 has a container program that does not work, "
                                      "1 has no container program")
    text = ctl.ok("explain-placement", "boxed-model").stdout
    assert "no docker or podman on PATH: install docker or podman, or use runtime: host" in text


def test_a_venv_profile_names_the_missing_interpreter(gateway):
    ctl = Ctl(gateway)
    verdicts = wait_for(lambda: (v := _verdicts(ctl, "far-model")) and len(v) == 2
                        and not any(x["fits"] for x in v.values()) and v, 60, "both nodes judged for far-model")
    for node in ("a-cli", "b-nodocker"):
        assert verdicts[node]["reasons"] == ["no Python python3.0-absent on the node for its environment: install "
                                             "it, or set the profile's python to one the node has"]


def test_the_node_holding_the_environment_ranks_first(gateway):
    ctl = Ctl(gateway)
    wait_for(lambda: any(r["model"] == "probed" and r["serving"] for r in ctl.json("replicas")["replicas"]), 300,
             f"probed to serve on b-nodocker\n{gateway.log()[-2000:]}")
    # The next inventory (every 10 s) reports the environment built.
    explanation = wait_for(lambda: (e := ctl.json("explain-placement", "probed-too"))
                           and "has its environment" in e["verdicts"][0]["reasons"] and e, 60,
                           f"b-nodocker reported holding the environment\n{gateway.log()[-2000:]}")
    print(f"\nprobed-too: {explanation['summary']}; "
          + "; ".join(f"{v['node']}: {v['reasons']}" for v in explanation["verdicts"]))
    assert [(v["node"], v["fits"], v["holds_engine"]) for v in explanation["verdicts"]] == [
        ("b-nodocker", True, True), ("a-cli", True, False)]
    builds, estimate, packs = explanation["verdicts"][1]["reasons"]
    assert (builds, packs) == ("builds its environment", "packs: leaves 0 GPUs free")
    # The build b-nodocker made is what the estimate for a-cli is taken from.
    assert re.fullmatch(r"before its engine starts: about \d+ s \(build about \d+ s, as the last build took\)",
                        estimate), estimate
    assert explanation["verdicts"][1]["prepare_seconds"] > 0 and explanation["verdicts"][0]["prepare_seconds"] == 0
    assert explanation["plan"]["shards"][0]["node"] == "b-nodocker"
