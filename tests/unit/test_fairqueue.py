"""The router's fair queue on its own: priority classes, weighted shares, bounded waits (R-6.17)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.feed import FeedError, GatewaySettings, gateway_from_wire, gateway_to_wire
from llmgw.control.feed import gateway_settings, routed_models
from llmgw.router.errors import error_response
from llmgw.router.fairqueue import FALLBACK_RETRY_AFTER, FairQueue, ModelQueue, QueueTimeout
from llmgw.router.metrics import RouterMetrics


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
