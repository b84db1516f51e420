"""Usage per model and per key over a period (R-6.9)."""

from __future__ import annotations

import pytest

from llmgw.admin.usage import usage_report
from llmgw.router.usage import BUCKET_SECONDS
from llmgw.store import Store, add_usage

NOW = 1_800_001_800.0  # half past an hour
HOUR = int(NOW) // BUCKET_SECONDS * BUCKET_SECONDS


@pytest.fixture
def store(tmp_path):
    store = Store.open(tmp_path / "state.db")
    store.write_sync(lambda db: db["api_keys"].insert({"id": "k1", "name": "ops", "hash": "h", "prefix": "p",
                                                       "created_at": 0.0}))
    store.write_sync(lambda db: add_usage(db, [
        (HOUR, "k1", "chat", 3, 30, 90),
        (HOUR - BUCKET_SECONDS, "k1", "chat", 1, 10, 10),
        (HOUR, "gone", "embed", 2, 5, 0),
        (HOUR - 48 * BUCKET_SECONDS, "k1", "chat", 100, 1000, 1000),
    ]))
    yield store
    store.close()


def test_by_model_since_two_hours(store):
    report = store.read_sync(lambda db: usage_report(db, "model", 2 * 3600, NOW))
    assert [(r["name"], r["requests"], r["total_tokens"]) for r in report["rows"]] == [("chat", 4, 140),
                                                                                      ("embed", 2, 5)]
    assert report["from"] == HOUR - 2 * BUCKET_SECONDS and report["totals"]["requests"] == 6


def test_by_key_names_keys_and_keeps_unknown_ids(store):
    report = store.read_sync(lambda db: usage_report(db, "key", 3600, NOW))
    assert [(r["name"], r["requests"]) for r in report["rows"]] == [("ops", 4), ("gone", 2)]


def test_period_starts_at_the_hour_that_holds_it(store):
    report = store.read_sync(lambda db: usage_report(db, "model", 60, NOW))
    assert report["from"] == HOUR and report["rows"][0]["requests"] == 3


def test_unknown_grouping_is_refused(store):
    with pytest.raises(ValueError):
        store.read_sync(lambda db: usage_report(db, "colour", 60, NOW))
