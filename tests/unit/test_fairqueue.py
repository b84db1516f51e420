"""The router's fair queue on its own: priority classes, weighted shares, bounded waits, the
places of a replica and their headroom (R-6.17)."""

from __future__ import annotations

import asyncio
import json
from types import MappingProxyType

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import FeedError, GatewaySettings, RoutedModel, Snapshot, gateway_from_wire, gateway_to_wire
from llmgw.control.feed import gateway_settings, routed_models
from llmgw.router import Router
from llmgw.router.engineload import EnginePoller
from llmgw.router.errors import error_response
from llmgw.router.fairqueue import (DEFAULT_REPLICA_CONCURRENCY, FALLBACK_RETRY_AFTER, FairQueue, ModelQueue, QueueTimeout,
                                    replica_places)
from llmgw.router.metrics import RouterMetrics
from tests.unit.test_engine_load import engine, fixture


def served(queue: ModelQueue, n: int) -> list[str]:
    order = []
    for _ in range(n):
        waiter = queue.pop()
        assert waiter is not None
        order.append(waiter.key_id)
    return order


def test_a_higher_priority_class_is_served_first():
    queue = ModelQueue(1)
    for i in range(3):
        queue.push("batch", 0, 1)
    queue.push("interactive", 5, 1)
    queue.push("interactive", 5, 1)
    assert served(queue, 5) == ["interactive", "interactive", "batch", "batch", "batch"]
    assert queue.pop() is None and queue.waiting == 0


def test_weights_two_to_one_share_what_is_served_within_a_class():
    queue = ModelQueue(1)
    for _ in range(30):
        queue.push("heavy", 0, 2)
        queue.push("light", 0, 1)
    first = served(queue, 30)
    print("first 30 served:", first.count("heavy"), "heavy,", first.count("light"), "light")
    assert first.count("heavy") == 20 and first.count("light") == 10
    # every window of three has two of one and one of the other
    assert all(first[i:i + 3].count("heavy") == 2 for i in range(0, 30, 3))


def test_a_key_arriving_later_is_not_behind_a_backlog():
    queue = ModelQueue(1)
    for _ in range(20):
        queue.push("noisy", 0, 1)
    served(queue, 5)
    queue.push("quiet", 0, 1)
    assert served(queue, 2).count("quiet") == 1  # next or the one after, not after 15 noisy ones


def test_a_resumed_request_goes_first_in_its_class():
    queue = ModelQueue(1)
    for _ in range(3):
        queue.push("a", 0, 1)
    queue.push("b", 0, 1, resumed=True)
    assert served(queue, 4) == ["b", "a", "a", "a"]


def test_the_fast_path_takes_places_until_the_capacity():
    queue = ModelQueue(2)
    assert queue.take() and queue.take() and not queue.take()
    assert queue.held == 2
    queue.push("a", 0, 1)
    given = queue.leave(0.5)
    assert [w.key_id for w in given] == ["a"] and queue.held == 2 and queue.service == 0.5
    assert not queue.take()  # the place went to the waiter, not to a newcomer


def test_retry_after_is_estimated_from_service_time_and_position():
    queue = ModelQueue(2)
    assert queue.retry_after(0) == FALLBACK_RETRY_AFTER  # nothing measured yet
    queue.held = 1
    queue.leave(4.0)
    assert queue.retry_after(0) == 2  # 4 s a place, 2 places
    assert queue.retry_after(9) == 20


async def test_a_wait_is_bounded_and_answers_503_with_retry_after():
    fq = FairQueue()
    fq.set_capacity("m", 1)
    assert fq.take("m")
    fq.models["m"].service = 3.0
    with pytest.raises(QueueTimeout) as caught:
        await fq.wait("m", "k", 0, 1, 0.05)
    exc = caught.value
    assert fq.waiting() == {"m": 0}
    response = error_response(exc)
    body = json.loads(response.body)
    print("refusal:", response.status, response.headers["Retry-After"], body["error"]["message"])
    assert response.status == 503 and body["error"]["code"] == "queue_timeout"
    assert response.headers["Retry-After"] == "3"


async def test_a_cancelled_waiter_leaves_the_queue_at_once():
    fq = FairQueue()
    fq.set_capacity("m", 1)
    assert fq.take("m")
    task = asyncio.create_task(fq.wait("m", "k", 0, 1, 30))
    await asyncio.sleep(0)
    assert fq.waiting() == {"m": 1}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fq.waiting() == {"m": 0}
    fq.leave("m", 0.0)
    assert fq.models["m"].held == 0  # nobody got the place it would have had


async def test_a_place_given_to_a_waiter_being_cancelled_is_passed_on():
    fq = FairQueue()
    fq.set_capacity("m", 1)
    assert fq.take("m")
    first = asyncio.create_task(fq.wait("m", "a", 0, 1, 30))
    second = asyncio.create_task(fq.wait("m", "b", 0, 1, 30))
    await asyncio.sleep(0)
    fq.leave("m", 0.0)  # the place goes to the first waiter ...
    first.cancel()  # ... whose client leaves before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 5)
    assert fq.models["m"].held == 1 and fq.waiting() == {"m": 0}


async def test_capacity_growing_releases_waiters():
    fq = FairQueue()
    fq.set_capacities({"m": 1})
    assert fq.take("m")
    waiters = [asyncio.create_task(fq.wait("m", f"k{i}", 0, 1, 30)) for i in range(3)]
    await asyncio.sleep(0)
    assert fq.waiting() == {"m": 3}
    fq.set_capacities({"m": 3})  # two more places: two waiters go
    await asyncio.sleep(0)
    assert sum(t.done() for t in waiters) == 2 and fq.waiting() == {"m": 1}
    fq.set_capacities({"m": 0})  # no endpoints: nothing is held back, the no-replica path answers
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert fq.waiting() == {"m": 0}


async def test_priority_holds_through_the_wait():
    fq = FairQueue()
    fq.set_capacity("m", 1)
    assert fq.take("m")
    order = []

    async def one(key, priority):
        await fq.wait("m", key, priority, 1, 30)
        order.append(key)
        fq.leave("m", 0.0)

    tasks = [asyncio.create_task(one(f"low{i}", 0)) for i in range(3)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("high", 1)))
    await asyncio.sleep(0)
    fq.leave("m", 0.0)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["high", "low0", "low1", "low2"]


def test_queue_wait_travels_on_the_feed_and_is_checked():
    settings = GatewaySettings(max_body=1000, request_timeout=60.0, on_demand_wait=5.0, queue_wait=2.5)
    wire = gateway_to_wire(settings)
    assert gateway_from_wire(json.loads(json.dumps(wire)), "gateway") == settings
    del wire["queue_wait"]  # a control plane that does not send it: the default
    assert gateway_from_wire(wire, "gateway").queue_wait == 30.0
    with pytest.raises(FeedError, match="queue_wait"):
        gateway_from_wire({**wire, "queue_wait": "soon"}, "gateway")


def test_the_published_settings_carry_queue_wait_and_the_profiles_concurrency():
    assert gateway_settings(GatewayConfig(queue_wait="4s")).queue_wait == 4.0
    catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="narrow"), ModelConfig(name="n", profile="wide")],
                            profiles={"narrow": ProfileConfig(engine="vllm", concurrency=2),
                                      "wide": ProfileConfig(engine="vllm")})
    models = routed_models(catalog)
    assert models["m"].concurrency == 2 and models["n"].concurrency is None


async def test_metrics_show_the_requests_waiting_per_model():
    fq = FairQueue()
    fq.set_capacities({"m": 1, "n": 2})
    assert fq.take("m")
    task = asyncio.create_task(fq.wait("m", "k", 0, 1, 30))
    await asyncio.sleep(0)
    registry = CollectorRegistry()
    RouterMetrics(registry, waiting=fq.waiting)
    text = generate_latest(registry).decode()
    print([line for line in text.splitlines() if line.startswith("llmgw_router_queued")])
    assert 'llmgw_router_queued{model="m"} 1.0' in text and 'llmgw_router_queued{model="n"} 0.0' in text
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- a replica's places and their headroom ---------------------------------------------------------


def test_r6_17_a_replicas_places_come_from_the_profile_else_its_slots_else_the_default():
    assert replica_places(2, 4) == (2, 1)  # the operator's choice wins over the engine's slots
    assert replica_places(None, 4) == (4, 0)  # a llama-server's slots: no headroom, it defers the rest itself
    assert replica_places(None, None) == (DEFAULT_REPLICA_CONCURRENCY, 8)
    assert replica_places(16, None) == (16, 2) and replica_places(1, None) == (1, 1)


def test_r6_17_a_key_below_its_share_takes_a_place_of_the_headroom_at_once():
    queue = ModelQueue(4, 1)
    assert all(queue.take("noisy") for _ in range(4))
    assert not queue.take("noisy")  # alone it holds its whole share: no headroom for it
    queue.push("noisy", 0, 1)
    assert queue.take("quiet")  # holds nothing: its place is the headroom's
    assert (queue.held, queue.waiting) == (5, 1)
    assert not queue.take("other")  # the headroom is taken: it waits like any other
    queue.push("other", 0, 1)
    given = queue.leave(0.1, "noisy")  # a place frees: the next in order gets it, as ever
    assert [w.key_id for w in given] == ["other"] and queue.held == 5


def test_r6_17_no_headroom_at_or_above_the_share_or_behind_its_own_waiters():
    queue = ModelQueue(4, 1)
    assert queue.take("a") and queue.take("a") and queue.take("b") and queue.take("b")
    assert not queue.take("a") and not queue.take("b")  # two keys at 2 of 4 places each: at their share
    heavy = ModelQueue(4, 1)
    assert heavy.take("light", weight=1) and heavy.take("light", weight=1)
    assert heavy.take("heavy", weight=3) and heavy.take("heavy", weight=3)
    assert not heavy.take("light", weight=1)  # its share is 1 of 4 places
    assert heavy.take("heavy", weight=3)  # its share is 3: it holds 2
    queue = ModelQueue(1, 1)
    assert queue.take("a")
    queue.push("b", 0, 1)
    queue.push("c", 0, 1)
    queue.push("c", 0, 1)
    given = queue.leave(None, "a")
    assert [w.key_id for w in given] == ["b", "c"]  # b's place, then the headroom to c, holding nothing
    assert not queue.take("c") and queue.waiting == 1  # c's newcomer does not pass c's own waiter


def test_r6_17_no_headroom_past_a_higher_class_waiting():
    queue = ModelQueue(2, 1)
    assert queue.take("batch", 0) and queue.take("batch", 0)
    queue.push("vip", 5, 1)  # it waits (the test puts it there), a lower class must not pass it
    assert not queue.take("low", 0)
    assert queue.take("top", 9)  # a higher class than any waiting may


def test_r6_17_a_freed_headroom_place_goes_to_a_waiter_below_its_share_only():
    queue = ModelQueue(2, 1)
    assert queue.take("noisy") and queue.take("noisy") and queue.take("quiet")
    for _ in range(3):
        queue.push("noisy", 0, 1)
    assert queue.leave(None, "quiet") == []  # the noisy key holds its share: the headroom stays free
    queue.push("quiet", 0, 1)
    assert queue.held == 2 and queue.waiting == 4  # pushed while the headroom was free: the test's doing
    assert [w.key_id for w in queue.fill()] == ["quiet"] and queue.held == 3


async def test_r6_17_a_models_capacity_follows_its_engines_slots():
    """Per endpoint: the profile's concurrency where set, else the slots the engine reported, else
    the default; a reading that raises the count gives waiters the new places, and one that lowers
    it takes places back as they are given back."""
    seen: list = []
    metrics = (200, fixture("llama_server_metrics.txt"))
    three = {"/metrics": metrics, "/slots": (200, fixture("llama_server_slots_busy.json"))}
    two = {"/metrics": metrics, "/slots": (200, fixture("llama_server_slots.json"))}
    a, a_url = await engine(three, seen)
    b, b_url = await engine(two, seen)
    models = {name: RoutedModel(name=name, engine="llama-server", served_name=None, routing="least-outstanding",
                                on_demand=False, concurrency=concurrency)
              for name, concurrency in (("m", None), ("n", 2))}
    endpoints = {"m": (Endpoint("a", "m", a_url, "k"), Endpoint("b", "m", b_url, "k")),
                 "n": (Endpoint("a", "n", a_url, "k"),)}
    router = Router()
    router.apply(Snapshot(epoch="e", version=1, models=MappingProxyType(models), endpoints=MappingProxyType(endpoints),
                          keys=(), gateway=gateway_settings(GatewayConfig())))
    fq = router.fairqueue
    places = {name: (q.capacity, q.headroom) for name, q in fq.models.items()}
    assert places == {"m": (2 * DEFAULT_REPLICA_CONCURRENCY, 16), "n": (2, 1)}  # before any reading
    try:
        async with aiohttp.ClientSession() as session:
            poller = EnginePoller(router.balancer, session, on_slots=router.feed.set_capacities)
            await poller.poll_once()
            places = {name: (q.capacity, q.headroom) for name, q in fq.models.items()}
            print("after the first reading:", places)
            assert places == {"m": (5, 0), "n": (2, 1)}  # 3 + 2 slots; n's profile says 2
            assert all(fq.take("m", f"k{i}") for i in range(5)) and not fq.take("m", "k5")
            waiter = asyncio.create_task(fq.wait("m", "k5", 0, 1, 30))
            await asyncio.sleep(0)
            assert fq.waiting()["m"] == 1
            two["/slots"] = three["/slots"]  # b restarted with one more slot
            await poller.poll_once()
            await asyncio.wait_for(waiter, 5)  # the new place went to the waiter
            assert (fq.models["m"].capacity, fq.models["m"].held) == (6, 6)
            two["/slots"] = (200, fixture("llama_server_slots.json"))  # and back to two
            await poller.poll_once()
            assert fq.models["m"].capacity == 5 and not fq.take("m", "k6")  # held 6 of 5: none given
    finally:
        await a.cleanup()
        await b.cleanup()
