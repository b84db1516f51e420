"""The router's per-key limits as a mechanism: buckets, estimates, settling, shares (R-6.16)."""

from __future__ import annotations

import pytest

from llmgw.contracts.feed import KeyEntry, Limits
from llmgw.router.limits import (DEFAULT_ANSWER_TOKENS, MAX_ESTIMATE, Limiter, OverWholeLimit, RateLimited, duration,
                                 estimate, split_places)


def key(**limits) -> KeyEntry:
    return KeyEntry("k1", "alice", "h", "sk-ab", None, limits=Limits(**limits))


@pytest.mark.parametrize("seconds, text", [(0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (59.99, "59.99s"),
                                           (60, "1m0s"), (360, "6m0s"), (3723, "1h2m3s")])
def test_r6_16_reset_times_in_openais_form(seconds, text):
    assert duration(seconds) == text


def test_r6_16_estimate_is_body_over_four_plus_the_answer_cap():
    assert estimate(400, {"max_tokens": 50}) == 150
    assert estimate(400, {"max_completion_tokens": 7}) == 107
    assert estimate(400, {"max_output_tokens": 0}) == 100
    assert estimate(400, {}) == 100 + DEFAULT_ANSWER_TOKENS
    assert estimate(400, {"max_tokens": "lots"}) == 100 + DEFAULT_ANSWER_TOKENS  # not a number: the default
    assert estimate(0, None) == DEFAULT_ANSWER_TOKENS


@pytest.mark.parametrize("document, answer", [
    pytest.param({"max_tokens": 1, "max_completion_tokens": 100000, "n": 50}, 100000 * 50, id="largest-cap-times-n"),
    pytest.param({"max_output_tokens": 30, "max_tokens": 20}, 30, id="largest-of-the-three"),
    pytest.param({"max_tokens": 10, "n": 2, "best_of": 5}, 50, id="best_of-larger-than-n"),
    pytest.param({"max_tokens": 10, "n": 0}, 10, id="n-zero-is-one-answer"),
    pytest.param({"n": 4}, 4 * DEFAULT_ANSWER_TOKENS, id="no-cap-default-per-answer"),
    pytest.param({"max_tokens": -5, "max_completion_tokens": 9}, 9, id="negative-is-absent"),
    pytest.param({"max_tokens": True, "n": True}, DEFAULT_ANSWER_TOKENS, id="booleans-are-not-numbers"),
    pytest.param({"max_tokens": 2.5e9, "n": "3"}, DEFAULT_ANSWER_TOKENS, id="non-integers-are-absent"),
    pytest.param({"max_tokens": 10 ** 300, "n": 10 ** 300}, MAX_ESTIMATE, id="bounded"),
])
def test_r6_16a_estimate_takes_the_largest_cap_times_the_answers(document, answer):
    assert estimate(0, document) == answer


@pytest.mark.parametrize("limit, shares, expected", [
    pytest.param(1, [("a", 0.85), ("b", 0.05), ("c", 0.05), ("d", 0.05)], {"a": 1, "b": 0, "c": 0, "d": 0},
                 id="one-place-goes-to-the-router-with-demand"),
    pytest.param(2, [("a", 0.05), ("b", 0.85), ("c", 0.05), ("d", 0.05)], {"a": 0, "b": 2, "c": 0, "d": 0},
                 id="two-places-four-routers"),
    pytest.param(3, [("a", 0.45), ("b", 0.45), ("c", 0.05), ("d", 0.05)], None, id="ties-add-up"),
    pytest.param(5, [("a", 0.85), ("b", 0.05), ("c", 0.05), ("d", 0.05)], {"a": 2, "b": 1, "c": 1, "d": 1},
                 id="enough-for-one-each-first"),
    pytest.param(4, [("a", 0.5), ("b", 0.5)], {"a": 2, "b": 2}, id="even"),
    pytest.param(7, [("a", 0.33), ("b", 0.33), ("c", 0.33)], None, id="shares-below-one-still-add-up"),
])
def test_r6_16b_places_add_up_to_the_limit_and_follow_demand(limit, shares, expected):
    places = split_places(limit, shares, "k1")
    print(limit, shares, "->", places)
    assert sum(places.values()) == limit
    if expected is not None:
        assert places == expected
    assert split_places(limit, shares, "k1") == places  # every router computes the same


def test_r6_16b_a_concurrency_limit_below_the_routers_gives_places_only_where_there_is_demand():
    k = key(concurrency=1)
    leases = {"ra": {"k1": 0.05}, "rb": {"k1": 0.85}, "rc": {"k1": 0.05}, "rd": {"k1": 0.05}}
    routers = {name: Limiter() for name in leases}
    for name, limiter in routers.items():
        limiter.set_leases(leases, name, now=0.0)
    admitted = []
    for name, limiter in routers.items():
        try:
            admitted.append((name, limiter.admit(k, "m", 1, now=0.0)))
        except RateLimited as exc:
            assert "1 requests in flight at once (this router holds 0 of them now)" in exc.message
    assert [name for name, _ in admitted] == ["rb"]  # one place in all, where the demand is
    moved = {**leases, "ra": {"k1": 0.85}, "rb": {"k1": 0.05}}
    for name, limiter in routers.items():
        limiter.set_leases(moved, name, now=1.0)
    with pytest.raises(RateLimited):  # the place moved with the demand: rb admits no more
        routers["rb"].admit(k, "m", 1, now=1.0)
    # ra admits, although rb's request has not ended yet: a router knows only its own requests, so
    # while a moved place's old request lasts the key has one more at once (the documented bound).
    routers["ra"].admit(k, "m", 1, now=1.0)
    late = Limiter()
    late.set_leases(leases, "re", now=0.0)  # not in the split yet: no place of a limit below the routers
    with pytest.raises(RateLimited):
        late.admit(k, "m", 1, now=0.0)


def test_r6_16_requests_bucket_refills_continuously():
    limiter, k = Limiter(), key(rpm=60)  # one a second, a minute's worth at once
    for _ in range(60):
        limiter.admit(k, "m", 1, now=100.0).release()
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 1, now=100.0)
    assert refused.value.wait == pytest.approx(1.0) and refused.value.retry_after == 1
    limiter.admit(k, "m", 1, now=100.5 + 0.5)  # one second later, one more
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 1, now=101.25)
    assert refused.value.wait == pytest.approx(0.75)  # not a whole window: the bucket refills as time goes
    assert limiter.take_asked() == {"k1": 63} and limiter.take_asked() == {}
    limiter.keep({"k1"})
    assert limiter._budgets
    limiter.keep(set())  # revoked: its budget is forgotten
    assert not limiter._budgets


def test_r6_16_tokens_reserved_then_settled_to_the_usage():
    limiter, k = Limiter(), key(tpm=6000)
    admission = limiter.admit(k, "m", 5000, now=0.0)
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 2000, now=0.0)  # 1000 left
    admission.settle(500)  # the answer used less than reserved: the rest comes back
    admission.settle(500)  # once
    limiter.admit(k, "m", 2000, now=0.0)
    assert admission.headers(0.0)["x-ratelimit-remaining-tokens"] == "3500"
    more = limiter.admit(k, "m", 100, now=0.0)
    more.settle(5000)  # more than reserved: the bucket goes into debt
    assert more.headers(0.0)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 100, now=0.0)
    assert refused.value.wait == pytest.approx((1500 + 100) / 100)  # 3400 - 4900: the debt is paid back first


def test_r6_16a_a_request_with_no_cap_larger_than_the_bucket_reserves_the_bucket_when_it_is_full():
    limiter, k = Limiter(), key(tpm=1000)
    first = limiter.admit(k, "m", 5000, now=0.0)  # no cap: never refused for its estimate, admitted when full
    assert first.taken == (1000,)  # what it reserves is at most the bucket
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 5000, now=30.0)  # half of the bucket back: not full yet
    assert refused.value.wait == pytest.approx(30.0)
    limiter.admit(k, "m", 5000, now=60.0)  # full again: the key's reservations never exceed its bucket
    first.settle(300)  # what it used comes back beyond the bucket's level at most up to its capacity
    assert first.headers(60.0)["x-ratelimit-remaining-tokens"] == "700"


def test_r6_16a_a_capped_request_over_the_whole_limit_is_refused_at_once_even_when_full():
    limiter, k = Limiter(), key(tpm=1000, rpm=10, concurrency=1)
    with pytest.raises(OverWholeLimit) as refused:
        limiter.admit(k, "m", 1001, now=0.0, capped=True)
    assert "estimated at 1001 tokens" in refused.value.message and "1000 tokens per minute" in refused.value.message
    assert refused.value.retry_after is None and (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    # nothing was spent: the place, the request and the tokens are all still there
    admission = limiter.admit(k, "m", 1000, now=0.0, capped=True)
    assert admission.headers(0.0)["x-ratelimit-remaining-requests"] == "9"
    assert admission.headers(0.0)["x-ratelimit-remaining-tokens"] == "0"


def test_r6_16a_the_refusal_is_about_the_whole_limit_not_this_routers_share():
    limiter, k = Limiter(), key(tpm=1000)
    limiter.set_leases({"ra": {"k1": 0.1}, "rb": {"k1": 0.9}}, "ra", now=0.0)  # 100 tokens a minute here
    admission = limiter.admit(k, "m", 900, now=0.0, capped=True)  # more than the share, less than the whole
    assert admission.taken == (100,)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 900, now=0.0, capped=True)
    assert not isinstance(refused.value, OverWholeLimit) and refused.value.retry_after == 60


def test_r6_16a_a_model_limits_refusal_gives_the_keys_request_back():
    limiter = Limiter()
    k = KeyEntry("k1", "alice", "h", "sk-ab", None, limits=Limits(rpm=10, concurrency=2),
                 model_limits={"m": Limits(tpm=100)})
    held = limiter.hold(k, now=0.0)
    with pytest.raises(OverWholeLimit, match="for model 'm'"):
        limiter.admit(k, "m", 101, now=0.0, capped=True, held=held)
    held.release()
    admission = limiter.admit(k, "m", 10, now=0.0)
    assert admission.headers(0.0)["x-ratelimit-remaining-requests"] == "9"
    admission.release()
    assert [b.inflight for b in limiter._budgets.values()] == [0, 0]


def test_r6_16_a_share_of_the_limit_and_the_headers_scale_it_back():
    limiter, k = Limiter(), key(rpm=100, concurrency=4)
    limiter.set_leases({"ra": {}, "rb": {}}, "ra", now=0.0)  # no lease of the key yet: half of the limit
    admitted = [limiter.admit(k, "m", 1, now=0.0) for _ in range(2)]
    with pytest.raises(RateLimited, match="4 requests in flight"):
        limiter.admit(k, "m", 1, now=0.0)
    assert admitted[-1].headers(0.0)["x-ratelimit-remaining-requests"] == "96"  # 48 of 50 here, scaled to 100
    for a in admitted:
        a.release()
        a.release()  # once
    for _ in range(48):
        limiter.admit(k, "m", 1, now=0.0).release()
    with pytest.raises(RateLimited, match="100 requests per minute"):
        limiter.admit(k, "m", 1, now=0.0)
    limiter.set_leases({"ra": {"k1": 0.75}, "rb": {"k1": 0.25}}, "ra", now=0.0)  # a bigger lease fills at its pace, not at once
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=0.0)
    for _ in range(75):  # 75 a minute now, and a minute's worth held at most
        limiter.admit(k, "m", 1, now=60.0).release()
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=60.0)
    limiter.set_leases({"ra": {"k1": 0.1}, "rb": {"k1": 0.9}}, "ra", now=60.0)  # a smaller one holds at most its own minute
    for _ in range(10):
        limiter.admit(k, "m", 1, now=120.0).release()
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=120.0)
