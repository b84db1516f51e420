"""Engines in containers through the helper, on the real Docker daemon (R-4.10): the image
provisioned or refused with the command that loads it, the template's command in place of the
entrypoint with host networking, the key kept out of argv, labels, adoption by a new helper
without a restart, stop removing the container, and a container llmgw did not make left alone.

The engine is busybox's httpd (an image made here, tests/testbed/images.py): it listens on the
shard's port and answers /health, which is all these behaviours need; the real vLLM in a
container is tests/integration/test_real_vllm_container.py.
"""

import json
import os
import subprocess

import pytest

from tests.helper.client import HelperClient, process_running, wait_until
from tests.helper.conftest import free_port
from tests.testbed import images

SECRET = "container-engine-key-9f3b"


@pytest.fixture(scope="module")
def image():
    reason = images.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the container tests must run under CI: {reason}")
        pytest.skip(reason)
    return images.busybox_image(images.docker_client())


@pytest.fixture
def docker():
    client = images.docker_client()
    made = []
    yield client, made
    for name in made:
        try:
            client.containers.get(name).remove(force=True)
        except Exception:
            pass


def _runtime(image, **extra):
    runtime = {"kind": "container", "image": image, "container": "docker", "pull": "if_missing",
               "labels": {"llmgw.replica": "r-test"}}
    runtime.update(extra)
    return runtime


def _launch(helper, shard_id, image, port, **extra):
    args = {"shard_id": shard_id, "argv": ["httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", "/www"],
            "env": {"ENGINE_KEY": SECRET}, "port": port, "host": "127.0.0.1",
            "health_url": f"http://127.0.0.1:{port}/health", "gpus": None, "runtime": _runtime(image)}
    args.update(extra)
    return helper.call("launch", args, timeout=90)


def _shard(helper, shard_id, **args):
    return next(s for s in helper.call("status", args)["shards"] if s["shard_id"] == shard_id)


def _running_container(helper, shard_id):
    def known():
        shard = _shard(helper, shard_id)
        return shard if (shard["container"] or {}).get("id") else None
    return wait_until(known, 60, message=f"the container of {shard_id} recorded")


def test_present_image_is_provisioned_without_a_registry(helper, image):
    result = helper.call("provision", {"runtime": _runtime(image)})
    assert result["kind"] == "container" and result["image"] == image and result["pulled"] is False
    assert result["image_id"].startswith("sha256:")


def test_unpullable_image_names_the_image_and_how_to_load_it(helper, image):
    answer = helper.request("provision", {"runtime": _runtime("llmgw-test/absent:1")}, timeout=120)
    assert answer["ok"] is False, answer
    assert answer["error"]["kind"] == "provision_failed"
    message = answer["error"]["message"]
    assert "llmgw-test/absent:1" in message and "docker load -i" in message


def test_launch_of_an_absent_image_is_refused_before_anything_starts(helper, image, installed):
    answer = helper.request("launch", {"shard_id": "absent", "argv": ["httpd"], "env": {}, "port": None,
                                       "runtime": _runtime("llmgw-test/absent:1")}, timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "engine_missing", answer
    assert "llmgw-test/absent:1" in answer["error"]["message"]
    assert not (installed.root / "shards" / "absent" / "state.json").exists()


def test_a_missing_container_program_is_named(helper, image):
    answer = helper.request("provision", {"runtime": _runtime(image, container="podman")})
    assert answer["ok"] is False and answer["error"]["kind"] == "runtime_missing", answer
    assert "podman" in answer["error"]["message"]


def test_container_engine_serves_on_the_host_network_and_is_adopted_then_removed(
        helper, image, installed, base_env, docker):
    client, made = docker
    made.append("llmgw-c1")
    port = free_port()
    launched = _launch(helper, "c1", image, port)
    shard = _running_container(helper, "c1")
    container = shard["container"]
    assert container["image"] == image and container["image_id"].startswith("sha256:")
    assert container["state"] == "alive" and shard["alive"] is True

    # The health probe counts: the listener is the container's own process, seen from the host.
    probed = wait_until(lambda: (s := _shard(helper, "c1", probe=True))["health"]["status"] == 200 and s,
                        30, message="the container's health answer")
    assert probed["health"]["error"] is None

    # The key travels by name: never in the client's argv, in the container's environment.
    with open(f"/proc/{launched['pid']}/cmdline", "rb") as handle:
        argv = handle.read().decode()
    assert SECRET not in argv and "ENGINE_KEY" in argv
    inspected = client.containers.get(container["id"])
    assert f"ENGINE_KEY={SECRET}" in inspected.attrs["Config"]["Env"]
    labels = inspected.labels
    assert labels["llmgw.shard"] == "c1" and labels["llmgw.replica"] == "r-test" and labels["llmgw.fleet"]
    assert inspected.attrs["HostConfig"]["NetworkMode"] == "host"
    shard_dir = str(installed.root / "shards" / "c1")
    mounts = {m["Destination"]: m for m in inspected.attrs["Mounts"]}
    assert mounts[shard_dir]["RW"] is False and mounts[shard_dir]["Source"] == shard_dir
    assert inspected.attrs["Config"]["Entrypoint"] == ["httpd"]

    # A new helper (the control plane restarted) finds the same container running: adopted.
    helper.kill()
    again = HelperClient(installed.path, installed.sha, installed.root, env=base_env)
    try:
        again.wait_hello()
        adopted = _shard(again, "c1")
        assert adopted["alive"] is True and adopted["container"]["id"] == container["id"]
        assert adopted["container"]["state"] == "alive"
        assert client.containers.get(container["id"]).attrs["State"]["StartedAt"] == inspected.attrs["State"]["StartedAt"]

        stopped = again.call("stop", {"shard_id": "c1", "grace": 5.0}, timeout=60)
        assert stopped == {"was_alive": True, "stopped": True}
        assert not process_running(launched["pid"])
        names = [c.name for c in client.containers.list(all=True)]
        assert "llmgw-c1" not in names
        ended = wait_until(lambda: (s := _shard(again, "c1"))["ended_at"] and s, 30, message="the exit recorded")
        assert ended["alive"] is False
    finally:
        again.kill()


def test_a_container_killed_behind_llmgws_back_is_seen_as_ended(helper, image, docker):
    client, made = docker
    made.append("llmgw-c2")
    _launch(helper, "c2", image, free_port())
    container = _running_container(helper, "c2")["container"]
    client.containers.get(container["id"]).kill()
    ended = wait_until(lambda: (s := _shard(helper, "c2"))["exit_code"] is not None and s, 30,
                       message="the killed container's exit recorded")
    assert ended["alive"] is False and ended["exit_code"] != 0
    assert "llmgw-c2" not in [c.name for c in client.containers.list(all=True)]


def test_a_container_of_the_name_llmgw_did_not_make_is_refused_and_kept(helper, image, docker, installed):
    client, made = docker
    made.append("llmgw-c3")
    planted = client.containers.run(image, ["sleep", "300"], name="llmgw-c3", detach=True, network_mode="host")
    answer = helper.request("launch", {"shard_id": "c3", "argv": ["httpd", "-f", "-p", f"127.0.0.1:{free_port()}"],
                                       "env": {}, "port": None, "runtime": _runtime(image)}, timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "identity", answer
    assert client.containers.get(planted.id).status == "running"


def test_gpus_become_the_toolkits_device_list_not_cuda_visible_devices(helper, image, installed, docker):
    # No GPU here: the command is checked as the supervisor recorded it (docker refuses --gpus
    # without the NVIDIA runtime, and that refusal is the engine's exit).
    client, made = docker
    made.append("llmgw-g1")
    launched = _launch(helper, "g1", image, free_port(), gpus=[2, 3])
    assert launched["argv"][launched["argv"].index("--gpus") + 1] == '"device=2,3"'
    state = json.loads((installed.root / "shards" / "g1" / "state.json").read_text())
    assert "CUDA_VISIBLE_DEVICES" not in " ".join(state["argv"])
    wait_until(lambda: _shard(helper, "g1")["exit_code"] is not None, 60, message="docker's refusal of --gpus")
    log = subprocess.run(["cat", str(installed.root / "shards" / "g1" / "engine.log")], capture_output=True,
                         text=True).stdout
    assert "gpu" in log.lower()


def test_inventory_reports_the_daemon_its_runtimes_and_which_images_it_holds(helper, image):
    """R-4.12: what placement reads. This daemon has no NVIDIA runtime; the answer says so only
    as far as it is true here (the hook may be installed on another machine running the suite)."""
    import shutil

    info = images.docker_client().info()
    found = helper.call("inventory", {"images": [image, "llmgw-test/absent:1"]})["containers"]["docker"]
    assert found["path"] == shutil.which("docker") and found["answers"] is True and found["error"] is None, found
    assert found["runtimes"] == sorted(info["Runtimes"])
    assert found["gpu"] is ("nvidia" in info["Runtimes"] or shutil.which("nvidia-container-runtime-hook") is not None)
    assert found["images"] == {image: True, "llmgw-test/absent:1": False}


def _record(installed, image, **fields):
    """The helper's record of an image, as a helper of this fleet writes it (the test knows the
    fleet secret): used to stand for a pull, which no registry here can give."""
    from tests.helper.client import load_helper
    helper_module = load_helper()
    client = images.docker_client()
    record = {"image": image, "program": "docker", "image_id": client.images.get(image).id, "pulled": True,
              "first_used": 1.0, "last_used": 2.0}
    record.update(fields)
    record["mac"] = helper_module.image_record_mac(installed.secret, record)
    name = helper_module.image_record_name("docker", image)
    directory = installed.root / "images"
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(record))
    return name


def test_images_used_are_listed_and_only_one_llmgw_pulled_is_removed(helper, image, installed, docker):
    client, _ = docker
    helper.call("provision", {"runtime": _runtime(image)})
    listed = {e["image"]: e for e in helper.call("envs", {})["images"]}
    mine = listed[image]
    assert mine["present"] is True and mine["pulled"] is False and mine["bytes"] > 0 and mine["used_by"] == []
    assert mine["id"] == client.images.get(image).id
    # Present before llmgw used it: never removed.
    (refused,) = helper.call("reclaim", {"images": [mine["name"]], "collect": True})["images"]
    assert refused["action"] == "refused" and "llmgw removes only images it pulled" in refused["reason"]
    assert client.images.get(image)
    # A copy llmgw "pulled" (its record says so, under the fleet secret) goes; a forged record does not.
    copy = "llmgw-test/busybox-copy:1"
    client.images.get(image).tag(copy)
    client.images.get(image).tag("llmgw-test/busybox-forged:1")
    pulled = _record(installed, copy)
    forged = _record(installed, "llmgw-test/busybox-forged:1")
    forged_path = installed.root / "images" / f"{forged}.json"
    forged_path.write_text(forged_path.read_text().replace('"mac": "', '"mac": "0'))
    try:
        wanted = helper.call("envs", {"wanted": {"boxed": _runtime(copy), "odd": {"kind": "container"}}})["wanted"]
        assert wanted["boxed"] == {"name": pulled, "error": None}
        assert wanted["odd"]["name"] is None and "image" in wanted["odd"]["error"]
        answer = helper.call("reclaim", {"images": [pulled, forged, "../etc"], "collect": True})["images"]
        by_name = {e["name"]: e for e in answer}
        assert by_name[pulled]["action"] == "removed", by_name[pulled]
        assert by_name[forged]["action"] == "refused" and "not written by this fleet" in by_name[forged]["reason"]
        assert by_name["../etc"]["action"] == "refused"
        assert client.images.list(name="llmgw-test/busybox-copy") == []
        assert client.images.list(name="llmgw-test/busybox-forged")
        assert client.images.get(image)  # the same image id, still tagged as the profile's image
    finally:
        for tag in (copy, "llmgw-test/busybox-forged:1"):
            try:
                client.images.remove(tag)
            except Exception:
                pass


def test_an_image_a_live_shard_runs_is_not_removed(helper, image, installed, docker):
    client, made = docker
    copy = "llmgw-test/busybox-live:1"
    client.images.get(image).tag(copy)
    name = _record(installed, copy)
    port = free_port()
    made.append("llmgw-live")
    _launch(helper, "live", copy, port)
    try:
        _running_container(helper, "live")
        (entry,) = helper.call("reclaim", {"images": [name], "collect": True})["images"]
        assert entry["action"] == "refused" and "live" in entry["reason"], entry
        assert client.images.list(name="llmgw-test/busybox-live")
    finally:
        helper.call("stop", {"shard_id": "live", "grace": 5}, timeout=60)
        client.images.remove(copy, force=True)
