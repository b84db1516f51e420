"""The router's per-key limits as a mechanism: buckets, estimates, settling, shares (R-6.16)."""

from __future__ import annotations

import pytest

from llmgw.contracts.feed import KeyEntry, Limits
from llmgw.router.limits import DEFAULT_ANSWER_TOKENS, Limiter, RateLimited, duration, estimate


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


def test_r6_16_a_request_larger_than_the_bucket_passes_when_it_is_full():
    limiter, k = Limiter(), key(tpm=1000)
    limiter.admit(k, "m", 5000, now=0.0)  # a full bucket admits it, and the key then waits it out
    with pytest.raises(RateLimited) as refused:
        limiter.admit(k, "m", 5000, now=60.0)
    assert refused.value.wait == pytest.approx(4 * 60)


def test_r6_16_a_share_of_the_limit_and_the_headers_scale_it_back():
    limiter, k = Limiter(), key(rpm=100, concurrency=4)
    limiter.set_leases({}, routers=2, now=0.0)  # no lease yet: half of the limit
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
    limiter.set_leases({"k1": 0.75}, routers=2, now=0.0)  # a bigger lease fills at its pace, not at once
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=0.0)
    for _ in range(75):  # 75 a minute now, and a minute's worth held at most
        limiter.admit(k, "m", 1, now=60.0).release()
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=60.0)
    limiter.set_leases({"k1": 0.1}, routers=2, now=60.0)  # a smaller one holds at most its own minute
    for _ in range(10):
        limiter.admit(k, "m", 1, now=120.0).release()
    with pytest.raises(RateLimited):
        limiter.admit(k, "m", 1, now=120.0)
