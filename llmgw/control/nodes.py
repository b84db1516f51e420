"""The nodes as the control plane keeps them: their admin state (cordon, drain, R-9.4) and its
`node_admin` table, a node's removal from the inventory (drained, then forgotten, R-9.5, R-10.5),
how placement sees each node, and what each is asked about for the catalog (R-2.6, R-4.12).

`NodeMemory` is what is kept between passes; `Nodes` changes it and writes the table. How a
node's replicas follow its admin state is `follow_admin`'s, which the reconciler applies to each
replica on the node when the operator sets it, and to the replicas a pass finds unmarked on a
draining node (and saves those that changed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw.catalog import CatalogHolder
from llmgw.config import NodeConfig
from llmgw.contracts.states import AdminState, transition
from llmgw.control import placement
from llmgw.control.state import ACTIVE_PHASE, DRAINING_PHASE, NodeAdmin, Replica
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import CONNECTING, READY
from llmgw.fleet.ops import InventoryRequest
from llmgw.runtimes import runtime_digest, runtime_spec
from llmgw.store import Store, audit

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NodeMemory:
    """Per node: what the operator set on it, whether it is leaving the inventory, and the live
    engines it runs that no replica has."""

    admin: dict[str, NodeAdmin] = field(default_factory=dict)
    removing: dict[str, float] = field(default_factory=dict)  # node left the inventory -> when its drain's grace ends
    unknown_engines: dict[str, list[str]] = field(default_factory=dict)  # reported, left alone

    @classmethod
    def of(cls, nodes: Mapping[str, NodeConfig]) -> NodeMemory:
        return cls(admin={name: NodeAdmin() for name in nodes})


class Nodes:
    """Node admin (kept in SQLite) and a node's removal by a reload; the node views placement goes by."""

    def __init__(self, fleet: Fleet, holder: CatalogHolder, store: Store | None, memory: NodeMemory):
        self.fleet = fleet
        self.holder = holder
        self.store = store
        self.memory = memory
        self._settled = False
        self._forgetting: set[asyncio.Task] = set()  # links of forgotten nodes being closed

    async def load(self) -> None:
        """The admin state recorded before a restart (R-4.5)."""
        if self.store is None:
            return
        admin = self.memory.admin
        for row in await self.store.read(lambda db: list(db["node_admin"].rows)):
            if row["node"] in admin:
                admin[row["node"]] = NodeAdmin(AdminState(row["state"]), row["grace_until"], row["actor"])

    async def close(self) -> None:
        await asyncio.gather(*self._forgetting, return_exceptions=True)

    def set_admin(self, node: str, state: str, grace: float | None, actor: str | None) -> NodeAdmin:
        """The node's new admin state, recorded and audited; KeyError for a node not in the inventory."""
        if node not in self.memory.admin:
            raise KeyError(node)
        state = AdminState(state)
        transition(self.memory.admin[node].state, state, f"node {node}")  # every admin move is allowed
        admin = NodeAdmin(state=state, grace_until=time.time() + grace if grace is not None else None, actor=actor)
        self.memory.admin[node] = admin
        if self.store is not None:
            row = {"node": node, "state": state, "grace_until": admin.grace_until, "actor": actor,
                   "updated_at": time.time()}
            self.store.submit(lambda db: (db["node_admin"].upsert(row, pk="node"),
                                          audit(db, actor, state, node, {"grace": grace})))
        return admin

    # -- the inventory changing while running (a reload, R-10.5) ---------------------------------

    def add(self, name: str) -> bool:
        """A node the fleet has just added; True when it was being removed (the removal is called off)."""
        called_off = self.memory.removing.pop(name, None) is not None
        if called_off:
            log.info("%s: back in the inventory; no longer removed", name)
        self.memory.admin.setdefault(name, NodeAdmin())
        return called_off

    def remove(self, name: str, grace: float) -> None:
        """A node left the inventory: it is drained (the caller marks it draining), then forgotten."""
        self.memory.removing[name] = time.time() + grace

    def drained(self, replicas: Mapping[str, Replica], now: float) -> list[str]:
        """The removed nodes to forget now: each that runs nothing any more, and one that still
        does once its grace is over while it is out of reach (its engines are then not known to
        be stopped)."""
        done = []
        for name, deadline in self.memory.removing.items():
            left = [r.id for r in replicas.values() if any(s.node == name for s in r.shards)]
            link = self.fleet.links.get(name)
            if left and not (now >= deadline and (link is None or link.state != READY)):
                continue
            if left:
                log.warning("%s: forgotten with replicas %s still recorded on it: the node is out of reach and "
                            "its drain's grace is over; engines it may still run are not stopped", name,
                            ", ".join(left))
            done.append(name)
        return done

    def forget(self, name: str) -> None:
        """A drained node leaves the memory, the fleet (its link closed) and the table."""
        self.memory.removing.pop(name, None)
        self.memory.admin.pop(name, None)
        self.memory.unknown_engines.pop(name, None)
        link = self.fleet.detach_node(name)
        if link is not None:
            task = asyncio.ensure_future(link.close())
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)
        if self.store is not None:
            self.store.submit(lambda db: (db["node_admin"].delete_where("node = ?", [name]),
                                          audit(db, "reload", "node.forget", name)))
        log.info("%s: drained and forgotten (its link closed)", name)

    # -- what the fleet says ---------------------------------------------------------------------

    def note_unknown_engines(self, unknown: Mapping[str, list[str]]) -> None:
        known = self.memory.unknown_engines
        for name, strangers in unknown.items():
            if strangers != known.get(name, []):
                if strangers:
                    log.warning("%s runs engines llmgw has no record of (left alone): %s", name, ", ".join(strangers))
                known[name] = strangers

    def settled(self, now: float, started_at: float, window: float) -> bool:
        """Place nothing until every node has answered once (or the settling window is over):
        a decision made while half the fleet is still connecting is a worse decision (R-4.5)."""
        if self._settled:
            return True
        links = self.fleet.links
        answered = all(
            (link.state == READY and self.fleet.facts[name].inventory is not None)
            or (link.state != READY and link.state != CONNECTING)
            for name, link in links.items())
        if answered or now - started_at >= window:
            self._settled = True
            log.info("fleet settled: %d of %d nodes ready", sum(link.state == READY for link in links.values()), len(links))
        return self._settled

    def views(self) -> list[placement.NodeView]:
        return node_views(self.fleet, self.memory.admin)

    def view(self, name: str) -> placement.NodeView:
        return node_view(self.fleet, self.memory.admin, name)

    # -- what each node is asked about -----------------------------------------------------------

    def holdings_wanted(self, node: NodeConfig) -> dict[str, list[str]]:
        """Candidate paths of every catalog model's weights on this node (R-2.6)."""
        wanted = {}
        paths = self.fleet.paths(node.name)
        dirs = [*paths.model_dirs, *paths.shared_dirs]
        catalog = self.holder.current
        # An adapter is asked about under its own name, as weights are.
        named = [(m.name, m.source) for m in catalog.models.values()]
        named += [(a.name, a.source) for a in catalog.adapters.values()]
        for name, source in named:
            if source is not None:
                candidates = source.candidates(dirs, paths.cache_dir)
                if source.kind == "path" and source.path.startswith("/"):
                    candidates = [c for c in candidates if _inside_any(c, dirs)]
                if candidates:
                    wanted[name] = candidates
        return wanted

    def inventory_wanted(self, node: NodeConfig) -> InventoryRequest:
        """What a node's inventory is asked about besides its GPUs (R-4.12): the images of the
        catalog's container profiles, and its venv recipes under the key placement looks for."""
        images: set[str] = set()
        venvs: dict[str, dict] = {}
        for model in self.holder.current.models.values():
            profile = model.profile
            if profile is None:
                continue
            if profile.runtime == "container" and profile.image:
                images.add(profile.image)
            elif profile.runtime == "venv":
                spec = runtime_spec(profile)
                if spec is not None:
                    venvs[runtime_digest(spec)] = spec
        return InventoryRequest(images=sorted(images), venvs=venvs)


def follow_admin(replica: Replica, admin: AdminState) -> bool:
    """Move a replica on a node as the node's admin state says: marked draining when it drains (it
    serves until it is retired, R-9.5), active again when the node is; a cordon leaves it as it is
    (R-9.4). True when its phase changed."""
    if admin == AdminState.DRAINING:
        return replica.set_phase(DRAINING_PHASE)
    return admin == AdminState.ACTIVE and replica.draining and replica.set_phase(ACTIVE_PHASE)


def node_views(fleet: Fleet, admin: Mapping[str, NodeAdmin]) -> list[placement.NodeView]:
    return [node_view(fleet, admin, name) for name in fleet.nodes]


def node_view(fleet: Fleet, admin: Mapping[str, NodeAdmin], name: str) -> placement.NodeView:
    """The node as placement sees it: its link, admin state and latest facts. Its own mappings
    (labels, containers, venvs) are read-only proxies; what they hold (the configuration's labels,
    a container program's images) is shared with the configuration and the facts, not copied."""
    node = fleet.nodes[name]
    link = fleet.links.get(name)
    facts = fleet.facts[name]
    inventory, storage = facts.inventory, facts.storage
    gpus = None
    gpu_class = node.gpu_class
    memory = None
    if inventory is not None:
        gpus = tuple(placement.GPUView(g.index, g.healthy, g.reasons) for g in inventory.gpus)
        gpu_class = gpu_class or inventory.gpu_class
        memory = inventory.memory_bytes
    cache_free = None
    if storage is not None:
        fs = storage.filesystem_of(fleet.paths(name).cache_dir)
        cache_free = fs.free_bytes if fs is not None else None
    holds = frozenset(facts.holdings) if facts.holdings is not None else None
    containers = venvs = None
    if inventory is not None and inventory.containers is not None:
        containers = MappingProxyType({
            program: placement.ContainerView(c.path is not None, c.answers, c.gpu, c.images, c.error)
            for program, c in inventory.containers.items()})
    if inventory is not None and inventory.venvs is not None:
        venvs = MappingProxyType({key: placement.VenvView(v.found, v.built) for key, v in inventory.venvs.items()})
    return placement.NodeView(
        name=name, fabric=node.fabric, labels=MappingProxyType(node.labels),
        state=link.state if link is not None else CONNECTING,
        state_reason=link.reason if link is not None else None,
        admin=admin[name].state, gpu_class=gpu_class, gpus=gpus, memory_bytes=memory,
        cache_free_bytes=cache_free, holds=holds, containers=containers, venvs=venvs)


def _inside_any(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)
