"""Replicas and shards: the reconciler's records, and how they are kept in SQLite (R-4.2).

The reconciler is the only writer of these records; everything else reads snapshots.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field

import sqlite_utils

PENDING, FETCHING, STARTING, SERVING = "pending", "fetching", "starting", "serving"
DRAINING, STOPPING, STOPPED, FAILED = "draining", "stopping", "stopped", "failed"
SHARD_STATES = (PENDING, FETCHING, STARTING, SERVING, DRAINING, STOPPING, STOPPED, FAILED)
ENDED = frozenset({STOPPED, FAILED})


@dataclass
class Shard:
    id: str
    replica_id: str
    rank: int
    node: str
    gpus: tuple[int, ...]
    port: int | None = None
    dist_port: int | None = None
    state: str = PENDING
    state_since: float = field(default_factory=time.time)
    reason: str | None = None
    log_tail: list[str] | None = None
    argv: list[str] | None = None
    pid: int | None = None
    start_time: int | None = None
    serves_http: bool = True
    progress: tuple[int, int | None] | None = None  # bytes so far, total when known
    created_at: float = field(default_factory=time.time)

    def set_state(self, state: str, reason: str | None = None) -> bool:
        """A real transition: new timestamp, and the progress line goes (R-5.4)."""
        if state == self.state and reason == self.reason:
            return False
        if state != self.state:
            self.state_since = time.time()
        self.state = state
        self.reason = reason
        self.progress = None
        return True

    def row(self) -> dict:
        return {"id": self.id, "replica_id": self.replica_id, "rank": self.rank, "node": self.node,
                "state": self.state, "port": self.port, "dist_port": self.dist_port,
                "serves_http": int(self.serves_http), "gpus": json.dumps(list(self.gpus)),
                "argv": json.dumps(self.argv) if self.argv is not None else None, "pid": self.pid,
                "start_time": self.start_time, "reason": self.reason,
                "log_tail": json.dumps(self.log_tail) if self.log_tail is not None else None,
                "state_since": self.state_since, "created_at": self.created_at, "updated_at": time.time()}

    @classmethod
    def from_row(cls, row: dict) -> Shard:
        return cls(id=row["id"], replica_id=row["replica_id"], rank=row["rank"], node=row["node"],
                   gpus=tuple(json.loads(row["gpus"] or "[]")), port=row["port"], dist_port=row["dist_port"],
                   serves_http=bool(row["serves_http"] if row["serves_http"] is not None else 1), state=row["state"],
                   state_since=row["state_since"] or time.time(), reason=row["reason"],
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
    draining: bool = False  # marked for a rolling move: stopped once its replacement serves
    replaces: str | None = None
    retiring: bool = False  # being torn down (surplus, model gone, failed, drained)
    reason: str | None = None
    serving_since: float | None = None

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
        if STOPPING in states or (self.retiring and states - ENDED):
            return STOPPING
        if states == {SERVING}:
            return DRAINING if self.draining else SERVING
        for state in (PENDING, FETCHING, STARTING):
            if state in states:
                return state
        return SERVING

    @property
    def serving(self) -> bool:
        return all(s.state == SERVING for s in self.shards) and not self.retiring

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.shards]

    def row(self) -> dict:
        return {"id": self.id, "model": self.model, "api_key": self.api_key, "state": self.state,
                "reason": self.reason, "replaces": self.replaces, "draining": int(self.draining),
                "created_at": self.created_at, "updated_at": time.time()}


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
                                draining=bool(row["draining"]), replaces=row["replaces"], reason=row["reason"]))
    return [r for r in replicas if r.shards]
