"""Faults between the router and the engines: retries, ejection, fallbacks, on-demand, cancellation.

R-6.5 to R-6.8 and R-6.11, with engine doubles as real processes on loopback ports.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx2
import openai
import pytest

from llmgw.config import GatewayConfig
from llmgw.router import Endpoint
from tests.integration.test_router_support import (apoll, catalog, engines, free_port, model, refusing_port,  # noqa: F401
                                                   start_router)

HELLO = [{"role": "user", "content": "hello"}]


def dead_endpoint(name: str, port: int | None = None) -> Endpoint:
    """An endpoint whose port nothing listens on: connections are refused."""
    return Endpoint(replica_id=f"dead-{name}", model=name, url=f"http://127.0.0.1:{port or refusing_port()}",
                    api_key="k")


def metric(gw, name: str, **labels) -> float:
    return gw.registry.get_sample_value(name, labels) or 0


async def test_r6_5_least_outstanding_spreads_concurrent_streams(engines, start_router):  # noqa: F811
    a = engines.start("m", token_delay=0.02)
    b = engines.start("m", token_delay=0.02)
    gw = await start_router(catalog(model("m")), {"m": [a.endpoint("ra"), b.endpoint("rb")]})
    async with gw.client() as client:
        async def one():
            stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=20)
            return [c async for c in stream]
        await asyncio.gather(*(one() for _ in range(6)))
    assert a.counters()["requests"] == 3 and b.counters()["requests"] == 3
    assert set(await gw.take_last_used()) == {"ra", "rb"}


async def test_r7_1_last_used_absent_until_used(engines, start_router):  # noqa: F811
    a = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [a.endpoint("ra")]})
    assert await gw.take_last_used() == {}  # unknown is not idle: absent, not zero
    before = time.time()
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=HELLO)
    used = await gw.take_last_used()
    assert set(used) == {"ra"} and before <= used["ra"] <= time.time()


async def test_r6_6_dead_first_endpoint_is_retried_elsewhere_and_ejected(engines, start_router):  # noqa: F811
    live = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [dead_endpoint("m"), live.endpoint("live")]})
    gw.router.balancer.eject_seconds = 3600  # stays ejected for the whole test
    async with gw.client() as client:
        for _ in range(4):
            answer = await client.chat.completions.create(model="m", messages=HELLO)
            assert answer.choices[0].message.content.startswith("m heard")
    assert live.counters()["requests"] == 4
    assert metric(gw, "llmgw_router_retries_total", model="m") == 1  # only the first request met it
    assert metric(gw, "llmgw_router_ejections_total", model="m") == 1


async def test_r6_6_engine_503_is_retried_and_ejected(engines, start_router):  # noqa: F811
    failing = engines.start("m", fail_requests=1)
    live = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [failing.endpoint("failing"), live.endpoint("live")]})
    gw.router.balancer.eject_seconds = 3600
    async with gw.client() as client:
        for _ in range(3):
            stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
            assert [c async for c in stream]
    assert failing.counters()["requests"] == 0  # the double counts only requests it served
    assert live.counters()["requests"] == 3
    assert metric(gw, "llmgw_router_ejections_total", model="m") == 1


async def test_r6_6_ejected_endpoint_recovers_after_cool_down(engines, start_router):  # noqa: F811
    port = free_port()
    live = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [dead_endpoint("m", port), live.endpoint("live")]})
    gw.router.balancer.eject_seconds = 0.2
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=HELLO)
        assert metric(gw, "llmgw_router_ejections_total", model="m") == 1
        revived = engines.start("m", port=port, key="k")

        async def revived_serves():
            await client.chat.completions.create(model="m", messages=HELLO)
            return revived.counters()["requests"] > 0
        await apoll(revived_serves, what="the revived endpoint to get traffic again")


async def test_r6_6_all_attempts_failing_is_502(start_router):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": [dead_endpoint("m"), dead_endpoint("m")]})
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="m", messages=HELLO)
    assert failed.value.status_code == 502
    assert "after 2 attempts" in failed.value.message


async def test_r6_6_nothing_is_retried_after_the_first_byte(engines, start_router):  # noqa: F811
    first = engines.start("m", token_delay=0.05)
    second = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [first.endpoint("first"), second.endpoint("second")]})
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=400)
        received = []
        with pytest.raises((openai.APIError, httpx2.HTTPError)) as broken:
            async for chunk in stream:
                received.append(chunk)
                if len(received) == 2:
                    first.kill()  # the engine dies in the middle of the answer
    assert 2 <= len(received) < 400
    assert "incomplete" in str(broken.value)  # told, not left with a silently short answer
    assert second.counters()["requests"] == 0  # not replayed elsewhere
    assert metric(gw, "llmgw_router_retries_total", model="m") == 0


@pytest.mark.parametrize("cancellation", [
    pytest.param(True, id="handler-cancellation"),
    pytest.param(False, id="noticed-at-next-write"),
])
async def test_r6_11_client_disconnect_cancels_the_upstream(engines, start_router, monkeypatch,  # noqa: F811
                                                            cancellation):
    if not cancellation:  # the second line of defence: the failed write to the client
        from llmgw.router import listener
        settings = {k: v for k, v in listener.SERVER_SETTINGS.items() if k != "handler_cancellation"}
        monkeypatch.setattr(listener, "SERVER_SETTINGS", settings)
    engine = engines.start("m", token_delay=0.05)
    # The router's runner carries the server settings it needs, whoever serves it.
    gw = await start_router(catalog(model("m")), {"m": [engine.endpoint("r")]})
    body = {"model": "m", "messages": HELLO, "stream": True, "max_tokens": 400}
    async with aiohttp.ClientSession() as session:
        response = await session.post(gw.url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {gw.secret}"})
        assert response.status == 200
        assert await response.content.readany()
        response.close()  # the client goes away mid-stream
    await apoll(lambda: engine.counters().get("aborted") == 1, what="the engine to see the stream aborted")
    await apoll(lambda: gw.router.outstanding("r") == 0, what="the request to be released")


async def test_r6_7_fallback_used_when_model_has_no_serving_replica(engines, start_router):  # noqa: F811
    small = engines.start("small")
    gw = await start_router(catalog(model("big", fallback="small"), model("small")), {"small": [small.endpoint()]})
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="big", messages=HELLO)
    assert answer.model == "small"  # the engine of the fallback answered, under its own name
    assert small.counters()["requests"] == 1


async def test_r6_7_fallback_used_when_every_endpoint_fails(engines, start_router):  # noqa: F811
    small = engines.start("small")
    gw = await start_router(catalog(model("big", fallback="small"), model("small")),
                            {"big": [dead_endpoint("big")], "small": [small.endpoint()]})
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="big", messages=HELLO)
    assert answer.model == "small"


async def test_r6_7_fallback_not_used_when_model_serves(engines, start_router):  # noqa: F811
    big = engines.start("big")
    small = engines.start("small")
    gw = await start_router(catalog(model("big", fallback="small"), model("small")),
                            {"big": [big.endpoint()], "small": [small.endpoint()]})
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="big", messages=HELLO)
    assert answer.model == "big"
    assert small.counters()["requests"] == 0


async def test_r6_7_a_fallback_the_key_may_not_use_is_skipped(engines, start_router):  # noqa: F811
    """big -> mid -> small, for a key allowed big and small: mid serves, yet small answers."""
    mid = engines.start("mid")
    small = engines.start("small")
    gw = await start_router(catalog(model("big", fallback="mid"), model("mid", fallback="small"), model("small")),
                            {"mid": [mid.endpoint()], "small": [small.endpoint()]})
    secret = gw.key("big-and-small", ["big", "small"])
    async with gw.client(secret) as client:
        answer = await client.chat.completions.create(model="big", messages=HELLO)
    assert answer.model == "small"
    assert (mid.counters()["requests"], small.counters()["requests"]) == (0, 1)


@pytest.mark.parametrize("big_endpoints,status,code", [
    pytest.param("none", 503, "no_capacity", id="no-replica"),
    pytest.param("dead", 502, "upstream_unavailable", id="every-endpoint-fails"),
])
async def test_r6_7_no_allowed_fallback_left_is_the_models_own_failure(engines, start_router,  # noqa: F811
                                                                       big_endpoints, status, code):
    small = engines.start("small")
    endpoints = {"small": [small.endpoint()]}
    if big_endpoints == "dead":
        endpoints["big"] = [dead_endpoint("big")]
    gw = await start_router(catalog(model("big", fallback="small"), model("small")), endpoints)
    secret = gw.key("only-big", ["big"])
    async with gw.client(secret) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="big", messages=HELLO)
    assert (refused.value.status_code, refused.value.code) == (status, code)
    assert "'big'" in refused.value.message and "small" not in refused.value.message
    assert small.counters()["requests"] == 0


async def test_r6_8_on_demand_waits_rather_than_use_a_fallback_the_key_may_not(engines, start_router):  # noqa: F811
    small = engines.start("small")
    asked = []
    gw = await start_router(catalog(model("lazy", on_demand=True, fallback="small"), model("small")),
                            {"small": [small.endpoint()]}, on_demand=asked.append,
                            gateway=GatewayConfig(on_demand_wait=0.2))
    secret = gw.key("only-lazy", ["lazy"])
    async with gw.client(secret) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="lazy", messages=HELLO)
    assert refused.value.code == "model_loading"
    await apoll(lambda: asked == ["lazy"], what="the demand for lazy to reach the control plane")
    assert small.counters()["requests"] == 0


async def test_r6_8_on_demand_request_waits_for_the_replica(engines, start_router):  # noqa: F811
    asked = []
    holder = {}

    def on_demand(name):  # a stand-in control plane: start a replica, then push it
        asked.append(name)

        async def start():
            engine = await asyncio.to_thread(engines.start, name)
            holder["gw"].set_endpoints({name: [engine.endpoint("od-1")]})
        asyncio.get_running_loop().create_task(start())

    gw = holder["gw"] = await start_router(catalog(model("lazy", on_demand=True)), on_demand=on_demand)
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="lazy", messages=HELLO)
    assert answer.model == "lazy"
    assert asked == ["lazy"]
    assert set(await gw.take_last_used()) == {"od-1"}


async def test_r6_8_on_demand_timeout_is_503_with_retry_after(start_router):  # noqa: F811
    asked = []
    gw = await start_router(catalog(model("lazy", on_demand=True)), on_demand=asked.append,
                            gateway=GatewayConfig(on_demand_wait=0.2))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="lazy", messages=HELLO)
    assert refused.value.status_code == 503
    assert refused.value.code == "model_loading"
    assert int(refused.value.response.headers["Retry-After"]) > 0
    await apoll(lambda: asked == ["lazy"], what="the demand for lazy to reach the control plane")


async def test_r6_8_fallback_serves_while_on_demand_model_loads(engines, start_router):  # noqa: F811
    small = engines.start("small")
    asked = []
    gw = await start_router(catalog(model("lazy", on_demand=True, fallback="small"), model("small")),
                            {"small": [small.endpoint()]}, on_demand=asked.append)
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="lazy", messages=HELLO)
    assert answer.model == "small"
    # The replica is still asked for: the demand travels in the router's next report, sent at once.
    await apoll(lambda: asked == ["lazy"], what="the demand for lazy to reach the control plane")


async def test_r6_10_static_endpoints_need_no_control_plane(engines, start_router, monkeypatch):  # noqa: F811
    from llmgw.catalog import Catalog
    from llmgw.config import ModelConfig, StaticEndpoint

    engine = engines.start("upstream-name")
    monkeypatch.setenv("STATIC_ENGINE_KEY", engine.key)
    cat = Catalog.build(file_models=[ModelConfig(
        name="static", served_name="upstream-name",
        endpoints=[StaticEndpoint(url=engine.url + "/", api_key_env="STATIC_ENGINE_KEY")])])
    gw = await start_router(cat)
    gw.set_endpoints({"static": []})  # a push does not replace static endpoints
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="static", messages=HELLO)
    assert answer.model == "upstream-name"  # the request was rewritten to the engine's name
    assert engine.counters()["requests"] == 1


async def test_r6_6_engine_silent_before_the_first_byte_is_504_not_retried(engines, start_router):  # noqa: F811
    hung = engines.start("m", healthy=False, bind_early=1, start_delay=600)  # accepts connections, answers nothing
    live = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [hung.endpoint("hung"), live.endpoint("live")]},
                            gateway=GatewayConfig(request_timeout=0.3))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="m", messages=HELLO)
    assert failed.value.status_code == 504 and failed.value.code == "upstream_timeout"
    assert live.counters()["requests"] == 0  # the engine may still be working: not sent twice


async def test_r6_6_engine_silent_mid_stream_ends_the_stream_with_an_error(engines, start_router):  # noqa: F811
    slow = engines.start("m", token_delay=30)  # the first event at once, then silence
    gw = await start_router(catalog(model("m")), {"m": [slow.endpoint("slow")]},
                            gateway=GatewayConfig(request_timeout=0.3))
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
        received = []
        with pytest.raises((openai.APIError, httpx2.HTTPError)) as broken:
            async for chunk in stream:
                received.append(chunk)
    assert len(received) == 1
    assert "silent" in str(broken.value)
    await apoll(lambda: gw.router.outstanding("slow") == 0, what="the request to be released")


async def test_engine_refusing_the_replica_key_is_not_the_clients_401(engines, start_router):  # noqa: F811
    engine = engines.start("m")
    wrong = Endpoint("r", "m", engine.url, "not-the-engine-key")
    gw = await start_router(catalog(model("m")), {"m": [wrong]})
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="m", messages=HELLO)
    assert failed.value.status_code == 502 and failed.value.code == "upstream_auth_failed"


async def test_r6_8_on_demand_without_a_control_plane_does_not_wait(start_router):  # noqa: F811
    gw = await start_router(catalog(model("lazy", on_demand=True)), gateway=GatewayConfig(on_demand_wait=3600))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="lazy", messages=HELLO)
    assert refused.value.code == "no_capacity"


async def test_requests_waiting_on_a_given_up_replica_go_elsewhere(engines, start_router):  # noqa: F811
    """A replica whose node is cut off answers nothing; once the control plane gives it up, a
    request waiting for its first byte is retried on another replica (R-6.6), not held for
    request_timeout."""
    hung = engines.start("m", healthy=False, bind_early=1, start_delay=600)  # accepts, answers nothing
    live = engines.start("m")
    gw = await start_router(catalog(model("m")), {"m": [hung.endpoint("hung")]},
                            gateway=GatewayConfig(request_timeout=120))
    async with gw.client() as client:
        waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
        await apoll(lambda: gw.router.outstanding("hung") == 1, what="the request to wait on the hung replica")
        gw.set_endpoints({"m": [live.endpoint("live")]})
        assert await gw.abandon("hung") == 1
        reply = await asyncio.wait_for(waiting, 30)
    assert "m" in reply.choices[0].message.content
    assert live.counters()["requests"] == 1


async def test_a_stream_on_a_given_up_replica_ends_with_an_error(engines, start_router):  # noqa: F811
    slow = engines.start("m", token_delay=30)  # the first event at once, then silence
    gw = await start_router(catalog(model("m")), {"m": [slow.endpoint("slow")]},
                            gateway=GatewayConfig(request_timeout=120))
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
        received = [await stream.__anext__()]
        assert await gw.abandon("slow") == 1
        with pytest.raises((openai.APIError, httpx2.HTTPError)) as broken:
            async for chunk in stream:
                received.append(chunk)
    assert len(received) == 1 and "incomplete" in str(broken.value)
    await apoll(lambda: gw.router.outstanding("slow") == 0, what="the request to be released")


async def test_r6_6_a_pooled_connection_the_engine_dropped_is_not_a_failed_request(start_router):  # noqa: F811
    """llama-server closes keep-alive connections without `Connection: close` (a stream's, or one
    served by an extra HTTP thread). An engine that answers the first request of a connection and
    drops the connection at the second: with one replica, every request must still be answered."""
    connections = []
    answer = (b'{"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", '
              b'"message": {"role": "assistant", "content": "hi"}}], "usage": {"prompt_tokens": 1, '
              b'"completion_tokens": 1, "total_tokens": 2}}')

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served:
                    break  # the second request on this connection: dropped, unanswered
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(answer) + answer)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_router(catalog(model("m")), {"m": [Endpoint("r", "m", f"http://127.0.0.1:{port}", None)]})
        async with gw.client() as client:
            # Requests at once leave several connections in the router's pool, each of which the
            # engine drops at its next use: a resend must not take another of them.
            await asyncio.gather(*(client.chat.completions.create(model="m", messages=HELLO) for _ in range(4)))
            for n in range(5):
                reply = await client.chat.completions.create(model="m", messages=HELLO)
                assert reply.choices[0].message.content == "hi", n
        assert len(connections) >= 5  # each reused connection was dropped and a new one made
    finally:
        server.close()
        await server.wait_closed()
