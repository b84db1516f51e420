"""Revisions and rollouts as the control plane keeps them (R-8.6, R-4.13).

`RolloutMemory` owns, between passes and across restarts (the `revisions` and `rollouts`
tables), every revision each model has had — its id, its number (1, 2, … in the order the
model first had them) and its definition, so that an undo can launch it again — and each
model's rollout: the revision it moves to, the one it came from, whether it is paused and why,
its canary share and whether the canary was promoted, and an undo's hold. The decision of a
pass is llmgw.control.rollout's, pure; this module says what the target is.

A model's target is the revision its catalog entry defines, except while an undo holds it: an
undo sets the target to the previous revision and remembers the revision the catalog defined
then (`held_over`); the hold lasts while the catalog still defines that revision, so a reload
of the unchanged file keeps it and a changed definition ends it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import sqlite_utils

from llmgw import revisions
from llmgw.catalog import Catalog, Model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Revision:
    """One definition a model has had."""

    model: str
    id: str
    number: int
    definition: Mapping
    created_at: float

    def row(self) -> dict:
        return {"model": self.model, "id": self.id, "number": self.number,
                "definition": json.dumps(self.definition, sort_keys=True), "created_at": self.created_at}


@dataclass(frozen=True, slots=True)
class Rollout:
    """A model's rollout: towards `target`, from `previous`."""

    model: str
    target: str
    previous: str | None
    started_at: float
    paused: str | None = None  # why it is paused; None: it moves
    canary: int | None = None  # this rollout's canary share, in place of the model's `rollout.canary`
    promoted: bool = False  # the canary was promoted: the rollout goes on to every replica
    held_over: str | None = None  # an undo: the revision the catalog defined when it was undone
    actor: str | None = None
    updated_at: float = field(default_factory=time.time)

    def row(self) -> dict:
        return {"model": self.model, "target": self.target, "previous": self.previous, "paused": self.paused,
                "canary": self.canary, "promoted": int(self.promoted), "held_over": self.held_over,
                "actor": self.actor, "started_at": self.started_at, "updated_at": self.updated_at}

    @classmethod
    def from_row(cls, row: Mapping) -> Rollout:
        return cls(model=row["model"], target=row["target"], previous=row["previous"], started_at=row["started_at"],
                   paused=row["paused"], canary=row["canary"], promoted=bool(row["promoted"]),
                   held_over=row["held_over"], actor=row["actor"], updated_at=row["updated_at"] or row["started_at"])


def load(db: sqlite_utils.Database) -> tuple[list[Revision], list[Rollout]]:
    found = [Revision(r["model"], r["id"], r["number"], json.loads(r["definition"]), r["created_at"])
             for r in db["revisions"].rows]
    return found, [Rollout.from_row(r) for r in db["rollouts"].rows]


def save_revision(db: sqlite_utils.Database, revision: Revision) -> None:
    db["revisions"].insert(revision.row(), pk=("model", "id"), ignore=True)


def save_rollout(db: sqlite_utils.Database, rollout: Rollout) -> None:
    db["rollouts"].upsert(rollout.row(), pk="model")


def delete_rollout(db: sqlite_utils.Database, model: str) -> None:
    db["rollouts"].delete_where("model = ?", [model])


class RolloutMemory:
    """Each model's revisions and rollout; see the module's docstring."""

    def __init__(self) -> None:
        self.revisions: dict[str, dict[str, Revision]] = {}  # model -> revision id -> Revision
        self.rollouts: dict[str, Rollout] = {}

    def adopt(self, found: list[Revision], rollouts: list[Rollout]) -> None:
        for revision in found:
            self.revisions.setdefault(revision.model, {})[revision.id] = revision
        self.rollouts = {r.model: r for r in rollouts}

    def note(self, model: Model, now: float) -> Revision | None:
        """Register the revision `model` defines; returns it when it is new (to be saved)."""
        defined = revisions.definition(model)
        if defined is None:
            return None
        rid = revisions.revision_id(defined)
        known = self.revisions.setdefault(model.name, {})
        if rid in known:
            return None
        number = max((r.number for r in known.values()), default=0) + 1
        revision = known[rid] = Revision(model.name, rid, number, defined, now)
        return revision

    def number(self, model: str, revision_id: str | None) -> int | None:
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        return None if found is None else found.number

    def target(self, model: Model, catalog: Catalog) -> tuple[str | None, Model]:
        """The revision the model's replicas should run and the model to launch them from: the
        catalog's, unless an undo holds the model on an earlier one (module docstring)."""
        defined = revisions.of(model)
        rollout = self.rollouts.get(model.name)
        if rollout is None or rollout.held_over is None or rollout.held_over != defined:
            return defined, model
        held = self.revisions.get(model.name, {}).get(rollout.target)
        if held is None:
            return defined, model
        try:
            return rollout.target, revisions.model_at(model, held.definition, catalog.engines)
        except ValueError as exc:
            log.warning("model %s cannot be held on revision %s any more (%s): it runs the catalog's",
                        model.name, rollout.target, exc)
            return defined, model

    def start(self, model: str, target: str, previous: str | None, now: float,
              actor: str | None = None) -> Rollout:
        """A rollout towards `target` begins (the catalog's revision changed)."""
        held = self.rollouts.get(model)
        rollout = Rollout(model, target, previous, now, actor=actor)
        if held is not None and held.held_over is not None and held.target == target:
            rollout = replace(rollout, held_over=held.held_over)
        self.rollouts[model] = rollout
        return rollout

    def update(self, rollout: Rollout, **changes) -> Rollout:
        changed = self.rollouts[rollout.model] = replace(rollout, updated_at=time.time(), **changes)
        return changed
