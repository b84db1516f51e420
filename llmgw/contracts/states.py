"""The states of nodes, shards and replicas, and the moves between them (R-4.2, R-9.4, R-9.5).

Each state is a `StrEnum`: its members are the strings stored in SQLite, shown in JSON and in
/metrics labels, and compare equal to them. `TRANSITIONS` is the one table of allowed moves;
`transition()` checks a move against it, and a move the table does not allow is refused,
logged at error and counted in `refused` (a refusal is a bug in the caller, never an operator's
mistake).
"""

from __future__ import annotations

import collections
import logging
from enum import StrEnum

log = logging.getLogger(__name__)


class LinkState(StrEnum):
    """A node's connection, as its link reports it."""

    CONNECTING = "connecting"  # not answered yet since the control plane started
    READY = "ready"
    UNREACHABLE = "unreachable"
    UNHEALTHY = "unhealthy"  # connected, but its helper's answers are wrong


class AdminState(StrEnum):
    """What the operator made of a node (R-9.4)."""

    ACTIVE = "active"
    CORDONED = "cordoned"  # nothing new is placed there
    DRAINING = "draining"  # its replicas move elsewhere


class ShardState(StrEnum):
    """One engine process of a replica (R-4.2). DRAINING is only ever a replica's state, derived
    from its phase; it is listed here because replica and shard states share one vocabulary."""

    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class ReplicaPhase(StrEnum):
    """Where a replica is in its life as the reconciler decides it (its shards say how it runs)."""

    ACTIVE = "active"
    DRAINING = "draining"  # marked for a rolling move: stopped once enough others serve
    RETIRING = "retiring"  # being torn down: off the router, its engines being stopped


_link, _admin, _shard, _phase = LinkState, AdminState, ShardState, ReplicaPhase

# Per kind, because members of different kinds can be equal strings ("draining", "active").
TRANSITIONS: dict[type[StrEnum], dict[StrEnum, frozenset[StrEnum]]] = {
    # A link never goes back to connecting: that is only the state before its first answer.
    LinkState: {
        _link.CONNECTING: frozenset({_link.READY, _link.UNREACHABLE, _link.UNHEALTHY}),
        _link.READY: frozenset({_link.UNREACHABLE, _link.UNHEALTHY}),
        _link.UNREACHABLE: frozenset({_link.READY, _link.UNHEALTHY}),
        _link.UNHEALTHY: frozenset({_link.READY, _link.UNREACHABLE}),
    },
    # The operator may move a node from any admin state to any other.
    AdminState: {
        _admin.ACTIVE: frozenset({_admin.CORDONED, _admin.DRAINING}),
        _admin.CORDONED: frozenset({_admin.ACTIVE, _admin.DRAINING}),
        _admin.DRAINING: frozenset({_admin.ACTIVE, _admin.CORDONED}),
    },
    # A shard that never launched is stopped without a node call; stopped and failed are final.
    ShardState: {
        _shard.PENDING: frozenset({_shard.FETCHING, _shard.STARTING, _shard.STOPPED, _shard.FAILED}),
        _shard.FETCHING: frozenset({_shard.STARTING, _shard.STOPPED, _shard.FAILED}),
        _shard.STARTING: frozenset({_shard.SERVING, _shard.STOPPING, _shard.FAILED}),
        _shard.SERVING: frozenset({_shard.STOPPING, _shard.FAILED}),
        _shard.DRAINING: frozenset(),
        _shard.STOPPING: frozenset({_shard.STOPPED}),
        _shard.STOPPED: frozenset(),
        _shard.FAILED: frozenset(),
    },
    # A drain is undone by uncordoning the node; a replica being retired is never brought back.
    ReplicaPhase: {
        _phase.ACTIVE: frozenset({_phase.DRAINING, _phase.RETIRING}),
        _phase.DRAINING: frozenset({_phase.ACTIVE, _phase.RETIRING}),
        _phase.RETIRING: frozenset(),
    },
}

refused: collections.Counter[tuple[str, str, str]] = collections.Counter()  # (kind, from, to) -> refusals


def allowed(current: StrEnum | str, new: StrEnum) -> bool:
    """Whether the table allows `current` → `new`; staying in a state is always allowed. A
    current value that is no state of new's kind (a damaged record) allows no move."""
    return new == current or new in TRANSITIONS[type(new)].get(current, ())


def transition(current: StrEnum | str, new: StrEnum, subject: str) -> bool:
    """Check the move of `subject` (e.g. "shard m-1a2b-0") from `current` to `new`: True when the
    table allows it; otherwise False, logged at error and counted. The caller makes the move."""
    if allowed(current, new):
        return True
    refused[(type(new).__name__, str(current), str(new))] += 1
    log.error("refused: %s cannot go from %s to %s", subject, current, new)
    return False
