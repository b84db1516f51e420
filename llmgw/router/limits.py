"""Per-key limits in one router (R-6.16): requests and tokens per minute, requests at once.

Requests per minute and tokens per minute are token buckets refilled continuously: a bucket holds
at most a minute's worth (the limit) and gains limit/60 every second, so a key may spend its
minute in a burst and then goes at the limit's pace. Admission reserves the request's tokens from
an estimate (`estimate`): the body's bytes / 4 plus the answer's cap times the answers asked for.
The cap is the largest of `max_tokens`, `max_completion_tokens` and `max_output_tokens` (vLLM
honours the largest of those it reads), else DEFAULT_ANSWER_TOKENS; the answers are the larger of
`n` and `best_of`. Once the answer's usage is known the reservation is corrected to what the
engine counted (`settle`), so a bucket may go below zero and the key then waits until it is paid
back. A request that sets a cap and whose estimate is more than the key's whole tokens per minute
could never be admitted: it is refused at once (R-6.16a). What a request reserves is at most its
bucket (a request that sets no cap may be estimated above it, and is admitted once the bucket is
full), so a key's reservations in flight never exceed its bucket. Concurrency counts requests in
flight and releases each in a finally. A key's per-model limits apply on top of its own: every
limit that applies must admit.

Admission is in two steps so that a limited key's request is refused before its body is read:
`hold` takes the key's own place and request (which need no body), `admit` then checks the
tokens and the model's limits, giving the request back when it refuses.

With several routers each enforces its lease, a share of every limited key's budget that the
control plane gives it (`set_leases`); for a key with no lease yet it uses 1/N of the limit,
N being the number of routers in the last leases it got (1 when none). Requests at once are
whole places: `split_places` divides a concurrency limit among the routers of the leases in
proportion to their shares so that the places add up to the limit, one for each router first
when there are enough, and a limit below the number of routers only to those with the most
demand (R-6.16b). Every router computes the same split from the same leases. A router knows only
its own requests: a request running where a place moved from runs to its end, one more at once
for the key while it lasts.

Over a limit the request is refused with a 429 in OpenAI's shape (`rate_limit_error`,
`rate_limit_exceeded`, the message names the limit) and Retry-After: the seconds until the
bucket holds enough. Every answer to a limited key carries OpenAI's x-ratelimit-* headers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

from llmgw.contracts.errors import Category
from llmgw.contracts.feed import KeyEntry, Limits
from llmgw.router.errors import RouterError

BYTES_PER_TOKEN = 4  # the estimate of a prompt's tokens from its body
DEFAULT_ANSWER_TOKENS = 256  # the estimate of an answer whose request sets no cap on it
ANSWER_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
ANSWER_COUNTS = ("n", "best_of")  # answers asked for at once, each up to the cap
MAX_ESTIMATE = 1 << 53  # an estimate stays exact in the buckets' floats; any limit is far below it
MINUTE = 60.0
CONCURRENCY_RETRY = 1.0  # Retry-After of a refusal for concurrency: no bucket says when one ends


class RateLimited(RouterError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"
    category = Category.CAPACITY  # the key's own: it may send again after Retry-After

    def __init__(self, message: str, wait: float, budgets: tuple[_Budget, ...]):
        super().__init__(message, retry_after=max(1, math.ceil(wait)))
        self.wait = wait
        self.budgets = budgets  # for the x-ratelimit-* headers of the refusal


class OverWholeLimit(RateLimited):
    """A request whose estimate is more than the key's whole tokens per minute: never admitted."""

    def __init__(self, message: str, budgets: tuple[_Budget, ...]):
        RouterError.__init__(self, message)  # no Retry-After: waiting does not help
        self.wait = math.inf
        self.budgets = budgets


def _whole(value) -> int | None:
    """A JSON integer at least 0 (a boolean is not one), else None: the field counts as absent."""
    return value if type(value) is int and value >= 0 else None


def answer_cap(document: dict | None) -> int | None:
    """The most tokens the request lets one answer have: the largest of ANSWER_CAPS it sets, None when none."""
    if document is None:
        return None
    caps = [cap for cap in (_whole(document.get(name)) for name in ANSWER_CAPS) if cap is not None]
    return max(caps) if caps else None


def estimate(body_size: int, document: dict | None) -> int:
    """Tokens to reserve for a request: its body's bytes / 4 plus the answer's cap (the default
    when it sets none) times the answers it asks for (`n`, `best_of`), at most MAX_ESTIMATE."""
    cap = answer_cap(document)
    answers = 1
    if document is not None:
        for name in ANSWER_COUNTS:
            count = _whole(document.get(name))
            if count is not None and count > answers:
                answers = count
    answer = (DEFAULT_ANSWER_TOKENS if cap is None else min(cap, MAX_ESTIMATE)) * min(answers, MAX_ESTIMATE)
    return min(MAX_ESTIMATE, body_size // BYTES_PER_TOKEN + answer)


def split_places(limit: int, shares: Sequence[tuple[str, float]], salt: str) -> dict[str, int]:
    """Whole places of a concurrency limit among routers (id, share), adding up to the limit: one
    for each router first when the limit allows, the rest in proportion to the shares by largest
    remainder. With fewer places than routers only the routers with the largest shares (the most
    demand) get one. Ties go by an order that `salt` (the key) shuffles, the same on every router."""
    out = {router: 0 for router, _ in shares}
    if not out:
        return out
    rest = limit
    if limit >= len(out):
        out = {router: 1 for router in out}
        rest -= len(out)
    total = sum(share for _, share in shares) or 1.0
    exact = {router: rest * share / total for router, share in shares}
    for router, part in exact.items():
        out[router] += math.floor(part)
    left = limit - sum(out.values())
    order = sorted(out, key=lambda r: (math.floor(exact[r]) - exact[r], zlib.crc32(f"{salt}\0{r}".encode())))
    for router in order[:left]:
        out[router] += 1
    return out


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

    def __init__(self, limits: Limits, share: float, places: int | None, now: float):
        self.limits = limits
        self.share = -1.0
        self.requests = Bucket(1.0, now) if limits.rpm is not None else None
        self.tokens = Bucket(1.0, now) if limits.tpm is not None else None
        self.inflight = 0
        self.concurrency: int | None = None
        self.apply(share, places, now, fresh=True)

    def apply(self, share: float, places: int | None, now: float, fresh: bool = False) -> None:
        """This router's share of the limits, and its places of the requests at once (split_places)."""
        self.concurrency = places
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


class Admission:
    """An admitted request: `settle` corrects its tokens once usage is known, `release` ends it.

    `reserved` is the request's estimate; `taken` what each budget's bucket gave for it, the
    estimate at most the bucket's capacity."""

    __slots__ = ("budgets", "reserved", "taken", "settled", "released")

    def __init__(self, budgets: tuple[_Budget, ...], reserved: int, taken: tuple[float, ...] = ()):
        self.budgets = budgets
        self.reserved = reserved
        self.taken = taken or (reserved,) * len(budgets)
        self.settled = False
        self.released = False

    def settle(self, used: int) -> None:
        """The answer used `used` tokens (prompt and completion): the reservation becomes that, once."""
        if self.settled:
            return
        self.settled = True
        for budget, taken in zip(self.budgets, self.taken):
            delta = used - taken
            if delta and budget.tokens is not None:
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
        self._everyone: Mapping[str, Mapping[str, float]] = {}  # router id -> key id -> share, for the places
        self._me: str | None = None
        self._default_share = 1.0
        self.asked: dict[str, int] = {}  # key id -> requests asked since the last report, admitted or refused

    @staticmethod
    def applies(key: KeyEntry) -> bool:
        return key.limits is not None or bool(key.model_limits)

    def share(self, key_id: str) -> float:
        return self._leases.get(key_id, self._default_share)

    def places(self, key_id: str, model: str | None, limit: int | None) -> int | None:
        """This router's places of a key's concurrency limit (R-6.16b): the limit itself with no
        leases (one router), its part of split_places among the routers of the leases (a key they
        hold no lease of yet split evenly), and for a router not among them yet the limit divided
        by their number, rounded down."""
        if limit is None or not self._everyone:
            return limit
        routers = sorted(self._everyone)
        if self._me not in self._everyone:
            return limit // len(routers)
        even = 1.0 / len(routers)
        shares = [(router, self._everyone[router].get(key_id, even)) for router in routers]
        return split_places(limit, shares, key_id if model is None else f"{key_id}\0{model}")[self._me]

    def set_leases(self, leases: Mapping[str, Mapping[str, float]], me: str | None, now: float) -> None:
        """Every router's share of each key's limits (router id -> key id -> 0..1) and which router
        this is; a key this router has no lease of gets 1/routers."""
        self._everyone = leases
        self._me = me
        self._leases = leases.get(me, {}) if me is not None else {}
        self._default_share = 1.0 / max(1, len(leases))
        for (key_id, model), budget in self._budgets.items():
            budget.apply(self.share(key_id), self.places(key_id, model, budget.limits.concurrency), now)

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
            fresh = _Budget(limits, self.share(key.id), self.places(key.id, model, limits.concurrency), now)
            if budget is not None:  # the key's limits changed: what was spent stays spent
                fresh.inflight = budget.inflight
                for old, new in ((budget.requests, fresh.requests), (budget.tokens, fresh.tokens)):
                    if old is not None and new is not None:
                        old.refill(now)
                        new.level = min(new.capacity, old.level)
            budget = self._budgets[(key.id, model)] = fresh
        return budget

    def hold(self, key: KeyEntry, now: float) -> Admission:
        """The first step of admission, before the request's body is read: the key's own
        concurrency and requests per minute take a place and a request, or RateLimited."""
        self.asked[key.id] = self.asked.get(key.id, 0) + 1
        if key.limits is None:
            return Admission((), 0)
        budget = self._budget(key, None, key.limits, now)
        _check_requests(budget, "", (budget,), now)
        _take_requests(budget)
        return Admission((budget,), 0)

    def admit(self, key: KeyEntry, model: str, tokens: int, now: float, *, capped: bool = False,
              held: Admission | None = None) -> Admission:
        """Admit one request of `tokens` (estimated; `capped`: the request set the answer's cap) or
        raise RateLimited naming the limit. `held`: what `hold` took for it (taken here when None);
        a refusal gives its request back and the caller still releases it."""
        own = held is None
        if own:
            held = self.hold(key, now)
        per_model = key.model_limits.get(model)
        model_budget = None if per_model is None else self._budget(key, model, per_model, now)
        budgets = [(b, "") for b in held.budgets]
        if model_budget is not None:
            budgets.append((model_budget, f" for model {model!r}"))
        every = tuple(b for b, _ in budgets)
        try:
            for budget, scope in budgets:
                tpm = budget.limits.tpm
                if capped and tpm is not None and tokens > tpm:
                    raise OverWholeLimit(f"this request is estimated at {tokens} tokens (its body's bytes / "
                                         f"{BYTES_PER_TOKEN} plus its largest answer cap times its n or best_of), "
                                         f"more than the {tpm} tokens per minute this key may use{scope}: it "
                                         "can never be admitted; ask for fewer tokens or fewer answers", every)
            if model_budget is not None:
                _check_requests(model_budget, budgets[-1][1], every, now)
            for budget, scope in budgets:
                if budget.tokens is not None:
                    budget.tokens.refill(now)
                    wait = budget.tokens.wait(tokens)
                    if wait:
                        raise RateLimited(f"rate limit reached: this key may use {budget.limits.tpm} tokens per "
                                          f"minute{scope} and this request is estimated at {tokens}; retry in "
                                          f"{wait:.1f} s", wait, every)
        except RateLimited:
            for budget in held.budgets:  # refused: the request held for it is not spent
                if budget.requests is not None:
                    budget.requests.level = min(budget.requests.capacity, budget.requests.level + 1)
            if own:
                held.release()
            raise
        if model_budget is not None:
            _take_requests(model_budget)
        taken = []
        for budget in every:
            amount = 0.0
            if budget.tokens is not None:  # a reservation is at most the bucket (R-6.16a)
                amount = min(tokens, budget.tokens.capacity)
                budget.tokens.level -= amount
            taken.append(amount)
        held.budgets, held.reserved, held.taken = every, tokens, tuple(taken)
        return held


def _check_requests(budget: _Budget, scope: str, budgets: tuple[_Budget, ...], now: float) -> None:
    """RateLimited when the budget has no place or no request left for one more."""
    limits = budget.limits
    if budget.concurrency is not None and budget.inflight >= budget.concurrency:
        held_here = "" if budget.concurrency == limits.concurrency else \
            f" (this router holds {budget.concurrency} of them now)"
        raise RateLimited(f"rate limit reached: this key may have {limits.concurrency} requests in flight"
                          f"{scope} at once{held_here}; retry when one has finished", CONCURRENCY_RETRY, budgets)
    if budget.requests is not None:
        budget.requests.refill(now)
        wait = budget.requests.wait(1)
        if wait:
            raise RateLimited(f"rate limit reached: this key may make {limits.rpm} requests per minute"
                              f"{scope}; retry in {wait:.1f} s", wait, budgets)


def _take_requests(budget: _Budget) -> None:
    if budget.requests is not None:
        budget.requests.level -= 1
    budget.inflight += 1
