"""A canary revision's share of a model's requests (R-4.13): drawn by the affinity key, so a
conversation stays on one revision, about the share over many conversations."""

from __future__ import annotations

from llmgw.contracts.endpoints import Endpoint
from llmgw.router.balancer import PREFIX, Balancer


def endpoints(canary: int | None):
    return {"m": [Endpoint("old-1", "m", "http://10.0.0.1:1", "k", revision="aaa"),
                  Endpoint("old-2", "m", "http://10.0.0.2:1", "k", revision="aaa"),
                  Endpoint("new-1", "m", "http://10.0.0.3:1", "k", revision="bbb", canary=canary)]}


def test_r4_13_a_canary_gets_its_share_by_conversation():
    for policy in ("least-outstanding", PREFIX):
        balancer = Balancer()
        balancer.replace(endpoints(25), {"m": policy})
        assert balancer.has_canary("m")
        on_new = 0
        for i in range(400):
            key = f"conversation {i}".encode()
            chosen = set()
            for _ in range(3):  # every turn of one conversation: the same revision
                up = balancer.acquire("m", 0.0, (), False, key, "owner")
                chosen.add(up.replica_id.startswith("new"))
                balancer.release(up)
            assert len(chosen) == 1, (policy, i)
            on_new += chosen.pop()
        assert 0.18 <= on_new / 400 <= 0.32, (policy, on_new)


def test_r4_13_the_canary_share_follows_the_endpoints_and_ends_with_them():
    balancer = Balancer()
    balancer.replace(endpoints(None), {"m": "least-outstanding"})
    assert not balancer.has_canary("m")
    balancer.replace(endpoints(50), {"m": "least-outstanding"})  # same members: the pool kept, the share set
    assert balancer.has_canary("m")
    balancer.replace(endpoints(None), {"m": "least-outstanding"})  # promoted
    assert not balancer.has_canary("m")


def test_r4_13_with_its_side_unable_to_serve_a_request_goes_to_the_other():
    balancer = Balancer()
    balancer.replace(endpoints(99), {"m": "least-outstanding"})
    new = next(up for up in balancer.endpoints("m") if up.replica_id == "new-1")
    balancer.eject(new, 0.0)
    up = balancer.acquire("m", 1.0, (), False, b"any", "owner")
    assert up is not None and up.replica_id.startswith("old")
