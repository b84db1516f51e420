"""Usage per model and per key over a period (R-6.9), by key with the key's limits (R-6.16)."""

from __future__ import annotations

import pytest
from rich.console import Console

from llmgw.admin import render
from llmgw.admin.usage import usage_report
from llmgw.contracts.feed import Limits
from llmgw.keys import KeySettings, create_key
from llmgw.contracts.feed import USAGE_BUCKET_SECONDS as BUCKET_SECONDS
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
    settings = KeySettings(limits=Limits(rpm=30, concurrency=4),
                           model_limits={"chat": Limits(tpm=9000), "embed": Limits(rpm=5, concurrency=1)})
    limited, _ = store.write_sync(lambda db: create_key(db, "batch", settings=settings))
    store.write_sync(lambda db: add_usage(db, [(HOUR, limited.id, "chat", 1, 1, 1)]))
    yield store
    store.close()


def test_by_model_since_two_hours(store):
    report = store.read_sync(lambda db: usage_report(db, "model", 2 * 3600, NOW))
    assert [(r["name"], r["requests"], r["total_tokens"]) for r in report["rows"]] == [("chat", 5, 142),
                                                                                      ("embed", 2, 5)]
    assert report["from"] == HOUR - 2 * BUCKET_SECONDS and report["totals"]["requests"] == 7


def test_by_key_names_keys_and_keeps_unknown_ids(store):
    report = store.read_sync(lambda db: usage_report(db, "key", 3600, NOW))
    assert [(r["name"], r["requests"]) for r in report["rows"]] == [("ops", 4), ("gone", 2), ("batch", 1)]


def test_r6_16_by_key_each_row_carries_the_keys_limits(store):
    rows = {r["name"]: r for r in store.read_sync(lambda db: usage_report(db, "key", 3600, NOW))["rows"]}
    limits = ("rpm", "tpm", "concurrency", "model_limits")
    assert {f: rows["batch"][f] for f in limits} == {
        "rpm": 30, "tpm": None, "concurrency": 4,
        "model_limits": {"chat": {"rpm": None, "tpm": 9000, "concurrency": None},
                         "embed": {"rpm": 5, "tpm": None, "concurrency": 1}}}
    assert {f: rows["ops"][f] for f in limits} == {"rpm": None, "tpm": None, "concurrency": None,
                                                   "model_limits": {}}  # none set
    assert {f: rows["gone"][f] for f in limits} == dict.fromkeys(limits)  # the key is gone: not known
    by_model = store.read_sync(lambda db: usage_report(db, "model", 3600, NOW))["rows"]
    assert not any("rpm" in row for row in by_model)


def test_r6_16_ctl_usage_by_key_shows_limits_beside_usage_and_dash_where_none(store):
    report = store.read_sync(lambda db: usage_report(db, "key", 3600, NOW))
    console = Console(width=200, record=True)
    console.print(render.usage(report))
    lines = console.export_text().splitlines()
    print("\n".join(lines))
    assert lines[0].split() == ["KEY", "REQUESTS", "PROMPT", "TOKENS", "COMPLETION", "TOKENS", "TOTAL", "TOKENS",
                                "ESTIMATED", "UNMETERED", "RPM", "TPM", "CONC", "MODEL", "LIMITS"]
    shown = {line.split()[0]: line.split()[7:] for line in lines[1:4]}
    assert shown["batch"] == ["30", "-", "4", "chat:", "tpm=9000;", "embed:", "rpm=5,concurrency=1"]
    assert shown["ops"] == ["-", "-", "-", "-"]
    assert shown["gone"] == ["-", "-", "-", "-"]
    console = Console(width=200, record=True)
    console.print(render.usage(store.read_sync(lambda db: usage_report(db, "model", 3600, NOW))))
    assert "RPM" not in console.export_text()  # limits belong to keys


def test_r6_9a_estimated_share_and_unknown_tokens_are_shown_as_such(store):
    """A row's estimate is part of its tokens and shown apart; a row made only of requests whose
    tokens nobody knows has no token counts (`-`, null), not 0."""
    store.write_sync(lambda db: add_usage(db, [(HOUR, "k1", "cut", 2, 20, 300, 250, 0),
                                               (HOUR, "k1", "blind", 3, 0, 0, 0, 3)]))
    report = store.read_sync(lambda db: usage_report(db, "model", 3600, NOW))
    rows = {r["name"]: r for r in report["rows"]}
    assert {k: rows["cut"][k] for k in ("requests", "prompt_tokens", "completion_tokens", "total_tokens",
                                        "estimated_tokens", "unmetered")} == {
        "requests": 2, "prompt_tokens": 20, "completion_tokens": 300, "total_tokens": 320, "estimated_tokens": 250,
        "unmetered": 0}
    blind = rows["blind"]
    assert (blind["prompt_tokens"], blind["completion_tokens"], blind["total_tokens"], blind["unmetered"]) == \
        (None, None, None, 3)
    assert report["totals"]["estimated_tokens"] == 250 and report["totals"]["unmetered"] == 3
    console = Console(width=200, record=True)
    console.print(render.usage(report))
    lines = console.export_text().splitlines()
    assert next(line.split() for line in lines if line.startswith("blind")) == ["blind", "3", "-", "-", "-", "0", "3", "-"]  # no alias: VIA ALIAS -
    summary = " ".join(" ".join(lines).split())
    assert "of which 250 estimated" in summary and "3 requests whose tokens are unknown" in summary


def test_period_starts_at_the_hour_that_holds_it(store):
    report = store.read_sync(lambda db: usage_report(db, "model", 60, NOW))
    assert report["from"] == HOUR and report["rows"][0]["requests"] == 4


def test_unknown_grouping_is_refused(store):
    with pytest.raises(ValueError):
        store.read_sync(lambda db: usage_report(db, "colour", 60, NOW))


def test_r8_7_usage_through_an_alias_is_the_models_with_the_alias_named(store):
    store.write_sync(lambda db: add_usage(db, [(HOUR, "k1", "chat-v2", 2, 20, 30, 0, 0),
                                               (HOUR, "k1", "chat-v2", 3, 30, 45, 0, 0, "chat"),
                                               (HOUR, "k2", "chat-v2", 1, 10, 15, 0, 0, "chat")]))
    report = store.read_sync(lambda db: usage_report(db, "model", 3600, NOW))
    row = next(r for r in report["rows"] if r["name"] == "chat-v2")
    assert (row["name"], row["requests"], row["via"]) == ("chat-v2", 6, {"chat": 4})
    console = Console(width=200, record=True)
    console.print(render.usage(report))
    assert "chat: 4" in console.export_text()
