"""SQLite state through sqlite-utils: schema, migrations, and one writer thread.

The event loop never waits on SQLite for writes: `Store.submit` queues a function that the writer
thread runs in a batch inside one transaction (WAL mode). `await Store.write(fn)` is the same but
lets the caller wait for the result off the loop. Reads are few (start-up, the admin's usage and
router listings, the feed's keys every 2 s): `await Store.read(fn)` runs on a worker thread, with
that thread's own connection; `read_sync` runs on the caller's thread, for start-up and the CLI.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from llmgw.contracts.feed import MAX_COUNT

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 9
# How long an opener waits for another process's write transaction before giving up.
BUSY_TIMEOUT = 30.0


def _migrate_1(db: sqlite_utils.Database) -> None:
    db["models"].create({"name": str, "definition": str, "actor": str, "created_at": float,
                         "updated_at": float}, pk="name")
    db["node_admin"].create({"node": str, "state": str, "grace_until": float, "actor": str,
                             "updated_at": float}, pk="node")
    db["replicas"].create({"id": str, "model": str, "api_key": str, "state": str, "reason": str,
                           "replaces": str, "draining": int, "created_at": float, "updated_at": float},
                          pk="id")
    db["shards"].create({"id": str, "replica_id": str, "rank": int, "node": str, "state": str,
                         "port": int, "dist_port": int, "serves_http": int, "gpus": str, "argv": str, "pid": int, "start_time": int,
                         "reason": str, "log_tail": str, "state_since": float, "created_at": float,
                         "updated_at": float}, pk="id", foreign_keys=[("replica_id", "replicas", "id")])
    db["shards"].create_index(["replica_id"])
    db["api_keys"].create({"id": str, "name": str, "hash": str, "prefix": str, "models": str,
                           "created_at": float, "revoked_at": float, "last_used_at": float}, pk="id")
    db["api_keys"].create_index(["name"], unique=True)
    db["api_keys"].create_index(["hash"], unique=True)
    db["usage"].create({"bucket": int, "key_id": str, "model": str, "requests": int,
                        "prompt_tokens": int, "completion_tokens": int}, pk=("bucket", "key_id", "model"))
    db["audit"].create({"id": int, "ts": float, "actor": str, "action": str, "target": str,
                        "detail": str}, pk="id")


def _migrate_2(db: sqlite_utils.Database) -> None:
    """Shards get their launch time. Before, a launched shard's `state_since` was reset at
    launch, so for one that has a process it is the best value there is."""
    db["shards"].add_column("launched_at", float)
    db.execute("UPDATE shards SET launched_at = state_since WHERE pid IS NOT NULL")


def _migrate_3(db: sqlite_utils.Database) -> None:
    """The last report seq applied per router id: a report sent again is not counted again (R-10.3)."""
    db["router_seq"].create({"router": str, "seq": int, "updated_at": float}, pk="router")


def _migrate_4(db: sqlite_utils.Database) -> None:
    """Keys get limits (R-6.16): rpm, tpm and concurrency (NULL: none), a priority class and a
    weight, and per-model limits as JSON ({model: {"rpm": .., "tpm": .., "concurrency": ..}})."""
    for column, kind in (("rpm", int), ("tpm", int), ("concurrency", int), ("priority", int), ("weight", int),
                         ("model_limits", str)):
        db["api_keys"].add_column(column, kind)
    db.execute("UPDATE api_keys SET priority = 0, weight = 1")


def _migrate_5(db: sqlite_utils.Database) -> None:
    """Usage rows get the estimated part of their tokens (a stream cut before its usage, R-6.9a)
    and the requests whose tokens are unknown; rows from before had neither."""
    db["usage"].add_column("estimated_tokens", int, not_null_default=0)
    db["usage"].add_column("unmetered", int, not_null_default=0)


def _migrate_6(db: sqlite_utils.Database) -> None:
    """Routers get credentials of their own (R-10.7): one row per router name, holding the verifier
    (SHA-256) of its credential, never the credential, and while a rotation's grace runs the
    previous verifier with the time it stops being accepted."""
    db["router_credentials"].create({"name": str, "verifier": str, "prefix": str, "created_at": float,
                                     "rotated_at": float, "revoked_at": float, "previous_verifier": str,
                                     "previous_until": float}, pk="name")


def _migrate_7(db: sqlite_utils.Database) -> None:
    """Models get revisions (R-8.6) and rollouts (R-4.13). A replica records the revision it
    runs (NULL for one made before: it is taken to run its model's revision when adopted). Each
    revision a model had is kept with its number and its definition (what its replicas run, so an
    undo can launch it again); a model's rollout is one row: the revision it moves to, the one
    it came from, whether it is paused and why, its canary share, and an undo's hold (the model
    stays on `target` while the catalog still defines `held_over`)."""
    db["replicas"].add_column("revision", str)
    db["revisions"].create({"model": str, "id": str, "number": int, "definition": str, "created_at": float},
                           pk=("model", "id"))
    db["rollouts"].create({"model": str, "target": str, "previous": str, "paused": str, "canary": int,
                           "promoted": int, "held_over": str, "actor": str, "started_at": float,
                           "updated_at": float}, pk="model")


def _migrate_8(db: sqlite_utils.Database) -> None:
    """Aliases set at runtime (R-8.7): a stable name clients call, pointing at a model; usage is
    counted per alias the client used too (`via`, '' for the model's own name), so it joins the key."""
    db["aliases"].create({"name": str, "target": str, "actor": str, "created_at": float, "updated_at": float},
                         pk="name")
    db["usage"].add_column("via", str, not_null_default="")
    db["usage"].transform(pk=("bucket", "key_id", "model", "via"))


def _migrate_9(db: sqlite_utils.Database) -> None:
    """The request log (R-6.20): one row per request a router recorded, with the router that
    reported it. `id` only grows (AUTOINCREMENT: an id is never given again, even once every row
    was pruned), so a follower's cursor never skips a record. Indexed for the listing's filters,
    each with the time so that the newest come first from the index, and for pruning by age."""
    db.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY AUTOINCREMENT, router TEXT NOT NULL, at REAL NOT NULL, "
               "request_id TEXT NOT NULL, route TEXT NOT NULL, status INTEGER NOT NULL, duration REAL NOT NULL, "
               "key TEXT, model TEXT, asked TEXT, replica TEXT, node TEXT, error TEXT, attempts INTEGER NOT NULL, "
               "fallback TEXT, queued REAL, ttfb REAL, prompt_tokens INTEGER, completion_tokens INTEGER, "
               "estimated INTEGER NOT NULL, stream INTEGER NOT NULL, client TEXT, client_request_id TEXT)")
    db.execute("CREATE INDEX requests_at ON requests (at)")
    db.execute("CREATE INDEX requests_key ON requests (key, at)")
    db.execute("CREATE INDEX requests_model ON requests (model, at)")
    db.execute("CREATE INDEX requests_asked ON requests (asked, at) WHERE asked IS NOT NULL")  # aliases only
    db.execute("CREATE INDEX requests_status ON requests (status, at)")


MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {1: _migrate_1, 2: _migrate_2, 3: _migrate_3,
                                                                  4: _migrate_4, 5: _migrate_5, 6: _migrate_6,
                                                                  7: _migrate_7, 8: _migrate_8, 9: _migrate_9}


def schema_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


@contextlib.contextmanager
def write_transaction(db: sqlite_utils.Database) -> Iterator[sqlite_utils.Database]:
    """One transaction that holds the write lock from its start, waiting for it up to the busy
    timeout. A plain BEGIN reads first and then fails at once ("database is locked", no waiting)
    when another process committed in between, e.g. `keys create` beside a running serve."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.conn.in_transaction:  # an error may have ended the transaction already
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def migrate(db: sqlite_utils.Database) -> int:
    """Bring the schema to SCHEMA_VERSION in one write transaction; returns the version.

    Any llmgw command may be the first to open a state directory, and two may do it at once
    (`serve` and `keys create`): the version is read again once the write lock is held, so the
    second one waits for the first and then finds nothing left to do."""
    if schema_version(db) == SCHEMA_VERSION:
        return SCHEMA_VERSION
    with write_transaction(db):
        current = schema_version(db)
        if current > SCHEMA_VERSION:
            raise RuntimeError(f"the state database has schema version {current}, newer than this "
                               f"llmgw understands ({SCHEMA_VERSION}); upgrade llmgw")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version](db)
            db.execute(f"PRAGMA user_version = {version}")
    for version in range(current + 1, SCHEMA_VERSION + 1):
        log.info("state database migrated to schema version %d", version)
    return SCHEMA_VERSION


def _use_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL unless it is already (the mode is kept in the file).

    The switch needs the database to itself and SQLite does not wait for that (no busy handler):
    while another process opens the same fresh file it fails at once, so it is retried."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")  # ":memory:" keeps its own mode
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def _connect(path: str) -> sqlite_utils.Database:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT)
    _use_wal(conn)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    return sqlite_utils.Database(conn)


_STOP = object()


class Store:
    """The state database. Open with `Store.open(path)`, close with `close()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fresh = not Path(self.path).exists()
        else:
            fresh = False
        self._writer_db = _connect(self.path)
        if fresh:
            os.chmod(self.path, 0o600)  # holds engine API keys and key hashes
        migrate(self._writer_db)
        self._reader_local = threading.local()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run_writer, name="llmgw-store-writer", daemon=True)
        self._thread.start()
        self._closed = False

    @classmethod
    def open(cls, path: str | os.PathLike) -> Store:
        return cls(path)

    # -- writing -------------------------------------------------------------------------------

    def submit(self, fn: Callable[[sqlite_utils.Database], T]) -> concurrent.futures.Future:
        """Queue `fn(db)` for the writer thread; never blocks. Returns a concurrent Future."""
        if self._closed:
            raise RuntimeError("the store is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future

    async def write(self, fn: Callable[[sqlite_utils.Database], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def write_sync(self, fn: Callable[[sqlite_utils.Database], T]) -> T:
        """For start-up and CLI code that is not on the event loop."""
        return self.submit(fn).result()

    def _run_writer(self) -> None:
        db = self._writer_db
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # take whatever else is waiting: one transaction for the batch
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(entry is _STOP for entry in batch)
            work = [entry for entry in batch if entry is not _STOP]
            if work:
                self._run_batch(db, work)
            if stop:
                return

    @staticmethod
    def _run_batch(db: sqlite_utils.Database, work: list) -> None:
        results = []
        try:
            with write_transaction(db):
                for fn, future in work:
                    try:
                        with db.atomic():  # a savepoint: one bad write does not lose the batch
                            results.append((future, fn(db), None))
                    except Exception as exc:
                        results.append((future, None, exc))
        except sqlite3.Error as exc:
            for _, future in work:
                _settle(future, None, exc)
            return
        for future, value, exc in results:
            _settle(future, value, exc)

    # -- reading -------------------------------------------------------------------------------

    def reader(self) -> sqlite_utils.Database:
        """A connection for the calling thread (readers see committed state, WAL)."""
        db = getattr(self._reader_local, "db", None)
        if db is None:
            db = self._reader_local.db = _connect(self.path) if self.path != ":memory:" else self._writer_db
        return db

    async def read(self, fn: Callable[[sqlite_utils.Database], T]) -> T:
        return await asyncio.to_thread(lambda: fn(self.reader()))

    def read_sync(self, fn: Callable[[sqlite_utils.Database], T]) -> T:
        return fn(self.reader())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        self._writer_db.conn.close()


def _settle(future: concurrent.futures.Future, value: Any, exc: BaseException | None) -> None:
    """Hand a write's outcome to its caller. A caller that was cancelled while its write waited
    (a client gone, a shutdown) has cancelled its future: the write still ran, and nobody waits
    for the outcome any more. The writer thread must never die of that."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


# -- typed helpers used by several parts --------------------------------------------------------

def audit(db: sqlite_utils.Database, actor: str | None, action: str, target: str, detail: Any = None) -> None:
    db["audit"].insert({"ts": time.time(), "actor": actor or "unknown", "action": action,
                        "target": target, "detail": json.dumps(detail) if detail is not None else None})


def add_usage(db: sqlite_utils.Database, rows: list[tuple]) -> None:
    """Add (bucket, key_id, model, requests, prompt_tokens, completion_tokens[, estimated_tokens,
    unmetered[, via]]) to the counters (`via`: the alias the client used, R-8.7).

    Each sum saturates at MAX_COUNT (R-10.8): SQLite would turn an integer overflow into a float."""
    db.conn.executemany(
        "INSERT INTO usage (bucket, key_id, model, requests, prompt_tokens, completion_tokens, estimated_tokens, "
        "unmetered, via) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (bucket, key_id, model, via) DO UPDATE SET "
        f"requests = MIN(requests + excluded.requests, {MAX_COUNT}), "
        f"prompt_tokens = MIN(prompt_tokens + excluded.prompt_tokens, {MAX_COUNT}), "
        f"completion_tokens = MIN(completion_tokens + excluded.completion_tokens, {MAX_COUNT}), "
        f"estimated_tokens = MIN(estimated_tokens + excluded.estimated_tokens, {MAX_COUNT}), "
        f"unmetered = MIN(unmetered + excluded.unmetered, {MAX_COUNT})",
        [(*row, 0, 0)[:8] + (row[8] if len(row) > 8 else "",) for row in rows])
