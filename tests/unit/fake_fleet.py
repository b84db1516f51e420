"""A simulated fleet for reconciler unit tests and the control-plane benchmark.

Not SSH: nodes are values whose facts the test sets, and helper calls are answered in memory
the way the real helper answers them (launch returns a pid; status reports what was launched).
Integration tests use real hosts; this exists so the reconciler's decisions can be checked fast
and at a scale (2,000 nodes) no testbed reaches.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from llmgw.config import Inventory, NodeConfig
from llmgw.fleet.facts import GPU, Filesystem, Inventory as InventoryFacts, NodeFacts, ShardStatus, Storage
from llmgw.fleet.link import READY, UNREACHABLE
from llmgw.fleet.ops import Hello, NodeOps
from llmgw.fleet.session import NodeError


class FakeLink:
    def __init__(self, name: str):
        self.name = name
        self.state = READY
        self.reason = None
        self.since = time.time()
        self.root = Path("/nonexistent") / name

    def cut(self):
        self.state, self.reason, self.since = UNREACHABLE, "cut", time.time()

    def restore(self):
        self.state, self.reason, self.since = READY, None, time.time()


class FakeStream:
    def __init__(self, result, events):
        self.result, self._events = result, events

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for event in self._events:
            yield event


class FakeFleet:
    def __init__(self, inventory: Inventory, gpus: dict[str, int] | None = None, memory_gb: dict[str, float | None] | None = None):
        self.inventory = inventory
        self.nodes: dict[str, NodeConfig] = {n.name: n for n in inventory.nodes}
        self.links = {n: FakeLink(n) for n in self.nodes}
        self.facts: dict[str, NodeFacts] = {}
        self.engines: dict[str, dict[str, dict]] = {n: {} for n in self.nodes}  # node -> shard id -> record
        self.calls: list[tuple[str, str, dict]] = []
        self.holdings_wanted = None
        self.crash_on_launch = False
        self.missing_program: dict[str, str] = {}  # node -> the helper's engine_missing message
        self.source_bytes = 10**9
        self._pids = itertools.count(1000)
        for name in self.nodes:
            count = (gpus or {}).get(name, 8)
            mem = (memory_gb or {}).get(name, 512)
            self.facts[name] = NodeFacts(
                inventory=InventoryFacts(hostname=name, boot_id="b", cpus=64,
                                         memory_bytes=None if mem is None else int(mem * 1024**3),
                                         gpus=tuple(GPU(i, f"GPU-{name}-{i}", "NVIDIA H100 80GB HBM3", 81559, 0, 0, True)
                                                    for i in range(count)), nvidia_smi="ok"),
                storage=Storage((Filesystem("1:1", "ext4", "/", False, 10**13, 10**13, ("/cache",)),)),
                holdings={}, shards={}, observed_at={"status": time.time()})

    def paths(self, node):
        from llmgw.fleet.fleet import node_paths
        return node_paths(self.nodes[node], Hello(root=f"/home/{node}/.llmgw", home=f"/home/{node}"))

    def ops(self, node):
        return NodeOps(node, _NodeCalls(self, node))

    def ready_nodes(self):
        return [n for n, link in self.links.items() if link.state == READY]

    def stream(self, node, op, args=None):
        self.calls.append((node, op, args or {}))
        return FakeStream({"path": f"{args['cache_dir']}/{args['name']}"}, [("progress", {"bytes": 10, "total": None})])

    async def refresh(self, nodes=None, probe=True):
        now = time.time()
        for name, records in self.engines.items():
            if self.links[name].state != READY:
                continue
            self.facts[name].shards = {sid: ShardStatus(
                shard_id=sid, pid=r["pid"], start_time=r["start_time"], argv=tuple(r["argv"]), alive=r["alive"],
                exit_code=r.get("exit_code"), ended_at=None, started_at=r["started_at"], port=r["port"],
                health_status=200 if r["alive"] and r.get("healthy", True) else None, health_error=None,
                log_tail=r.get("log_tail", ("boom",)) if not r["alive"] else None) for sid, r in records.items()}
            self.facts[name].observed_at["status"] = now

    async def call(self, node, op, args=None, timeout=None):
        self.calls.append((node, op, args or {}))
        if self.links[node].state != READY:
            raise NodeError(node, op, "not connected", "cut")
        if op == "launch" and node in self.missing_program:
            raise NodeError(node, op, "remote", self.missing_program[node], kind="engine_missing")
        if op == "launch":
            pid = next(self._pids)
            self.engines[node][args["shard_id"]] = {"pid": pid, "start_time": pid * 10, "argv": args["argv"],
                                                    "alive": not self.crash_on_launch, "exit_code":
                                                    1 if self.crash_on_launch else None,
                                                    "started_at": time.time(), "port": args["port"]}
            return {"pid": pid, "start_time": pid * 10, "argv": args["argv"], "shard_id": args["shard_id"]}
        if op == "stop":
            record = self.engines[node].get(args["shard_id"])
            if record is None:
                raise NodeError(node, op, "remote", "no such shard", kind="not_found")
            was = record["alive"]
            record["alive"] = False
            return {"was_alive": was, "stopped": True}
        if op == "source_size":
            return {"bytes": self.source_bytes, "files": 1}
        if op == "forget":
            self.engines[node].pop(args["shard_id"], None)
            return {}
        raise NodeError(node, op, "remote", "not simulated", kind="unknown_op")

    # -- nodes added and removed while running (a reload) -------------------------------------

    def set_inventory(self, inventory):
        self.inventory = inventory

    def add_node(self, node, gpus: int = 8):
        self.nodes[node.name] = node
        self.links[node.name] = FakeLink(node.name)
        self.engines[node.name] = {}
        self.facts[node.name] = NodeFacts(
            inventory=InventoryFacts(hostname=node.name, boot_id="b", cpus=64, memory_bytes=512 * 1024**3,
                                     gpus=tuple(GPU(i, f"GPU-{node.name}-{i}", "NVIDIA H100 80GB HBM3", 81559, 0, 0,
                                                    True) for i in range(gpus)), nvidia_smi="ok"),
            storage=Storage((Filesystem("1:1", "ext4", "/", False, 10**13, 10**13, ("/cache",)),)),
            holdings={}, shards={}, observed_at={"status": time.time()})
        self.calls.append((node.name, "add_node", {}))

    async def update_node(self, node, reconnect):
        self.nodes[node.name] = node
        self.calls.append((node.name, "reconnect" if reconnect else "update_node", {}))

    def detach_node(self, name):
        self.nodes.pop(name, None)
        self.facts.pop(name, None)
        self.engines.pop(name, None)
        link = self.links.pop(name, None)
        self.calls.append((name, "detach_node", {}))
        return _ClosingLink() if link is not None else None

    def crash_engine(self, node, shard_id, code=1, log_tail=("boom",)):
        record = self.engines[node][shard_id]
        record["alive"] = False
        record["exit_code"] = code
        record["log_tail"] = tuple(log_tail)


class _ClosingLink:
    closed = False

    async def close(self):
        self.closed = True


class _NodeCalls:
    """One node's calls of the fake fleet: what the typed operations (NodeOps) run over."""

    def __init__(self, fleet: FakeFleet, node: str):
        self.fleet, self.node = fleet, node

    async def call(self, op, args=None, timeout=None):
        return await self.fleet.call(self.node, op, args, timeout)

    def stream(self, op, args=None):
        return self.fleet.stream(self.node, op, args)
