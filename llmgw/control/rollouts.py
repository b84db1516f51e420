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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import sqlite_utils

from llmgw import revisions
from llmgw.catalog import Catalog, Model
from llmgw.control import plan, rollout
from llmgw.contracts.refusals import ErrorKind, ServiceError
from llmgw.control.state import Replica
from llmgw.store import Store, audit
from llmgw.weights import parse_weights

log = logging.getLogger(__name__)

SUPERVISOR_LINE = "llmgw supervisor:"  # what the node's supervisor adds to an engine's log, not the engine's


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


def save_rollout(db: sqlite_utils.Database, record: Rollout) -> None:
    db["rollouts"].upsert(record.row(), pk="model")


def delete_rollout(db: sqlite_utils.Database, model: str) -> None:
    db["rollouts"].delete_where("model = ?", [model])


class RolloutMemory:
    """Each model's revisions and rollout; see the module's docstring."""

    def __init__(self) -> None:
        self.revisions: dict[str, dict[str, Revision]] = {}  # model -> revision id -> Revision
        self.rollouts: dict[str, Rollout] = {}
        self.progress: dict[str, plan.Rolled] = {}  # model -> where its rollout stood after the last pass
        # Per model name, the last two Model objects seen (the catalog's, and the one an undo holds)
        # with their definition and id: a catalog's models never change, so each pass reuses them
        # instead of dumping and hashing every model again.
        self._seen: dict[str, list[tuple[Model, dict | None, str | None]]] = {}
        self._held: dict[str, tuple[Model, str, Model]] = {}  # name -> (catalog model, target, model at it)

    def adopt(self, found: list[Revision], rollouts: list[Rollout]) -> None:
        for revision in found:
            self.revisions.setdefault(revision.model, {})[revision.id] = revision
        self.rollouts = {r.model: r for r in rollouts}

    def _defined(self, model: Model) -> tuple[dict | None, str | None]:
        """`model`'s definition and revision id (revisions.definition, revision_id), kept per object."""
        seen = self._seen.setdefault(model.name, [])
        for kept, defined, rid in seen:
            if kept is model:
                return defined, rid
        defined = revisions.definition(model)
        rid = None if defined is None else revisions.revision_id(defined)
        seen.insert(0, (model, defined, rid))
        del seen[2:]
        return defined, rid

    def revision_of(self, model: Model) -> str | None:
        """The id of the revision `model` defines (revisions.of), None when llmgw runs nothing for it."""
        return self._defined(model)[1]

    def note(self, model: Model, now: float) -> Revision | None:
        """Register the revision `model` defines; returns it when it is new (to be saved)."""
        defined, rid = self._defined(model)
        if defined is None:
            return None
        known = self.revisions.setdefault(model.name, {})
        if rid in known:
            return None
        number = max((r.number for r in known.values()), default=0) + 1
        revision = known[rid] = Revision(model.name, rid, number, defined, now)
        return revision

    def number(self, model: str, revision_id: str | None) -> int | None:
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        return None if found is None else found.number

    def cache_name(self, model: str, revision_id: str | None) -> str | None:
        """The cache entry a revision's weights are fetched into; None for weights on a path, or
        a revision not known."""
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        weights = found.definition.get("weights") if found is not None else None
        if weights is None:
            return None
        source = parse_weights(revisions.weights_field(weights))
        return source.cache_name if source.fetched else None

    def cache_names(self, model: str, revision_id: str | None) -> frozenset[str]:
        """The cache entries a revision's replicas run from: its weights' and its adapters'
        (R-8.8), those fetched; none for a revision not known."""
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        if found is None:
            return frozenset()
        names = {self.cache_name(model, revision_id)}
        names.update(a.source.cache_name for a in revisions.adapters_at(model, found.definition))
        return frozenset(n for n in names if n is not None)

    def adapters(self, model: str, revision_id: str | None) -> tuple[str, ...]:
        """The adapters a revision's replicas were launched with, in launch order (R-8.8); ()
        for a revision not known."""
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        return revisions.adapter_names(found.definition if found is not None else None)

    def loads_adapters(self, model: str, revision_id: str | None) -> bool:
        """Whether a revision's replicas were launched with adapter support (R-8.8): a vLLM
        revision's profile keeps the adapter fields only then."""
        found = self.revisions.get(model, {}).get(revision_id) if revision_id is not None else None
        return found is not None and "max_adapters" in (found.definition.get("profile") or {}) \
            and found.definition["profile"].get("engine") == "vllm"

    def target(self, model: Model, catalog: Catalog) -> tuple[str | None, Model]:
        """The revision the model's replicas should run and the model to launch them from: the
        catalog's, unless an undo holds the model on an earlier one (module docstring)."""
        defined = self.revision_of(model)
        record = self.rollouts.get(model.name)
        if record is None or record.held_over is None or record.held_over != defined:
            return defined, model
        held = self.revisions.get(model.name, {}).get(record.target)
        if held is None:
            return defined, model
        kept = self._held.get(model.name)
        if kept is not None and kept[0] is model and kept[1] == record.target:
            return record.target, kept[2]
        try:
            at = revisions.model_at(model, held.definition, catalog.engines)
            self._held[model.name] = (model, record.target, at)
            return record.target, at
        except ValueError as exc:
            log.warning("model %s cannot be held on revision %s any more (%s): it runs the catalog's",
                        model.name, record.target, exc)
            return defined, model

    def start(self, model: str, target: str, previous: str | None, now: float,
              actor: str | None = None) -> Rollout:
        """A rollout towards `target` begins (the catalog's revision changed)."""
        held = self.rollouts.get(model)
        record = Rollout(model, target, previous, now, actor=actor)
        if held is not None and held.held_over is not None and held.target == target:
            record = replace(record, held_over=held.held_over)
        self.rollouts[model] = record
        return record

    def failed(self, replica: Replica, reason: str, live: Iterable[Replica]) -> Rollout | None:
        """A replica failed: when it runs the target of a rollout still under way (some live
        replica of its model runs another revision), the rollout pauses with the reason;
        returns the paused rollout (to be saved), else None."""
        record = self.rollouts.get(replica.model)
        if record is None or record.paused is not None or replica.revision != record.target:
            return None
        if not any(r.revision != record.target for r in live if r.model == replica.model and r.id != replica.id):
            return None
        tail = next((line.strip() for shard in replica.shards for line in reversed(shard.log_tail or ())
                     if line.strip() and not line.startswith(SUPERVISOR_LINE)), None)
        if tail is not None:  # the engine's own last word says what to fix (the key never in it)
            reason = f"{reason}; its log ends: {replica.without_key([tail])[0][:300]}"
        log.warning("%s: rollout to revision %s paused: replica %s failed: %s", replica.model, record.target,
                    replica.id, reason)
        return self.update(record, paused=f"replica {replica.id} of revision {record.target} failed: {reason}")

    def update(self, record: Rollout, **changes) -> Rollout:
        changed = self.rollouts[record.model] = replace(record, updated_at=time.time(), **changes)
        return changed


@dataclass(frozen=True, slots=True)
class Targets:
    """One pass's view of every model's revision: what `plan` reads, what the loop launches from,
    and what changed that is to be saved."""

    rolling: Mapping[str, plan.Rolling]  # model -> its target and rollout, for plan.plan_model
    launch: Mapping[str, Model]  # each model llmgw runs (none served by fixed URLs) as its replicas launch
    # from: the catalog's, or at the revision an undo holds it on; in the catalog's order
    revisions: tuple[Revision, ...]  # revisions seen for the first time
    rollouts: tuple[Rollout, ...]  # rollouts begun
    replicas: tuple[Replica, ...]  # replicas that had no revision and were given their model's
    canaries: Mapping[str, tuple[str, int]]  # model -> (its canary revision, the share of its requests)


def targets(memory: RolloutMemory, catalog: Catalog, live: Mapping[str, list[Replica]], now: float) -> Targets:
    """Each model's target revision this pass; a rollout begins for a model some of whose live
    replicas run another revision than its target and whose rollout is not towards it yet."""
    rolling: dict[str, plan.Rolling] = {}
    launch: dict[str, Model] = {}
    canaries: dict[str, tuple[str, int]] = {}
    new_revisions, begun, given = [], [], []
    for model in catalog.models.values():
        if model.static:
            continue
        target, launch_model = memory.target(model, catalog)
        if target is None:
            continue
        launch[model.name] = launch_model
        if (revision := memory.note(launch_model, now)) is not None:
            new_revisions.append(revision)
        replicas = live.get(model.name, ())
        others: dict[str, int] = {}
        for replica in replicas:
            if replica.revision is None:  # recorded before revisions existed: taken to run the model's
                replica.revision = target
                given.append(replica)
            elif replica.revision != target:
                others[replica.revision] = others.get(replica.revision, 0) + 1
        record = memory.rollouts.get(model.name)
        if others and (record is None or record.target != target):
            previous = max(others, key=lambda rid: (others[rid], memory.number(model.name, rid) or 0))
            record = memory.start(model.name, target, previous, now)
            begun.append(record)
            log.info("%s: rolling %d replica(s) to revision %s (#%s) from %s", model.name, sum(others.values()),
                     target, memory.number(model.name, target), previous)
        shape = model.config.rollout
        canary = shape.canary
        paused = promoted = None
        if record is not None and record.target == target:
            canary = record.canary if record.canary is not None else canary
            paused, promoted = record.paused, record.promoted
        rolling[model.name] = plan.Rolling(target, rollout.Shape(shape.surge, shape.unavailable, canary),
                                           paused, bool(promoted))
        if others and canary is not None and not promoted:  # a canary held: its share of the requests
            canaries[model.name] = (target, canary)
    return Targets(rolling, launch, tuple(new_revisions), tuple(begun), tuple(given), canaries)


def keep(store: Store | None, found: Targets, save_replica: Callable[[Replica], None]) -> None:
    """Save what a pass's targets changed: new revisions, rollouts begun (audited), replicas given
    their revision."""
    for replica in found.replicas:
        save_replica(replica)
    if store is None or not (found.revisions or found.rollouts):
        return

    def write(db: sqlite_utils.Database) -> None:
        for revision in found.revisions:
            save_revision(db, revision)
        for record in found.rollouts:
            save_rollout(db, record)
            audit(db, record.actor or "reconciler", "model.rollout.start", record.model,
                  {"from": record.previous, "to": record.target})
    store.submit(write)


def note_failure(memory: RolloutMemory, store: Store | None, replica: Replica, reason: str,
                 live: Mapping[str, Replica]) -> None:
    """A replica failed: a rollout to its revision that is under way pauses (R-4.13), saved."""
    paused = memory.failed(replica, reason, live.values())
    if paused is not None and store is not None:
        store.submit(lambda db: save_rollout(db, paused))


# -- what an operator sees and does (ctl rollout, R-4.13) ------------------------------------------

ACTIONS = ("pause", "resume", "promote", "undo")


def _label(memory: RolloutMemory, model: str, revision_id: str | None) -> dict | None:
    if revision_id is None:
        return None
    return {"id": revision_id, "number": memory.number(model, revision_id)}


def status(memory: RolloutMemory, model: Model, catalog: Catalog, live: Iterable[Replica]) -> dict:
    """Where the model's rollout stands: its target and the catalog's revision (they differ while
    an undo holds it), the rollout's state, why it waits, and the replicas per revision."""
    target, _ = memory.target(model, catalog)
    defined = memory.revision_of(model)
    record = memory.rollouts.get(model.name)
    per: dict[str | None, dict] = {}
    for replica in live:
        if replica.model != model.name or replica.retiring:
            continue
        entry = per.setdefault(replica.revision, {"revision": _label(memory, model.name, replica.revision),
                                                  "replicas": 0, "serving": 0})
        entry["replicas"] += 1
        entry["serving"] += int(replica.serving)
    progress = memory.progress.get(model.name)
    rolling = any(rid != target for rid in per)
    state = "none"
    if record is not None and record.target == target:
        canary = record.canary if record.canary is not None else model.config.rollout.canary
        if not rolling:
            state = "done"
        elif record.paused is not None:
            state = "paused"
        elif canary is not None and not record.promoted:
            state = "canary"
        else:
            state = "rolling"
    else:
        canary = model.config.rollout.canary
    shape = model.config.rollout
    return {
        "model": model.name, "state": state, "target": _label(memory, model.name, target),
        "catalog": _label(memory, model.name, defined), "held": target != defined,
        "previous": _label(memory, model.name, record.previous) if record is not None else None,
        "paused": record.paused if record is not None and state == "paused" else None,
        "waiting": progress.waiting if progress is not None and state != "done" else None,
        "canary": canary, "promoted": bool(record is not None and record.promoted),
        "surge": shape.surge, "unavailable": shape.unavailable,
        # What the rollout changes, environment variables by name only.
        "changes": _changes(memory, model.name, record.previous, target) if record is not None else [],
        "started_at": record.started_at if record is not None else None,
        "actor": record.actor if record is not None else None,
        "revisions": sorted(per.values(), key=lambda e: -((e["revision"] or {}).get("number") or 0)),
    }


def _changes(memory: RolloutMemory, model: str, old: str | None, new: str | None) -> list[str]:
    known = memory.revisions.get(model, {})
    if old not in known or new not in known:
        return []
    return revisions.diff(known[old].definition, known[new].definition)


def act(memory: RolloutMemory, model: Model, catalog: Catalog, live: Iterable[Replica], action: str, *,
        actor: str, canary: int | None = None) -> Rollout:
    """Pause, resume, promote or undo the model's rollout; the changed record (to be saved).
    Raises ServiceError naming why when the model's rollout cannot take it."""
    if action not in ACTIONS:
        raise ServiceError(ErrorKind.INVALID, f"unknown rollout action {action!r}; one of {', '.join(ACTIONS)}")
    if canary is not None and not 1 <= canary <= 99:
        raise ServiceError(ErrorKind.INVALID, "canary is a percent from 1 to 99")
    if canary is not None and model.config.rollout.surge == 0:
        raise ServiceError(ErrorKind.INVALID, f"a canary runs beside the old replicas: {model.name} has "
                                              "rollout.surge 0")
    target, _ = memory.target(model, catalog)
    record = memory.rollouts.get(model.name)
    replicas = [r for r in live if r.model == model.name and not r.retiring]
    rolling = record is not None and record.target == target and any(r.revision != target for r in replicas)
    where = f"{model.name} runs revision {target} (#{memory.number(model.name, target)})"
    if action == "undo":
        if record is None or record.previous is None or record.target != target:
            raise ServiceError(ErrorKind.CONFLICT, f"{where}; it has no earlier revision to go back to")
        back = record.previous
        if back not in memory.revisions.get(model.name, {}):
            raise ServiceError(ErrorKind.CONFLICT, f"revision {back} of {model.name} is not known any more")
        defined = memory.revision_of(model)
        now = time.time()
        undone = Rollout(model.name, back, target, now, canary=canary, actor=actor,
                         held_over=None if back == defined else defined, updated_at=now)
        memory.rollouts[model.name] = undone
        return undone
    if not rolling:
        raise ServiceError(ErrorKind.CONFLICT, f"no rollout of {model.name} is under way: {where} on every replica")
    if action == "pause":
        if record.paused is not None:
            raise ServiceError(ErrorKind.CONFLICT, f"the rollout of {model.name} is paused already: {record.paused}")
        return memory.update(record, paused=f"paused by {actor}")
    if action == "resume":
        if record.paused is None and canary is None:
            raise ServiceError(ErrorKind.CONFLICT, f"the rollout of {model.name} is not paused")
        return memory.update(record, paused=None, canary=canary if canary is not None else record.canary)
    effective = record.canary if record.canary is not None else model.config.rollout.canary
    if effective is None or record.promoted:
        raise ServiceError(ErrorKind.CONFLICT, f"the rollout of {model.name} has no canary to promote")
    return memory.update(record, promoted=True)


def answers_by_revision(memory: RolloutMemory, model: str, replicas: Iterable[Replica], counters: list) -> list[dict]:
    """The attempts each revision's replicas answered, by status class, summed over the routers'
    latest counters (those of replicas stopped lately included): a canary's errors beside the
    old revision's (R-4.13). Newest revision first."""
    revision_of = {r.id: r.revision for r in replicas if r.model == model}
    per: dict[str | None, dict[str, int]] = {}
    for reported in counters:
        for (replica_id, status), count in reported.replicas.items():
            if replica_id in revision_of:
                classes = per.setdefault(revision_of[replica_id], {})
                classes[status] = classes.get(status, 0) + count
    rows = [{"revision": _label(memory, model, rid), "answers": dict(sorted(classes.items())),
             "total": sum(classes.values()),
             "errors": sum(n for status, n in classes.items() if status != "2xx")} for rid, classes in per.items()]
    return sorted(rows, key=lambda r: -((r["revision"] or {}).get("number") or 0))
