"""API keys for clients (R-6.2): random secrets, only their SHA-256 stored, constant-time checks.

The store functions (`create_key`, `list_keys`, `revoke_key`) run on a sqlite-utils Database and
serve the `llmgw keys` commands. The router never reads SQLite on the request path: its `KeyRing`
is reloaded off the event loop every couple of seconds, so a key created or revoked from another
process takes effect without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import sqlite_utils

from llmgw.router.errors import InvalidKey

SECRET_PREFIX = "sk-llmgw-"
SHOWN_PREFIX_LENGTH = len(SECRET_PREFIX) + 6  # enough to tell keys apart in a listing, useless to guess
REFRESH_SECONDS = 2.0

CREATE_HINT = "an operator creates one with `llmgw keys create NAME`"


class KeyRefused(ValueError):
    """A refused key operation in the operator's words (the CLI prints it)."""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


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


# -- the store side (CLI) ----------------------------------------------------------------------

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


def record_key_use(db: sqlite_utils.Database, last_used: dict[str, float]) -> None:
    db.conn.executemany("UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?",
                        [(t, key_id) for key_id, t in last_used.items()])


# -- the router side ---------------------------------------------------------------------------

class KeyRing:
    """The keys in force, in memory; `authenticate` is all the request path does."""

    def __init__(self, keys: Iterable[ApiKey] = ()):
        self._by_hash: dict[str, ApiKey] = {}
        self.replace(keys)

    def replace(self, keys: Iterable[ApiKey]) -> None:
        self._by_hash = {key.hash: key for key in keys}

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> ApiKey:
        """The key an `Authorization: Bearer ...` header carries, or else an `x-api-key` header
        (as Anthropic's clients send it); raises InvalidKey otherwise."""
        if authorization:
            scheme, _, secret = authorization.partition(" ")
            if scheme.lower() != "bearer" or not secret.strip():
                raise InvalidKey("the Authorization header must be 'Bearer <key>'")
        elif x_api_key and x_api_key.strip():
            secret = x_api_key
        else:
            raise InvalidKey("no API key: send it as 'Authorization: Bearer sk-llmgw-...' or "
                             f"'x-api-key: sk-llmgw-...' ({CREATE_HINT})")
        try:
            digest = hash_secret(secret.strip())
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as surrogates: no key looks like that
            raise InvalidKey("invalid API key") from None
        # The dict finds the candidate by the secret's hash; compare_digest then confirms it in
        # constant time, so response timing says nothing about how close a guess was.
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(key.hash, digest):
            raise InvalidKey("invalid API key")
        if key.revoked_at is not None:
            raise InvalidKey("this API key has been revoked")
        return key

    @staticmethod
    def load(db: sqlite_utils.Database) -> list[ApiKey]:
        return list_keys(db)
