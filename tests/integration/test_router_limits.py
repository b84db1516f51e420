"""Per-key limits enforced by the router: 429s, Retry-After, OpenAI's rate-limit headers (R-6.16)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import openai
from aiohttp import web

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Limits
from llmgw.keys import KeySettings, create_key
from tests.integration.test_router_support import catalog, model, scripted_engine, start_router  # noqa: F401

HELLO = [{"role": "user", "content": "hi"}]
PROMPT_TOKENS = 10  # what the scripted engine reports for every prompt


class Engine:
    """Answers chat completions with usage: the prompt's PROMPT_TOKENS and `max_tokens` completion tokens."""

    def __init__(self):
        self.requests = 0
        self.hold: asyncio.Event | None = None
        self.held = False
        self.arrived = asyncio.Event()

    async def chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        document = await request.json()
        self.arrived.set()
        if self.hold is not None and not self.held:  # only the first: a test never waits on a later one
            self.held = True
            await self.hold.wait()
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": document.get("max_tokens") or 1}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": document["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}], "usage": usage})


def limited_key(gw, name: str, **options) -> str:
    _, secret = gw.store.write_sync(lambda db: create_key(db, name, settings=KeySettings(**options)))
    gw.reload_keys()
    return secret


def refusals(gw, model: str = "m") -> int:
    """Answers of 4xx the router gave for the model (its request counters)."""
    return gw.router.metrics.requests.get((model, "4xx"), 0)


async def test_r6_16_openai_client_gets_through_after_a_429_and_sees_rate_limit_error_without_retries(start_router):  # noqa: F811
    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        # 6000 tokens a minute is 100 a second. The first request leaves 6000 - 3210 = 2790; the
        # next one is estimated at 3200 plus its body / 4, so it waits about 4.5 s.
        secret = limited_key(gw, "tight", limits=Limits(tpm=6000))
        async with gw.client(secret, max_retries=0) as client:
            first = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=3200)
            print("first answer headers:", {k: v for k, v in first.headers.items() if k.startswith("x-ratelimit")})
            assert first.headers["x-ratelimit-limit-tokens"] == "6000"
            remaining = int(first.headers["x-ratelimit-remaining-tokens"])
            assert 2790 <= remaining < 2900  # corrected to the usage: 6000 - 3210, plus the refill since
            assert "x-ratelimit-limit-requests" not in first.headers  # the key has no rpm
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=3200)
            except openai.RateLimitError as exc:
                refused = exc
            else:
                raise AssertionError("the second request was admitted")
        assert refused.status_code == 429
        error = refused.body if isinstance(refused.body, dict) and "code" in refused.body else refused.body["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "6000 tokens per minute" in error["message"]
        retry_after = int(refused.response.headers["retry-after"])
        print("refusal:", error["message"], "Retry-After:", retry_after,
              "reset:", refused.response.headers["x-ratelimit-reset-tokens"])
        assert 1 <= retry_after <= 6
        assert refused.response.headers["x-ratelimit-limit-tokens"] == "6000"
        assert engine.requests == 1  # the refusal never reached the engine

        before = refusals(gw)
        started = time.monotonic()
        async with gw.client(secret, max_retries=2) as client:
            answer = await client.chat.completions.create(model="m", messages=HELLO, max_tokens=3200)
        print(f"with max_retries=2: {refusals(gw) - before} refusals first, answered after "
              f"{time.monotonic() - started:.1f} s")
        assert answer.usage.completion_tokens == 3200
        assert refusals(gw) - before >= 1 and engine.requests == 2  # refused, waited, then let through


async def test_r6_16_requests_per_minute_headers_and_refusal(start_router):  # noqa: F811
    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        secret = limited_key(gw, "three", limits=Limits(rpm=3))
        seen = []
        async with gw.client(secret) as client:
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=1)
                seen.append((raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"],
                             raw.headers["x-ratelimit-reset-requests"]))
            print("rpm=3:", seen)
            assert [(limit, remaining) for limit, remaining, _ in seen] == [("3", "2"), ("3", "1"), ("3", "0")]
            assert all(re.fullmatch(r"(\d+m)?\d+(\.\d+)?s|\d+ms", reset) for _, _, reset in seen)  # OpenAI's form
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
            except openai.RateLimitError as exc:
                refused = exc
            else:
                raise AssertionError("a fourth request in the minute was admitted")
        assert "3 requests per minute" in refused.message
        assert 1 <= int(refused.response.headers["retry-after"]) <= 20  # one request comes back every 20 s
        assert refused.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert engine.requests == 3
        async with gw.client() as client:  # a key without limits: no headers, never refused
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=1)
        assert not [name for name in raw.headers if name.startswith("x-ratelimit")]


async def test_r6_16_concurrency_is_released_when_a_request_ends(start_router):  # noqa: F811
    engine = Engine()
    engine.hold = asyncio.Event()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        secret = limited_key(gw, "one-at-a-time", limits=Limits(concurrency=1))
        async with gw.client(secret) as client:
            first = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO, max_tokens=1))
            await engine.arrived.wait()
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
                message = None
            except openai.RateLimitError as exc:
                message = exc.message
            engine.hold.set()
            await first
            assert message is not None and "1 requests in flight at once" in message, "a second one was admitted"
            await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)  # released: admitted
            # a request that fails releases its place too
            gw.set_endpoints({"m": []})
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503
            gw.set_endpoints({"m": [Endpoint("r", "m", url, None)]})
            await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
        assert engine.requests == 3


async def test_r6_16_a_model_limit_applies_on_top_of_the_key(start_router):  # noqa: F811
    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m"), model("n")),
                                {"m": [Endpoint("rm", "m", url, None)], "n": [Endpoint("rn", "n", url, None)]})
        secret = limited_key(gw, "per-model", limits=Limits(rpm=10), model_limits={"m": Limits(rpm=1)})
        async with gw.client(secret) as client:
            started = time.monotonic()
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=1)
            assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == \
                ("1", "0")  # the tighter of the two
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
            except openai.RateLimitError as exc:
                assert "1 requests per minute for model 'm'" in exc.message
            else:
                raise AssertionError("the model's limit was not applied")
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(model="n", messages=HELLO, max_tokens=1)
            # 10 less the 4 admitted (a refusal spends nothing), plus what the bucket regained since:
            # one request every 6 s.
            regained = math.floor((time.monotonic() - started) / 6)
            assert 6 <= int(raw.headers["x-ratelimit-remaining-requests"]) <= 6 + regained
            assert json.loads(raw.text)["usage"]["completion_tokens"] == 1


async def test_r6_16a_a_request_over_the_keys_whole_tpm_is_refused_at_once(start_router):  # noqa: F811
    engine = Engine()
    engine.hold = asyncio.Event()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        secret = limited_key(gw, "tight", limits=Limits(tpm=6000))
        async with gw.client(secret) as client:
            # vLLM honours the largest of the caps, for each of the n answers: 5,000,000 tokens at
            # most, of a key that may use 6000 a minute; its bucket is full, and it is still refused.
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1,
                                                     max_completion_tokens=100000, n=50)
            except openai.RateLimitError as exc:
                refused = exc
            else:
                raise AssertionError("a request estimated at 5,000,000 tokens was admitted by a 6000-token key")
            print("refusal:", refused.message)
            assert refused.body["code"] == "rate_limit_exceeded"
            estimated = int(re.search(r"estimated at (\d+) tokens", refused.message).group(1))
            assert estimated >= 5_000_000 and "6000 tokens per minute" in refused.message
            assert "retry-after" not in refused.response.headers  # waiting would not help
            assert engine.requests == 0 and gw.router.fairqueue.waiting().get("m", 0) == 0  # not sent, not queued

            # A request that sets no cap is never refused for its estimate: its body alone is
            # estimated at more than the whole minute, and it reserves what the bucket holds.
            big = [{"role": "user", "content": "x" * 30_000}]
            first = asyncio.create_task(client.chat.completions.create(model="m", messages=big))
            await engine.arrived.wait()
            try:  # while it is in flight the bucket is empty, and only for a minute: what it reserved is bounded
                await client.chat.completions.create(model="m", messages=big)
            except openai.RateLimitError as exc:
                second = exc
            else:
                raise AssertionError("a second request was admitted while the first held the whole bucket")
            print("while the first holds the bucket:", second.message, second.response.headers["retry-after"])
            assert 1 <= int(second.response.headers["retry-after"]) <= 60
            engine.hold.set()
            answer = await first
            assert answer.usage.completion_tokens == 1 and engine.requests == 1


async def two_routers(tmp_path, url: str, limits: Limits):
    """Two routers fed by one control plane, sharing a key with these limits, once both hold leases:
    (routers, their chat URLs, the key's id and secret, and a close() for the end)."""
    from llmgw.catalog import CatalogHolder
    from llmgw.config import GatewayConfig
    from llmgw.control.feed import FeedPublisher
    from llmgw.localfeed import LocalFeed
    from llmgw.router.app import Router
    from llmgw.store import Store
    from tests.integration.test_router_support import apoll

    store = Store.open(tmp_path / "state.db")
    shared, secret = store.write_sync(lambda db: create_key(db, "shared", settings=KeySettings(limits=limits)))
    publisher = FeedPublisher(CatalogHolder(catalog(model("m"))), store, GatewayConfig())
    publisher.set_endpoints({"m": [Endpoint("r", "m", url, None)]})
    publisher.mark_ready()
    routers, feeds, runners, urls = [], [], [], []

    async def close():
        for runner in runners:
            await runner.cleanup()
        for feed in feeds:
            await feed.close()
        await publisher.close()
        store.close()

    try:
        for name in ("a", "b"):
            router = Router()
            feed = LocalFeed(publisher, router.feed, router_id=f"router-{name}")
            feed.pump()
            feed.start()
            runner = router.runner()
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            routers.append(router)
            feeds.append(feed)
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions")
        await apoll(lambda: all(len(r.snapshot.leases) == 2 for r in routers), what="leases for both routers")
    except BaseException:
        await close()
        raise
    return routers, urls, shared.id, secret, close


async def test_r6_16b_a_concurrency_of_one_behind_two_routers_is_one_request_at_once(tmp_path):
    from aiohttp import ClientSession

    from tests.integration.test_router_support import DEADLINE

    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        routers, urls, key_id, secret, close = await two_routers(tmp_path, url, Limits(concurrency=1))
        headers = {"Authorization": f"Bearer {secret}"}
        try:
            async with ClientSession() as session:
                async def post(which: int, **fields) -> tuple[int, dict]:
                    body = {"model": "m", "messages": HELLO, "max_tokens": 1, **fields}
                    async with session.post(urls[which], json=body, headers=headers) as response:
                        return response.status, await response.json()

                places = [r.limiter.places(key_id, None, 1) for r in routers]
                print("places of a concurrency of 1 on two routers:", places)
                assert sorted(places) == [0, 1]  # they add up to the limit

                # One request at each router at once, the engine holding the first it gets: one
                # goes through, the other router has no place and refuses.
                engine.hold = asyncio.Event()
                tasks = [asyncio.create_task(post(which)) for which in (0, 1)]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=DEADLINE)
                refused = done.pop().result()
                assert refused[0] == 429, refused
                assert "1 requests in flight at once" in refused[1]["error"]["message"]
                await asyncio.wait_for(engine.arrived.wait(), DEADLINE)  # the other one, held by the engine
                engine.hold.set()
                statuses = sorted(status for status, _ in await asyncio.gather(*tasks))
                assert statuses == [200, 429] and engine.requests == 1

                # The place follows demand: the router without it is asked (and refuses, which
                # counts as asking) until the next splits give it the place, then it admits.
                loser = places.index(0)
                deadline = time.monotonic() + DEADLINE
                while True:
                    status, answer = await post(loser)
                    if status == 200:
                        break
                    assert status == 429, answer
                    assert time.monotonic() < deadline, "the place never moved to the router asked for it"
                    await asyncio.sleep(0.02)
                moved = [r.limiter.places(key_id, None, 1) for r in routers]
                print("after the other router was asked:", moved)
                assert moved[loser] == 1 and sum(moved) == 1
        finally:
            await close()


async def test_r6_16a_behind_two_routers_the_estimate_is_refused_against_the_whole_tpm(tmp_path):
    from aiohttp import ClientSession

    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        routers, urls, key_id, secret, close = await two_routers(tmp_path, url, Limits(tpm=6000))
        headers = {"Authorization": f"Bearer {secret}"}
        try:
            shares = [r.limiter.share(key_id) for r in routers]
            print("shares of a 6000-token minute:", shares)
            assert max(shares) * 6000 < 4000
            async with ClientSession() as session:
                async def post(which: int, max_tokens: int) -> tuple[int, dict]:
                    body = {"model": "m", "messages": HELLO, "max_tokens": max_tokens}
                    async with session.post(urls[which], json=body, headers=headers) as response:
                        return response.status, await response.json()

                # More than either router's share and less than the whole: admitted once its
                # router's bucket is full (it is), never refused as too large.
                status, answer = await post(0, 4000)
                assert status == 200, answer
                status, answer = await post(1, 6001)  # more than the whole: refused, by a router with a full bucket
                assert status == 429 and "more than the 6000 tokens per minute" in answer["error"]["message"], answer
                assert engine.requests == 1
        finally:
            await close()


async def test_r6_16_two_routers_share_one_keys_limit(tmp_path):
    """Two routers fed by one control plane: together they admit the key's rpm, not twice it."""
    from aiohttp import ClientSession

    rpm = 6000  # 100 a second
    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        routers, urls, key_id, secret, close = await two_routers(tmp_path, url, Limits(rpm=rpm))
        try:
            headers = {"Authorization": f"Bearer {secret}"}
            body = {"model": "m", "messages": HELLO, "max_tokens": 1}
            counts = {"admitted": 0, "refused": 0}
            admitted_by = [0, 0]

            async def hammer(session: ClientSession, which: int, until: float | None) -> bool:
                """Send until `until` (monotonic) or, with None, until the first refusal: then
                whether that refusal was the first answer (the router held nothing)."""
                sent = 0
                while until is None or time.monotonic() < until:
                    async with session.post(urls[which], json=body, headers=headers) as response:
                        await response.read()
                        sent += 1
                        if response.status == 429:
                            if until is None:
                                return sent == 1
                            counts["refused"] += 1
                        else:
                            assert response.status == 200, response.status
                            if until is not None:
                                counts["admitted"] += 1
                                admitted_by[which] += 1
                return True

            async with ClientSession() as session:
                # Spend what the buckets hold, until both routers refuse at once (a router that
                # emptied first would otherwise refill while the other drains, and carry that
                # into the window), then count what both admit for a window.
                await asyncio.gather(*(hammer(session, which, None) for which in (0, 0, 1)))
                while not all(await asyncio.gather(*(hammer(session, which, None) for which in (0, 1)))):
                    pass
                window = 6.0
                started = time.monotonic()
                await asyncio.gather(*(hammer(session, which, started + window) for which in (0, 0, 0, 1)))
                ended = time.monotonic()
                elapsed = ended - started
            expected = rpm * elapsed / 60
            # What the routers still held at the end and nobody asked for in time: on a machine
            # whose cores other work holds, the clients may not keep up with the limit's pace.
            unspent = 0.0
            for router in routers:
                bucket = router.limiter._budgets[(key_id, None)].requests
                bucket.refill(ended)
                unspent += max(0.0, bucket.level)
            shares = {r.feed.router_id: dict(r.snapshot.leases.get(r.feed.router_id, {})) for r in routers}
            print(f"two routers, rpm {rpm}: admitted {counts['admitted']} (a {admitted_by[0]}, b {admitted_by[1]}) "
                  f"in {elapsed:.2f} s, the limit's pace allows {expected:.0f}; refused {counts['refused']}; "
                  f"held unspent at the end {unspent:.0f}; leases {shares}")
            assert counts["refused"] > 0  # both were held back, not merely slow
            assert counts["admitted"] <= 1.1 * expected  # the limit did not multiply with the routers
            assert counts["admitted"] + unspent >= 0.9 * expected  # nor did the split lose it
        finally:
            await close()


async def test_r6_16_a_limited_keys_request_is_refused_before_its_body_is_read(start_router):  # noqa: F811
    from tests.integration.test_router_support import DEADLINE

    engine = Engine()
    async with scripted_engine(engine.chat) as url:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", url, None)]})
        secret = limited_key(gw, "one-a-minute", limits=Limits(rpm=1))
        async with gw.client(secret) as client:
            await client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
        # The headers of a 10 MB request, and none of its body: the router answers without it.
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {10_000_000}\r\n\r\n").encode() + b'{"model": "m", ')
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
        finally:
            writer.close()
        print("answered without the body:", head.split(b"\r\n")[0])
        assert head.startswith(b"HTTP/1.1 429 ")
        assert b"retry-after" in head.lower() and b"x-ratelimit-limit-requests: 1" in head.lower()
        assert engine.requests == 1
