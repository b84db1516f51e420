"""Responses and Anthropic Messages through the router against the real llama-server (a tiny GGUF) (R-6.12, R-6.13).

One llama-server per module on 127.0.0.1, its key in LLAMA_API_KEY as llmgw's template passes
it. llama-server's Responses keep nothing, so a GET of a response id is the router's 404 naming
the engine; its Anthropic stream is read for usage like any other. Skips with the reason when the
real llama-server or the tiny GGUF is not there (scripts/engines builds them).
"""

from __future__ import annotations

import os

import aiohttp
import anthropic
import openai
import pytest

from llmgw.router import Endpoint
from tests.integration.test_router_api_surface_vllm import ENGINES_DIR, recorded, running_engine, tiny_model
from tests.integration.test_router_support import catalog, free_port, model, poll, start_router  # noqa: F401

pytestmark = pytest.mark.slow

LLAMA = ENGINES_DIR / "llama.cpp-11434.0.0" / "bin" / "llama-server"
KEY = "real-llama-engine-key"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    if not (LLAMA.parent.parent / "ready").is_file() or not os.access(LLAMA, os.X_OK):
        pytest.skip(f"the real llama-server is not built at {LLAMA.parent.parent} (run ./scripts/engines as root)")
    weights = tiny_model("gguf")
    port = free_port()
    argv = [str(LLAMA), "-m", str(weights), "--alias", "m", "--host", "127.0.0.1", "--port", str(port),
            "-c", "1024", "-t", "1"]
    env = {**os.environ, "LLAMA_API_KEY": KEY}
    with running_engine("llama-server", argv, env, tmp_path_factory.mktemp("llama") / "llama.log", port, 120) as url:
        yield url


async def test_r6_13_anthropic_messages_on_the_real_llama_server(llama, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m", profile="llama")), {"m": [Endpoint("real-l", "m", llama, KEY)]})
    hello = [{"role": "user", "content": "hello there"}]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=gw.secret, max_retries=0, timeout=120) as client:
        message = await client.messages.create(model="m", max_tokens=8, messages=hello)
        async with client.messages.stream(model="m", max_tokens=6, messages=hello) as stream:
            async for _ in stream.text_stream:
                pass
            final = await stream.get_final_message()
    print("llama-server Messages usage:", message.usage, final.usage)
    assert message.type == "message" and message.usage.output_tokens > 0 and final.usage.input_tokens > 0

    def prompt(usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert await recorded(gw, 2) == (prompt(message.usage) + prompt(final.usage),
                                     message.usage.output_tokens + final.usage.output_tokens)


async def test_r6_12_responses_and_tokenize_on_the_real_llama_server(llama, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m", profile="llama")), {"m": [Endpoint("real-l", "m", llama, KEY)]})
    async with gw.client(timeout=120) as client:
        reply = await client.responses.create(model="m", input="hello there", max_output_tokens=8)
        stream = await client.responses.create(model="m", input="one two", max_output_tokens=6, stream=True)
        events = [event async for event in stream]
        with pytest.raises(openai.NotFoundError) as not_served:
            await client.responses.retrieve(reply.id)
    done = events[-1].response
    print("llama-server Responses usage:", reply.usage, done.usage)
    assert gw.opened(reply.id)[:2] == ("m", "real-l") and gw.opened(done.id)[1] == "real-l"
    assert "runs on llama-server" in not_served.value.message
    reported = [(r.usage.input_tokens, r.usage.output_tokens) for r in (reply, done)]
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/tokenize", json={"model": "m", "content": "hello there"},
                                headers={"Authorization": f"Bearer {gw.secret}"}) as r:
            tokenized = await r.json()
    assert r.status == 200 and tokenized["tokens"], tokenized
    assert await recorded(gw, 3) == (sum(i for i, _ in reported), sum(o for _, o in reported))
