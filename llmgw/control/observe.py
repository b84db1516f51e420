"""The observe step: each live shard judged from its node's latest report, and the engines a
node runs that no replica has (R-4.2–R-4.5, R-4.7).

Pure: a judgement is a function of the shard, its replica, the node's link and facts, the clock
and what the shard is allowed (`Patience`: the settling window, its model's start timeout, the
health probes it failed in a row so far). Nothing is read from a node and nothing is changed here;
the reconciler applies the judgements through the transition table. What a judgement counts from
one pass to the next (failed health probes in a row) is kept in `ProbeMemory`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.contracts.states import LinkState, ShardState
from llmgw.control.state import RETIRING_PHASE, SERVING, STARTING, Replica, Shard
from llmgw.fleet.facts import NodeFacts

if TYPE_CHECKING:
    from llmgw.catalog import Model

UNHEALTHY_PROBES = 3  # consecutive failed health probes before a serving shard is failed
READY = LinkState.READY  # read for every shard in every pass: a module global is the cheaper lookup
CONNECTING = LinkState.CONNECTING


@dataclass(eq=False)
class ProbeMemory:
    """Failed health probes in a row per serving shard, kept between passes: `observe` judges with
    them, the reconciler notes what each judgement says of them."""

    failed: dict[str, int] = field(default_factory=dict)  # shard id -> failed probes in a row

    def note(self, shard_id: str, count: int) -> None:
        if count:
            self.failed[shard_id] = count
        else:
            self.failed.pop(shard_id, None)


@dataclass(frozen=True, slots=True)
class Patience:
    """What a live shard is allowed before it is judged failed, the same for every shard of a pass:
    its node away for the settling window (R-4.5), its start for its model's start timeout (R-4.3),
    UNHEALTHY_PROBES failed health probes in a row, of which `failed_probes` counts those so far."""

    settling_window: float
    start_timeout: Callable[[str], float]  # a model's start timeout, by the model's name
    failed_probes: Mapping[str, int]  # shard id -> failed health probes in a row (absent: none)


@dataclass(frozen=True, slots=True)
class Judgement:
    """What one report means for one shard. Only shards with something to change get one."""

    replica_id: str
    rank: int
    state: ShardState | None = None  # the shard's new state; None keeps it
    reason: str | None = None
    log_tail: tuple[str, ...] | None = None  # the engine's last lines, its key removed
    abandon: bool = False  # requests waiting on the replica go elsewhere now (its node is lost)
    failed_probes: int | None = None  # failed health probes in a row after this report; None: unchanged


@dataclass(frozen=True, slots=True)
class Observation:
    """One pass's reading of the fleet: the judgements, and per node that reported its shards
    the live engines no replica has (reported, left alone)."""

    judgements: list[Judgement]
    unknown_engines: dict[str, list[str]]


def start_timeout(model: Model | None) -> float:
    """A model's start timeout (R-4.3); for a replica whose model left the catalog (the pass
    retires it next), that of a profile which sets none."""
    return model.profile.start_timeout if model is not None and model.profile is not None else 900.0


def observe(replicas: Iterable[Replica], links: Mapping[str, object], facts: Mapping[str, NodeFacts],
            now: float, patience: Patience) -> Observation:
    """Judge every starting or serving shard of the replicas not being retired, and find the
    engines nobody knows."""
    judgements = []
    known: dict[str, set[str]] = {}
    for replica in replicas:
        retiring = replica.phase is RETIRING_PHASE
        for shard in replica.shards:
            known.setdefault(shard.node, set()).add(shard.id)
            if retiring:
                continue
            if shard.state == SERVING or shard.state == STARTING:
                judgement = judge(replica, shard, links.get(shard.node), facts.get(shard.node), now, patience)
                if judgement is not None:
                    judgements.append(judgement)
    unknown = {}
    for name, node_facts in facts.items():
        if node_facts.shards is not None:
            unknown[name] = sorted(sid for sid, status in node_facts.shards.items()
                                   if status.alive and sid not in known.get(name, ()))
    return Observation(judgements, unknown)


def judge(replica: Replica, shard: Shard, link, facts: NodeFacts | None, now: float,
          patience: Patience) -> Judgement | None:
    """One starting or serving shard judged; None when nothing changes.

    `link` is the node's link (its `state` and `since`), None once the node left the inventory."""
    if link is None:
        return Judgement(replica.id, shard.rank, ShardState.FAILED, f"node {shard.node} is no longer in the inventory")
    if link.state != READY:
        if link.state == CONNECTING:
            # The first attempt since the control plane started has not ended: nothing is known
            # of the node yet, however long its turn at the connect gate or its handshake takes
            # (each bounded by its own timeout). Its replicas keep serving; if the attempt fails,
            # the window counts from that failure.
            return None
        if now - link.since > patience.settling_window:
            since = time.strftime('%H:%M:%S', time.localtime(link.since))
            return Judgement(replica.id, shard.rank, ShardState.FAILED, f"node {shard.node} {link.state} since {since}",
                             abandon=True)
        return None  # it may come back within the settling window
    if (facts is None or facts.shards is None or shard.pid is None or shard.launched_at is None
            or facts.observed_at.get("status", 0.0) < shard.launched_at):
        return None  # no report newer than the launch yet
    status = facts.shards.get(shard.id)
    if status is None or not status.alive or status.pid != shard.pid or status.start_time != shard.start_time:
        if status is None:
            reason = "engine not found on the node"
        elif not status.alive and status.exit_code is not None:
            reason = f"engine exited with status {status.exit_code}"
        elif not status.alive:
            reason = "engine is gone (no exit status recorded)"
        else:
            reason = "a different process now has the engine's id"
        tail = tuple(replica.without_key(status.log_tail)) if status is not None and status.log_tail else None
        return Judgement(replica.id, shard.rank, ShardState.FAILED, reason, log_tail=tail)
    healthy = (not shard.serves_http) or status.health_status == 200
    last_health = status.health_status or status.health_error
    if shard.state == STARTING:
        if healthy:
            return Judgement(replica.id, shard.rank, ShardState.SERVING)
        # Counted from the launch: download progress never resets it.
        start_timeout = patience.start_timeout(replica.model)
        if now - shard.launched_at > start_timeout:
            return Judgement(replica.id, shard.rank, ShardState.FAILED,
                             f"did not become ready within {start_timeout:.0f}s (last health: {last_health})")
        return None
    failed_probes = patience.failed_probes.get(shard.id, 0)
    if healthy:
        return Judgement(replica.id, shard.rank, failed_probes=0) if failed_probes else None
    count = failed_probes + 1
    if count >= UNHEALTHY_PROBES:
        return Judgement(replica.id, shard.rank, ShardState.FAILED, f"health check failing: {last_health}",
                         failed_probes=count)
    return Judgement(replica.id, shard.rank, failed_probes=count)
