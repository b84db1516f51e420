"""The reload diff (R-10.5): what changes between two inventories, and the words for each change."""

from __future__ import annotations

import pytest

from llmgw.config import load_inventory_text
from llmgw.control.reload import ADDED, CHANGED, REMOVED, RESTART, inventory_diff, kept_restart_settings

BASE = """
gateway: {tick: 3s, listen: "127.0.0.1:8080"}
nodes:
  - {name: n1, host: 10.0.0.1, labels: {zone: a}}
  - {name: n2, host: 10.0.0.2}
profiles:
  small: {engine: vllm, gpus: 1}
models:
  - {name: chat, profile: small}
"""


def inv(text: str):
    return load_inventory_text(text)[0]


def lines_of(diff, section: str):
    return {(line.name, line.change): line for line in diff.lines if line.section == section}


def test_the_same_file_changes_nothing():
    diff = inventory_diff(inv(BASE), inv(BASE))
    assert diff.empty and diff.lines == ()
    assert not diff.catalog_changed and diff.nodes_added == diff.nodes_removed == diff.nodes_reconnected == ()
    assert diff.to_json()["changes"] == []


def test_nodes_added_and_removed_say_what_happens():
    new = BASE.replace("  - {name: n2, host: 10.0.0.2}", "  - {name: n3, host: 10.0.0.3}")
    diff = inventory_diff(inv(BASE), inv(new), removal_grace=120)
    assert diff.nodes_added == ("n3",) and diff.nodes_removed == ("n2",)
    nodes = lines_of(diff, "node")
    added, removed = nodes[("n3", ADDED)], nodes[("n2", REMOVED)]
    assert "10.0.0.3" in added.effect and "a link is made" in added.effect
    assert "placement uses the node" in added.effect
    assert removed.effect.startswith("drained") and "after 2m" in removed.effect
    assert "link is closed and the node forgotten" in removed.effect
    assert not diff.catalog_changed and diff.nodes_reconnected == ()


@pytest.mark.parametrize("field,value,reconnects", [
    ("host", "10.9.9.9", True), ("port", "2222", True), ("user", "ops", True), ("python", "python3.12", True),
    ("fabric", "ib0", False), ("gpu_class", "h100-80gb", False), ("ports", "21000-21099", False),
])
def test_a_changed_node_reconnects_only_for_connection_settings(field, value, reconnects):
    new = BASE.replace("{name: n2, host: 10.0.0.2}", f"{{name: n2, host: 10.0.0.2, {field}: {value}}}")
    if field == "host":
        new = BASE.replace("host: 10.0.0.2", f"host: {value}")
    diff = inventory_diff(inv(BASE), inv(new))
    assert diff.nodes_changed == ("n2",)
    assert diff.nodes_reconnected == (("n2",) if reconnects else ())
    (line,) = diff.lines
    assert (line.section, line.name, line.change, line.fields) == ("node", "n2", CHANGED, (field,))
    assert ("its link reconnects" in line.effect) == reconnects
    assert "running replicas stay where they are" in line.effect
    if field == "ports":
        assert "20000-20999 -> 21000-21099" in line.effect and "next launches" in line.effect


def test_a_label_change_counts_for_the_next_placements():
    diff = inventory_diff(inv(BASE), inv(BASE.replace("zone: a", "zone: b")))
    (line,) = diff.lines
    assert line.fields == ("labels",) and diff.nodes_reconnected == ()
    assert "labels {zone: a} -> {zone: b}" in line.effect and "next placements" in line.effect


def test_an_ssh_setting_reconnects_every_ssh_node_but_the_handshake_spacing_does_not():
    diff = inventory_diff(inv(BASE), inv(BASE + "ssh: {user: ops}\n"))
    assert diff.nodes_reconnected == ("n1", "n2")
    assert lines_of(diff, "ssh")[("user", CHANGED)].effect == "- -> ops: every ssh node's link reconnects with it"
    spacing = inventory_diff(inv(BASE), inv(BASE + "ssh: {connect_stagger: 0.5s}\n"))
    assert spacing.nodes_reconnected == ()
    assert lines_of(spacing, "ssh")[("connect_stagger", CHANGED)].effect == \
        "0.02s -> 0.5s: spaces the next SSH handshakes"


def test_runtime_gateway_settings_change_and_listeners_need_a_restart():
    new = BASE.replace('gateway: {tick: 3s, listen: "127.0.0.1:8080"}',
                       'gateway: {tick: 1s, listen: "0.0.0.0:9000", state_dir: /srv/llmgw, max_body: 1MB, '
                       'request_timeout: 5m, pinned_weights: ["hf:org/a"]}')
    diff = inventory_diff(inv(BASE), inv(new))
    gateway = lines_of(diff, "gateway")
    assert set(diff.gateway_changed) == {"tick", "max_body", "request_timeout", "pinned_weights"}
    assert diff.restart_needed == ("listen", "state_dir")
    assert gateway[("tick", CHANGED)].effect.startswith("3s -> 1s: ")
    assert gateway[("max_body", CHANGED)].effect.startswith("16.0 MB -> 1.0 MB: ")
    assert gateway[("request_timeout", CHANGED)].effect.startswith("10m -> 5m: ")
    assert gateway[("pinned_weights", CHANGED)].effect.startswith("[] -> [hf:org/a]: ")
    listen = gateway[("listen", RESTART)]
    assert listen.effect.startswith("127.0.0.1:8080 -> 0.0.0.0:9000: needs a restart")
    assert "left as it is" in listen.effect and "the rest applies" in listen.effect
    assert diff.to_json()["restart_needed"] == ["gateway.listen", "gateway.state_dir"]


def test_settings_that_need_a_restart_are_kept_as_they_run_and_still_reported():
    running, new = inv(BASE), inv(BASE.replace('listen: "127.0.0.1:8080"', 'listen: "0.0.0.0:9000"'))
    kept = kept_restart_settings(running, new)
    assert kept.gateway.listen == "127.0.0.1:8080" and kept.gateway.tick == new.gateway.tick
    # What runs is compared with the file again next time: the restart is still owed.
    assert inventory_diff(kept, new).restart_needed == ("listen",)


def test_models_profiles_and_engines_make_a_new_catalog():
    new = BASE.replace("small: {engine: vllm, gpus: 1}",
                       "small: {engine: vllm, gpus: 2}\n  cpu: {engine: llama-server}") + \
        "  - {name: tiny, profile: cpu}\nengines:\n  mine: {command: [serve, '{port}']}\n"
    diff = inventory_diff(inv(BASE), inv(new))
    assert diff.catalog_changed
    assert {(line.section, line.name, line.change) for line in diff.lines} == {
        ("profile", "small", CHANGED), ("profile", "cpu", ADDED), ("model", "tiny", ADDED),
        ("engine", "mine", ADDED)}
    small = lines_of(diff, "profile")[("small", CHANGED)]
    assert small.fields == ("gpus",) and "roll to a new revision" in small.effect
    removed = inventory_diff(inv(new), inv(BASE))
    assert lines_of(removed, "model")[("tiny", REMOVED)].effect == \
        "its replicas are stopped (requests in flight finish first)"


def test_the_order_is_nodes_ssh_gateway_then_the_catalog():
    new = BASE.replace("tick: 3s", "tick: 1s").replace("gpus: 1", "gpus: 2") + "ssh: {user: ops}\n"
    new = new.replace("  - {name: n2, host: 10.0.0.2}\n", "")
    sections = [line.section for line in inventory_diff(inv(BASE), inv(new)).lines]
    assert sections == sorted(sections, key=["node", "ssh", "gateway", "model", "profile", "engine"].index)


def test_a_model_whose_scaling_alone_changes_says_the_count_follows():
    diff = inventory_diff(inv(BASE), inv(BASE.replace("{name: chat, profile: small}",
                                                      "{name: chat, profile: small, scaling: {min: 2}}")))
    (line,) = diff.lines
    assert (line.section, line.name, line.fields) == ("model", "chat", ("scaling",))
    assert line.effect == "scaling: the replica count follows it from the next pass"


def test_ctl_prints_the_diff_as_a_table_and_what_needs_a_restart():
    from rich.console import Console

    from llmgw.admin import render

    new = BASE.replace('listen: "127.0.0.1:8080"', 'listen: "0.0.0.0:9000"') + "  - {name: tiny, profile: small}\n"
    answer = {"source": "inventory.yaml", "dry_run": True, "applied": False,
              **inventory_diff(inv(BASE), inv(new)).to_json()}
    console = Console(width=400, record=True)
    console.print(render.reload(answer))
    out = console.export_text()
    assert out.splitlines()[0] == "inventory.yaml: 2 changes (dry run: nothing applied)"
    assert any(row.split()[:3] == ["model", "tiny", "added"] for row in out.splitlines())
    assert "needs a restart of llmgw serve (left as they are): gateway.listen" in out
    applied = {**answer, "dry_run": False, "applied": True, "changes": answer["changes"][:1]}
    console = Console(width=400, record=True)
    console.print(render.reload(applied))
    assert console.export_text().splitlines()[0] == "inventory.yaml: 1 change applied"


def test_every_node_and_gateway_setting_has_its_words():
    """A setting added to the schema later is still said, never dropped from the diff."""
    from llmgw.config import GatewayConfig, NodeConfig
    from llmgw.control.reload import CONNECTION_FIELDS, GATEWAY_EFFECTS, NODE_EFFECTS, RESTART_SETTINGS

    assert set(NodeConfig.model_fields) - {"name"} == set(CONNECTION_FIELDS) | set(NODE_EFFECTS)
    assert set(GatewayConfig.model_fields) == set(RESTART_SETTINGS) | set(GATEWAY_EFFECTS)


def test_a_new_collector_for_traces_applies_at_once_and_rolls_no_model():
    """R-6.21: gateway.tracing is a gateway setting, not part of any model's revision."""
    new = BASE.replace('gateway: {tick: 3s, listen: "127.0.0.1:8080"}',
                       'gateway: {tick: 3s, listen: "127.0.0.1:8080", tracing: {otlp_endpoint: "http://collector:4318/"}}')
    diff = inventory_diff(inv(BASE), inv(new))
    assert diff.gateway_changed == ("tracing",) and not diff.restart_needed
    assert [line.section for line in diff.lines] == ["gateway"]  # no model line: nothing rolls
    effect = lines_of(diff, "gateway")[("tracing", CHANGED)].effect
    assert effect.startswith("{otlp_endpoint: -} -> {otlp_endpoint: http://collector:4318}: the routers' traces")
