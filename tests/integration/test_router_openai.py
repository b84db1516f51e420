"""The router through the official openai client: every route and every refusal (R-6.1, R-6.2)."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from llmgw.config import GatewayConfig
from tests.integration.test_router_support import (catalog, model, shared_engines,  # noqa: F401
                                                   start_router)

CATALOG = catalog(model("m1"), model("m2"), model("idle"))


@pytest.fixture
async def gw(shared_engines, start_router):  # noqa: F811
    if not shared_engines.started:
        shared_engines.start("m1")
        shared_engines.start("m2")
    m1, m2 = shared_engines.started[:2]
    return await start_router(CATALOG, {"m1": [m1.endpoint()], "m2": [m2.endpoint()]},
                              gateway=GatewayConfig(max_body=4096))


async def test_r6_1_chat_completion(gw):
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hello there"}])
    assert answer.model == "m1"
    assert answer.choices[0].message.content.startswith("m1 heard 2 words")
    assert answer.usage.prompt_tokens == 2 and answer.usage.completion_tokens == 8


async def test_r6_1_chat_completion_streamed(gw):
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="m2", stream=True,
                                                      messages=[{"role": "user", "content": "one two three"}])
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("m2 heard 3 words")
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_r6_1_completions_and_embeddings(gw):
    async with gw.client() as client:
        completion = await client.completions.create(model="m1", prompt="a b c d", max_tokens=5)
        embedding = await client.embeddings.create(model="m2", input=["one", "two words"])
    assert completion.choices[0].text == "m1 heard 4 words la"
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 8
    assert embedding.usage.prompt_tokens == 3


async def test_r6_1_models_list(gw):
    async with gw.client() as client:
        models = [m.id async for m in client.models.list()]
        one = await client.models.retrieve("m2")
    assert models == ["idle", "m1", "m2"]
    assert one.id == "m2"


async def test_r6_2_key_limited_to_some_models(gw):
    secret = gw.key("only-m1", ["m1"])
    async with gw.client(secret) as client:
        assert [m.id async for m in client.models.list()] == ["m1"]
        answer = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        assert answer.model == "m1"
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("m2")
    assert refused.value.code == "model_not_found"


async def test_r6_1_a_model_the_key_may_not_use_is_answered_as_one_that_does_not_exist(gw):
    """The same status, code and message (the name aside) as an unknown model: a key cannot tell
    which models exist by asking for them, through any route or dialect."""
    secret = gw.key("only-m1", ["m1"])
    headers = {"Authorization": f"Bearer {secret}"}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async def ask(method: str, path: str, body: dict | None = None) -> tuple[int, str]:
            async with session.request(method, gw.url + path, json=body, headers=headers) as response:
                # Each answer names its own request: the one difference allowed.
                return response.status, (await response.text()).replace(response.headers["X-Request-Id"], "ID")
        for method, path, body in (("POST", "/v1/chat/completions", {"model": "{}", **chat}),
                                   ("GET", "/v1/models/{}", None),
                                   ("POST", "/v1/messages", {"model": "{}", **chat})):
            answers = set()
            for name in ("m2", "no-such-model"):
                status, text = await ask(method, path.format(name),
                                         None if body is None else {**body, "model": name})
                answers.add((status, text.replace(name, "NAME")))
            assert len(answers) == 1, answers
            status, text = answers.pop()
            assert status == 404 and ("model_not_found" in text or "not_found_error" in text), text


@pytest.mark.parametrize("secret", [
    pytest.param("", id="missing"),
    pytest.param("sk-llmgw-not-a-key", id="unknown"),
    pytest.param("revoked", id="revoked"),
])
async def test_r6_1_bad_key_is_401(gw, secret):
    if secret == "revoked":
        from llmgw.keys import revoke_key
        secret = gw.key("to-revoke")
        gw.store.write_sync(lambda db: revoke_key(db, "to-revoke"))
        gw.reload_keys()  # the feed carries the keys in force only: a revoked one is unknown
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="placeholder", max_retries=0,
                                  default_headers={"Authorization": f"Bearer {secret}" if secret else ""}) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
    assert refused.value.code == "invalid_api_key"
    body = refused.value.body
    assert set(body) == {"message", "type", "code", "param", "request_id"}
    if secret.startswith("sk-llmgw-") and secret != "sk-llmgw-not-a-key":  # revoked: absent from the feed
        assert body["message"] == "invalid API key"


async def test_r6_1_unknown_model_is_404(gw):
    async with gw.client() as client:
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
    assert refused.value.code == "model_not_found"
    assert "GET /v1/models" in refused.value.message


async def test_r6_1_empty_model_is_400(gw):
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])
    assert "'model' is required" in refused.value.message


async def test_r6_1_too_large_is_413(gw):
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x" * 5000}])
    assert refused.value.status_code == 413
    assert refused.value.code == "request_too_large"


async def test_r6_1_model_without_replica_is_503_with_retry_after(gw):
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="idle", messages=[{"role": "user", "content": "x"}])
    assert refused.value.status_code == 503
    assert int(refused.value.response.headers["Retry-After"]) > 0
    assert refused.value.code == "no_capacity"


@pytest.mark.parametrize("body,headers,status,fragment", [
    pytest.param(b"{not json", {}, 400, "not valid JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", {}, 400, "JSON object", id="not-an-object"),
    pytest.param(b'{"messages": []}', {}, 400, "'model' is required", id="missing-model"),
    pytest.param(b'{"model": 3}', {}, 400, "'model' is required", id="model-not-a-string"),
    pytest.param(b"\xff\xfe", {}, 400, "not valid JSON", id="not-utf8"),
    pytest.param(b"model=m1", {"Content-Type": "application/x-www-form-urlencoded"}, 400, "not valid JSON",
                 id="form-encoded"),
])
async def test_r6_1_malformed_bodies_are_400(gw, body, headers, status, fragment):
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", data=body,
                                headers={"Authorization": f"Bearer {gw.secret}", **headers}) as response:
            document = await response.json()
    assert response.status == status
    assert fragment in document["error"]["message"]
    assert document["error"]["type"] == "invalid_request_error"


async def test_r6_1_oversize_body_without_length_is_413(gw):
    """A chunked body has no Content-Length: the limit is enforced while reading."""
    async def body():
        for _ in range(10):
            yield b'{"model": "m1", "pad": "' + b"x" * 1000 + b'"}'

    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", data=body(),
                                headers={"Authorization": f"Bearer {gw.secret}"}) as response:
            document = json.loads(await response.read())
    assert response.status == 413
    assert document["error"]["code"] == "request_too_large"


async def test_r6_1_wrong_method_is_openai_json(gw):
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/v1/chat/completions",
                               headers={"Authorization": f"Bearer {gw.secret}"}) as response:
            document = await response.json()
    assert response.status == 405
    assert document["error"]["code"] == "method_not_allowed"


async def test_r6_1_engine_errors_pass_through(gw):
    """A refusal by the engine itself (here: a chat without messages) reaches the client as is."""
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m1", messages=[])
    assert "messages" in refused.value.message


async def test_r9_7_metrics_count_requests_and_tokens(gw):
    async with gw.client() as client:
        await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "a b"}])
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    registry = gw.registry
    assert registry.get_sample_value("llmgw_router_requests_total", {"model": "m1", "code": "2xx"}) == 1
    # An unknown model is never a label: the client's string would be unbounded cardinality.
    assert registry.get_sample_value("llmgw_router_requests_total", {"model": "-", "code": "4xx"}) == 1
    assert registry.get_sample_value("llmgw_router_tokens_total", {"model": "m1", "kind": "prompt"}) == 2
    assert registry.get_sample_value("llmgw_router_tokens_total", {"model": "m1", "kind": "completion"}) == 8
    assert registry.get_sample_value("llmgw_router_upstream_seconds_count", {"model": "m1"}) == 1


async def _post(gw, body: bytes, headers: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(gw.url + "/v1/chat/completions", data=body, skip_auto_headers=("Content-Type",),
                                headers={"Authorization": f"Bearer {gw.secret}", **headers}) as response:
            return response.status, json.loads(await response.read())


async def test_r6_1_compressed_bodies(gw):
    import gzip
    import zlib

    request = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "a b c"}]}).encode()
    status, answer = await _post(gw, gzip.compress(request), {"Content-Encoding": "gzip"})
    assert status == 200 and answer["choices"][0]["message"]["content"].startswith("m1 heard 3 words")
    status, answer = await _post(gw, zlib.compress(request), {"Content-Encoding": "deflate"})
    assert status == 200
    status, answer = await _post(gw, b"not gzip at all", {"Content-Encoding": "gzip"})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    status, answer = await _post(gw, request, {"Content-Encoding": "br"})
    assert status == 415 and set(answer["error"]) == {"message", "type", "code", "param", "request_id"}
    bomb = gzip.compress(b'{"model": "m1", "pad": "' + b"x" * 100_000 + b'"}')  # small on the wire
    assert len(bomb) < 4096
    status, answer = await _post(gw, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and answer["error"]["code"] == "request_too_large"


async def test_r6_1_deeply_nested_json_is_400(gw):
    status, answer = await _post(gw, b"[" * 1500 + b"]" * 1500, {})
    assert status == 400 and "too deeply" in answer["error"]["message"]


async def test_r6_2_authorization_that_is_not_utf8_is_401(gw):
    from tests.integration.test_router_support import raw_request

    host, port = gw.url.removeprefix("http://").split(":")
    status, _, body = await raw_request(gw.url, "GET", "/v1/models")
    assert status == 401
    import asyncio
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Authorization: Bearer sk-llmgw-\xff\xfe\r\n\r\n")
    data = await reader.read()
    writer.close()
    assert data.startswith(b"HTTP/1.1 401")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"
