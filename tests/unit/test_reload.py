"""Reload on a simulated fleet (R-10.5): what `ControlPlane.reload` changes, refuses and records.

The reload itself (reading the file, the diff, the fleet, the reconciler, the catalog) is the real
code; only the nodes are simulated (tests/unit/fake_fleet.py). The testbed scenario
(tests/scenarios/test_reload.py) does the same against real SSH nodes and a real `llmgw serve`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from llmgw.admin.app import http_status
from llmgw.catalog import Catalog, CatalogHolder, StoredModel
from llmgw.config import ModelConfig, embedded_inventory, load_inventory
from llmgw.control.reconciler import Reconciler
from llmgw.contracts.refusals import ServiceError
from llmgw.control.service import ControlPlane
from llmgw.store import Store
from tests.unit.fake_fleet import FakeFleet
from tests.unit.test_reconciler import serving, settle, until

GPU_PROFILE = {"engine": "vllm", "gpus": 8, "start_timeout": "1s"}


def write(path: Path, nodes=("a",), models=None, profiles=None, gateway=None) -> Path:
    doc = {"gateway": {"settling_window": "0.3s", **(gateway or {})},
           "nodes": [{"name": n, "host": f"h-{n}"} for n in nodes],
           "profiles": profiles if profiles is not None else {"whole": GPU_PROFILE},
           "models": models if models is not None else [{"name": "m", "profile": "whole", "weights": "hf:org/m"}]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def plane(path: Path, tmp_path: Path, stored: list[StoredModel] = (), gpus: dict[str, int] | None = None):
    inventory, document = load_inventory(path)
    holder = CatalogHolder(Catalog.from_inventory(inventory, document, stored=list(stored)))
    fleet = FakeFleet(inventory, gpus=gpus)
    store = Store.open(tmp_path / "state.db")
    reconciler = Reconciler(holder, fleet, store, inventory.gateway)
    control = ControlPlane(inventory, document, holder, store, reconciler, fleet, str(path))
    return control, reconciler, fleet, holder, store


def audit_rows(store: Store) -> list[dict]:
    return store.read_sync(lambda db: list(db["audit"].rows_where("action = 'reload'")))


async def test_a_node_added_is_used_and_a_node_removed_is_drained_then_forgotten(tmp_path):
    path = write(tmp_path / "inventory.yaml", nodes=("a",))
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    await settle(reconciler, fleet)
    (original,) = serving(reconciler, "m")
    assert original.leader.node == "a"

    write(path, nodes=("a", "b"))
    preview = await control.reload("ops", dry_run=True)
    assert preview["dry_run"] and not preview["applied"] and preview["nodes_added"] == ["b"]
    assert "b" not in fleet.nodes and control.inventory.node("a") and len(control.inventory.nodes) == 1
    assert audit_rows(store) == []

    answer = await control.reload("ops")
    assert answer["applied"] and answer["nodes_added"] == ["b"]
    assert "b" in fleet.nodes and reconciler.memory.nodes.admin["b"].state == "active"
    assert [n.name for n in control.inventory.nodes] == ["a", "b"]

    write(path, nodes=("b",))
    answer = await control.reload("ops", grace=60)
    assert answer["nodes_removed"] == ["a"]
    assert "a" in fleet.nodes and reconciler.memory.nodes.admin["a"].state == "draining"  # drained first
    with pytest.raises(ServiceError) as refused:  # an uncordon would keep it forever
        control.set_node("a", "uncordon", None, "ops")
    assert http_status(refused.value) == 409 and "is being drained before it is forgotten" in refused.value.message
    await until(lambda: "a" not in fleet.nodes, reconciler, fleet, what="node a forgotten")
    (moved,) = serving(reconciler, "m")
    assert moved.leader.node == "b" and moved.replaces == original.id
    assert original.id not in reconciler.memory.records.replicas
    assert "a" not in reconciler.memory.nodes.admin and "a" not in reconciler.memory.nodes.removing
    assert [c[1] for c in fleet.calls if c[0] == "a" and c[1] in ("stop", "detach_node")] == ["stop", "detach_node"]
    await store.write(lambda db: None)  # the writes queued before it are done
    rows = store.read_sync(lambda db: list(db["node_admin"].rows_where("node = 'a'")))
    assert rows == []
    actions = [(r["action"], r["target"]) for r in store.read_sync(lambda db: list(db["audit"].rows))]
    assert actions.count(("reload", "inventory")) == 2 and ("node.forget", "a") in actions
    details = [json.loads(r["detail"]) for r in audit_rows(store)]
    assert [d["nodes_added"] for d in details] == [["b"], []]
    assert [d["nodes_removed"] for d in details] == [[], ["a"]]
    store.close()


async def test_an_unreachable_removed_node_is_forgotten_once_its_grace_is_over(tmp_path):
    path = write(tmp_path / "inventory.yaml", nodes=("a", "b"))
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    await settle(reconciler, fleet)
    (replica,) = serving(reconciler, "m")
    node = replica.leader.node
    fleet.links[node].cut()
    write(path, nodes=[n for n in ("a", "b") if n != node])
    await control.reload("ops", grace=0.2)
    await until(lambda: node not in fleet.nodes, reconciler, fleet, what="the cut node forgotten")
    await until(lambda: replica.id not in reconciler.memory.records.replicas, reconciler, fleet, what="its replica's record gone")
    store.close()


@pytest.mark.parametrize("text,expected", [
    ("nodes: [{name: a, host: h-a}\n", "not valid YAML"),
    ("nodes:\n  - {name: a, host: h-a, colour: red}\n", "inventory.yaml:2: nodes[0].colour: unknown field"),
    ("nodes: [{name: a, host: h-a}]\nmodels:\n  - {name: m, profile: nope}\n",
     "inventory.yaml:3: models[0].profile: unknown profile 'nope'"),
])
async def test_a_file_that_does_not_build_is_refused_and_changes_nothing(tmp_path, text, expected):
    path = write(tmp_path / "inventory.yaml", nodes=("a",))
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    await settle(reconciler, fleet)
    before = (control.inventory, control.document, holder.current, dict(fleet.nodes), dict(reconciler.memory.nodes.admin),
              dict(reconciler.memory.records.replicas), reconciler.gateway)
    path.write_text(text + "gateway: {tick: 1s}\n" if "nope" in text else text)
    with pytest.raises(ServiceError) as refused:
        await control.reload("ops")
    assert http_status(refused.value) == 400 and refused.value.code == "bad_inventory"
    assert any(expected in problem for problem in refused.value.problems), refused.value.problems
    assert refused.value.problems[0].startswith(str(path))
    after = (control.inventory, control.document, holder.current, dict(fleet.nodes), dict(reconciler.memory.nodes.admin),
             dict(reconciler.memory.records.replicas), reconciler.gateway)
    assert after == before and all(a is b for a, b in zip(after[:3], before[:3]))
    assert audit_rows(store) == []
    store.close()


async def test_a_removed_profile_still_used_by_a_stored_model_is_refused(tmp_path):
    profiles = {"whole": GPU_PROFILE, "spare": {"engine": "llama-server"}}
    path = write(tmp_path / "inventory.yaml", profiles=profiles)
    stored = [StoredModel(ModelConfig(name="added", profile="spare", weights="/w"), "ops")]
    control, reconciler, fleet, holder, store = plane(path, tmp_path, stored)
    write(path, profiles={"whole": GPU_PROFILE})
    with pytest.raises(ServiceError) as refused:
        await control.reload("ops")
    assert "added.profile: unknown profile 'spare'" in refused.value.message
    assert "spare" in holder.current.profiles and holder.current.version == 1
    store.close()


async def test_gateway_settings_change_and_listeners_are_left_for_a_restart(tmp_path):
    path = write(tmp_path / "inventory.yaml")
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    seen = []
    control.on_reload.append(seen.append)
    write(path, gateway={"tick": "1s", "request_timeout": "42s", "listen": "0.0.0.0:9999",
                         "cache_low_water": "10%"})
    answer = await control.reload("ops")
    assert answer["restart_needed"] == ["gateway.listen"]
    assert reconciler.gateway.tick == 1.0 and reconciler.actions.gateway.request_timeout == 42.0
    assert reconciler.cleanup.enabled and str(reconciler.cleanup.marks["a"]) == "10%"
    assert control.inventory.gateway.listen == "127.0.0.1:8080"  # as it runs
    assert seen == [control.inventory]
    assert holder.current.version == 1  # the catalog did not change: no swap
    store.close()


async def test_the_embedded_default_has_no_file_to_reload(tmp_path):
    inventory = embedded_inventory()
    holder = CatalogHolder(Catalog.from_inventory(inventory))
    fleet = FakeFleet(inventory)
    store = Store.open(tmp_path / "state.db")
    reconciler = Reconciler(holder, fleet, store, inventory.gateway)
    control = ControlPlane(inventory, None, holder, store, reconciler, fleet, "the embedded default")
    with pytest.raises(ServiceError) as refused:
        await control.reload("ops")
    assert http_status(refused.value) == 409 and refused.value.code == "no_inventory_file"
    assert "the embedded default" in refused.value.message and "-i FILE" in refused.value.message
    store.close()


async def test_one_reload_at_a_time(tmp_path):
    path = write(tmp_path / "inventory.yaml", nodes=("a",))
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    write(path, nodes=("a", "b"))
    release = asyncio.Event()
    updating = fleet.update_node

    async def slow_update(node, reconnect):
        await release.wait()
        await updating(node, reconnect)

    fleet.update_node = slow_update
    write(path, nodes=("a", "b"), gateway={"tick": "2s"})
    path.write_text(path.read_text().replace("host: h-a", "host: h-a2"))
    first = asyncio.ensure_future(control.reload("alice"))
    await asyncio.sleep(0.05)
    with pytest.raises(ServiceError) as refused:
        await control.reload("bob")
    assert http_status(refused.value) == 409 and refused.value.code == "reload_in_progress"
    assert "a reload by alice" in refused.value.message
    release.set()
    answer = await first
    assert answer["applied"] and answer["nodes_reconnected"] == ["a"]
    assert ("a", "reconnect", {}) in fleet.calls and fleet.nodes["a"].host == "h-a2"
    assert (await control.reload("bob"))["changes"] == []  # free again, and nothing left to change
    store.close()


async def test_a_node_put_back_while_it_drains_is_kept(tmp_path):
    path = write(tmp_path / "inventory.yaml", nodes=("a",))
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    await settle(reconciler, fleet)
    (replica,) = serving(reconciler, "m")
    write(path, nodes=())
    await control.reload("ops", grace=60, force=True)  # m's min has nowhere to go
    await settle(reconciler, fleet)
    assert reconciler.memory.nodes.admin["a"].state == "draining" and "a" in fleet.nodes  # nowhere to move it: it waits
    write(path, nodes=("a",))
    answer = await control.reload("ops")
    assert answer["nodes_added"] == ["a"]
    await settle(reconciler, fleet)
    assert reconciler.memory.nodes.removing == {} and reconciler.memory.nodes.admin["a"].state == "active"
    assert serving(reconciler, "m") == [replica] and not replica.draining
    assert ("a", "add_node", {}) not in fleet.calls  # the same link, not a second one
    store.close()


# -- a reload that leaves a model's min nowhere to go (R-10.5) ----------------------------------


def write_nodes(path: Path, nodes: list[dict], models: list[dict], profiles: dict) -> Path:
    doc = {"gateway": {"settling_window": "0.3s"}, "nodes": [{"host": f"h-{n['name']}", **n} for n in nodes],
           "profiles": profiles, "models": models}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


PROFILES = {"whole": GPU_PROFILE, "zoned": {"engine": "vllm", "gpus": 1, "node_selector": {"zone": "z1"}},
            "pair": {"engine": "vllm", "gpus": 2, "nodes": 2}, "small": {"engine": "vllm", "gpus": 1}}


@pytest.mark.parametrize("before,after,model,why", [
    pytest.param([{"name": "a"}, {"name": "b"}], [{"name": "b"}], {"name": "m", "profile": "whole"},
                 "2 of 2 GPUs free, needs 8", id="the-only-node-with-8-gpus-removed"),
    pytest.param([{"name": "a", "labels": {"zone": "z1"}}, {"name": "b"}], [{"name": "a"}, {"name": "b"}],
                 {"name": "m", "profile": "zoned"}, "no label zone, needs zone=z1", id="the-label-taken-away"),
    pytest.param([{"name": "a", "fabric": "ib"}, {"name": "b", "fabric": "ib"}], [{"name": "a", "fabric": "ib"}],
                 {"name": "m", "profile": "pair"}, "ib has 1 node", id="the-fabric-too-small"),
])
async def test_r10_5_a_reload_that_leaves_a_min_nowhere_is_refused_unless_forced(tmp_path, before, after, model, why):
    path = write_nodes(tmp_path / "inventory.yaml", before, [{**model, "weights": "hf:org/m"}], PROFILES)
    control, reconciler, fleet, holder, store = plane(path, tmp_path, gpus={"b": 2})
    await settle(reconciler, fleet)
    running = control.inventory
    write_nodes(path, after, [{**model, "weights": "hf:org/m"}], PROFILES)

    preview = await control.reload("ops", dry_run=True)
    (entry,) = preview["unplaceable"]
    assert (entry["model"], entry["min"], entry["made_by_reload"]) == ("m", 1, True)
    assert why in entry["reason"], entry["reason"]
    assert "no node of the new inventory could ever run m (min 1)" in preview["refused"]
    assert "--force" in preview["refused"] and not preview["applied"]

    with pytest.raises(ServiceError) as refused:
        await control.reload("ops")
    assert http_status(refused.value) == 409 and refused.value.code == "min_unplaceable"
    assert "m (min 1)" in refused.value.message and why in refused.value.problems[0]
    assert control.inventory is running and set(fleet.nodes) == {n["name"] for n in before}  # nothing changed
    assert all(admin.state == "active" for admin in reconciler.memory.nodes.admin.values()) and audit_rows(store) == []

    forced = await control.reload("ops", force=True)
    assert forced["applied"] and forced["forced"] and [e["model"] for e in forced["unplaceable"]] == ["m"]
    assert [n.name for n in control.inventory.nodes] == [n["name"] for n in after]
    (row,) = audit_rows(store)
    assert json.loads(row["detail"])["unplaceable"] == ["m"] and json.loads(row["detail"])["forced"] is True
    store.close()


async def test_r10_5_a_change_that_only_waits_for_room_is_not_refused(tmp_path):
    """Node a leaves while b's GPUs are all taken: m's replacement must wait for room there, but
    b could run it, so the reload goes on; a model no node could run before is named, not refused."""
    nodes = [{"name": "a"}, {"name": "b"}]
    models = [{"name": "m", "profile": "small", "weights": "hf:org/m"},
              {"name": "filler", "profile": "whole", "weights": "hf:org/f"},
              {"name": "never", "profile": "zoned", "weights": "hf:org/n"}]
    path = write_nodes(tmp_path / "inventory.yaml", nodes, models, PROFILES)
    control, reconciler, fleet, holder, store = plane(path, tmp_path)
    await settle(reconciler, fleet)
    (filler,) = serving(reconciler, "filler")
    (m,) = serving(reconciler, "m")
    gone = m.leader.node
    assert filler.leader.node != gone  # the other node is full
    write_nodes(path, [n for n in nodes if n["name"] != gone], models, PROFILES)
    answer = await control.reload("ops")
    assert answer["applied"] and "refused" not in answer
    assert [(e["model"], e["made_by_reload"]) for e in answer["unplaceable"]] == [("never", False)]
    store.close()


async def test_r10_5_ctl_reload_names_the_model_and_exits_1_unless_forced(tmp_path):
    """`llmgw ctl reload` (and --dry-run) against the real admin app: the model named, exit 1, nothing
    changed; `--force` applies it."""
    from aiohttp.test_utils import TestClient, TestServer
    from typer.testing import CliRunner

    from llmgw.admin.app import build_admin_app
    from llmgw.cli.main import app
    from tests.unit.admin_gateway import TOKEN, FakeGateway

    path = write_nodes(tmp_path / "inventory.yaml", [{"name": "a"}, {"name": "b"}],
                       [{"name": "m", "profile": "whole", "weights": "hf:org/m"}], PROFILES)
    control, reconciler, fleet, holder, store = plane(path, tmp_path, gpus={"b": 2})
    await settle(reconciler, fleet)
    gateway = FakeGateway(holder, fleet, reconciler, store, control=control)
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    runner = CliRunner(env={"COLUMNS": "400", "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None, "LLMGW_STATE_DIR": None})

    async def ctl(*args):
        address = f"{client.server.host}:{client.server.port}"
        return await asyncio.to_thread(runner.invoke, app, ["ctl", "--admin", address, "--token", TOKEN, "reload", *args])

    try:
        write_nodes(path, [{"name": "b"}], [{"name": "m", "profile": "whole", "weights": "hf:org/m"}], PROFILES)
        preview = await ctl("--dry-run")
        assert preview.exit_code == 1, preview.output
        assert "a" in preview.stdout and "removed" in preview.stdout  # the diff is still shown
        assert "no node of the new inventory could ever run m (min 1)" in preview.stdout
        refused = await ctl()
        assert refused.exit_code == 1 and "m (min 1)" in refused.stderr and "--force" in refused.stderr
        assert "a" in fleet.nodes and reconciler.memory.nodes.admin["a"].state == "active"  # nothing changed
        forced = await ctl("--force")
        assert forced.exit_code == 0, forced.output
        assert "applied" in forced.stdout and "could ever run m (min 1)" in forced.stdout
        assert reconciler.memory.nodes.admin["a"].state == "draining"
    finally:
        await client.close()
        store.close()
