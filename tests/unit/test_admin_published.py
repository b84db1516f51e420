"""The admin renders the view the control plane published, never the reconciler's own records."""

from __future__ import annotations

import dataclasses

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw.admin.app import build_admin_app
from llmgw.admin.views import listings
from llmgw.control import publish
from llmgw.control.state import SERVING, Replica, Shard
from tests.unit.admin_gateway import TOKEN, make_gateway

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def gateway(tmp_path):
    gw = make_gateway(tmp_path)
    yield gw
    gw.store.close()


def _extra(replica_id: str = "chat-9") -> Replica:
    return Replica(replica_id, "chat", "k", [Shard(f"{replica_id}-0", replica_id, 0, "gpu2", (0,), port=20009,
                                                   state=SERVING)])


def test_the_view_is_frozen(gateway):
    view = gateway.control.view()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.pass_number = 7
    node = view.node("gpu1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.state = "ready"
    with pytest.raises(TypeError):
        node.labels["zone"] = "b"  # read-only mappings
    with pytest.raises(TypeError):
        view.models["chat"] = None
    replica = view.replica("chat-1")
    assert isinstance(replica.shards, tuple) and isinstance(replica.shards[0].gpus, tuple)
    assert not hasattr(node, "__dict__")  # slots: no attribute can be added either


def test_listings_show_what_was_published_not_what_changed_since(gateway):
    before = {r["id"] for r in listings(gateway.admin_dependencies()).replicas()}
    gateway.reconciler.memory.records.replicas["chat-9"] = _extra()
    gateway.fleet.links["gpu3"].cut()
    assert {r["id"] for r in listings(gateway.admin_dependencies()).replicas()} == before
    assert {n["name"]: n["state"] for n in listings(gateway.admin_dependencies()).nodes()}["gpu3"] == "ready"
    gateway.publish()
    assert "chat-9" in {r["id"] for r in listings(gateway.admin_dependencies()).replicas()}
    assert {n["name"]: n["state"] for n in listings(gateway.admin_dependencies()).nodes()}["gpu3"] == "unreachable"


async def test_a_pass_publishes_and_the_view_is_built_once_when_read(gateway, monkeypatch):
    reconciler = gateway.reconciler
    first = gateway.control.view()
    built = []
    real = publish.control_view
    monkeypatch.setattr(publish, "control_view", lambda *a: built.append(a[1]) or real(*a))
    for _ in range(3):
        reconciler.step()
    assert built == []  # a pass pays nothing for a view nobody reads
    view = gateway.control.view()
    assert view is not first and view.pass_number == reconciler.passes == 3
    assert gateway.control.view() is view and built == [3]  # one build per publication, shared by readers
    print(f"passes {reconciler.passes}, views built {len(built)}")


def test_endpoints_are_the_routers_input_with_the_draining_mark(gateway):
    gateway.control.set_node("gpu1", "drain", None, "alice")
    # The endpoint table the reconciler pushes to the router feed (the published view holds none).
    endpoints = gateway.reconciler.memory.records.endpoints(gateway.fleet.nodes)
    by_replica = {e.replica_id: e for e in endpoints["chat"]}
    assert by_replica["chat-1"].draining and not by_replica["chat-0"].draining  # chat-1 runs on gpu1
    assert by_replica["chat-1"].api_key == "k"  # the router gets the engine key...
    assert "api_key" not in repr(endpoints) and "'k'" not in repr(endpoints)  # ...no repr shows it


async def test_operator_actions_show_at_once_without_a_pass(gateway):
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    try:
        passes = gateway.reconciler.passes
        answer = await client.post("/api/nodes/gpu2/admin", json={"action": "cordon"}, headers=AUTH)
        assert answer.status == 200
        nodes = {n["name"]: n for n in (await (await client.get("/api/nodes", headers=AUTH)).json())["nodes"]}
        assert nodes["gpu2"]["admin"]["state"] == "cordoned"
        added = await client.post("/api/models", json={"yaml": "name: extra\nprofile: one\n"}, headers=AUTH)
        assert added.status == 201, await added.text()
        models = {m["name"] for m in (await (await client.get("/api/models", headers=AUTH)).json())["models"]}
        assert "extra" in models
        assert gateway.reconciler.passes == passes  # shown by the publication, not by a pass
    finally:
        await client.close()
