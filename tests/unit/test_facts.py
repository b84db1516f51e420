"""Helper answers to typed facts (SPEC §2): sound answers parse, malformed ones name the field."""

from __future__ import annotations

import copy

import pytest

from llmgw.fleet.facts import (
    ContainerProgram,
    Held,
    Inventory,
    Malformed,
    Storage,
    holdings,
    shard_statuses,
)

INVENTORY = {"hostname": "gpu1", "boot_id": "b-1", "cpus": 64, "memory_bytes": 512 * 1024**3,
             "nvidia_smi": "ok", "nvidia_smi_error": None,
             "gpus": [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
                       "memory_used_mib": 0, "utilization_pct": 0, "ecc_uncorrected": 0, "healthy": True,
                       "reasons": []},
                      {"index": 1, "uuid": None, "name": None, "memory_total_mib": None, "memory_used_mib": None,
                       "utilization_pct": None, "healthy": False, "reasons": ["every field reads [GPU is lost]"]}]}
STORAGE = {"filesystems": [{"device": "8:1", "fstype": "ext4", "mount_point": "/", "shared": False,
                            "total_bytes": 10**12, "free_bytes": None, "dirs": ["/cache"]}],
           "missing": ["/models"], "stuck": []}
STATUS = {"shards": [{"shard_id": "chat-1-0", "pid": 4242, "pgid": 4242, "start_time": 123456, "argv": ["vllm"],
                      "port": 20000, "started_at": 1700000000.5, "alive": True, "exit_code": None, "ended_at": None,
                      "health": {"status": 200, "error": None}, "log_tail": None},
                     {"shard_id": "chat-0-0", "pid": None, "alive": False, "exit_code": 1, "ended_at": 1700000001,
                      "health": None, "log_tail": ["CUDA out of memory"]}]}


ENGINES = dict(INVENTORY, python={"path": "/usr/bin/python3", "version": "3.11.2"}, containers={
    "docker": {"path": "/usr/bin/docker", "answers": True, "error": None, "runtimes": ["nvidia", "runc"], "gpu": True,
               "images": {"img:1": True, "img:2": False}},
    "podman": {"path": None, "answers": None, "error": None, "runtimes": None, "gpu": None, "images": None}},
    venvs={"k1": {"python": "python3.12", "found": False, "interpreter": None, "version": None, "id": None,
                  "built": None, "error": "the Python interpreter python3.12 is not on PATH=/usr/bin"}})


def test_what_a_node_can_run_engines_from_parses_and_unknown_stays_none():
    inventory = Inventory.from_helper(ENGINES)
    assert inventory.python == "3.11.2"
    assert inventory.containers == {
        "docker": ContainerProgram("docker", "/usr/bin/docker", True, None, ("nvidia", "runc"), True,
                                   {"img:1": True, "img:2": False}),
        "podman": ContainerProgram("podman", None)}
    (check,) = inventory.venvs.values()
    assert check.found is False and check.built is None and "python3.12" in check.error
    older = Inventory.from_helper(INVENTORY)  # a helper that did not report them: unknown, not "none"
    assert older.containers is None and older.venvs is None and older.python is None


def test_sound_answers_parse_and_unknown_stays_none():
    inventory = Inventory.from_helper(INVENTORY)
    assert inventory.gpus[0].gpu_class == "h100-80gb" and inventory.gpus[1].memory_total_mib is None
    assert not inventory.gpus[1].healthy
    storage = Storage.from_helper(STORAGE)
    assert storage.filesystems[0].free_bytes is None and storage.missing == ("/models",)
    shards = shard_statuses(STATUS)
    assert shards["chat-1-0"].health_status == 200 and shards["chat-0-0"].log_tail == ("CUDA out of memory",)
    assert holdings({"held": {"chat": {"path": "/m/chat", "bytes": None}}}) == {"chat": Held("/m/chat", None)}
    entry = {"path": "/c/llmgw-ab", "bytes": 5, "file": None, "verified": False}
    assert holdings({"held": {"chat": entry}}) == {"chat": Held("/c/llmgw-ab", 5, None, verified=False)}
    assert Inventory.from_helper({}).memory_bytes is None  # nothing reported: unknown, not zero


def _with(document: dict, path: tuple, value) -> dict:
    changed = copy.deepcopy(document)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


@pytest.mark.parametrize(("parse", "answer", "message"), [
    pytest.param(Inventory.from_helper, [], "the answer is a list, not an object", id="inventory-not-object"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("memory_bytes",), "lots"),
                 "memory_bytes is a string, not an integer", id="memory-string"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("cpus",), True), "cpus is a boolean, not an integer",
                 id="cpus-bool"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("gpus",), {"0": {}}), "gpus is an object, not a list",
                 id="gpus-object"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("gpus", 1, "memory_total_mib"), "80GB"),
                 "gpus[1].memory_total_mib is a string, not an integer", id="gpu-memory-string"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("gpus", 0), "H100"), "gpus[0] is a string, not an object",
                 id="gpu-not-object"),
    pytest.param(Inventory.from_helper, _with(INVENTORY, ("gpus", 0, "reasons"), ["ok", 3]),
                 "gpus[0].reasons[1] is an integer, not a string", id="gpu-reason-int"),
    pytest.param(Inventory.from_helper, _with(ENGINES, ("containers", "docker", "answers"), "yes"),
                 "containers['docker'].answers is a string, not a boolean", id="container-answers-string"),
    pytest.param(Inventory.from_helper, _with(ENGINES, ("containers", "docker", "images", "img:1"), None),
                 "containers['docker'].images['img:1'] is null, not a boolean", id="image-presence-null"),
    pytest.param(Inventory.from_helper, _with(ENGINES, ("containers", "podman"), "absent"),
                 "containers['podman'] is a string, not an object", id="container-not-object"),
    pytest.param(Inventory.from_helper, _with(ENGINES, ("venvs", "k1", "built"), 1),
                 "venvs['k1'].built is an integer, not a boolean", id="venv-built-int"),
    pytest.param(Storage.from_helper, _with(STORAGE, ("filesystems", 0, "device"), None),
                 "filesystems[0].device is missing", id="fs-device-missing"),
    pytest.param(Storage.from_helper, _with(STORAGE, ("filesystems", 0, "free_bytes"), 1.5e9),
                 "filesystems[0].free_bytes is a number, not an integer", id="fs-free-float"),
    pytest.param(Storage.from_helper, _with(STORAGE, ("missing",), "/models"), "missing is a string, not a list",
                 id="missing-string"),
    pytest.param(shard_statuses, {"shards": [{"pid": "twelve"}]}, "shards[0].shard_id is missing",
                 id="shard-id-missing"),
    pytest.param(shard_statuses, _with(STATUS, ("shards", 0, "pid"), "4242"),
                 "shards[0].pid is a string, not an integer", id="pid-string"),
    pytest.param(shard_statuses, _with(STATUS, ("shards", 1, "ended_at"), "yesterday"),
                 "shards[1].ended_at is a string, not a number", id="ended-at-string"),
    pytest.param(shard_statuses, _with(STATUS, ("shards", 0, "health"), {"status": "200"}),
                 "shards[0].health.status is a string, not an integer", id="health-status-string"),
    pytest.param(shard_statuses, _with(STATUS, ("shards", 0, "alive"), "yes"),
                 "shards[0].alive is a string, not a boolean", id="alive-string"),
    pytest.param(holdings, {"held": {"chat": "/m/chat"}}, "held['chat'] is a string, not an object",
                 id="held-not-object"),
    pytest.param(holdings, {"held": {"chat": {"bytes": 5}}}, "held['chat'].path is missing", id="held-path-missing"),
])
def test_malformed_answers_name_the_field(parse, answer, message):
    with pytest.raises(Malformed) as caught:
        parse(answer)
    assert str(caught.value) == message
