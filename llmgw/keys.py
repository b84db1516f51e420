"""Client API keys in the state database (R-6.2): random secrets, only their SHA-256 stored.

The functions run on a sqlite-utils Database: `create_key` (with its `KeySettings`), `set_key`,
`list_keys` and `revoke_key` serve the `llmgw keys` commands (`parse_limit` and `parse_model_limit`
read their limit flags), `key_entries` is what the router feed carries of them to the routers
(hashes, never secrets, and each key's limits), `record_key_use` writes the last use routers report.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import sqlite_utils

from llmgw.contracts.feed import LIMIT_FIELDS, NO_MODEL_LIMITS, KeyEntry, Limits
from llmgw.contracts.keyhash import SECRET_PREFIX, hash_secret
from llmgw.contracts.errors import Category, LlmgwError

SHOWN_PREFIX_LENGTH = len(SECRET_PREFIX) + 6  # enough to tell keys apart in a listing, useless to guess


class KeyRefused(LlmgwError, ValueError):
    """A refused key operation in the operator's words (the CLI prints it)."""

    category = Category.INPUT


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
    limits: Limits | None = None  # None: no limit of its own
    priority: int = 0
    weight: int = 1
    model_limits: Mapping[str, Limits] = field(default_factory=lambda: NO_MODEL_LIMITS, hash=False)

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
                   last_used_at=row.get("last_used_at"),
                   limits=Limits(row.get("rpm"), row.get("tpm"), row.get("concurrency")) or None,
                   priority=row.get("priority") or 0, weight=row.get("weight") or 1,
                   model_limits=_model_limits(row.get("model_limits")))


def _model_limits(text: str | None) -> Mapping[str, Limits]:
    if not text:
        return NO_MODEL_LIMITS
    return MappingProxyType({m: Limits(d.get("rpm"), d.get("tpm"), d.get("concurrency"))
                             for m, d in json.loads(text).items()})


def _model_limits_json(model_limits: Mapping[str, Limits]) -> str | None:
    if not model_limits:
        return None
    return json.dumps({m: {f: getattr(lim, f) for f in LIMIT_FIELDS} for m, lim in sorted(model_limits.items())})


# -- the limit flags -----------------------------------------------------------------------------

MODEL_LIMIT_SYNTAX = "MODEL:rpm=N,tpm=N,concurrency=N (any of the three; MODEL:none clears the model's limits)"


def parse_limit(text: str, flag: str) -> int | None:
    """`--rpm 600`: a whole number of at least 1; `none` means no limit."""
    text = text.strip()
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise KeyRefused(f"{flag} {text!r}: expected a whole number of at least 1, or none") from None
    if value < 1:
        raise KeyRefused(f"{flag} {value}: must be at least 1 (use none for no limit)")
    return value


def parse_int(text: str, flag: str, minimum: int | None = None) -> int:
    """`--priority 2`, `--weight 3`: a whole number (at least `minimum` when given)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise KeyRefused(f"{flag} {text!r}: expected a whole number") from None
    if minimum is not None and value < minimum:
        raise KeyRefused(f"{flag} {value}: must be at least {minimum}")
    return value


def parse_model_limit(text: str) -> tuple[str, Limits | None]:
    """`--model-limit MODEL:rpm=N,tpm=N,concurrency=N`; the model's limits, None for MODEL:none.

    The model is what precedes the last colon, so a model named `llama3:8b` works too."""
    model, sep, spec = text.rpartition(":")
    model = model.strip()
    if not sep or not model:
        raise KeyRefused(f"--model-limit {text!r}: expected {MODEL_LIMIT_SYNTAX}")
    if spec.strip().lower() == "none":
        return model, None
    values: dict[str, int | None] = {}
    for part in spec.split(","):
        name, eq, value = part.partition("=")
        name = name.strip().lower()
        if not eq or name not in LIMIT_FIELDS:
            raise KeyRefused(f"--model-limit {text!r}: {part.strip()!r} is not one of rpm=N, tpm=N, "
                             f"concurrency=N (syntax: {MODEL_LIMIT_SYNTAX})")
        if name in values:
            raise KeyRefused(f"--model-limit {text!r}: {name} is given twice")
        values[name] = parse_limit(value, f"--model-limit {model}:{name}=")
    limits = Limits(**values)
    return model, limits or None


def _check_model_limits(model_limits: Mapping[str, Limits], models: frozenset[str] | None) -> None:
    if models is None:
        return
    outside = sorted(set(model_limits) - models)
    if outside:
        raise KeyRefused(f"--model-limit for {', '.join(outside)}: the key may not use "
                         f"{'that model' if len(outside) == 1 else 'those models'} (its models: {', '.join(sorted(models))})")


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeySettings:
    """What a new key is limited to and how it shares (R-6.16): its own limits (None: none), its
    priority class and weight among the keys waiting for a model, and limits per model (a model
    given None, or empty limits, has none of its own)."""

    limits: Limits | None = None
    priority: int = 0
    weight: int = 1
    model_limits: Mapping[str, Limits | None] | None = None


NO_SETTINGS = KeySettings()  # no limit, priority 0, weight 1


def create_key(db: sqlite_utils.Database, name: str, models: Iterable[str] | None = None,
               settings: KeySettings = NO_SETTINGS, secret: str | None = None) -> tuple[ApiKey, str]:
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
    if settings.weight < 1:
        raise KeyRefused(f"--weight {settings.weight}: must be at least 1")
    kept = {m: lim for m, lim in (settings.model_limits or {}).items() if lim}
    _check_model_limits(kept, frozenset(model_list) if model_list is not None else None)
    limits = settings.limits or Limits()
    row = {"id": uuid.uuid4().hex, "name": name, "hash": hash_secret(secret),
           "prefix": secret[:SHOWN_PREFIX_LENGTH],
           "models": json.dumps(model_list) if model_list is not None else None,
           "created_at": time.time(), "revoked_at": None, "last_used_at": None,
           "rpm": limits.rpm, "tpm": limits.tpm, "concurrency": limits.concurrency,
           "priority": settings.priority, "weight": settings.weight, "model_limits": _model_limits_json(kept)}
    db["api_keys"].insert(row)
    return ApiKey.from_row(row), secret


def list_keys(db: sqlite_utils.Database) -> list[ApiKey]:
    return [ApiKey.from_row(row) for row in db["api_keys"].rows_where(order_by="created_at")]


def set_key(db: sqlite_utils.Database, name: str, changes: Mapping[str, int | None],
            model_limits: Mapping[str, Limits | None] | None = None) -> ApiKey:
    """Change a key's limits: `changes` maps rpm, tpm, concurrency (None clears), priority and
    weight to their new values; each model in `model_limits` gets those limits instead of the ones
    it had (None: none any more). Whatever is not named stays as it was."""
    key = _named(db, name)
    if key.revoked:
        raise KeyRefused(f"key {name!r} is revoked; its limits no longer matter")
    unknown = set(changes) - {*LIMIT_FIELDS, "priority", "weight"}
    if unknown:
        raise KeyRefused(f"unknown key settings: {', '.join(sorted(unknown))}")
    if changes.get("priority", 0) is None or changes.get("weight", 1) is None:
        raise KeyRefused("priority and weight take a whole number, not none")
    if changes.get("weight", 1) < 1:
        raise KeyRefused(f"--weight {changes['weight']}: must be at least 1")
    merged = dict(key.model_limits)
    for model, lim in (model_limits or {}).items():
        if lim:
            merged[model] = lim
        else:
            merged.pop(model, None)
    _check_model_limits(merged, key.models)
    update = dict(changes)
    if model_limits:
        update["model_limits"] = _model_limits_json(merged)
    if update:
        db["api_keys"].update(key.id, update)
    return ApiKey.from_row(db["api_keys"].get(key.id))


def _named(db: sqlite_utils.Database, name: str) -> ApiKey:
    rows = list(db["api_keys"].rows_where("name = ?", [name]))
    if not rows:
        known = ", ".join(k.name for k in list_keys(db)) or "none exist yet"
        raise KeyRefused(f"no key named {name!r} (keys: {known})")
    return ApiKey.from_row(rows[0])


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
    rows = db.execute("SELECT id, name, hash, prefix, models, priority, weight, rpm, tpm, concurrency, model_limits "
                      "FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at").fetchall()
    return tuple(KeyEntry(i, n, h, p, None if m is None else frozenset(json.loads(m)), prio or 0, w or 1,
                          None if rpm is None and tpm is None and conc is None else Limits(rpm, tpm, conc),
                          _model_limits(ml))
                 for i, n, h, p, m, prio, w, rpm, tpm, conc, ml in rows)


def record_key_use(db: sqlite_utils.Database, last_used: dict[str, float]) -> None:
    db.conn.executemany("UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?",
                        [(t, key_id) for key_id, t in last_used.items()])
