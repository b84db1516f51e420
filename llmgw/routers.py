"""Router credentials in the state database (R-10.7): one per router name, only its verifier stored.

The functions run on a sqlite-utils Database and serve `llmgw ctl routers add|list|rotate|revoke`
(through the admin API) and `llmgw serve`, which keeps the credential of the router it spawns
(`serve_router_credential`). `Verifiers` is what the router feed checks against: the verifiers each
name is accepted with now, kept in memory and reloaded after every change.

A credential is never stored: the row holds SHA-256 of it, which is also the key of the feed's
proofs (llmgw.contracts.routerauth), so the database stays as private as it already is (0600).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlite_utils

from llmgw.contracts.routerauth import CREDENTIAL_PREFIX, NAME_RULE, credential_name, new_credential, valid_name
from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.routerauth import verifier as verifier_of

SERVE_ROUTER = "local"  # the name of the router `llmgw serve` spawns on its own host
SHOWN_SECRET = 6  # characters of the secret shown in a listing: enough to tell two apart, useless to guess


class RouterRefused(LlmgwError, ValueError):
    """A refused router credential operation in the operator's words."""

    category = Category.INPUT


@dataclass(frozen=True)
class RouterCredential:
    name: str
    prefix: str
    created_at: float
    rotated_at: float | None = None
    revoked_at: float | None = None
    previous_until: float | None = None  # the previous credential is accepted until then (a rotation's grace)
    verifier: str = ""
    previous_verifier: str | None = None

    def __repr__(self) -> str:
        return f"RouterCredential(name={self.name!r}, prefix={self.prefix!r})"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def accepted(self, now: float) -> tuple[bytes, ...]:
        """The verifiers the feed accepts for this router at `now`: none once revoked."""
        if self.revoked:
            return ()
        keys = [bytes.fromhex(self.verifier)]
        if self.previous_verifier and self.previous_until is not None and now < self.previous_until:
            keys.append(bytes.fromhex(self.previous_verifier))
        return tuple(keys)

    def as_json(self, now: float) -> dict:
        grace = self.previous_until if self.previous_until is not None and now < self.previous_until else None
        return {"name": self.name, "prefix": self.prefix, "created_at": self.created_at,
                "rotated_at": self.rotated_at, "revoked_at": self.revoked_at, "previous_until": grace,
                "state": "revoked" if self.revoked else "active"}

    @classmethod
    def from_row(cls, row: dict) -> RouterCredential:
        return cls(name=row["name"], prefix=row["prefix"], created_at=row["created_at"],
                   rotated_at=row.get("rotated_at"), revoked_at=row.get("revoked_at"),
                   previous_until=row.get("previous_until"), verifier=row["verifier"],
                   previous_verifier=row.get("previous_verifier"))


def _prefix(credential: str) -> str:
    name = credential_name(credential)
    return credential[:len(CREDENTIAL_PREFIX) + len(name) + 1 + SHOWN_SECRET]


def _check_name(name: str) -> str:
    name = name.strip()
    if not valid_name(name):
        raise RouterRefused(f"router name {name!r}: {NAME_RULE}")
    return name


def list_routers(db: sqlite_utils.Database) -> list[RouterCredential]:
    return [RouterCredential.from_row(row) for row in db["router_credentials"].rows_where(order_by="created_at")]


def _named(db: sqlite_utils.Database, name: str) -> RouterCredential:
    rows = list(db["router_credentials"].rows_where("name = ?", [name]))
    if not rows:
        known = ", ".join(r.name for r in list_routers(db)) or "none exist yet"
        raise RouterRefused(f"no router named {name!r} (routers: {known}); add it with `llmgw ctl routers add {name}`")
    return RouterCredential.from_row(rows[0])


def add_router(db: sqlite_utils.Database, name: str, now: float | None = None) -> tuple[RouterCredential, str]:
    """A new router credential, returned once with its secret. A revoked name may be added again:
    its router ids and their report seqs are the same router's."""
    name = _check_name(name)
    now = time.time() if now is None else now
    existing = list(db["router_credentials"].rows_where("name = ?", [name]))
    if existing and existing[0]["revoked_at"] is None:
        raise RouterRefused(f"a router named {name!r} already has a credential; give it a new one with "
                            f"`llmgw ctl routers rotate {name} --grace DURATION`, or revoke it first")
    credential = new_credential(name)
    row = {"name": name, "verifier": verifier_of(credential).hex(), "prefix": _prefix(credential),
           "created_at": now, "rotated_at": None, "revoked_at": None, "previous_verifier": None,
           "previous_until": None}
    db["router_credentials"].upsert(row, pk="name")
    return RouterCredential.from_row(row), credential


def rotate_router(db: sqlite_utils.Database, name: str, grace: float, now: float | None = None,
                  credential: str | None = None) -> tuple[RouterCredential, str]:
    """A new credential for `name`; the one it replaces is accepted for `grace` seconds more."""
    current = _named(db, _check_name(name))
    if current.revoked:
        raise RouterRefused(f"router {name!r} is revoked; add it again with `llmgw ctl routers add {name}`")
    if grace < 0:
        raise RouterRefused(f"--grace {grace}: must not be negative")
    now = time.time() if now is None else now
    credential = credential or new_credential(current.name)
    db["router_credentials"].update(current.name, {
        "verifier": verifier_of(credential).hex(), "prefix": _prefix(credential), "rotated_at": now,
        "previous_verifier": current.verifier if grace > 0 else None,
        "previous_until": now + grace if grace > 0 else None})
    return _named(db, current.name), credential


def revoke_router(db: sqlite_utils.Database, name: str, now: float | None = None) -> tuple[RouterCredential, bool]:
    """Refuse the router's credential from now on; False when it already was (not an error)."""
    current = _named(db, name)
    newly = not current.revoked
    if newly:
        db["router_credentials"].update(current.name, {"revoked_at": time.time() if now is None else now,
                                                       "previous_verifier": None, "previous_until": None})
    return _named(db, current.name), newly


def serve_router_credential(db: sqlite_utils.Database, kept: str | None) -> str:
    """The credential of the router `llmgw serve` spawns: `kept` (what its file holds) while it is
    still the active one of SERVE_ROUTER, otherwise a new one in its place, at once (no grace)."""
    rows = list(db["router_credentials"].rows_where("name = ?", [SERVE_ROUTER]))
    if kept and rows and rows[0]["revoked_at"] is None:
        try:
            if credential_name(kept) == SERVE_ROUTER and verifier_of(kept).hex() == rows[0]["verifier"]:
                return kept.strip()
        except ValueError:
            pass
    if rows and rows[0]["revoked_at"] is None:
        return rotate_router(db, SERVE_ROUTER, 0)[1]
    return add_router(db, SERVE_ROUTER)[1]


class Verifiers:
    """The verifiers the router feed accepts per router name, in memory (`load` after each change)."""

    def __init__(self, credentials: list[RouterCredential] | None = None, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._by_name: dict[str, RouterCredential] = {}
        self.load(credentials or [])

    def __repr__(self) -> str:
        return f"Verifiers({len(self._by_name)} routers)"

    def load(self, credentials: list[RouterCredential]) -> None:
        self._by_name = {c.name: c for c in credentials}

    def accepted(self, name: str) -> tuple[bytes, ...]:
        credential = self._by_name.get(name)
        return () if credential is None else credential.accepted(self.clock())

    def known(self, name: str) -> bool:
        return name in self._by_name
