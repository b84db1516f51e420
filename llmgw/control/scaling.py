"""Load-based scaling: how many replicas a model wants, decided once per pass (R-6.8, R-6.8a, R-6.8b).

Pure: a decision is a function of the model's scaling settings, the replica count it wanted
before (`Scale`), its load now and the clock. The plan step asks for it per model and turns the
count into launches and retirements. What scaling keeps from one pass to the next is
`ScalingMemory`: each model's returned `Scale`, the demand and last use it decides from, and the
engines whose own count is capped now (logged once; the only logging here).

The rule, per model:

- bounds: never below `min`, never above `max`. An on-demand model (`min: 0`) wants 0 while it is
  idle, 1 as soon as it is asked for (or used within its idle timeout), and from there on scales
  on load up to `max`; after `idle_timeout` without use it goes back to 0. A model without `max`
  has max = min (1 for an on-demand model): it never scales on load.
- load: per replica, the larger of the router's requests in flight to it and the count its
  engine reports (waiting + running, where it reports them). Each is a lower bound of what the
  replica has to do: the router does not see requests of other clients, the engine does not yet
  see requests still on their way, and a request the router sent is in both, so their sum would
  count it twice. An engine that reports nothing leaves the router's figure alone (unknown is
  not zero). What an engine's own count can add is capped at what the routers may send the
  replica at once (`engine_cap`: its places, the profile's `concurrency` or 64, and their
  headroom, R-6.17): an engine claiming 1e12 waiting would otherwise scale its model to max and
  evict others. The model's load is the sum over its live replicas.
- wanted = ceil(load / target), within the bounds. Only when every pass for `up_delay` wanted
  more than now does the count go up, and only when every pass for `down_delay` wanted fewer
  does it go down, in both cases to what the mean load (time-weighted) of the trend's last
  `up_delay` needs: the delay decides when, the recent load how many, so the first seconds of
  a long quiet period (a burst's last requests ending) do not hold a replica. A pass that wants
  the present count ends the trend: it starts over.
- never two load decisions for one model within `up_delay` of each other. A change of the
  bounds (an operator's `ctl scale`, an on-demand model asked for or gone idle) applies at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.catalog import Model
from llmgw.contracts.views import ScaleDecision
from llmgw.units import format_duration

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Scale:
    """A model's scaling between passes: the count it wants, the load trend, the last decision."""

    desired: int
    trend: int = 0  # +1: every pass since `since` wanted more; -1: fewer; 0: none
    since: float = 0.0  # when the trend began
    # The trend's passes as (time, load), oldest first: those of the last up_delay, and the one
    # before them (its load held until the next pass).
    samples: tuple[tuple[float, float], ...] = ()
    last: ScaleDecision | None = None
    ups: int = 0  # decisions so far, by direction
    downs: int = 0


@dataclass(eq=False)
class ScalingMemory:
    """What scaling keeps between passes: each model's `Scale`, when each on-demand model was
    last asked for while nothing served it (R-6.8), the routers' last use of each replica, and the
    replicas whose engine's own count is capped now (R-6.8a)."""

    scales: dict[str, Scale] = field(default_factory=dict)  # model ->
    demand: dict[str, float] = field(default_factory=dict)  # model -> when it was asked for
    last_used: dict[str, float] = field(default_factory=dict)  # replica id -> the routers' last use
    engine_capped: set[str] = field(default_factory=set)  # said once while it lasts

    def keep(self, model: str, scale: Scale) -> ScaleDecision | None:
        """Keep the model's scaling; its decision when that is new (the reconciler logs and audits it, R-6.8b)."""
        previous = self.scales.get(model)
        self.scales[model] = scale
        decision = scale.last
        if decision is None or (previous is not None and previous.last is decision):
            return None
        return decision

    def forget_models(self, models: Mapping[str, Model]) -> None:
        """The scaling of models no longer in the catalog goes."""
        if len(self.scales) > len(models) or any(k not in models for k in self.scales):
            self.scales = {k: v for k, v in self.scales.items() if k in models}

    def loads(self, model: Model, live: Iterable, outstanding: Callable[[str], int] | None,
              engine_load: Callable[[str], object] | None) -> dict[str, float]:
        """Each live replica's load as scaling counts it (`replica_load`) from the routers' requests
        in flight (`outstanding`) and the engine's own count (`engine_load`), that count capped at
        `engine_cap` (logged once per replica while it lasts); empty without the routers' figures."""
        if outstanding is None:
            return {}
        cap = engine_cap(model)
        capped = self.engine_capped
        loads = {}
        for replica in live:
            reading = engine_load(replica.id) if engine_load else None
            own = engine_count(reading)
            if own is not None and own > cap:
                if replica.id not in capped:
                    if len(capped) > 4096:  # of replicas long gone: say it again rather than grow
                        capped.clear()
                    capped.add(replica.id)
                    log.warning("replica %s: its engine reports %d requests waiting or running, more than the %d "
                                "the routers may send it; scaling counts %d", replica.id, own, cap, cap)
            else:
                capped.discard(replica.id)
            loads[replica.id] = replica_load(outstanding(replica.id), reading, cap)
        return loads


# The places of a replica whose profile sets no `concurrency`: the router's default (R-6.17,
# llmgw.router.fairqueue.DEFAULT_REPLICA_CONCURRENCY).
DEFAULT_PLACES = 64


def engine_cap(model: Model) -> int:
    """The most an engine's own count may add to its replica's load (R-6.8a): the requests the
    routers may send it at once, its places (the profile's `concurrency`, else 64) and their
    headroom of an eighth (R-6.17). The engine's slot count is not used: the engine says it."""
    places = (model.profile.concurrency if model.profile is not None else None) or DEFAULT_PLACES
    return places + max(1, places // 8)


def engine_count(engine) -> int | None:
    """The engine's own waiting + running, None where it reports neither."""
    if engine is None or (engine.waiting is None and engine.running is None):
        return None
    return (engine.waiting or 0) + (engine.running or 0)


def replica_load(in_flight: int, engine, cap: int | None = None) -> float:
    """One replica's load: the router's requests in flight to it, or the engine's own count
    (waiting + running, `engineload.EngineLoad`) where that is larger, the engine's taken as at
    most `cap` (`engine_cap`); None from the engine (it does not say) leaves the router's figure."""
    own = engine_count(engine)
    if own is None:
        return in_flight
    return max(in_flight, own if cap is None else min(own, cap))


def bounds(model: Model, awake: bool) -> tuple[int, int]:
    """The lowest and highest count the model may want now. `awake`: an on-demand model is asked
    for or was used within its idle timeout (R-6.8)."""
    if model.on_demand:
        return (1, max(model.max_replicas, 1)) if awake else (0, 0)
    return model.min_replicas, model.max_replicas


def decide(model: Model, previous: Scale | None, *, awake: bool, current: int, load: float | None,
           now: float) -> Scale:
    """The model's scaling after this pass; `previous` itself when nothing changed.

    `current` is how many replicas it has (a first decision keeps them, within the bounds: the
    replicas adopted after a restart are not stopped for being more than min); `load` is None
    when the model does not scale on load."""
    low, high = bounds(model, awake)
    if previous is None:
        return Scale(desired=min(max(current, low), high))
    desired = previous.desired
    if desired < low or desired > high:
        after = low if desired < low else high
        if model.on_demand and desired == 0:
            why = "asked for with no replica"
        elif model.on_demand and high == 0:
            why = f"unused for {format_duration(model.idle_timeout)}"
        else:
            why = f"min is {low}" if after > desired else f"max is {high}"
        return _decided(previous, ScaleDecision(now, desired, after, f"scale {desired}→{after}: {why}"))
    if load is None or low == high:
        return previous if previous.trend == 0 else Scale(desired, last=previous.last, ups=previous.ups,
                                                          downs=previous.downs)
    settings = model.config.scaling
    target = settings.target
    wanted = min(max(math.ceil(load / target), low), high)
    trend = (wanted > desired) - (wanted < desired)
    if trend == 0:
        return previous if previous.trend == 0 else Scale(desired, last=previous.last, ups=previous.ups,
                                                          downs=previous.downs)
    window = settings.up_delay
    if trend != previous.trend:
        samples: tuple[tuple[float, float], ...] = ((now, load),)
        since = now
    else:
        samples, since = previous.samples, previous.since
        while len(samples) > 1 and samples[1][0] <= now - window:
            samples = samples[1:]  # older than the window, and a newer one covers its start
        samples += ((now, load),)
    state = Scale(desired, trend, since, samples, previous.last, previous.ups, previous.downs)
    if now - since < (settings.up_delay if trend > 0 else settings.down_delay):
        return state
    if state.last is not None and now - state.last.at < settings.up_delay:
        return state  # never two decisions inside the up-delay
    span = min(window, now - since)
    mean = _mean(samples, now, span) if span > 0 else load
    # Every pass wanted more (fewer), so the mean does too; the bound only guards the rounding.
    needed = math.ceil(mean / target)
    if trend > 0:
        needed = max(needed, desired + 1)
        after = min(needed, high)
        bound = f", max {high}" if needed > high else ""
    else:
        needed = min(needed, desired - 1)
        after = max(needed, low)
        bound = f", min {low}" if needed < low and not model.on_demand else ""
    reason = f"scale {desired}→{after}: {mean:.1f} in flight over {format_duration(span)}, target {target:g}{bound}"
    return _decided(state, ScaleDecision(now, desired, after, reason))


def _mean(samples: tuple[tuple[float, float], ...], now: float, span: float) -> float:
    """The time-weighted mean load of the last `span` seconds, each pass's load held until the next."""
    start = now - span
    area = 0.0
    for index, (at, load) in enumerate(samples):
        until = samples[index + 1][0] if index + 1 < len(samples) else now
        if until > start:
            area += load * (until - max(at, start))
    return area / span


def _decided(state: Scale, decision: ScaleDecision) -> Scale:
    up = decision.after > decision.before
    return Scale(decision.after, last=decision, ups=state.ups + up, downs=state.downs + (not up))
