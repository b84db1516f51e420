"""The real vLLM (the suite's CPU build) in a container on the local node (R-4.10).

The image is made here from that build (tests/testbed/images.py: `docker import`, no registry)
and run by the Docker daemon scripts/dockerd starts, with `runtime: container` in the profile:
llmgw provisions it (present, so no registry is asked), runs the built-in vLLM template's
command in place of the image's entrypoint with host networking and the model directory mounted
read-only, and the engine answers through the router with the official `openai` client. Checked
too: `ctl logs` reading the container's log, every engine path refused without the replica's
key, the key out of argv (in the container's environment, as the docs say), labels, adoption across a serve restart with the same
container, and stop removing the container. One engine starts for the module (a minute or two).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest
import yaml

from tests.integration import real_engines as rt
from tests.integration.gateway import GatewayProcess, wait_for
from tests.testbed import engines as real
from tests.testbed import images

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # an engine start in a setup, and a restart

MODEL = "tiny-boxed"
KEY = "container-tests"
START_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def docker():
    reason = images.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the container tests must run under CI: {reason}")
        pytest.skip(reason)
    return images.docker_client()


@pytest.fixture(scope="module")
def image(docker, tmp_path_factory):
    real.require("vllm")
    return images.vllm_image(docker, tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def gateway(docker, image, tmp_path_factory):
    chat = real.models()["chat"]
    tmp = tmp_path_factory.mktemp("boxed")
    # The engine's caches live in the container; the host's are not mounted (read-only mounts).
    env = {k: v for k, v in real.VLLM_TEST_ENV.items() if k not in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    inventory = {
        "nodes": [{"name": "here", "connection": "local", "model_dirs": [str(chat.parent)]}],
        "profiles": {"boxed": {"engine": "vllm", "runtime": "container", "image": image, "container": "docker",
                               "env": env, "start_timeout": f"{START_TIMEOUT:.0f}s"}},
    }
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(inventory))
    gw = GatewayProcess(path, tmp / "state").start()
    try:
        # Added at runtime, as `ctl model add` does, so that the last test may remove it.
        model = {"name": MODEL, "profile": "boxed", "weights": str(chat), "scaling": {"min": 1}}
        status, answer = gw.admin("/api/models", "POST", yaml.safe_dump(model).encode())
        assert status == 201, answer
        rt.wait_serving(gw, MODEL, START_TIMEOUT + 60)
        yield gw
    finally:
        gw.stop()
        for container in docker.containers.list(all=True, filters={"label": "llmgw.shard"}):
            if container.name.startswith("llmgw-"):
                container.remove(force=True)


@pytest.fixture(scope="module")
def client(gateway):
    return rt.new_client(gateway, KEY)[0]


def _container(docker, replica_id: str):
    found = docker.containers.list(filters={"label": f"llmgw.replica={replica_id}"})
    assert len(found) == 1, [c.name for c in found]
    return found[0]


def _shard(gateway):
    replica = rt.wait_serving(gateway, MODEL, 60)[0]
    return replica, replica["shards"][0]


def test_chat_and_a_stream_with_usage_through_the_router(gateway, client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 0


def test_the_container_is_labelled_and_runs_the_template_on_the_host_network(gateway, docker, image):
    replica, shard = _shard(gateway)
    container = _container(docker, replica["id"])
    assert container.labels["llmgw.shard"] and container.labels["llmgw.fleet"]
    attrs = container.attrs
    assert attrs["HostConfig"]["NetworkMode"] == "host"
    assert attrs["Config"]["Entrypoint"] == ["vllm"] and attrs["Config"]["Cmd"][0] == "serve"
    assert "--port" in attrs["Config"]["Cmd"] and str(shard["port"]) in attrs["Config"]["Cmd"]
    assert container.image.tags == [image]
    assert all(not m["RW"] for m in attrs["Mounts"])


def test_ctl_logs_reads_the_containers_log(gateway):
    replica, _ = _shard(gateway)
    text = rt.engine_log(gateway, replica["id"])
    assert "vLLM" in text and ("Application startup complete" in text or "Starting vLLM" in text), text[-2000:]


def test_every_engine_path_is_refused_without_the_key(gateway, docker):
    replica, shard = _shard(gateway)
    base = f"http://127.0.0.1:{shard['port']}"
    for method, path in (("GET", "/v1/models"), ("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics")):
        request = urllib.request.Request(base + path, method=method, data=b"{}" if method == "POST" else None,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, (path, refused.value.code)


def test_the_key_is_in_the_containers_environment_never_in_argv(gateway, docker):
    replica, _ = _shard(gateway)
    container = _container(docker, replica["id"])
    keys = [e.split("=", 1)[1] for e in container.attrs["Config"]["Env"] if e.startswith("VLLM_API_KEY=")]
    assert keys and len(keys[0]) >= 16
    assert keys[0] not in " ".join(container.attrs["Config"]["Cmd"] + container.attrs["Config"]["Entrypoint"])
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    assert keys[0].encode() not in handle.read(), f"the key is in the argv of pid {pid}"
            except OSError:
                pass


def test_restart_adopts_the_same_container(gateway, docker, client):
    replica, _ = _shard(gateway)
    before = _container(docker, replica["id"])
    assert gateway.stop() == 0
    gateway.start()
    again = rt.wait_serving(gateway, MODEL, 120)
    assert [r["id"] for r in again] == [replica["id"]]
    after = _container(docker, replica["id"])
    assert after.id == before.id and after.attrs["State"]["StartedAt"] == before.attrs["State"]["StartedAt"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.choices


def test_removing_the_model_stops_and_removes_its_container(gateway, docker):
    replica, _ = _shard(gateway)
    container = _container(docker, replica["id"])
    status, answer = gateway.admin(f"/api/models/{MODEL}", "DELETE")
    assert status == 200, answer
    wait_for(lambda: not rt.replicas(gateway, MODEL), 120, "the replica to go")
    names = [c.id for c in docker.containers.list(all=True)]
    assert container.id not in names
