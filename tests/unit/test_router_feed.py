"""The router fed by the router feed only (R-10.1): snapshots, changes, reports, and what it serves before any."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog import Catalog
from llmgw.config import EngineConfig, GatewayConfig, ModelConfig, ProfileConfig, ScalingConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Change, FeedError, GatewaySettings, KeyEntry, RouterCounters, from_wire, to_wire
from llmgw.contracts.keyhash import hash_secret
from llmgw.router import Router
from tests.unit.feedkit import snapshot
from tests.unit.routerkit import RouterTestServer

SECRET = "sk-llmgw-router-feed-test"
KEY = KeyEntry(id="k1", name="test", hash=hash_secret(SECRET), prefix=SECRET[:15], models=None)
AUTH = {"Authorization": f"Bearer {SECRET}"}
PROFILES = {"p": ProfileConfig(engine="vllm"), "c": ProfileConfig(engine="custom")}
ENGINES = {"custom": EngineConfig(command=["my-engine", "--port", "{port}"])}
CATALOG = Catalog.build(file_models=[
    ModelConfig(name="m", profile="p", served_name="m-upstream", routing="prefix", fallback="n"),
    ModelConfig(name="n", profile="c"),
    ModelConfig(name="lazy", profile="p", scaling=ScalingConfig(min=0, max=1))], profiles=PROFILES, engines=ENGINES)


def endpoint(replica: str, model: str = "m", url: str = "http://127.0.0.1:9") -> Endpoint:
    return Endpoint(replica_id=replica, model=model, url=url, api_key=f"engine-key-{replica}")


def change(version: int, **kw) -> Change:
    return Change(epoch="test", version=version, **kw)


@pytest.fixture
async def served():
    """A router on a test server; yields (router, client)."""
    router = Router()
    client = TestClient(RouterTestServer(router))
    await client.start_server()
    try:
        yield router, client
    finally:
        await client.close()


def test_r10_1_a_snapshot_then_a_change_replace_what_the_router_routes_with():
    router = Router()
    first = snapshot(CATALOG, endpoints={"m": [endpoint("r1")]}, keys=[KEY])
    router.apply(first)
    assert router.snapshot is first
    assert [up.replica_id for up in router.balancer.endpoints("m")] == ["r1"]
    assert router.balancer.policy("m") == "prefix"
    assert router.keys.authenticate(AUTH["Authorization"]).id == "k1"
    assert first.models["m"].engine == "vllm" and first.models["n"].engine is None  # a custom engine
    assert first.models["m"].fallbacks == ("n",) and first.models["lazy"].on_demand

    router.apply(change(2, endpoints={"m": (endpoint("r2"),), "n": (endpoint("r3", "n"),)}))
    assert router.snapshot.version == 2
    assert [up.replica_id for up in router.balancer.endpoints("m")] == ["r2"]
    assert [up.replica_id for up in router.balancer.endpoints("n")] == ["r3"]
    router.apply(change(3, endpoints={"n": None}, keys=()))
    assert router.balancer.endpoints("n") == [] and router.balancer.endpoints("m")[0].replica_id == "r2"
    assert len(router.keys) == 0  # keys replaced: the one key is gone

    again = dataclasses.replace(first, epoch="other", version=7)  # another control-plane run: a snapshot replaces all
    router.apply(again)
    assert router.snapshot is again and [up.replica_id for up in router.balancer.endpoints("m")] == ["r1"]


def test_r10_1_a_change_out_of_step_raises_and_changes_nothing():
    router = Router()
    with pytest.raises(FeedError, match="before any snapshot"):
        router.apply(change(2, keys=()))
    first = snapshot(CATALOG, endpoints={"m": [endpoint("r1")]}, keys=[KEY])
    router.apply(first)
    for wrong in (change(3, endpoints={"m": (endpoint("r9"),)}, keys=()),
                  Change(epoch="other", version=2, endpoints={"m": (endpoint("r9"),)}, keys=())):
        with pytest.raises(FeedError, match="does not follow"):
            router.apply(wrong)
        assert router.snapshot is first
        assert [up.replica_id for up in router.balancer.endpoints("m")] == ["r1"] and len(router.keys) == 1


async def test_r6_3_before_a_snapshot_healthz_says_starting_and_requests_get_a_clear_503(served):
    router, client = served
    router.feed.feed_status = {"state": "no-snapshot", "reason": "the control plane is unreachable"}
    health = await client.get("/healthz")
    assert health.status == 503 and await health.json() == {
        "status": "starting", "reason": "the control plane is unreachable", "snapshot_age_s": None}
    refused = await client.post("/v1/chat/completions", headers=AUTH, json={"model": "m", "messages": []})
    body = await refused.json()
    assert refused.status == 503 and body["error"]["code"] == "not_ready"  # not a 401: no key is known yet
    assert refused.headers["Retry-After"].isdigit()
    assert set(body["error"]) == {"message", "type", "code", "param", "request_id"}
    assert body["error"]["request_id"] == refused.headers["X-Request-Id"]
    assert "starting" in body["error"]["message"]
    assert "the control plane is unreachable" in body["error"]["message"]

    router.feed.feed_status = {"transport": "test"}
    router.feed.snapshot_age = lambda: 2.5
    router.apply(snapshot(CATALOG, keys=[KEY]))
    health = await client.get("/healthz")
    assert health.status == 200 and await health.json() == {"status": "ok", "snapshot_age_s": 2.5}
    listed = await client.get("/v1/models", headers=AUTH)
    assert [m["id"] for m in (await listed.json())["data"]] == ["lazy", "m", "n"]


FEED_DETAIL = {"state": "live", "since": None, "reason": None, "snapshot": {"epoch": "test", "version": 1},
               "unacked_reports": 0, "router_id": "routerhost-0-abcd"}


@pytest.mark.parametrize("headers, detail", [
    pytest.param({}, False, id="no-key"),
    pytest.param({"Authorization": "Bearer sk-llmgw-not-a-key"}, False, id="wrong-key"),
    pytest.param({"x-api-key": "sk-llmgw-not-a-key"}, False, id="wrong-x-api-key"),
    pytest.param(AUTH, True, id="valid-key"),
    pytest.param({"x-api-key": SECRET}, True, id="valid-x-api-key"),
])
async def test_r10_2_healthz_says_ready_and_the_snapshot_age_and_names_the_router_only_to_a_key(served, headers,
                                                                                                detail):
    router, client = served
    router.feed.router_id = "routerhost-0-abcd"
    router.feed.feed_status = FEED_DETAIL
    router.feed.snapshot_age = lambda: 1.25
    router.apply(snapshot(CATALOG, keys=[KEY]))
    health = await client.get("/healthz", headers=headers)
    body = await health.json()
    assert health.status == 200
    if detail:
        assert body == {"status": "ok", "snapshot_age_s": 1.25, "router_id": "routerhost-0-abcd", "feed": FEED_DETAIL}
    else:
        assert body == {"status": "ok", "snapshot_age_s": 1.25}
        assert "routerhost" not in await health.text()


async def test_r10_1_a_new_max_body_applies_to_the_next_request(served):
    router, client = served
    router.apply(snapshot(CATALOG, keys=[KEY], gateway=GatewayConfig(max_body=200)))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300}]}).encode()
    refused = await client.post("/v1/chat/completions", headers=AUTH, data=body)
    assert refused.status == 413 and (await refused.json())["error"]["code"] == "request_too_large"

    async def chunks():
        yield body[:100]
        yield body[100:]
    refused = await client.post("/v1/chat/completions", headers=AUTH, data=chunks())  # no Content-Length
    assert refused.status == 413

    router.apply(change(2, gateway=GatewaySettings(max_body=10_000, request_timeout=600.0, on_demand_wait=120.0)))
    accepted = await client.post("/v1/chat/completions", headers=AUTH, data=chunks())
    assert accepted.status == 503 and (await accepted.json())["error"]["code"] == "no_capacity"  # read, then routed


@pytest.mark.parametrize("how", ["change", "snapshot"])
async def test_r10_1_abandon_sends_a_waiting_request_elsewhere(served, how):
    """By the change that abandons the replica, or by the snapshot a router gets in place of the
    changes it missed (it fell behind, or was away), which names the replicas last given up."""
    router, client = served
    arrived = asyncio.Event()

    async def hang(request):
        arrived.set()
        await asyncio.sleep(3600)

    async def answer(request):
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})

    engines = []
    for handler in (hang, answer):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        engine = TestServer(app)
        await engine.start_server()
        engines.append(engine)
    try:
        hung, live = (endpoint(name, url=str(engine.make_url("")).rstrip("/")) for name, engine in
                      zip(("hung", "live"), engines))
        router.apply(snapshot(CATALOG, endpoints={"m": [hung]}, keys=[KEY]))
        waiting = asyncio.create_task(client.post("/v1/chat/completions", headers=AUTH,
                                                  json={"model": "m", "messages": []}))
        await asyncio.wait_for(arrived.wait(), 10)
        assert router.report_fields()["inflight"] == {"hung": 1}
        if how == "change":
            router.apply(change(2, endpoints={"m": (live,)}, abandon=("hung",)))
        else:
            later = dataclasses.replace(snapshot(CATALOG, endpoints={"m": [live]}, keys=[KEY], version=7),
                                        abandoned=("gone-before", "hung"))
            router.apply(from_wire(json.loads(json.dumps(to_wire(later)))))
        reply = await asyncio.wait_for(waiting, 10)
        assert reply.status == 200
        fields = router.report_fields()
        assert fields["inflight"] == {} and set(fields["last_used"]) == {"live"}  # kept for listed replicas
    finally:
        for engine in engines:
            await engine.close()


async def test_r10_1_report_fields_hand_counted_parts_over_once(served):
    router, client = served
    assert router.report_fields() == {"usage": (), "key_use": {}, "last_used": {}, "inflight": {},
                                      "engine_load": {}, "demand": (), "snapshot": None,
                                      "counters": RouterCounters(), "asked": {}, "homes": {}, "requests": (), "adapter_use": {}}
    asked = []
    router.feed.on_demand = lambda: asked.append(1)
    router.apply(snapshot(CATALOG, keys=[KEY], gateway=GatewayConfig(on_demand_wait=0.05)))
    for _ in range(2):
        loading = await client.post("/v1/chat/completions", headers=AUTH, json={"model": "lazy", "messages": []})
        assert loading.status == 503 and (await loading.json())["error"]["code"] == "model_loading"
    router.usage.add("k1", "m", 3, 4)
    fields = router.report_fields()
    assert fields["demand"] == ("lazy",) and len(asked) == 2  # told at once, each time; reported once
    assert [(u.key_id, u.model, u.requests, u.prompt_tokens, u.completion_tokens) for u in fields["usage"]] == \
        [("k1", "m", 1, 3, 4)]
    assert set(fields["key_use"]) == {"k1"} and fields["snapshot"] == ("test", 1)
    assert [(r.status, r.error, r.model) for r in fields["requests"]] == [(503, "model_loading", "lazy")] * 2
    again = router.report_fields()
    assert again["usage"] == () and again["key_use"] == {} and again["demand"] == () and again["requests"] == ()
    assert again["snapshot"] == ("test", 1)
