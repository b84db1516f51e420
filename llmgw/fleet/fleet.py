"""The Fleet: every node's link and its latest facts, refreshed on a tick (SPEC §1, §2)."""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from llmgw.config import Inventory, NodeConfig
from llmgw.fleet.errors import MalformedAnswer, NodeError
from llmgw.fleet.facts import NodeFacts
from llmgw.fleet.link import READY, ConnectGate, NodeLink, make_link
from llmgw.fleet.ops import (HoldingsRequest, Hello, InventoryRequest, NodeOps, StatusRequest, StorageDir,
                             StorageRequest)
from llmgw.fleet.secret import fleet_secret

log = logging.getLogger(__name__)

# SSH handshakes (unauthenticated connections) in flight at once: below sshd's default MaxStartups (10).
CONNECT_GATE = 8
STORAGE_TIMEOUT = 5.0
PROBE_TIMEOUT = 2.0
INVENTORY_EVERY = 10.0  # seconds between GPU/memory inventories of one node


class Fleet:
    """Links to all nodes of the inventory and what they last reported."""

    def __init__(self, inventory: Inventory, state_dir: str | os.PathLike,
                 holdings_wanted: Callable[[NodeConfig], dict[str, list[str]]] | None = None,
                 on_state: Callable[[NodeLink], None] | None = None,
                 inventory_wanted: Callable[[NodeConfig], InventoryRequest] | None = None):
        self.inventory = inventory
        self.nodes: dict[str, NodeConfig] = {n.name: n for n in inventory.nodes}
        self.facts: dict[str, NodeFacts] = {n.name: NodeFacts() for n in inventory.nodes}
        self.holdings_wanted = holdings_wanted
        self.inventory_wanted = inventory_wanted  # the images and venv recipes inventory asks about
        self._state_dir = Path(state_dir)
        self.gate: ConnectGate | None = None
        self._on_state = on_state
        self.links: dict[str, NodeLink] = {}
        self._problems: dict[str, dict[str, str]] = {n.name: {} for n in inventory.nodes}  # node -> op -> why

    async def start(self) -> None:
        """Create and start every link (R-1.1).

        The links' TCP connects all start at once, each bounded by connect_timeout; the SSH
        handshakes that follow pass the gate: at most CONNECT_GATE at a time, their starts
        `connect_stagger` apart. A node that does not answer therefore delays no other node."""
        self.gate = ConnectGate(CONNECT_GATE, spacing=self.inventory.ssh.connect_stagger)
        secret = fleet_secret(self._state_dir)
        for node in self.inventory.nodes:
            link = make_link(node, self.inventory.ssh, local_root=self._state_dir / "node" / node.name,
                             connect_gate=self.gate, on_state=self._on_state, fleet_secret=secret)
            self.links[node.name] = link
            link.start()

    # -- nodes added, changed and removed while running (a reload, R-10.5) ----------------------

    def set_inventory(self, inventory: Inventory) -> None:
        """The inventory new links are made with (its `ssh:` settings); the nodes are changed one
        by one (`add_node`, `update_node`, `remove_node`)."""
        self.inventory = inventory
        if self.gate is not None:
            self.gate.spacing = inventory.ssh.connect_stagger

    def add_node(self, node: NodeConfig) -> NodeLink:
        """A node joins: its link is made and started; its facts come with the next refresh."""
        if node.name in self.nodes:
            raise KeyError(f"node {node.name!r} is already in the fleet")
        self.nodes[node.name] = node
        self.facts[node.name] = NodeFacts()
        self._problems[node.name] = {}
        link = self._make_link(node)
        self.links[node.name] = link
        link.start()
        log.info("%s: added to the fleet", node.name)
        return link

    async def update_node(self, node: NodeConfig, reconnect: bool) -> None:
        """A node's settings change. `reconnect`: its link is closed and made again with them (a
        connection setting changed); otherwise the next placements and refreshes read them."""
        self.nodes[node.name] = node
        if not reconnect:
            return
        old = self.links.get(node.name)
        link = self._make_link(node)
        self.links[node.name] = link
        if old is not None:
            await old.close()
        link.start()
        log.info("%s: reconnecting with its new settings", node.name)

    def detach_node(self, name: str) -> NodeLink | None:
        """A node leaves: forgotten at once; its link (still open) is returned for the caller to
        close. Its engines are the caller's business: they are stopped before."""
        link = self.links.pop(name, None)
        self.nodes.pop(name, None)
        self.facts.pop(name, None)
        self._problems.pop(name, None)
        log.info("%s: removed from the fleet", name)
        return link

    async def remove_node(self, name: str) -> None:
        """`detach_node`, then its link closed."""
        link = self.detach_node(name)
        if link is not None:
            await link.close()

    def _make_link(self, node: NodeConfig) -> NodeLink:
        return make_link(node, self.inventory.ssh, local_root=self._state_dir / "node" / node.name,
                         connect_gate=self.gate, on_state=self._on_state, fleet_secret=fleet_secret(self._state_dir))

    async def wait_connected(self, timeout: float) -> bool:
        results = await asyncio.gather(*(link.wait_ready(timeout) for link in self.links.values()))
        return all(results)

    def ready_nodes(self) -> list[str]:
        return [name for name, link in self.links.items() if link.state == READY]

    def link(self, node: str) -> NodeLink:
        return self.links[node]

    def ops(self, node: str) -> NodeOps:
        """The node's helper operations, typed: `await fleet.ops(node).launch(LaunchRequest(...))`."""
        return NodeOps(node, self.links[node])

    async def call(self, node: str, op: str, args: dict | None = None, timeout: float | None = 30.0):
        """One operation by name with its answer untyped: the transport under `ops`."""
        return await self.links[node].call(op, args, timeout)

    def paths(self, node: str) -> NodePaths:
        link = self.links.get(node)
        return node_paths(self.nodes[node], link.hello if link is not None else None)

    def stream(self, node: str, op: str, args: dict | None = None):
        return self.links[node].stream(op, args)

    # -- facts ---------------------------------------------------------------------------------

    async def refresh(self, nodes: Iterable[str] | None = None, *, probe: bool = True) -> None:
        """Ask every node with an open session (or the given ones) for all its facts, concurrently.

        One node's answers never fail the refresh of the others: an answer without the protocol's
        shape makes that node unhealthy with the reason, until its answers are sound again."""
        names = [n for n in (nodes if nodes is not None else self.links) if n in self.links and self.links[n].answering]
        await asyncio.gather(*(self._refresh_node(name, probe) for name in names))

    async def _refresh_node(self, name: str, probe: bool) -> None:
        problems = self._problems.get(name)
        if problems is None:  # removed since the refresh began
            return
        try:
            await self._ask_facts(name, probe, problems)
        except Exception as exc:  # whatever one node's answers provoke stays with that node
            log.exception("%s: reading its facts failed", name)
            problems["facts"] = f"its facts could not be read: {type(exc).__name__}: {exc}"
        else:
            problems.pop("facts", None)
        link = self.links.get(name)
        if link is not None:  # None: the node was removed meanwhile
            link.report_answers("; ".join(problems.values()) or None)

    async def _ask_facts(self, name: str, probe: bool, problems: dict[str, str]) -> None:
        node = self.nodes[name]
        ops = self.ops(name)
        wanted = self.holdings_wanted(node) if self.holdings_wanted else {}
        calls = []
        if time.time() - self.facts[name].observed_at.get("inventory", 0.0) >= INVENTORY_EVERY:
            # nvidia-smi costs tens of milliseconds per call on a node: GPUs are asked for on a
            # slower beat than engine status, which every tick needs.
            request = self.inventory_wanted(node) if self.inventory_wanted else InventoryRequest()
            calls.append(self._fact(name, "inventory", ops.inventory(request), problems))
        dirs = tuple(StorageDir(d["path"], d["shared"]) for d in storage_dirs(self.paths(name)))
        calls += [
            self._fact(name, "storage", ops.storage(StorageRequest(dirs, STORAGE_TIMEOUT)), problems),
            self._fact(name, "status", ops.status(StatusRequest(probe, PROBE_TIMEOUT)), problems),
        ]
        if wanted:
            calls.append(self._fact(name, "holdings", ops.holdings(HoldingsRequest(wanted)), problems,
                                    lambda answer: answer.held))
        else:
            self.facts[name].holdings = {}
            problems.pop("holdings", None)
        await asyncio.gather(*calls)

    async def _fact(self, name: str, op: str, answer: Awaitable, problems: dict[str, str],
                    value: Callable = lambda answer: answer) -> None:
        # A report is as new as its question: an engine launched while the question was on its way
        # may be missing from the answer, and must not be judged gone by it.
        asked = time.time()
        try:
            result = await answer
        except MalformedAnswer as exc:
            # The last sound facts are kept (they go stale); the node is unhealthy meanwhile.
            problems[op] = exc.message
            return
        except NodeError as exc:
            log.debug("%s: %s failed: %s", name, op, exc)
            return
        problems.pop(op, None)
        facts = self.facts.get(name)
        if facts is None:  # removed while it answered
            return
        setattr(facts, "shards" if op == "status" else op, value(result))
        facts.observed_at[op] = asked

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))


@dataclass(frozen=True)
class NodePaths:
    """A node's directories as absolute paths on that node; cache None until the node said hello."""

    model_dirs: tuple[str, ...]
    shared_dirs: tuple[str, ...]
    cache_dir: str | None


def node_paths(node: NodeConfig, hello: Hello | None) -> NodePaths:
    """Resolve `~` against the node's home and default the cache to ROOT/cache (ROOT is the
    helper's state directory): the helper takes absolute paths only, and only the node knows
    where its home is."""
    home = hello.home if hello is not None else None
    root = hello.root if hello is not None else None

    def resolve(path: str) -> str | None:
        if path == "~" or path.startswith("~/"):
            return posixpath.join(home, path[2:]) if home else None
        return path

    def resolve_all(paths) -> tuple[str, ...]:
        return tuple(p for p in (resolve(d) for d in paths) if p is not None)

    cache = resolve(node.cache_dir) if node.cache_dir else (posixpath.join(root, "cache") if root else None)
    return NodePaths(resolve_all(node.model_dirs), resolve_all(node.shared_dirs), cache)


def storage_dirs(paths: NodePaths) -> list[dict]:
    """The directories a node is asked to look at: model dirs, shared dirs, its cache (R-2.4)."""
    dirs = [{"path": d, "shared": False} for d in paths.model_dirs]
    dirs += [{"path": d, "shared": True} for d in paths.shared_dirs]
    if paths.cache_dir:
        dirs.append({"path": paths.cache_dir, "shared": False})
    return dirs
