"""LoRA adapters in the router (R-8.8): an adapter's pool is the replicas of its base that hold
it, sharing their load with the base's; the body each engine is sent selects the adapter its own
way (vLLM by name, llama-server by the `lora` scales); a key reaches an adapter only when allowed
on the adapter's own name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import KeyEntry, RoutedModel
from llmgw.router.balancer import LEAST_OUTSTANDING, PREFIX, Balancer, Upstream, canary_draw, ring_hash
from llmgw.router.errors import ModelNotFound
from llmgw.router.exchange import Exchange
from llmgw.router.intake import Intake
from llmgw.router.routes import ROUTES
from llmgw.router.trail import Trail

CHAT = next(r for r in ROUTES if r.path == "/v1/chat/completions")


def endpoint(replica: str, adapters: tuple[str, ...] = (), model: str = "base", canary: int | None = None) -> Endpoint:
    return Endpoint(replica, model, f"http://{replica}.test:20000", "k",
                    adapters=adapters, canary=canary)


def models(engine: str = "vllm") -> dict[str, RoutedModel]:
    base = RoutedModel("base", engine, "org/base-8b", LEAST_OUTSTANDING, False, fallbacks=("other",))
    return {"base": base,
            "bot": RoutedModel("bot", engine, "bot-served", LEAST_OUTSTANDING, False, adapter_of="base"),
            "legal": RoutedModel("legal", engine, None, LEAST_OUTSTANDING, False, adapter_of="base"),
            "other": RoutedModel("other", engine, None, LEAST_OUTSTANDING, False)}


def balancer(members, policy=LEAST_OUTSTANDING) -> Balancer:
    b = Balancer()
    b.replace({"base": members}, {"base": policy})
    return b


def test_r8_8_an_adapter_is_served_only_by_replicas_of_its_base_that_hold_it():
    b = balancer([endpoint("r0"), endpoint("r1", ("bot",)), endpoint("r2", ("legal", "bot"))])
    chosen = set()
    for _ in range(6):
        up = b.acquire("bot", 1.0)
        chosen.add(up.replica_id)
        b.release(up)
    assert chosen == {"r1", "r2"}
    assert [up.replica_id for up in b.endpoints("legal")] == ["r2"]
    assert b.acquire("nobody-holds-it", 1.0) is None and not b.has_endpoints("nobody-holds-it")
    # The base's pool is every replica, adapters held or not (an adapter being rolled out).
    assert {up.replica_id for up in b.endpoints("base")} == {"r0", "r1", "r2"}


def test_r8_8_an_adapters_requests_and_its_bases_share_one_load():
    b = balancer([endpoint("r0"), endpoint("r1", ("bot",)), endpoint("r2", ("bot",))])
    busy = b.acquire("bot", 1.0)
    assert b.outstanding(busy.replica_id) == 1
    other = b.acquire("bot", 1.0)  # the least loaded holder: the other one
    assert other.replica_id != busy.replica_id
    b.release(busy)
    # A base request sees the adapter request in flight on `other`.
    picks = {b.acquire("base", 1.0).replica_id for _ in range(2)}
    assert other.replica_id not in picks
    # Retries exclude what was tried: the other holder, then none.
    assert b.acquire("bot", 2.0, exclude=[other]).replica_id == busy.replica_id
    assert b.acquire("bot", 2.0, exclude=[other, busy]) is None
    assert len(b.upstreams()) == 3  # each endpoint listed (and polled) once


def test_r8_8_an_adapter_follows_its_bases_policy_and_keeps_its_pool_across_lists():
    members = [endpoint("r0", ("bot",)), endpoint("r1", ("bot",)), endpoint("r2")]
    b = balancer(members, PREFIX)
    assert b.policy("bot") == PREFIX
    up = b.acquire("bot", 1.0, key=b"conversation-1")
    home = up.replica_id
    b.release(up)
    assert b.live_keys("bot") == {home: 1} and b.live_keys("base") == {}
    b.replace({"base": members}, {"base": PREFIX})  # the same lists again: the adapter's homes stay
    assert b.live_keys("bot") == {home: 1}
    assert b.take_homes() == {"bot": {ring_hash(b"conversation-1"): home}}  # reported under the adapter
    b.replace({"base": [members[0], members[2]]}, {"base": PREFIX})
    assert [up.replica_id for up in b.endpoints("bot")] == ["r0"]
    b.replace({"base": [endpoint("r0"), members[2]]}, {"base": PREFIX})  # r0 restarted without it
    assert not b.has_endpoints("bot") and b.has_endpoints("base")


def test_r8_8_the_control_planes_home_for_an_adapters_key_is_followed():
    b = balancer([endpoint("r0", ("bot",)), endpoint("r1", ("bot",)), endpoint("r2")], PREFIX)
    point = ring_hash(b"conversation-2")
    for replica in ("r0", "r1"):
        b.set_homes({"bot": {point: replica}}, 1.0)
        up = b.acquire("bot", 1.0, key=b"conversation-2", owner="k")
        assert up.replica_id == replica
        b.release(up)


def test_r8_8_an_adapter_takes_its_bases_canary_split():
    b = balancer([endpoint("r0", ("bot",)), endpoint("r1", ("bot",), canary=30), endpoint("r2", canary=30)])
    assert b.has_canary("bot") and b.has_canary("base")
    for i in range(20):  # a conversation's draw sends it to the canary's holder or to the other
        key = b"conversation-%d" % i
        up = b.acquire("bot", 1.0, key=key)
        assert up.replica_id == ("r1" if canary_draw(key) < 30 else "r0")
        b.release(up)
    only_new = balancer([endpoint("r0"), endpoint("r1", ("bot",), canary=30)])
    assert not only_new.has_canary("bot")  # its one holder serves it all


def exchange(model: str, engine: str, document: dict | None = None, via: str = "") -> Exchange:
    named = models(engine)
    document = document or {"model": via or model, "messages": [{"role": "user", "content": "hi"}]}
    return Exchange(CHAT, named[model], KeyEntry("k", "k", "0" * 64, "sk", None), named, document,
                    json.dumps(document).encode(), False, False, False, None, None, None,
                    Trail("id", None, 0.0, 0.0), via)


@pytest.mark.parametrize(("model", "adapters", "sent"), [
    pytest.param("bot", ("bot",), "bot-served", id="adapter-by-served-name"),
    pytest.param("legal", ("bot", "legal"), "legal", id="adapter-without-served-name"),
    pytest.param("base", ("bot",), "org/base-8b", id="base-on-a-replica-with-adapters"),
])
def test_r8_8_vllm_is_sent_the_adapters_name_as_model(model, adapters, sent):
    body = json.loads(exchange(model, "vllm").upstream_body(Upstream(endpoint("r", adapters))))
    assert body["model"] == sent and "lora" not in body


@pytest.mark.parametrize(("model", "adapters", "scales"), [
    pytest.param("bot", ("legal", "bot"), [0.0, 1.0], id="adapter-at-its-launch-position"),
    pytest.param("legal", ("legal", "bot"), [1.0, 0.0], id="other-adapter"),
    pytest.param("base", ("legal", "bot"), [0.0, 0.0], id="base-with-every-adapter-off"),
])
def test_r8_8_llama_server_is_sent_the_base_name_and_every_adapters_scale(model, adapters, scales):
    document = {"model": model, "messages": [{"role": "user", "content": "hi"}], "lora": [{"id": 1, "scale": 1}]}
    body = json.loads(exchange(model, "llama-server", document).upstream_body(Upstream(endpoint("r", adapters))))
    assert body["model"] == "org/base-8b"
    assert body["lora"] == [{"id": i, "scale": s} for i, s in enumerate(scales)]  # the client's replaced
    assert body["messages"] == document["messages"]


def test_r8_8_the_common_path_sends_the_clients_body_as_it_is():
    ex = exchange("other", "llama-server", {"model": "other", "messages": [], "lora": [{"id": 0, "scale": 1}]})
    assert ex.upstream_body(Upstream(endpoint("r", (), "other"))) is ex.body


def intake() -> Intake:
    return Intake(SimpleNamespace(models=models()), None, None)  # resolve reads only the feed's models


@pytest.mark.parametrize(("allowed", "may_use"), [
    pytest.param(None, True, id="every-model"),
    pytest.param({"bot"}, True, id="on-the-adapter"),
    pytest.param({"base"}, False, id="on-the-base-only"),
    pytest.param({"legal"}, False, id="on-another-adapter"),
])
def test_r8_8_a_key_reaches_an_adapter_only_when_allowed_on_its_name(allowed, may_use):
    key = KeyEntry("k", "k", "0" * 64, "sk", None if allowed is None else frozenset(allowed))
    if may_use:
        assert intake().resolve("bot", key).adapter_of == "base"
        return
    with pytest.raises(ModelNotFound) as refused:
        intake().resolve("bot", key)
    with pytest.raises(ModelNotFound) as unknown:
        intake().resolve("no-such-model", key)
    assert (refused.value.status, refused.value.code) == (unknown.value.status, unknown.value.code)
    assert refused.value.message == unknown.value.message.replace("no-such-model", "bot")
