"""The SQLite store: migrations, WAL, the single batched writer thread."""

from __future__ import annotations

import asyncio
import os
import stat
import threading

import pytest
import sqlite_utils

from llmgw.control.state import STARTING, load_replicas
from llmgw.store import MIGRATIONS, SCHEMA_VERSION, Store, add_usage, migrate, schema_version


def test_migration_from_an_empty_database(tmp_path):
    db = sqlite_utils.Database(tmp_path / "empty.db")
    assert schema_version(db) == 0
    assert migrate(db) == SCHEMA_VERSION
    assert schema_version(db) == SCHEMA_VERSION
    assert {"models", "node_admin", "replicas", "shards", "api_keys", "usage", "audit"} <= set(db.table_names())
    assert migrate(db) == SCHEMA_VERSION  # idempotent


def test_a_version_1_database_is_adopted_with_launch_times(tmp_path):
    """Schema 2 gives shards `launched_at`; a launched shard of an older database gets its
    `state_since` (reset at launch then), one never launched gets none."""
    path = tmp_path / "v1.db"
    db = sqlite_utils.Database(path)
    MIGRATIONS[1](db)
    db.execute("PRAGMA user_version = 1")
    db["replicas"].insert({"id": "m-1", "model": "m", "api_key": "k", "state": "starting", "draining": 1})
    shard = {"replica_id": "m-1", "node": "a", "gpus": "[0]", "serves_http": 1, "created_at": 1.0}
    db["shards"].insert_all([{**shard, "id": "m-1-0", "rank": 0, "state": "starting", "pid": 7, "start_time": 70,
                              "state_since": 1234.5},
                             {**shard, "id": "m-1-1", "rank": 1, "state": "pending", "state_since": 1200.0}])
    db.conn.close()
    store = Store.open(path)
    try:
        [replica] = store.read_sync(load_replicas)
    finally:
        store.close()
    assert [s.launched_at for s in replica.shards] == [1234.5, None]
    assert replica.shards[0].state == STARTING and replica.draining and not replica.retiring


def test_newer_schema_is_refused(tmp_path):
    db = sqlite_utils.Database(tmp_path / "new.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="upgrade llmgw"):
        migrate(db)


def test_wal_is_on_and_file_is_private(tmp_path):
    path = tmp_path / "state.db"
    store = Store.open(path)
    try:
        assert store.read_sync(lambda db: db.execute("PRAGMA journal_mode").fetchone()[0]) == "wal"
        store.write_sync(lambda db: db["audit"].insert({"ts": 1.0, "actor": "t", "action": "a", "target": "x"}))
        assert os.path.exists(str(path) + "-wal")  # the -wal file exists while the store is open
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        store.close()


def test_writes_run_on_one_thread_in_batches(tmp_path):
    store = Store.open(tmp_path / "state.db")
    threads = set()

    def write(i):
        def fn(db):
            threads.add(threading.get_ident())
            db["audit"].insert({"ts": float(i), "actor": "t", "action": "a", "target": str(i)})
        return fn

    try:
        futures = [store.submit(write(i)) for i in range(200)]
        for f in futures:
            f.result()
        assert len(threads) == 1 and threading.get_ident() not in threads
        assert store.read_sync(lambda db: db["audit"].count) == 200
    finally:
        store.close()


def test_a_failing_write_does_not_lose_the_batch(tmp_path):
    store = Store.open(tmp_path / "state.db")

    def bad(db):
        db["audit"].insert({"ts": 0.0, "actor": "t", "action": "bad", "target": "x"})
        raise ValueError("boom")

    try:
        good = store.submit(lambda db: db["audit"].insert({"ts": 1.0, "actor": "t", "action": "ok", "target": "x"}))
        failing = store.submit(bad)
        good2 = store.submit(lambda db: db["audit"].insert({"ts": 2.0, "actor": "t", "action": "ok", "target": "y"}))
        good.result(), good2.result()
        with pytest.raises(ValueError):
            failing.result()
        actions = store.read_sync(lambda db: [r["action"] for r in db["audit"].rows])
        assert actions == ["ok", "ok"]
    finally:
        store.close()


async def test_async_write_does_not_block_the_loop(tmp_path):
    store = Store.open(tmp_path / "state.db")
    try:
        rows = [(1, "k1", "m", 1, 10, 5), (1, "k1", "m", 1, 3, 2)]
        await store.write(lambda db: add_usage(db, rows))
        usage = await store.read(lambda db: list(db["usage"].rows))
        assert usage == [{"bucket": 1, "key_id": "k1", "model": "m", "requests": 2,
                          "prompt_tokens": 13, "completion_tokens": 7, "estimated_tokens": 0, "unmetered": 0, "via": ""}]
    finally:
        store.close()


OPENERS = 8


def _open_and_write(path: str, barrier, index: int) -> None:
    barrier.wait()  # every opener meets the fresh file at the same moment
    store = Store.open(path)
    try:
        store.write_sync(lambda db: db["audit"].insert({"ts": 0.0, "actor": "t", "action": "open",
                                                        "target": str(index)}))
    finally:
        store.close()


def _open_in_processes(path: str) -> list[int | None]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(OPENERS)
    processes = [context.Process(target=_open_and_write, args=(path, barrier, i)) for i in range(OPENERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    return [process.exitcode for process in processes]


def _open_in_threads(path: str) -> list[int | None]:
    barrier = threading.Barrier(OPENERS)
    codes: list[int | None] = [None] * OPENERS

    def run(index: int) -> None:
        try:
            _open_and_write(path, barrier, index)
            codes[index] = 0
        except Exception as exc:
            print(f"opener {index}: {type(exc).__name__}: {exc}")
            codes[index] = 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(OPENERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return codes


@pytest.mark.parametrize("open_all", [pytest.param(_open_in_processes, id="processes"),
                                      pytest.param(_open_in_threads, id="threads")])
def test_concurrent_first_use_of_a_fresh_state_database(tmp_path, open_all):
    """`serve` and `keys create` may open a new state directory together: each one waits for the
    other's migration and none fails ("database is locked", "table already exists")."""
    for attempt in range(3):  # a fresh file each time: the race is in the first use
        path = str(tmp_path / f"state-{attempt}.db")
        assert open_all(path) == [0] * OPENERS
        db = sqlite_utils.Database(path)
        assert schema_version(db) == SCHEMA_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert sorted(int(row["target"]) for row in db["audit"].rows) == list(range(OPENERS))
        db.close()


async def test_a_write_whose_caller_was_cancelled_still_runs_and_the_writer_lives_on(tmp_path):
    """A caller cancelled while its write waits (a client gone, a shutdown) cancels only its own
    wait: the write still runs, and the writer thread keeps serving the writes after it."""
    store = Store.open(tmp_path / "state.db")
    try:
        gate = threading.Event()
        store.submit(lambda db: gate.wait(10))  # holds the writer while the next write is queued
        waiting = asyncio.ensure_future(store.write(lambda db: db["audit"].insert(
            {"ts": 1.0, "actor": "t", "action": "cancelled-caller", "target": "x"})))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        # The writer is still alive: a dead one would leave this write waiting forever.
        assert await asyncio.wait_for(store.write(lambda db: db["audit"].count), 30) == 1
        assert [row["action"] for row in store.read_sync(lambda db: list(db["audit"].rows))] == ["cancelled-caller"]
    finally:
        store.close()
