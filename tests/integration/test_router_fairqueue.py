"""A saturated model's places shared fairly between keys, through the official client (R-6.17).

One engine double with a fixed service time (streamed tokens `token_delay` apart), a profile that
gives a replica 2 requests at once, and two keys: a noisy one sending 10x the quiet one's requests.
"""

from __future__ import annotations

import asyncio
import time

import openai

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, ProfileConfig
from llmgw.keys import set_key

from tests.integration.test_router_support import ENGINES, apoll, engines, model, start_router  # noqa: F401

TOKENS = 4


def saturated_catalog(concurrency: int) -> Catalog:
    return Catalog.build(file_models=[model("m", profile="narrow")],
                         profiles={"narrow": ProfileConfig(engine="vllm", concurrency=concurrency)}, engines=ENGINES)


async def streamed(client: openai.AsyncOpenAI, who: str, answered: list[str], tokens: int = TOKENS) -> None:
    stream = await client.completions.create(model="m", prompt="a b", max_tokens=tokens, stream=True)
    async for _ in stream:
        pass
    answered.append(who)


async def test_the_quiet_key_is_served_ahead_of_the_noisy_backlog(engines, start_router):  # noqa: F811
    engine = engines.start("m", token_delay=0.05)
    running = await start_router(saturated_catalog(2), {"m": [engine.endpoint()]})
    quiet_secret, noisy_secret = running.key("quiet"), running.key("noisy")
    quiet, noisy = running.client(quiet_secret), running.client(noisy_secret)
    fairqueue = running.router.fairqueue
    assert fairqueue.models["m"].capacity == 2  # one replica, the profile's concurrency
    answered: list[str] = []
    started = time.monotonic()
    noisy_tasks = [asyncio.create_task(streamed(noisy, "noisy", answered)) for _ in range(20)]
    await apoll(lambda: fairqueue.waiting().get("m") == 18, what="the noisy key's backlog queued")
    assert running.router.balancer.outstanding_by_model().get("m") == 2  # the engine has only its 2
    quiet_tasks = [asyncio.create_task(streamed(quiet, "quiet", answered)) for _ in range(2)]
    await apoll(lambda: fairqueue.waiting().get("m", 0) >= 19, what="the quiet key's requests queued")
    results = await asyncio.gather(*noisy_tasks, *quiet_tasks, return_exceptions=True)
    elapsed = time.monotonic() - started
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == []  # the noisy excess waited: no 5xx, nothing dropped
    last_quiet = max(i for i, who in enumerate(answered) if who == "quiet")
    noisy_before = answered[:last_quiet].count("noisy")
    print(f"answered {len(answered)} in {elapsed:.2f} s; noisy answers before the quiet key's last: "
          f"{noisy_before} of 20; order: {''.join(w[0] for w in answered)}")
    assert answered.count("noisy") == 20 and answered.count("quiet") == 2
    # First come, first served would answer all 20 noisy requests first; fair queueing serves the
    # quiet key's two among the first ones given a place after it arrived.
    assert noisy_before <= 6
    assert fairqueue.waiting() == {"m": 0} and fairqueue.models["m"].held == 0


async def test_a_wait_past_queue_wait_is_a_503_with_retry_after(engines, start_router):  # noqa: F811
    engine = engines.start("m", token_delay=0.2)
    running = await start_router(saturated_catalog(1), {"m": [engine.endpoint()]},
                                 gateway=GatewayConfig(queue_wait=0.3))
    client = running.client()
    fairqueue = running.router.fairqueue
    first = asyncio.create_task(streamed(client, "first", []))
    await apoll(lambda: fairqueue.models["m"].held == 1, what="the only place taken")
    refused = await asyncio.gather(*(streamed(client, "late", []) for _ in range(2)), return_exceptions=True)
    await first
    statuses = [getattr(r, "status_code", r) for r in refused]
    print("late requests:", statuses, [r.response.headers.get("retry-after") for r in refused
                                       if isinstance(r, openai.APIStatusError)])
    assert statuses == [503, 503]
    for exc in refused:
        assert exc.body["code"] == "queue_timeout"
        assert int(exc.response.headers["retry-after"]) >= 1
    assert fairqueue.waiting() == {"m": 0}


async def test_a_higher_priority_key_goes_before_the_waiting_backlog(engines, start_router):  # noqa: F811
    engine = engines.start("m", token_delay=0.05)
    running = await start_router(saturated_catalog(1), {"m": [engine.endpoint()]})
    batch_secret, interactive_secret, other_secret = running.key("batch"), running.key("interactive"), running.key("other")
    # In the store, not only in the publisher: it reads the keys again every couple of seconds.
    running.store.write_sync(lambda db: set_key(db, "interactive", {"priority": 5}))
    running.reload_keys()
    assert {k.name: k.priority for k in running.router.snapshot.keys}["interactive"] == 5
    fairqueue = running.router.fairqueue
    answered: list[str] = []
    # The batch request given the only place and the third key's in the one place of headroom
    # stream for minutes: the queue stays as built, however slowly the machine runs, until the
    # test ends the batch one.
    batch_client = running.client(batch_secret)
    first = asyncio.create_task(streamed(batch_client, "first batch", answered, tokens=4000))
    await apoll(lambda: fairqueue.models["m"].held == 1, what="the only place taken")
    backlog = [asyncio.create_task(streamed(batch_client, "batch", answered)) for _ in range(5)]
    await apoll(lambda: fairqueue.waiting().get("m") == 5, what="the batch backlog queued")
    other = asyncio.create_task(streamed(running.client(other_secret), "other", answered, tokens=4000))
    await apoll(lambda: fairqueue.models["m"].held == 2, what="the headroom taken")
    interactive = asyncio.create_task(streamed(running.client(interactive_secret), "interactive", answered))
    await apoll(lambda: fairqueue.waiting().get("m") == 6, what="the interactive request queued")
    first.cancel()  # its client goes: the place it held is the next one given
    await asyncio.gather(*backlog, interactive)
    other.cancel()
    print("order:", answered)
    assert answered[0] == "interactive"  # before the backlog that queued first (fair shares alone: after 1 of it)
    assert answered.count("batch") == 5 and "other" not in answered and "first batch" not in answered


async def test_a_client_gone_leaves_the_queue_and_a_new_replica_takes_waiters(engines, start_router):  # noqa: F811
    first_engine = engines.start("m", token_delay=1.0)
    second_engine = engines.start("m", token_delay=1.0)  # not routed to until the endpoints change
    running = await start_router(saturated_catalog(1), {"m": [first_engine.endpoint()]})
    client = running.client()
    fairqueue = running.router.fairqueue
    answered: list[str] = []
    holder = asyncio.create_task(streamed(client, "holder", answered))
    await apoll(lambda: fairqueue.models["m"].held == 1, what="the only place taken")
    waiting = asyncio.create_task(streamed(client, "waiting", answered))
    leaving = asyncio.create_task(streamed(client, "leaving", answered))
    await apoll(lambda: fairqueue.waiting().get("m") == 2, what="two requests queued")
    leaving.cancel()  # the client goes away: its connection closes and the router's handler is cancelled
    await apoll(lambda: fairqueue.waiting().get("m") == 1, what="the cancelled request out of the queue")
    running.set_endpoints({"m": [first_engine.endpoint(), second_engine.endpoint()]})
    assert fairqueue.models["m"].capacity == 2
    assert fairqueue.waiting().get("m") == 0  # the new replica's place went to the waiting request ...
    assert not holder.done() and fairqueue.models["m"].held == 2  # ... not the holder's, still in use
    await asyncio.gather(holder, waiting)
    print("answered:", answered)
    assert sorted(answered) == ["holder", "waiting"]
    assert fairqueue.models["m"].held == 0
