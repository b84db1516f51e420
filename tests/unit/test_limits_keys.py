"""Per-key limits in the state database, the `llmgw keys` flags and the router feed (R-6.16)."""

from __future__ import annotations

import json

import pytest
import sqlite_utils
from typer.testing import CliRunner

from llmgw.cli.main import app as cli
from llmgw.contracts.feed import FeedError, KeyEntry, Limits, key_from_wire, key_to_wire
from llmgw.keys import KeyRefused, KeySettings, create_key, key_entries, list_keys, parse_model_limit, set_key
from llmgw.store import MIGRATIONS, SCHEMA_VERSION, migrate, schema_version


@pytest.fixture
def db(tmp_path):
    database = sqlite_utils.Database(tmp_path / "keys.db")
    migrate(database)
    return database


def test_r6_16_migration_adds_limits_to_keys_made_before(tmp_path):
    database = sqlite_utils.Database(tmp_path / "old.db")
    for version in (1, 2, 3):
        MIGRATIONS[version](database)
    database.execute("PRAGMA user_version = 3")
    database["api_keys"].insert({"id": "k1", "name": "old", "hash": "h", "prefix": "sk-llmgw-abc", "models": None,
                                 "created_at": 1.0, "revoked_at": None, "last_used_at": None})
    migrate(database)
    assert schema_version(database) == SCHEMA_VERSION
    assert {"rpm", "tpm", "concurrency", "priority", "weight", "model_limits"} <= set(database["api_keys"].columns_dict)
    (old,) = list_keys(database)
    assert (old.limits, old.priority, old.weight, dict(old.model_limits)) == (None, 0, 1, {})
    (entry,) = key_entries(database)
    assert (entry.limits, entry.priority, entry.weight, dict(entry.model_limits)) == (None, 0, 1, {})


def test_r6_16_create_and_set_limits_reach_the_published_entries(db):
    create_key(db, "alice", ["m1", "m2"], KeySettings(limits=Limits(rpm=60), priority=2, weight=3,
                                                     model_limits={"m1": Limits(tpm=1000, concurrency=2)}))
    create_key(db, "bob")
    alice, bob = key_entries(db)
    assert alice.limits == Limits(60, None, None) and (alice.priority, alice.weight) == (2, 3)
    assert dict(alice.model_limits) == {"m1": Limits(None, 1000, 2)}
    assert bob.limits is None and not bob.model_limits

    set_key(db, "alice", {"rpm": None, "tpm": 5000}, {"m1": None, "m2": Limits(rpm=10)})
    alice, _ = key_entries(db)
    assert alice.limits == Limits(None, 5000, None)
    assert dict(alice.model_limits) == {"m2": Limits(10, None, None)}
    set_key(db, "alice", {"tpm": None})
    assert key_entries(db)[0].limits is None  # no limit left: None, not Limits(None, None, None)

    with pytest.raises(KeyRefused, match=r"m3: the key may not use that model \(its models: m1, m2\)"):
        set_key(db, "alice", {}, {"m3": Limits(rpm=1)})
    with pytest.raises(KeyRefused, match="no key named 'carol'"):
        set_key(db, "carol", {"rpm": 1})


@pytest.mark.parametrize("text, message", [
    ("m1", "expected MODEL:rpm=N"),
    (":rpm=1", "expected MODEL:rpm=N"),
    ("m1:rpm", "'rpm' is not one of rpm=N"),
    ("m1:rps=3", "'rps=3' is not one of rpm=N"),
    ("m1:rpm=0", "must be at least 1"),
    ("m1:rpm=ten", "expected a whole number of at least 1, or none"),
    ("m1:rpm=1,rpm=2", "rpm is given twice"),
])
def test_r6_16_bad_model_limit_is_refused_naming_the_fault(text, message):
    with pytest.raises(KeyRefused, match=message):
        parse_model_limit(text)


def test_r6_16_model_limit_syntax():
    assert parse_model_limit("llama3:8b:rpm=5, tpm=100") == ("llama3:8b", Limits(5, 100, None))
    assert parse_model_limit("m1:concurrency=2") == ("m1", Limits(None, None, 2))
    assert parse_model_limit("m1:none") == ("m1", None)


def test_r6_16_cli_create_set_list(tmp_path):
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path)]
    created = runner.invoke(cli, ["keys", "create", "alice", "--rpm", "600", "--concurrency", "4", "--priority", "1",
                                  "--model-limit", "m1:tpm=2000", *state])
    assert created.exit_code == 0, created.output
    runner.invoke(cli, ["keys", "create", "bob", *state])
    listed = {k["name"]: k for k in json.loads(runner.invoke(cli, ["keys", "list", "--json", *state]).stdout)}
    assert {f: listed["alice"][f] for f in ("rpm", "tpm", "concurrency", "priority", "weight", "model_limits")} == \
        {"rpm": 600, "tpm": None, "concurrency": 4, "priority": 1, "weight": 1,
         "model_limits": {"m1": {"rpm": None, "tpm": 2000, "concurrency": None}}}
    assert listed["bob"]["rpm"] is None and listed["bob"]["model_limits"] == {}

    changed = runner.invoke(cli, ["keys", "set", "alice", "--rpm", "none", "--tpm", "90000", "--weight", "2", *state])
    assert changed.exit_code == 0, changed.output
    print(changed.stdout)
    table = runner.invoke(cli, ["keys", "list", *state]).stdout
    print(table)
    alice = next(row for row in table.splitlines() if row.startswith("alice")).split()
    bob = next(row for row in table.splitlines() if row.startswith("bob")).split()
    assert alice[3:9] == ["-", "90000", "4", "1", "2", "m1:"]  # rpm cleared: `-`
    assert bob[3:9] == ["-", "-", "-", "0", "1", "-"]

    for args, message in [(["--rpm", "-5"], "--rpm -5: must be at least 1"),
                          (["--tpm", "lots"], "--tpm 'lots': expected a whole number of at least 1, or none"),
                          (["--weight", "0"], "--weight 0: must be at least 1"),
                          (["--priority", "none"], "--priority 'none': expected a whole number"),
                          (["--model-limit", "m1:rpm=1", "--model-limit", "m1:tpm=2"], "given twice"),
                          ([], "nothing to change")]:
        refused = runner.invoke(cli, ["keys", "set", "alice", *args, *state])
        assert refused.exit_code == 1 and message in refused.stderr, (args, refused.output)
    refused = runner.invoke(cli, ["keys", "create", "carol", "--rpm", "0", *state])
    assert refused.exit_code == 1 and "--rpm 0: must be at least 1" in refused.stderr
    assert "carol" not in runner.invoke(cli, ["keys", "list", *state]).stdout  # nothing half made
    after = {k["name"]: k for k in json.loads(runner.invoke(cli, ["keys", "list", "--json", *state]).stdout)}
    assert (after["alice"]["tpm"], after["alice"]["weight"]) == (90000, 2)  # refusals changed nothing


def test_r6_16_help_gives_the_model_limit_syntax():
    result = CliRunner().invoke(cli, ["keys", "set", "--help"])
    assert "MODEL:rpm=N,tpm=N,concurrency=N" in " ".join(result.stdout.split())


def test_r6_16_limits_travel_on_the_feed_and_are_checked():
    plain = KeyEntry("k1", "bob", "h", "sk-ab", None)
    assert key_to_wire(plain).keys() == {"id", "name", "hash", "prefix", "models"}  # nothing added for no limits
    limited = KeyEntry("k2", "alice", "h2", "sk-cd", frozenset({"m1"}), limits=Limits(rpm=60, tpm=None, concurrency=3),
                       model_limits={"m1": Limits(tpm=100)})
    wire = json.loads(json.dumps(key_to_wire(limited)))
    back = key_from_wire(wire, "keys[0]")
    assert back == limited and dict(back.model_limits) == {"m1": Limits(None, 100, None)}
    assert key_from_wire(key_to_wire(plain), "keys[0]") == plain
    for bad, message in [({"limits": {"rpm": 0}}, r"keys\[0\].limits.rpm: must be at least 1"),
                         ({"limits": {"tpm": "9"}}, r"keys\[0\].limits.tpm: expected int, got str"),
                         ({"limits": [60]}, r"keys\[0\].limits: expected dict, got list"),
                         ({"model_limits": {"m1": {"concurrency": 1.5}}},
                          r"keys\[0\].model_limits\['m1'\].concurrency: expected int, got float")]:
        with pytest.raises(FeedError, match=message):
            key_from_wire({**wire, **bad}, "keys[0]")
