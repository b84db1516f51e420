"""Pulls from a real registry (R-4.10, R-4.12): Debian's docker-registry on 127.0.0.1 (docker
trusts a loopback registry without TLS), holding the test busybox image pushed there.

- a missing image is pulled, once for two provisions asking at the same time, with the pull's
  lines as progress, and recorded as pulled by llmgw;
- reclaim removes that image (the tag llmgw pulled), never the image it shares layers with;
- a tag the registry does not have is refused by it: the error names the image, what the
  registry said and how to load the image by hand, and nothing is recorded as installed.
"""

import os
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from tests.helper.conftest import free_port
from tests.testbed import images

REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


@pytest.fixture(scope="module")
def client():
    reason = images.unavailable_reason() or (None if os.path.exists(REGISTRY) else
                                              f"no {REGISTRY} (Debian's docker-registry)")
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the registry tests must run under CI: {reason}")
        pytest.skip(reason)
    return images.docker_client()


@pytest.fixture(scope="module")
def registry(client, tmp_path_factory):
    """`127.0.0.1:PORT` of a registry holding llmgw-test/busybox:pushed."""
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {root / 'data'}}},"
                      f" delete: {{enabled: true}}}}\nhttp: {{addr: '127.0.0.1:{port}'}}\n")
    process = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except (OSError, socket.timeout):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise AssertionError(f"the registry did not answer: {process.stderr.read()[:2000]!r}")
                time.sleep(0.2)
        base = images.busybox_image(client)
        pushed = f"{address}/llmgw-test/busybox:pushed"
        client.images.get(base).tag(pushed)
        for line in client.images.push(pushed, stream=True, decode=True):
            assert "error" not in line, line
        client.images.remove(pushed)  # the node does not have the tag: provision must pull it
        yield address
    finally:
        process.kill()
        process.wait()


def _runtime(image):
    return {"kind": "container", "image": image, "container": "docker", "pull": "if_missing"}


def test_a_missing_image_is_pulled_once_recorded_and_removed_by_reclaim(helper, client, registry):
    image = f"{registry}/llmgw-test/busybox:pushed"
    base_id = client.images.get(images.busybox_image(client)).id
    first, second = (helper.send("provision", {"runtime": _runtime(image)}) for _ in range(2))
    answers = [helper.answer(first, 120), helper.answer(second, 120)]
    assert all(a["ok"] for a in answers), answers
    assert {a["result"]["pulled"] for a in answers} == {True}
    assert answers[0]["result"]["image_id"] == answers[1]["result"]["image_id"] == base_id
    lines = [data["line"] for _, data in helper.events_of(first) if data.get("line")]
    assert lines and any("pushed" in line or "Pull" in line or "Digest" in line for line in lines), lines
    # Present now: a third provision asks no registry.
    assert helper.call("provision", {"runtime": _runtime(image)})["pulled"] is False

    (listed,) = [e for e in helper.call("envs", {})["images"] if e["image"] == image]
    assert listed["pulled"] is True and listed["present"] is True and listed["id"] == base_id
    (removed,) = helper.call("reclaim", {"images": [listed["name"]], "collect": True})["images"]
    assert removed["action"] == "removed", removed
    assert client.images.list(name=f"{registry}/llmgw-test/busybox") == []
    assert client.images.get(base_id)  # the same image under the suite's own tag stays


def test_a_tag_the_registry_has_not_is_refused_with_its_words(helper, client, registry):
    image = f"{registry}/llmgw-test/absent:1"
    answer = helper.request("provision", {"runtime": _runtime(image)}, timeout=120)
    assert answer["ok"] is False and answer["error"]["kind"] == "provision_failed", answer
    message = answer["error"]["message"]
    assert image in message and "docker load -i" in message
    assert "manifest unknown" in message or "not found" in message, message
    assert not [e for e in helper.call("envs", {})["images"] if e["image"] == image]
