"""Client API keys in the state database (R-6.2): random secrets, only their SHA-256 stored.

The functions run on a sqlite-utils Database: `create_key`, `list_keys` and `revoke_key` serve the
`llmgw keys` commands, `key_entries` is what the control plane publishes to routers (the router
feed carries hashes, never secrets), `record_key_use` writes the last use routers report.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import sqlite_utils

from llmgw.contracts.feed import KeyEntry
from llmgw.contracts.keyhash import SECRET_PREFIX, hash_secret

SHOWN_PREFIX_LENGTH = len(SECRET_PREFIX) + 6  # enough to tell keys apart in a listing, useless to guess


class KeyRefused(ValueError):
    """A refused key operation in the operator's words (the CLI prints it)."""


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    hash: str
    prefix: str
    models: frozenset[str] | None  # None: every model
    created_at: float
    revoked_at: float | None = None
    last_used_at: float | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __repr__(self) -> str:
        return f"ApiKey(name={self.name!r}, prefix={self.prefix!r})"

    @classmethod
    def from_row(cls, row: dict) -> ApiKey:
        models = row.get("models")
        return cls(id=row["id"], name=row["name"], hash=row["hash"], prefix=row["prefix"],
                   models=frozenset(json.loads(models)) if models is not None else None,
                   created_at=row["created_at"], revoked_at=row.get("revoked_at"),
                   last_used_at=row.get("last_used_at"))


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def create_key(db: sqlite_utils.Database, name: str, models: Iterable[str] | None = None,
               secret: str | None = None) -> tuple[ApiKey, str]:
    """Store a new key and return it with its secret, which is not kept anywhere."""
    name = name.strip()
    if not name:
        raise KeyRefused("a key needs a name")
    existing = list(db["api_keys"].rows_where("name = ?", [name]))
    if existing:
        if existing[0]["revoked_at"] is not None:
            raise KeyRefused(f"a revoked key is already named {name!r}; names stay unique so that "
                            "usage stays attributable: choose another name")
        raise KeyRefused(f"a key named {name!r} already exists; revoke it first or choose another name")
    secret = secret or new_secret()
    model_list = sorted({m.strip() for m in models if m.strip()}) if models is not None else None
    if model_list is not None and not model_list:
        raise KeyRefused("--models was given but names no model")
    row = {"id": uuid.uuid4().hex, "name": name, "hash": hash_secret(secret),
           "prefix": secret[:SHOWN_PREFIX_LENGTH],
           "models": json.dumps(model_list) if model_list is not None else None,
           "created_at": time.time(), "revoked_at": None, "last_used_at": None}
    db["api_keys"].insert(row)
    return ApiKey.from_row(row), secret


def list_keys(db: sqlite_utils.Database) -> list[ApiKey]:
    return [ApiKey.from_row(row) for row in db["api_keys"].rows_where(order_by="created_at")]


def revoke_key(db: sqlite_utils.Database, name: str) -> tuple[ApiKey, bool]:
    """Mark the key revoked (kept for usage history); False when it already was (not an error)."""
    rows = list(db["api_keys"].rows_where("name = ?", [name]))
    if not rows:
        known = ", ".join(k.name for k in list_keys(db)) or "none exist yet"
        raise KeyRefused(f"no key named {name!r} (keys: {known})")
    newly = rows[0]["revoked_at"] is None
    if newly:
        db["api_keys"].update(rows[0]["id"], {"revoked_at": time.time()})
    return ApiKey.from_row(db["api_keys"].get(rows[0]["id"])), newly


def key_entries(db: sqlite_utils.Database) -> tuple[KeyEntry, ...]:
    """The keys in force, as the router feed carries them: a revoked key is left out."""
    rows = db.execute("SELECT id, name, hash, prefix, models FROM api_keys WHERE revoked_at IS NULL "
                      "ORDER BY created_at").fetchall()
    return tuple(KeyEntry(i, n, h, p, None if m is None else frozenset(json.loads(m))) for i, n, h, p, m in rows)


def record_key_use(db: sqlite_utils.Database, last_used: dict[str, float]) -> None:
    db.conn.executemany("UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?",
                        [(t, key_id) for key_id, t in last_used.items()])
