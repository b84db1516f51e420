"""A gateway for admin unit tests: real catalog, reconciler and store over a simulated fleet.

The facts of every node are set here so that each listing case is visible at a glance: an
unhealthy GPU, unknown memory, unknown GPUs and disk, a shared filer mounted by two nodes.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from llmgw.admin.app import build_admin_app
from llmgw.admin.dependencies import AdminDependencies, Listener
from llmgw.admin.tokens import AdminTokens
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.control import placement
from llmgw.config import GatewayConfig, Inventory, ModelConfig, NodeConfig, ProfileConfig
from llmgw.control.feedserver import FeedServer
from llmgw.control.reconciler import Reconciler
from llmgw.control.rollouts import Revision
from llmgw.control.service import ControlPlane
from llmgw.control.state import FETCHING, SERVING, Replica, Shard
from llmgw.fleet.facts import GPU, Filesystem, Held, Inventory as InventoryFacts, NodeFacts, Storage
from llmgw.fleet.link import UNREACHABLE
from llmgw.routers import Verifiers
from llmgw.store import Store
from tests.unit.fake_fleet import FakeFleet

TOKEN = "test-admin-token"
SIGNED_URL = "https://example.com/w.gguf?X-Amz-Signature=s3cr3t"  # the query is a credential
GB = 1000**3
PROFILES = {"one": ProfileConfig(engine="vllm", gpus=1), "pair": ProfileConfig(engine="vllm", gpus=4, nodes=2),
            "cpu": ProfileConfig(engine="llama-server")}


def _gpus(count: int, unhealthy: dict[int, str] | None = None) -> tuple[GPU, ...]:
    unhealthy = unhealthy or {}
    return tuple(GPU(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, 0, 0, i not in unhealthy,
                     (unhealthy[i],) if i in unhealthy else ()) for i in range(count))


def _facts(gpus, memory: int | None, filesystems=(), holdings=None) -> NodeFacts:
    now = time.time()
    return NodeFacts(inventory=InventoryFacts("h", "b", 32, memory, gpus, "ok" if gpus else "absent"),
                     storage=Storage(tuple(filesystems)), holdings=holdings if holdings is not None else {},
                     shards={}, observed_at={"inventory": now, "storage": now, "status": now})


FILER = dict(device="0:51", fstype="nfs4", mount_point="/mnt/filer", shared=True, total_bytes=1000 * GB,
             free_bytes=400 * GB, dirs=("/mnt/filer/models",))


class FakeRouter:
    """What the admin reads of the routers (through the feed publisher): requests in flight and
    engine loads per replica."""

    def __init__(self):
        self.in_flight: dict[str, int] = {}
        self.loads: dict = {}

    def outstanding(self, replica_id: str) -> int:
        return self.in_flight.get(replica_id, 0)

    def reported_in_flight(self, replica_id: str) -> int | None:
        return self.in_flight.get(replica_id, 0)

    def routers(self) -> list[dict]:
        return []

    def engine_load(self, replica_id: str):
        return self.loads.get(replica_id)


@dataclass
class FakeGateway:
    holder: CatalogHolder
    fleet: FakeFleet
    reconciler: Reconciler
    store: Store
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    token: str = TOKEN
    control: ControlPlane | None = None
    publisher: FakeRouter = field(default_factory=FakeRouter)
    feed_server: FeedServer | None = None
    router_credentials: Verifiers | None = None
    bound: dict[str, tuple[str, int]] = field(default_factory=dict)
    admin_socket: Path | None = None
    admin_tokens: AdminTokens | None = None  # None: the token alone

    def admin_dependencies(self) -> AdminDependencies:
        """What the admin is given, from this gateway's parts, as `Gateway.admin_dependencies` gives it."""
        return AdminDependencies(control=self.control, store=self.store, registry=self.registry,
                                 tokens=self.admin_tokens or AdminTokens(self.token), data_plane=self.publisher,
                                 feed=self.feed_server, router_credentials=self.router_credentials,
                                 listener=lambda: Listener(self.bound.get("admin"), self.admin_socket))

    def publish(self) -> None:
        """What the reconciler does at the end of a pass: the admin shows what was set since."""
        self.control.publish_view()


def make_gateway(tmp_path: Path) -> FakeGateway:
    nodes = [NodeConfig(name="gpu1", host="10.0.0.1", fabric="ib-a", labels={"zone": "a"}),
             NodeConfig(name="gpu2", host="10.0.0.2", fabric="ib-a", shared_dirs=["/mnt/filer/models"]),
             NodeConfig(name="gpu3", host="10.0.0.3", fabric="ib-b", shared_dirs=["/mnt/filer/models"]),
             NodeConfig(name="ghost", host="10.0.0.9", fabric="ib-b")]
    inventory = Inventory(nodes=nodes, profiles=PROFILES)
    models = [ModelConfig(name="chat", profile="one"),
              ModelConfig(name="big", profile="pair"),
              ModelConfig(name="fetched", profile="cpu", weights=SIGNED_URL),
              ModelConfig(name="shared", profile="one", weights="shared-model", scaling={"min": 0})]
    holder = CatalogHolder(Catalog.build(file_models=models, profiles=PROFILES))
    fleet = FakeFleet(inventory)
    fleet.facts["gpu1"] = _facts(_gpus(4, {3: "2 uncorrected ECC errors"}), 256 * GB,
                                 [Filesystem("8:1", "ext4", "/", False, 500 * GB, 120 * GB, ("/cache",))])
    fleet.facts["gpu2"] = _facts(_gpus(4), None,  # reports no memory: unknown, not small
                                 [Filesystem("8:1", "xfs", "/data", False, 200 * GB, 50 * GB, ("/cache",)),
                                  Filesystem(**FILER)],
                                 holdings={"shared": Held("/mnt/filer/models/shared-model", 5 * GB)})
    fleet.facts["gpu3"] = _facts(_gpus(4), 512 * GB, [Filesystem(**{**FILER, "device": "0:77"})],
                                 holdings={"shared": Held("/mnt/filer/models/shared-model", 5 * GB)})
    fleet.facts["ghost"] = NodeFacts()  # never reported anything
    ghost = fleet.links["ghost"]
    ghost.state, ghost.reason, ghost.since = UNREACHABLE, "connect timed out", time.time() - 120
    reconciler = Reconciler(holder, fleet, None, GatewayConfig())
    now = time.time()
    chat = Replica("chat-1", "chat", "k", [Shard("chat-1-0", "chat-1", 0, "gpu1", (0,), port=20000, state=SERVING)],
                   serving_since=now - 600)
    idle = Replica("chat-0", "chat", "k", [Shard("chat-0-0", "chat-0", 0, "gpu3", (1,), port=20001,
                                                 state=SERVING)], serving_since=now - 900)
    fetching = Replica("fetched-1", "fetched", "k",
                       [Shard("fetched-1-0", "fetched-1", 0, "gpu2", (), state=FETCHING,
                              progress=(1_200_000_000, 4_000_000_000))])
    for replica in (chat, idle, fetching):
        reconciler.memory.records.replicas[replica.id] = replica
    reconciler.memory.scaling.last_used["chat-0"] = now - 300  # chat-1 was never seen used: unknown
    reconciler.memory.placing.unplaceable["big"] = placement.explain_placement(
        holder.current.models["big"], reconciler.nodes.views(), reconciler.memory.records.allocated())
    store = Store.open(tmp_path / "state.db")
    control = ControlPlane(inventory, None, holder, store, reconciler, fleet, "inventory.yaml")
    gateway = FakeGateway(holder, fleet, reconciler, store, control=control)
    gateway.publish()
    return gateway


def roll_chat_onto_adapters(gateway: FakeGateway) -> None:
    """chat mid-rollout: chat-0 runs revision r1 (no adapters), chat-1 r2 (adapters a and b, which
    the catalog does not have); fetched-1 runs a revision llmgw does not know."""
    revisions = gateway.reconciler.memory.rollouts.revisions
    revisions["chat"] = {"r1": Revision("chat", "r1", 1, {"weights": "path:chat"}, 0.0),
                         "r2": Revision("chat", "r2", 2, {"weights": "path:chat",
                                                          "adapters": {"b": "path:loras/b", "a": "path:loras/a"}}, 1.0)}
    records = gateway.reconciler.memory.records.replicas
    records["chat-0"].revision, records["chat-1"].revision, records["fetched-1"].revision = "r1", "r2", "gone"
    gateway.publish()


@asynccontextmanager
async def served_admin(gateway):
    """The admin app of `gateway` on a test server: its client; the gateway's store closed after."""
    client = TestClient(TestServer(build_admin_app(gateway.admin_dependencies())))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        gateway.store.close()
