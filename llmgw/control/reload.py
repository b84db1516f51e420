"""What a reload of the inventory file changes (R-10.5): the difference between two inventories, pure.

`inventory_diff(old, new)` compares the inventory the control plane runs with and the one just
read, section by section, and says in operator words what each difference does when it is
applied (`ControlPlane.reload` applies it): a node added is connected and used; a node removed is
drained, then its link is closed and the node forgotten; a node's connection setting reconnects
its link, its labels or fabric count for the next placements; the gateway's listeners and state
directory need a restart and are left as they are, its other settings change at once; models,
profiles and engines make a new catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from llmgw.config import Inventory, NodeConfig
from llmgw.units import format_bytes, format_duration

ADDED, REMOVED, CHANGED, RESTART = "added", "removed", "changed", "needs a restart"
# A definition that changes what replicas run makes a new revision, to which they roll.
ROLLS = ("where it changes what replicas run, their models roll to a new revision (ctl rollout status); "
         "the rest applies in place")
# How long a removed node's replicas may wait for their replacements before they stop anyway.
REMOVAL_GRACE = 600.0

# A node's settings that the link uses to reach it: a change reconnects that node's link.
CONNECTION_FIELDS = ("connection", "host", "port", "user", "identity_file", "python")
NODE_EFFECTS = {
    "fabric": "counts for the next placements of multi-node replicas",
    "labels": "counts for the next placements (node selectors)",
    "gpu_class": "counts for the next placements",
    "model_dirs": "looked at from the next refresh of the node's storage",
    "shared_dirs": "looked at from the next refresh of the node's storage",
    "cache_dir": "used by the next downloads and the next refresh of the node's storage",
    "cache_low_water": "the clean-up's mark for this node from now on",
    "ports": "used by the next launches on the node",
}
# `ssh:` settings: the link of every ssh node reconnects with them, except the spacing of handshakes.
SSH_NOT_RECONNECTING = {"connect_stagger": "spaces the next SSH handshakes"}
RESTART_SETTINGS = ("listen", "admin", "admin_tls", "state_dir")  # read once, when the listeners start
GATEWAY_EFFECTS = {
    "tick": "the reconciler's next waits between passes",
    "settling_window": "how long an unreachable node's replicas are kept, from now on",
    "on_demand_wait": "how long a request waits for an on-demand model, for requests from now on",
    "queue_wait": "how long a request waits for a place of a saturated model, for requests from now on",
    "evict_idle": "the idle time before eviction, from the next pass",
    "request_timeout": "the time a request may take, for requests from now on, and the grace of replicas stopped "
                       "from now on",
    "max_body": "the largest request body, for requests from now on",
    "max_waiting_per_key": "how many requests of one key may wait in a router, for requests from now on",
    "max_answer": "the largest non-streamed engine answer, for requests from now on",
    "fetch_limit": "caps the next downloads",
    "fetch_stall": "the next downloads",
    "cache_low_water": "the clean-up's mark from the next pass",
    "pinned_weights": "what the clean-up keeps, from the next pass",
    "request_log": "what the routers record, for requests from now on, and what the control plane keeps, from its "
                   "next pruning",
    "tracing": "the routers' traces go to the new collector at once; vLLM replicas launched from now on export "
               "theirs there, running ones keep theirs (no model rolls for it)",
}
DURATIONS = frozenset({"tick", "settling_window", "on_demand_wait", "evict_idle", "request_timeout", "fetch_stall",
                       "keepalive_interval", "connect_timeout", "connect_stagger", "queue_wait"})
SIZES = frozenset({"max_body", "fetch_limit", "max_answer"})


@dataclass(frozen=True, slots=True)
class Line:
    """One difference: what (`section` and `name`), how (`change`) and what applying it does."""

    section: str  # node, ssh, gateway, model, profile, engine
    name: str
    change: str  # added, removed, changed, needs a restart
    effect: str
    fields: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"section": self.section, "name": self.name, "change": self.change, "effect": self.effect,
                "fields": list(self.fields)}


@dataclass(frozen=True, slots=True)
class Diff:
    lines: tuple[Line, ...] = ()
    nodes_added: tuple[str, ...] = ()
    nodes_removed: tuple[str, ...] = ()
    nodes_reconnected: tuple[str, ...] = ()  # nodes whose link is made again with their new settings
    nodes_changed: tuple[str, ...] = ()  # every node whose settings differ, reconnected or not
    catalog_changed: bool = False  # models, profiles or engines differ: a new catalog is built
    gateway_changed: tuple[str, ...] = ()  # runtime settings that change
    restart_needed: tuple[str, ...] = ()  # `gateway.listen` etc.: left as they are

    @property
    def empty(self) -> bool:
        return not self.lines

    def to_json(self) -> dict:
        return {"changes": [line.to_json() for line in self.lines], "nodes_added": list(self.nodes_added),
                "nodes_removed": list(self.nodes_removed), "nodes_reconnected": list(self.nodes_reconnected),
                "restart_needed": [f"gateway.{name}" for name in self.restart_needed]}


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}-{value[1]}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def _duration(seconds: float | None) -> str:
    return f"{seconds:g}s" if seconds is not None and seconds < 120 else format_duration(seconds)


def _setting(name: str, old: Any, new: Any) -> str:
    if name in DURATIONS:
        return f"{_duration(old)} -> {_duration(new)}"
    if name in SIZES:
        return f"{format_bytes(old)} -> {format_bytes(new)}"
    return f"{_shown(old)} -> {_shown(new)}"


def _differing(old: BaseModel, new: BaseModel) -> list[str]:
    return [name for name in type(old).model_fields if getattr(old, name) != getattr(new, name)]


def _node_line(old: NodeConfig, new: NodeConfig, ssh_reconnects: bool) -> tuple[Line, bool]:
    fields = _differing(old, new)
    connection = [f for f in fields if f in CONNECTION_FIELDS]
    parts = [f"{f} {_setting(f, getattr(old, f), getattr(new, f))}" for f in fields]
    effects = []
    reconnect = bool(connection) or (ssh_reconnects and new.connection == "ssh")
    if connection:
        effects.append(f"{', '.join(connection)}: its link reconnects with the new settings "
                       "(its engines keep running and are found again)")
    for name in fields:
        if name not in CONNECTION_FIELDS:
            effects.append(f"{name}: {NODE_EFFECTS.get(name, 'changes at once')}")
    if not connection and reconnect:
        effects.append("its link reconnects with the new ssh settings")
    effects.append("running replicas stay where they are")
    return Line("node", new.name, CHANGED, "; ".join(parts) + ": " + "; ".join(effects), tuple(fields)), reconnect


def _named(section: str, old: dict, new: dict, added: str, removed: str, changed: str,
           only: dict[str, str] | None = None) -> list[Line]:
    """Lines for a section of named entries; `only`: the words for a change of that one field alone."""
    lines = []
    for name in sorted(new.keys() - old.keys()):
        lines.append(Line(section, name, ADDED, added))
    for name in sorted(old.keys() - new.keys()):
        lines.append(Line(section, name, REMOVED, removed))
    for name in sorted(old.keys() & new.keys()):
        if old[name] != new[name]:
            fields = _differing(old[name], new[name])
            effect = (only or {}).get(fields[0], changed) if len(fields) == 1 else changed
            lines.append(Line(section, name, CHANGED, f"{', '.join(fields)}: {effect}", tuple(fields)))
    return lines


def inventory_diff(old: Inventory, new: Inventory, *, removal_grace: float = REMOVAL_GRACE) -> Diff:
    """What changes from `old` to `new`, in the order it is shown: nodes, ssh, gateway, catalog."""
    lines: list[Line] = []
    old_nodes = {n.name: n for n in old.nodes}
    new_nodes = {n.name: n for n in new.nodes}
    ssh_fields = _differing(old.ssh, new.ssh)
    ssh_reconnects = any(f not in SSH_NOT_RECONNECTING for f in ssh_fields)
    added = tuple(n.name for n in new.nodes if n.name not in old_nodes)
    removed = tuple(n.name for n in old.nodes if n.name not in new_nodes)
    for name in added:
        node = new_nodes[name]
        where = "this machine" if node.connection == "local" else f"{node.host}"
        lines.append(Line("node", name, ADDED, f"at {where}: a link is made; placement uses the node once it "
                                               "has reported its facts"))
    for name in removed:
        lines.append(Line("node", name, REMOVED,
                          "drained (each replica stopped once its replacement elsewhere serves, or after "
                          f"{format_duration(removal_grace)}), then its link is closed and the node forgotten"))
    reconnected, changed = [], []
    for name, node in new_nodes.items():
        before = old_nodes.get(name)
        if before is None:
            continue
        if before != node:
            line, reconnect = _node_line(before, node, ssh_reconnects)
            lines.append(line)
            changed.append(name)
            if reconnect:
                reconnected.append(name)
        elif ssh_reconnects and node.connection == "ssh":
            lines.append(Line("node", name, CHANGED, "its link reconnects with the new ssh settings; running "
                                                     "replicas stay where they are"))
            reconnected.append(name)
    for name in ssh_fields:
        effect = SSH_NOT_RECONNECTING.get(name, "every ssh node's link reconnects with it")
        lines.append(Line("ssh", name, CHANGED,
                          f"{_setting(name, getattr(old.ssh, name), getattr(new.ssh, name))}: {effect}"))
    gateway_changed, restart = [], []
    for name in _differing(old.gateway, new.gateway):
        shown = _setting(name, getattr(old.gateway, name), getattr(new.gateway, name))
        if name in RESTART_SETTINGS:
            restart.append(name)
            lines.append(Line("gateway", name, RESTART, f"{shown}: needs a restart of llmgw serve; left as it is "
                                                        "until then (the rest applies)"))
        else:
            gateway_changed.append(name)
            lines.append(Line("gateway", name, CHANGED, f"{shown}: {GATEWAY_EFFECTS.get(name, 'changes at once')}"))
    old_models = {m.name: m for m in old.models}
    new_models = {m.name: m for m in new.models}
    catalog_lines = [
        *_named("model", old_models, new_models, "placed as its scaling asks, from the next pass",
                "its replicas are stopped (requests in flight finish first)",
                ROLLS,
                only={"rollout": "how its next rollout moves, from now on","scaling": "the replica count follows it from the next pass",
                      "routing": "how requests are balanced, from now on",
                      "fallback": "the fallback of requests from now on"}),
        *_named("profile", old.profiles, new.profiles, "available to models",
                "no longer available to models", ROLLS,
                only={"concurrency": "requests each replica is given at once, from now on",
                      "start_timeout": "the start timeout of replicas starting from now on"}),
        *_named("engine", old.engines, new.engines, "available to profiles", "no longer available to profiles",
                ROLLS),
    ]
    lines += catalog_lines
    return Diff(lines=tuple(lines), nodes_added=added, nodes_removed=removed, nodes_reconnected=tuple(reconnected),
                nodes_changed=tuple(changed), catalog_changed=bool(catalog_lines),
                gateway_changed=tuple(gateway_changed), restart_needed=tuple(restart))


def kept_restart_settings(running: Inventory, new: Inventory) -> Inventory:
    """`new` with the gateway settings that need a restart as they run now."""
    keep = {name: getattr(running.gateway, name) for name in RESTART_SETTINGS}
    return new.model_copy(update={"gateway": new.gateway.model_copy(update=keep)})
