"""API keys: random secrets, hashes only, constant-time checks, model limits, the CLI (R-6.2)."""

from __future__ import annotations

import hashlib
import json

import pytest
import sqlite_utils
from typer.testing import CliRunner

from llmgw.cli.main import app as cli
from llmgw.keys import KeyRefused, create_key, key_entries, list_keys, record_key_use, revoke_key
from llmgw.router import keys as keys_module
from llmgw.router.errors import InvalidKey
from llmgw.router.keys import KeyRing, allows
from llmgw.store import migrate


@pytest.fixture
def db(tmp_path):
    database = sqlite_utils.Database(tmp_path / "keys.db")
    migrate(database)
    return database


def test_r6_2_secret_is_random_and_only_its_hash_is_stored(db):
    key, secret = create_key(db, "alice")
    _, other = create_key(db, "bob")
    assert secret.startswith("sk-llmgw-") and len(secret) > 40 and secret != other
    row = db["api_keys"].get(key.id)
    assert row["hash"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in json.dumps(row)
    assert secret.startswith(row["prefix"]) and len(row["prefix"]) < len(secret) // 2


def test_r6_2_names_are_unique_even_after_revocation(db):
    create_key(db, "alice")
    with pytest.raises(KeyRefused, match="already exists"):
        create_key(db, "alice")
    revoke_key(db, "alice")
    with pytest.raises(KeyRefused, match="revoked key is already named"):
        create_key(db, "alice")
    with pytest.raises(KeyRefused, match="no key named 'carol'"):
        revoke_key(db, "carol")


def test_r6_2_authenticate(db, monkeypatch):
    _, secret = create_key(db, "alice", ["m1"])
    _, revoked = create_key(db, "bob")
    revoke_key(db, "bob")
    ring = KeyRing(key_entries(db))
    compared = []
    real = keys_module.hmac.compare_digest
    monkeypatch.setattr(keys_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    key = ring.authenticate(f"Bearer {secret}")
    assert key.name == "alice" and allows(key, "m1") and not allows(key, "m2")
    assert compared  # the match is confirmed in constant time
    for header, message in [(None, "no API key"), ("", "no API key"), (secret, "must be 'Bearer"),
                            ("Basic abc", "must be 'Bearer"), ("Bearer ", "must be 'Bearer"),
                            (f"Bearer {secret}x", "invalid API key"), (f"Bearer {revoked}", "invalid API key")]:
        with pytest.raises(InvalidKey, match=message):
            ring.authenticate(header)


def test_r10_1_published_keys_leave_revoked_ones_out_and_show_no_hash(db):
    alice, _ = create_key(db, "alice", ["m1"])
    create_key(db, "bob")
    revoke_key(db, "bob")
    entries = key_entries(db)
    assert [(e.id, e.name, e.models) for e in entries] == [(alice.id, "alice", frozenset({"m1"}))]
    assert entries[0].hash == alice.hash and alice.hash not in repr(entries)


def test_r6_2_empty_ring_lets_nobody_in():
    with pytest.raises(InvalidKey):
        KeyRing().authenticate("Bearer sk-llmgw-anything")


def test_last_use_is_written_in_one_batch_and_never_goes_back(db):
    a, _ = create_key(db, "a")
    b, _ = create_key(db, "b")
    record_key_use(db, {a.id: 100.0, b.id: 200.0})
    record_key_use(db, {a.id: 50.0})
    used = {k.name: k.last_used_at for k in list_keys(db)}
    assert used == {"a": 100.0, "b": 200.0}


def test_r6_2_cli_create_list_revoke(tmp_path):
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path)]
    created = runner.invoke(cli, ["keys", "create", "alice", "--models", "m1,m2", *state])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip()
    assert secret.startswith("sk-llmgw-") and "\n" not in secret  # stdout is the secret alone
    assert "only time" in created.stderr

    table = runner.invoke(cli, ["keys", "list", *state])
    assert table.exit_code == 0
    assert "alice" in table.stdout and "m1, m2" in table.stdout and secret not in table.stdout
    line = next(row for row in table.stdout.splitlines() if row.startswith("alice"))
    assert line.split()[-2:] == ["-", "-"]  # never used, not revoked: `-`, never a made-up time

    listed = json.loads(runner.invoke(cli, ["keys", "list", "--json", *state]).stdout)
    assert listed == [{"name": "alice", "prefix": secret[:15], "models": ["m1", "m2"],
                       "rpm": None, "tpm": None, "concurrency": None, "priority": 0, "weight": 1, "model_limits": {},
                       "created_at": listed[0]["created_at"], "last_used_at": None, "revoked_at": None}]

    duplicate = runner.invoke(cli, ["keys", "create", "alice", *state])
    assert duplicate.exit_code == 1 and "already exists" in duplicate.stderr

    revoked = runner.invoke(cli, ["keys", "revoke", "alice", *state])
    assert revoked.exit_code == 0 and "revoked" in revoked.stdout
    assert json.loads(runner.invoke(cli, ["keys", "list", "--json", *state]).stdout)[0]["revoked_at"]
    unknown = runner.invoke(cli, ["keys", "revoke", "nobody", *state])
    assert unknown.exit_code == 1 and "no key named 'nobody'" in unknown.stderr


def test_r6_2_cli_state_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path / "env-state"))
    result = CliRunner().invoke(cli, ["keys", "create", "k"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "env-state" / "state.db").exists()


def test_r6_2_help_says_how_to_create_the_first_key():
    result = CliRunner().invoke(cli, ["keys", "--help"])
    assert "llmgw keys create NAME" in " ".join(result.stdout.split())


def test_r6_13_authenticate_takes_x_api_key_as_anthropic_clients_send_it(db):
    _, secret = create_key(db, "alice")
    _, revoked = create_key(db, "bob")
    revoke_key(db, "bob")
    ring = KeyRing(key_entries(db))
    assert ring.authenticate(None, secret).name == "alice"
    assert ring.authenticate(f"Bearer {secret}", "ignored").name == "alice"  # Authorization, when sent, decides
    for authorization, x_api_key, message in [(None, "", "no API key"), (None, " ", "no API key"),
                                              (None, secret + "x", "invalid API key"), (None, revoked, "invalid API key"),
                                              ("Basic abc", secret, "must be 'Bearer")]:
        with pytest.raises(InvalidKey, match=message):
            ring.authenticate(authorization, x_api_key)
