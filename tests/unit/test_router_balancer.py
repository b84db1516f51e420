"""Balancing: least outstanding, round-robin ties (R-6.5), ejection (R-6.6), last use (R-7.1)."""

from __future__ import annotations

import time

from llmgw.router.balancer import Balancer
from llmgw.contracts.endpoints import Endpoint


def endpoints(model: str, count: int) -> list[Endpoint]:
    return [Endpoint(f"{model}-{i}", model, f"http://10.0.0.{i}:20000", f"key-{i}") for i in range(count)]


def balancer(*pools: tuple[str, int]) -> Balancer:
    b = Balancer(eject_seconds=5)
    b.replace({model: endpoints(model, count) for model, count in pools})
    return b


def test_r6_5_ties_are_broken_round_robin():
    b = balancer(("m", 3))
    picked = []
    for _ in range(6):
        up = b.acquire("m", 1.0)
        picked.append(up.replica_id)
        b.release(up)
    assert picked == ["m-0", "m-1", "m-2", "m-0", "m-1", "m-2"]


def test_r6_5_least_outstanding_wins():
    b = balancer(("m", 3))
    first, second = b.acquire("m", 1.0), b.acquire("m", 1.0)
    assert {first.replica_id, second.replica_id} == {"m-0", "m-1"}
    third = b.acquire("m", 1.0)
    assert third.replica_id == "m-2"
    b.release(second)
    assert b.acquire("m", 1.0) is second  # the only idle one
    assert b.outstanding("m-0") == 1


def test_r6_6_ejected_and_excluded_endpoints_are_skipped():
    b = balancer(("m", 2))
    a = b.acquire("m", 1.0)
    b.release(a)
    b.eject(a, now=1.0)
    for _ in range(4):
        up = b.acquire("m", 2.0)
        assert up is not a
        b.release(up)
    assert b.acquire("m", 2.0, exclude=[b.endpoints("m")[1]]) is None
    assert b.acquire("m", 2.0, exclude=[b.endpoints("m")[1]], include_ejected=True) is a  # last resort
    assert b.acquire("m", 6.5) is not None  # cool-down over


def test_r6_6_unknown_model_has_nothing():
    b = balancer(("m", 1))
    assert b.acquire("other", 1.0) is None
    assert not b.has_endpoints("other") and b.has_endpoints("m")


def test_replace_keeps_counters_and_ejection_of_endpoints_that_stay():
    b = balancer(("m", 2))
    busy = b.acquire("m", 1.0)
    b.eject(busy, 1.0)
    b.replace({"m": endpoints("m", 3)})
    kept = next(up for up in b.endpoints("m") if up.replica_id == busy.replica_id)
    assert kept is busy and kept.outstanding == 1 and kept.ejected_until > 1.0


def test_outstanding_counts_replicas_taken_off_the_lists():
    """Draining takes a replica off the router first, then waits for its requests to finish."""
    b = balancer(("m", 2))
    up = b.acquire("m", 1.0)
    b.replace({"m": [e for e in endpoints("m", 2) if e.replica_id != up.replica_id]})
    assert b.outstanding(up.replica_id) == 1
    b.release(up)
    assert b.outstanding(up.replica_id) == 0
    b.replace({"m": endpoints("m", 1)})
    assert b.outstanding(up.replica_id) == 0


def test_r7_1_last_used_only_for_used_replicas_in_unix_time():
    b = balancer(("m", 2))
    assert b.last_used() == {}
    before = time.time()
    up = b.acquire("m", time.monotonic())
    used = b.last_used()
    assert set(used) == {up.replica_id}
    assert before - 1 <= used[up.replica_id] <= time.time() + 1


def test_endpoint_repr_hides_the_key():
    endpoint = Endpoint("r", "m", "http://h:1", "very-secret")
    assert "very-secret" not in repr(endpoint)
