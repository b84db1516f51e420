"""Per-key limits in one router (R-6.16): requests and tokens per minute, requests at once.

Requests per minute and tokens per minute are token buckets refilled continuously: a bucket holds
at most a minute's worth (the limit) and gains limit/60 every second, so a key may spend its
minute in a burst and then goes at the limit's pace. Admission reserves the request's tokens from
an estimate, the body's bytes / 4 plus the answer's cap (`max_tokens`, `max_completion_tokens` or
`max_output_tokens`, else DEFAULT_ANSWER_TOKENS); once the answer's usage is known the reservation
is corrected to what the engine counted (`settle`), so a bucket may go below zero and the key
then waits until it is paid back. A request whose estimate is more than the whole bucket is
admitted when the bucket is full rather than never. Concurrency counts requests in flight and
releases each in a finally. A key's per-model limits apply on top of its own: every limit that
applies must admit.

With several routers each enforces its lease, a share of every limited key's budget that the
control plane gives it (`set_leases`); for a key with no lease yet it uses 1/N of the limit,
N being the number of routers in the last leases it got (1 when none).

Over a limit the request is refused with a 429 in OpenAI's shape (`rate_limit_error`,
`rate_limit_exceeded`, the message names the limit) and Retry-After: the seconds until the
bucket holds enough. Every answer to a limited key carries OpenAI's x-ratelimit-* headers.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping

from llmgw.contracts.feed import KeyEntry, Limits
from llmgw.router.errors import RouterError

BYTES_PER_TOKEN = 4  # the estimate of a prompt's tokens from its body
DEFAULT_ANSWER_TOKENS = 256  # the estimate of an answer whose request sets no cap on it
ANSWER_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MINUTE = 60.0
CONCURRENCY_RETRY = 1.0  # Retry-After of a refusal for concurrency: no bucket says when one ends

# The admission of the request being answered, for the proxy to settle once usage is known.
CURRENT: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("llmgw_admission", default=None)


class RateLimited(RouterError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, wait: float, budgets: tuple[_Budget, ...]):
        super().__init__(message, retry_after=max(1, math.ceil(wait)))
        self.wait = wait
        self.budgets = budgets  # for the x-ratelimit-* headers of the refusal


def estimate(body_size: int, document: dict | None) -> int:
    """Tokens to reserve for a request: its body's bytes / 4 plus the answer's cap."""
    answer = None
    if document is not None:
        for name in ANSWER_CAPS:
            value = document.get(name)
            if type(value) is int and value >= 0:
                answer = value
                break
    return body_size // BYTES_PER_TOKEN + (DEFAULT_ANSWER_TOKENS if answer is None else answer)


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < MINUTE:
        return f"{round(seconds, 2):g}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


class Bucket:
    """A token bucket of `capacity` (a minute's worth) refilled continuously at capacity/60 per second."""

    __slots__ = ("capacity", "level", "at")

    def __init__(self, capacity: float, now: float):
        self.capacity = capacity
        self.level = capacity
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / MINUTE)
            self.at = now

    def wait(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (at most its capacity); 0 when it does now."""
        need = min(amount, self.capacity)
        if self.level >= need:
            return 0.0
        return (need - self.level) * MINUTE / self.capacity

    def resize(self, capacity: float) -> None:
        """A new share of the limit: what is held is kept up to the new capacity, and a bigger
        share fills at its faster pace rather than at once (so routers never hold more, together,
        than the shares they were given)."""
        self.level = min(self.level, capacity)
        self.capacity = capacity

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) * MINUTE / self.capacity)


class _Budget:
    """The buckets and the in-flight count of one limit (a key's own, or a key's for one model)."""

    __slots__ = ("limits", "share", "requests", "tokens", "inflight", "concurrency")

    def __init__(self, limits: Limits, share: float, now: float):
        self.limits = limits
        self.share = -1.0
        self.requests = Bucket(1.0, now) if limits.rpm is not None else None
        self.tokens = Bucket(1.0, now) if limits.tpm is not None else None
        self.inflight = 0
        self.concurrency: int | None = None
        self.apply(share, now, fresh=True)

    def apply(self, share: float, now: float, fresh: bool = False) -> None:
        limits = self.limits
        if share == self.share:
            return
        self.share = share
        for bucket, limit in ((self.requests, limits.rpm), (self.tokens, limits.tpm)):
            if bucket is not None:
                bucket.refill(now)
                if fresh:
                    bucket.capacity = bucket.level = limit * share
                else:
                    bucket.resize(limit * share)
        # A share of at least one request at once, so that a router can always admit something.
        self.concurrency = None if limits.concurrency is None else max(1, round(limits.concurrency * share))


class Admission:
    """An admitted request: `settle` corrects its tokens once usage is known, `release` ends it."""

    __slots__ = ("budgets", "reserved", "settled", "released")

    def __init__(self, budgets: tuple[_Budget, ...], reserved: int):
        self.budgets = budgets
        self.reserved = reserved
        self.settled = False
        self.released = False

    def settle(self, used: int) -> None:
        """The answer used `used` tokens (prompt and completion): the reservation becomes that, once."""
        if self.settled:
            return
        self.settled = True
        delta = used - self.reserved
        if delta:
            for budget in self.budgets:
                if budget.tokens is not None:
                    budget.tokens.level -= delta
                    if budget.tokens.level > budget.tokens.capacity:
                        budget.tokens.level = budget.tokens.capacity

    def release(self) -> None:
        if not self.released:
            self.released = True
            for budget in self.budgets:
                budget.inflight -= 1

    def headers(self, now: float) -> dict[str, str]:
        return headers(self.budgets, now)


def headers(budgets: tuple[_Budget, ...], now: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, per kind of the limit that applies with the least left. The
    limits are the key's; a remaining count is this router's share of it scaled up to the whole key."""
    out: dict[str, str] = {}
    for kind, limit_of in (("requests", "rpm"), ("tokens", "tpm")):
        best = None
        for budget in budgets:
            bucket = getattr(budget, kind)
            if bucket is None:
                continue
            bucket.refill(now)
            limit = getattr(budget.limits, limit_of)
            remaining = max(0, min(limit, math.floor(bucket.level / budget.share)))
            if best is None or remaining < best[1]:
                best = (limit, remaining, bucket.reset())
        if best is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(best[0])
            out[f"x-ratelimit-remaining-{kind}"] = str(best[1])
            out[f"x-ratelimit-reset-{kind}"] = duration(best[2])
    return out


class Limiter:
    """The budgets of every limited key this router has seen, and the leases it enforces."""

    def __init__(self):
        self._budgets: dict[tuple[str, str | None], _Budget] = {}
        self._leases: Mapping[str, float] = {}
        self._default_share = 1.0
        self.asked: dict[str, int] = {}  # key id -> requests asked since the last report, admitted or refused

    @staticmethod
    def applies(key: KeyEntry) -> bool:
        return key.limits is not None or bool(key.model_limits)

    def share(self, key_id: str) -> float:
        return self._leases.get(key_id, self._default_share)

    def set_leases(self, leases: Mapping[str, float], routers: int, now: float) -> None:
        """This router's share of each key's limits (key id -> 0..1), and how many routers share
        them; a key with no lease gets 1/routers."""
        self._leases = leases
        self._default_share = 1.0 / max(1, routers)
        for (key_id, _), budget in self._budgets.items():
            budget.apply(self.share(key_id), now)

    def keep(self, key_ids: set[str]) -> None:
        """Forget the budgets of keys no longer in force (revoked, or their limits removed)."""
        for pair in [pair for pair in self._budgets if pair[0] not in key_ids]:
            del self._budgets[pair]

    def take_asked(self) -> dict[str, int]:
        asked, self.asked = self.asked, {}
        return asked

    def _budget(self, key: KeyEntry, model: str | None, limits: Limits, now: float) -> _Budget:
        budget = self._budgets.get((key.id, model))
        if budget is None or budget.limits != limits:
            fresh = _Budget(limits, self.share(key.id), now)
            if budget is not None:  # the key's limits changed: what was spent stays spent
                fresh.inflight = budget.inflight
                for old, new in ((budget.requests, fresh.requests), (budget.tokens, fresh.tokens)):
                    if old is not None and new is not None:
                        old.refill(now)
                        new.level = min(new.capacity, old.level)
            budget = self._budgets[(key.id, model)] = fresh
        return budget

    def admit(self, key: KeyEntry, model: str, tokens: int, now: float) -> Admission:
        """Admit one request of `tokens` (estimated) or raise RateLimited naming the limit."""
        self.asked[key.id] = self.asked.get(key.id, 0) + 1
        budgets: list[tuple[_Budget, str]] = []
        if key.limits is not None:
            budgets.append((self._budget(key, None, key.limits, now), ""))
        per_model = key.model_limits.get(model)
        if per_model is not None:
            budgets.append((self._budget(key, model, per_model, now), f" for model {model!r}"))
        held = tuple(b for b, _ in budgets)
        for budget, scope in budgets:
            limits = budget.limits
            if budget.concurrency is not None and budget.inflight >= budget.concurrency:
                raise RateLimited(f"rate limit reached: this key may have {limits.concurrency} requests in flight"
                                  f"{scope} at once; retry when one has finished", CONCURRENCY_RETRY, held)
            if budget.requests is not None:
                budget.requests.refill(now)
                wait = budget.requests.wait(1)
                if wait:
                    raise RateLimited(f"rate limit reached: this key may make {limits.rpm} requests per minute"
                                      f"{scope}; retry in {wait:.1f} s", wait, held)
            if budget.tokens is not None:
                budget.tokens.refill(now)
                wait = budget.tokens.wait(tokens)
                if wait:
                    raise RateLimited(f"rate limit reached: this key may use {limits.tpm} tokens per minute"
                                      f"{scope} and this request is estimated at {tokens}; retry in {wait:.1f} s",
                                      wait, held)
        for budget, _ in budgets:
            if budget.requests is not None:
                budget.requests.level -= 1
            if budget.tokens is not None:
                budget.tokens.level -= tokens
            budget.inflight += 1
        return Admission(held, tokens)
