"""Replicas and shards: the control plane's records, and how they are kept in SQLite (R-4.2).

`Records` holds them between passes, with the replicas retired lately and each model's launch
record. The reconciler changes them, in its pass and at once when an operator drains or
uncordons a node, and so does `Actions` (llmgw.control.actions): its node tasks change a shard's
state, port, progress and log tail as its launch or stop goes on, and a stopped replica's record
leaves for the retired. A shard's or replica's state moves only through the transition table.
The admin's listings, /metrics and ctl are made from published views (llmgw.control.publish),
never from these records; only operator actions through the control plane's service (a
replica's log, what a reclaim keeps) look them up.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sqlite_utils

from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.states import AdminState, ReplicaPhase, ShardState, transition

if TYPE_CHECKING:
    from llmgw.catalog import Model
    from llmgw.config import NodeConfig

log = logging.getLogger(__name__)

PENDING, FETCHING, STARTING, SERVING = ShardState.PENDING, ShardState.FETCHING, ShardState.STARTING, ShardState.SERVING
DRAINING, STOPPING, STOPPED, FAILED = ShardState.DRAINING, ShardState.STOPPING, ShardState.STOPPED, ShardState.FAILED
SHARD_STATES = tuple(ShardState)
ENDED = frozenset({STOPPED, FAILED})
# Module constants: every pass reads them for every replica, and a module global is a cheaper
# lookup than an attribute of the enum class.
ACTIVE_PHASE, DRAINING_PHASE, RETIRING_PHASE = ReplicaPhase.ACTIVE, ReplicaPhase.DRAINING, ReplicaPhase.RETIRING

FAILURE_BACKOFF_BASE = 2.0
FAILURE_BACKOFF_CAP = 300.0
RETIRED_KEEP = 600.0  # how long a failed replica stays visible after it stopped
RETIRED_LISTED = 200  # and at most this many of them
INTERRUPTED_START = "its start was interrupted by a control-plane restart"


@dataclass
class Shard:
    id: str
    replica_id: str
    rank: int
    node: str
    gpus: tuple[int, ...]
    port: int | None = None
    dist_port: int | None = None
    state: ShardState = PENDING
    state_since: float = field(default_factory=time.time)
    launched_at: float | None = None  # when the node answered the launch: reports older say nothing of it
    reason: str | None = None
    log_tail: list[str] | None = None
    argv: list[str] | None = None
    pid: int | None = None
    start_time: int | None = None
    serves_http: bool = True
    progress: tuple[int, int | None] | None = None  # bytes so far, total when known
    activity: str | None = None  # what a fetch without byte counts is doing (an image pull, R-4.10)
    created_at: float = field(default_factory=time.time)

    def set_state(self, state: ShardState, reason: str | None = None) -> bool:
        """A real transition: new timestamp, and the progress line goes (R-5.4). A move the
        transition table does not allow is refused (False, logged)."""
        if state == self.state and reason == self.reason:
            return False
        if not transition(self.state, state, f"shard {self.id}"):
            return False
        if state != self.state:
            self.state_since = time.time()
        self.state = state
        self.reason = reason
        self.progress = None
        self.activity = None
        return True

    def row(self) -> dict:
        return {"id": self.id, "replica_id": self.replica_id, "rank": self.rank, "node": self.node,
                "state": self.state, "port": self.port, "dist_port": self.dist_port,
                "serves_http": int(self.serves_http), "gpus": json.dumps(list(self.gpus)),
                "argv": json.dumps(self.argv) if self.argv is not None else None, "pid": self.pid,
                "start_time": self.start_time, "reason": self.reason,
                "log_tail": json.dumps(self.log_tail) if self.log_tail is not None else None,
                "state_since": self.state_since, "launched_at": self.launched_at, "created_at": self.created_at,
                "updated_at": time.time()}

    @classmethod
    def from_row(cls, row: dict) -> Shard:
        return cls(id=row["id"], replica_id=row["replica_id"], rank=row["rank"], node=row["node"],
                   gpus=tuple(json.loads(row["gpus"] or "[]")), port=row["port"], dist_port=row["dist_port"],
                   serves_http=bool(row["serves_http"] if row["serves_http"] is not None else 1),
                   state=_shard_state(row["state"]), state_since=row["state_since"] or time.time(),
                   launched_at=row.get("launched_at"), reason=row["reason"],
                   log_tail=json.loads(row["log_tail"]) if row["log_tail"] else None,
                   argv=json.loads(row["argv"]) if row["argv"] else None, pid=row["pid"],
                   start_time=row["start_time"], created_at=row["created_at"] or time.time())


@dataclass
class Replica:
    id: str
    model: str
    api_key: str = field(repr=False)  # the engine key: never in a repr, a traceback or a log
    shards: list[Shard]
    created_at: float = field(default_factory=time.time)
    phase: ReplicaPhase = ReplicaPhase.ACTIVE
    replaces: str | None = None
    reason: str | None = None
    serving_since: float | None = None
    revision: str | None = None  # the model's revision it runs; None: made before revisions existed

    def __post_init__(self) -> None:
        self.phase = ReplicaPhase(self.phase)  # a member, so that it compares by identity

    @property
    def draining(self) -> bool:
        """Marked for a rolling move: stopped once enough others serve (R-9.5)."""
        return self.phase is DRAINING_PHASE

    @property
    def retiring(self) -> bool:
        """Being torn down (surplus, model gone, failed, drained, evicted)."""
        return self.phase is RETIRING_PHASE

    def set_phase(self, phase: ReplicaPhase) -> bool:
        """Move to `phase` if the transition table allows it; True when the phase changed."""
        if phase == self.phase or not transition(self.phase, phase, f"replica {self.id}"):
            return False
        self.phase = phase
        return True

    @property
    def leader(self) -> Shard:
        return self.shards[0]

    def without_key(self, lines) -> list[str]:
        """Engine log lines with this replica's engine key replaced, should the engine print it."""
        return [line.replace(self.api_key, "***") if self.api_key and self.api_key in line else line
                for line in lines]

    @property
    def state(self) -> str:
        states = {s.state for s in self.shards}
        if FAILED in states:
            return FAILED
        if states == {STOPPED}:
            return STOPPED
        if STOPPING in states or (self.phase is RETIRING_PHASE and states - ENDED):
            return STOPPING
        if states == {SERVING}:
            return DRAINING if self.phase is DRAINING_PHASE else SERVING
        for state in (PENDING, FETCHING, STARTING):
            if state in states:
                return state
        return SERVING

    @property
    def serving(self) -> bool:
        return self.phase is not RETIRING_PHASE and all(s.state == SERVING for s in self.shards)

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.shards]

    def row(self) -> dict:
        return {"id": self.id, "model": self.model, "api_key": self.api_key, "state": self.state,
                # The phase is stored as the draining flag alone: retiring is not kept.
                "reason": self.reason, "replaces": self.replaces, "draining": int(self.draining),
                "revision": self.revision, "created_at": self.created_at, "updated_at": time.time()}


def new_replica_id(model: str) -> str:
    return f"{model}-{uuid.uuid4().hex[:8]}"


def new_engine_key() -> str:
    """A per-replica engine API key that only the router knows (R-4.6)."""
    return "llmgw-engine-" + secrets.token_urlsafe(24)


def save_replica(db: sqlite_utils.Database, replica: Replica) -> None:
    db["replicas"].upsert(replica.row(), pk="id")
    db["shards"].upsert_all([s.row() for s in replica.shards], pk="id")


def delete_replica(db: sqlite_utils.Database, replica_id: str) -> None:
    db["shards"].delete_where("replica_id = ?", [replica_id])
    db["replicas"].delete_where("id = ?", [replica_id])


def load_replicas(db: sqlite_utils.Database) -> list[Replica]:
    shards: dict[str, list[Shard]] = {}
    for row in db["shards"].rows_where(order_by="replica_id, rank"):
        shards.setdefault(row["replica_id"], []).append(Shard.from_row(row))
    replicas = []
    for row in db["replicas"].rows:
        replicas.append(Replica(id=row["id"], model=row["model"], api_key=row["api_key"],
                                shards=shards.get(row["id"], []), created_at=row["created_at"],
                                phase=ReplicaPhase.DRAINING if row["draining"] else ReplicaPhase.ACTIVE,
                                replaces=row["replaces"], reason=row["reason"], revision=row.get("revision")))
    return [r for r in replicas if r.shards]


def _shard_state(value: str) -> ShardState | str:
    """A stored state as its member; a value this llmgw does not know is kept as it was."""
    try:
        return ShardState(value)
    except ValueError:
        return value


@dataclass
class NodeAdmin:
    state: AdminState = AdminState.ACTIVE
    grace_until: float | None = None
    actor: str | None = None


@dataclass
class ModelHealth:
    """A model's launch record: failures in a row and when the next attempt may start."""

    failures: int = 0
    next_attempt: float = 0.0
    last_failure: str | None = None
    last_log_tail: list[str] | None = None
    launches: int = 0
    failed_on: tuple[str, ...] = ()


@dataclass(eq=False)
class Records:
    """The replicas the control plane runs (by id), those retired lately (listed a while, for
    their reason and log tail), and each model's launch record.

    `started_at` is when this control plane started: what it did not see begin (a replica adopted
    after a restart, the fleet answering) is counted from then."""

    replicas: dict[str, Replica] = field(default_factory=dict)
    retired: list[tuple[float, Replica]] = field(default_factory=list)  # (when its engines stopped, replica)
    health: dict[str, ModelHealth] = field(default_factory=dict)  # model ->
    started_at: float = field(default_factory=time.time)
    # model -> (its canary revision, the percent of its requests the router gives that revision's
    # replicas), as the last pass set it from the rollouts; carried on their endpoints.
    canaries: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # (model, revision) -> the adapters that revision's replicas were launched with, in launch
    # order: what a replica's endpoint says its engine holds, whatever the catalog says now.
    revision_adapters: Callable[[str, str | None], tuple[str, ...]] | None = None
    # replica id -> the adapters it loaded while running, and (adapter, why) of the loads that
    # failed there lately: on its endpoint after its revision's.
    runtime_adapters: Callable[[str], tuple[str, ...]] | None = None
    adapter_errors: Callable[[str], tuple[tuple[str, str], ...]] | None = None

    def adopt(self, replicas: list[Replica]) -> None:
        """The replicas recorded before a restart, adopted rather than started again (R-4.5)."""
        for replica in replicas:
            if replica.state == STOPPED:
                continue
            # A failed replica is kept: its record is deleted only once its engines are stopped,
            # so one still here may have an engine running on a node that was out of reach. The
            # first pass retires it, and the engine is stopped when the node answers.
            # A start the restart cut short did not fail: it counts toward no backoff and pauses
            # no rollout. The first pass's sweep finishes its stop and a new one is placed.
            for shard in replica.shards:
                if shard.state in (PENDING, FETCHING):
                    shard.set_state(STOPPED, INTERRUPTED_START)  # nothing was launched on its node
                elif shard.state == STARTING and shard.pid is None:
                    # Launched, but the node's answer went with the control plane: whatever the
                    # node started under the shard's id is stopped there.
                    shard.set_state(STOPPING, INTERRUPTED_START)
                else:
                    continue
                replica.reason = replica.reason or INTERRUPTED_START
            self.replicas[replica.id] = replica
        if self.replicas:
            log.info("adopting %d replicas recorded before the restart", len(self.replicas))

    def allocated(self) -> dict[str, frozenset[int]]:
        """The GPUs each node's live shards hold."""
        used: dict[str, set[int]] = {}
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.state not in ENDED:
                    used.setdefault(shard.node, set()).update(shard.gpus)
        return {node: frozenset(gpus) for node, gpus in used.items()}

    def endpoints(self, nodes: Mapping[str, NodeConfig]) -> dict[str, list[Endpoint]]:
        """The router's endpoint table: each serving replica's leader, by model, in replica order,
        with the revision it runs, its leader's node (the head node of a multi-node replica) and,
        on a canary revision's replicas, the canary's share."""
        table: dict[str, list[Endpoint]] = {}
        for replica in self.replicas.values():
            if not replica.serving:
                continue
            leader = replica.leader
            node = nodes.get(leader.node)
            if node is None or leader.port is None:
                continue
            canary = self.canaries.get(replica.model)
            adapters = self.revision_adapters(replica.model, replica.revision) \
                if self.revision_adapters is not None else ()
            if self.runtime_adapters is not None:
                adapters += tuple(a for a in self.runtime_adapters(replica.id) if a not in adapters)
            table.setdefault(replica.model, []).append(
                Endpoint(replica_id=replica.id, model=replica.model, url=endpoint_url(node, leader.port),
                         api_key=replica.api_key, draining=replica.draining, revision=replica.revision,
                         canary=canary[1] if canary is not None and canary[0] == replica.revision else None,
                         node=leader.node, adapters=adapters,
                         adapter_errors=self.adapter_errors(replica.id) if self.adapter_errors is not None else ()))
        for endpoints in table.values():
            endpoints.sort(key=lambda e: e.replica_id)
        return table

    def cache_in_use(self, models: Mapping[str, Model], node: str,
                     revision_cache: Callable[[str, str | None], Iterable[str]] | None = None) -> set[str]:
        """Cache names the live replicas with a shard on the node run from: their model's
        source and adapters (R-8.8) as the catalog has them, and those of the revision each runs
        (`revision_cache`: (model, revision) -> its cache names), which differ while a rollout
        changes them."""
        names = set()
        for r in self.replicas.values():
            if not any(s.node == node for s in r.shards):
                continue
            m = models.get(r.model)
            if m is not None:
                sources = [m.source, *(a.source for a in m.adapters)]
                names.update(s.cache_name for s in sources if s is not None and s.fetched)
            if revision_cache is not None:
                names.update(revision_cache(r.model, r.revision))
        return names

    def record_failure(self, replica: Replica, now: float) -> None:
        """A failed replica counts toward its model's backoff; the failed shard's reason becomes the replica's."""
        health = self.health.setdefault(replica.model, ModelHealth())
        health.failures += 1
        health.next_attempt = now + backoff_delay(health.failures - 1, base=FAILURE_BACKOFF_BASE,
                                                  cap=FAILURE_BACKOFF_CAP)
        failed = next((s for s in replica.shards if s.state == FAILED), None)
        health.last_failure = failed.reason if failed else replica.reason
        health.last_log_tail = failed.log_tail if failed else None
        health.failed_on = tuple(s.node for s in replica.shards if s.state == FAILED)
        replica.reason = health.last_failure
        log.warning("replica %s of %s failed: %s (attempt %d; next in %.0fs)", replica.id, replica.model,
                    health.last_failure, health.failures, health.next_attempt - now)

    def record_serving(self, replica: Replica, now: float) -> None:
        """A replica serves (every shard does): since now, and its model's failures in a row are over."""
        replica.serving_since = now
        health = self.health.setdefault(replica.model, ModelHealth())
        health.failures, health.next_attempt = 0, 0.0
        log.info("replica %s of %s serving on %s", replica.id, replica.model, ", ".join(replica.nodes))

    def prune(self, now: float) -> None:
        """The retired replicas listed no longer: stopped more than RETIRED_KEEP ago, or beyond RETIRED_LISTED."""
        self.retired = [(t, r) for t, r in self.retired if now - t < RETIRED_KEEP][-RETIRED_LISTED:]

    def listed(self) -> set[str]:
        """The ids of the replicas live or still listed as retired."""
        return {r.id for _, r in self.retired} | self.replicas.keys()


def endpoint_url(node: NodeConfig, port: int) -> str:
    """The URL a replica's engine answers on: its (leader's) node's address and port."""
    host = "127.0.0.1" if node.connection == "local" else node.host
    return f"http://{_url_host(host)}:{port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
