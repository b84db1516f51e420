"""The rollout decision, pure: how a model's replicas move to its target revision (R-4.13).

Replicas whose revision is not the model's target are replaced by the rule a drain uses: a
replica of the target serves before one of another revision leaves. Per pass, with `count` the
replicas the model wants (its scaling decision), `surge` and `unavailable` its rollout shape:

- at most `count + surge` replicas run at once (old and new, starting or serving);
- never fewer than `count - unavailable` serve: an old replica is retired (drained: its requests
  in flight end first) only while the serving ones stay at or above that;
- old replicas that do not serve (still starting) are retired first, and cost nothing;
- a canary stops the rollout at one replica of the target beside all the old ones (its surge,
  so a canary needs `surge` of at least 1), until it is promoted: the router then sends the
  canary share of the model's requests to the target;
- a paused rollout launches and retires nothing (the old replicas keep serving).

The reconciler keeps the rollout's record (target, paused and why, canary) and turns the step
into actions; placement decides where the launches go, and says when the fleet has no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's `rollout:` settings: extra replicas at once, replicas that may be missing, canary %."""

    surge: int = 1
    unavailable: int = 0
    canary: int | None = None


@dataclass(frozen=True, slots=True)
class Member:
    """A live, active replica of the model as the rollout sees it."""

    id: str
    revision: str | None
    serving: bool
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Step:
    """What one pass does: `launch` replicas of the target, `retire` these old ones (drained)."""

    launch: int = 0
    retire: tuple[str, ...] = ()
    waiting: str | None = None  # why the rollout does not move on this pass
    done: bool = False  # every active replica runs the target: nothing is rolling


def step(target: str, members: Sequence[Member], count: int, shape: Shape, *,
         paused: str | None = None, promoted: bool = False) -> Step:
    """The next step towards `target` for a model that wants `count` replicas."""
    new = [m for m in members if m.revision == target]
    old = [m for m in members if m.revision != target]
    if not old:
        return Step(done=True)
    if paused is not None:
        return Step(waiting=f"paused: {paused}")
    running = len(members)
    serving = sum(1 for m in members if m.serving)
    # Old replicas that do not serve go first (nothing is lost), then the oldest.
    order = sorted(old, key=lambda m: (m.serving, m.created_at))
    if shape.canary is not None and not promoted:
        want_new = 1 if count > 0 else 0
        launch = max(0, min(want_new - len(new), count + shape.surge - running))
        retire = tuple(m.id for m in order if not m.serving)
        # Old ones beyond the wanted count (the model scaled down) leave as a surplus does.
        old_serving = tuple(m.id for m in order if m.serving)
        retire += old_serving[:max(0, len(old_serving) - count)]
        waiting = None
        if launch == 0 and any(m.serving for m in new):
            waiting = f"canary: {shape.canary} % of requests on revision {target}; promote or undo it"
        elif launch == 0:
            waiting = f"canary: waiting for the replica of revision {target} to serve"
        return Step(launch, retire, waiting)
    floor = count - shape.unavailable
    retire: list[str] = []
    for m in order:
        if not m.serving:
            retire.append(m.id)
        elif serving - 1 >= floor:
            retire.append(m.id)
            serving -= 1
    running -= len(retire)
    launch = max(0, min(count - len(new), count + shape.surge - running))
    waiting = None
    if not retire and launch == 0:
        starting = sum(1 for m in new if not m.serving)
        waiting = (f"waiting for {starting} replica(s) of revision {target} to serve" if starting
                   else f"waiting: {count + shape.surge} replicas at most at once (surge {shape.surge})")
    return Step(launch, tuple(retire), waiting)
