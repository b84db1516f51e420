"""Responses and Anthropic Messages through the router against the real vLLM (CPU, a tiny model) (R-6.12 to R-6.14).

One vLLM start per module, on 127.0.0.1, started directly (not through the helper, so without
the engine-port guard that tests/real_engines checks) with its key in VLLM_API_KEY as llmgw's
template passes it, plus VLLM_ENABLE_RESPONSES_API_STORE=1 so stored responses can be followed up. The official `openai`
and `anthropic` clients talk to the router; what vLLM reported is what the router recorded.
vLLM reads its key only from `Authorization: Bearer`, so every answer here also shows that the
router sent the engine's key that way, the Anthropic client's `x-api-key` notwithstanding.
Skips with the reason when the real vLLM or the tiny model is not there (scripts/engines builds them).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from llmgw.router import Endpoint
from llmgw.keys import list_keys
from tests.integration.test_router_support import apoll, catalog, free_port, model, poll, start_router  # noqa: F401

pytestmark = pytest.mark.slow

ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", "/opt/llmgw-engines"))
VLLM = ENGINES_DIR / "vllm-0.32.0" / "bin" / "vllm"
KEY = "real-vllm-engine-key"
START_SECONDS = 600  # a first start compiles vLLM's CPU graph; later ones reuse its cache


def tiny_model(kind: str = "chat") -> Path:
    """The tiny model the real-engine tests serve (`chat`: a Hugging Face folder; `gguf`: the same
    for llama-server): made by tests/testbed/engines.py where that helper is present, else one it
    already made under ENGINES_DIR/models."""
    try:
        from tests.testbed import engines as real_engines
    except ImportError:
        real_engines = None
    if real_engines is not None and hasattr(real_engines, "models"):
        return Path(real_engines.models()[kind])
    for made in sorted(ENGINES_DIR.glob("models/*/made.json")):
        path = Path(json.loads(made.read_text()).get(kind, ""))
        if path.name and path.exists():
            return path
    pytest.skip(f"no tiny {kind} model under {ENGINES_DIR}/models (tests/testbed/engines.py makes it)")


@contextlib.contextmanager
def running_vllm(tmp_path_factory, name: str, *args: str):
    """A real vLLM serving the tiny model as `name` on 127.0.0.1; yields its URL."""
    if not (VLLM.parent.parent / "ready").is_file() or not os.access(VLLM, os.X_OK):
        pytest.skip(f"the real vLLM is not built at {VLLM.parent.parent} (run ./scripts/engines as root)")
    weights = tiny_model()
    port = free_port()
    env = {**os.environ, "VLLM_API_KEY": KEY, "VLLM_ENABLE_RESPONSES_API_STORE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_CI_ENV": "1",  # traced once and run eagerly, not compiled (tests/testbed/engines.py)
           "VLLM_CACHE_ROOT": str(ENGINES_DIR / "cache" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(ENGINES_DIR / "cache" / "torchinductor"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": "",
           "HOME": str(tmp_path_factory.mktemp("vllm-home"))}
    argv = [str(VLLM), "serve", str(weights), "--served-model-name", name, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "1024", *args]
    with running_engine("vLLM", argv, env, tmp_path_factory.mktemp("vllm") / "vllm.log", port, START_SECONDS) as url:
        yield url


@contextlib.contextmanager
def running_engine(what: str, argv: list[str], env: dict, log_path: Path, port: int, timeout: float):
    """`argv` started in a session of its own, its output in `log_path`, until its /health
    answers 200 on 127.0.0.1:`port`; yields its URL, then ends its process group."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n" + log_path.read_text()[-4000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False
    try:
        poll(healthy, timeout=timeout, what=f"the real {what} to be healthy")
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    with running_vllm(tmp_path_factory, "m") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_pooling(tmp_path_factory):
    """The same weights under vLLM's pooling runner: an embedding model, which vLLM also scores and reranks with."""
    with running_vllm(tmp_path_factory, "e", "--runner", "pooling") as url:
        yield url


async def recorded(gw, requests: int) -> tuple[int, int]:
    keys = {k.name: k.id for k in gw.store.read_sync(list_keys)}

    async def row():
        for r in await gw.usage_rows():
            if r["key_id"] == keys["test-0"] and r["requests"] == requests:
                return r
    found = await apoll(row, what=f"{requests} request(s) in the usage table")
    return found["prompt_tokens"], found["completion_tokens"]


async def test_r6_12_responses_on_the_real_vllm(vllm, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": [Endpoint("real-1", "m", vllm, KEY)]})
    async with gw.client(timeout=120) as client:
        reply = await client.responses.create(model="m", input="hello there", max_output_tokens=8)
        stream = await client.responses.create(model="m", input="one two", max_output_tokens=6, stream=True)
        events = [event async for event in stream]
        done = events[-1].response
        follow = await client.responses.create(model="m", input="and then", previous_response_id=reply.id,
                                               max_output_tokens=4)
        fetched = await client.responses.retrieve(reply.id)
    print("vLLM Responses usage:", reply.usage, done.usage, follow.usage)
    assert gw.opened(reply.id)[:2] == ("m", "real-1")
    assert events[-1].type == "response.completed" and gw.opened(done.id)[1] == "real-1"
    assert follow.previous_response_id == reply.id and fetched.id == reply.id
    reported = [(r.usage.input_tokens, r.usage.output_tokens) for r in (reply, done, follow)]
    assert all(i > 0 and o > 0 for i, o in reported)
    # the stored response read back is a request, not tokens spent again
    assert await recorded(gw, 4) == (sum(i for i, _ in reported), sum(o for _, o in reported))
    # another key allowed on the model: the same 404 as an unknown id, for reading and continuing
    async with gw.client(gw.key("other-tenant", ["m"]), timeout=120) as client:
        with pytest.raises(openai.NotFoundError) as read:
            await client.responses.retrieve(reply.id)
        with pytest.raises(openai.NotFoundError) as continued:
            await client.responses.create(model="m", input="x", previous_response_id=reply.id, max_output_tokens=2)
    assert read.value.code == continued.value.code == "response_not_found"
    # a forged suffix that walked out of the route before reaches no vLLM page (R-6.14a)
    async with gw.client(timeout=120) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(reply.id + "%2F..%2F..%2F..%2Fmetrics")


async def test_r6_9a_a_stream_left_early_is_counted_exactly_from_the_real_vllms_chunks(vllm, start_router):  # noqa: F811
    """Every vLLM stream asks for usage in each chunk (stream_options.continuous_usage_stats): the
    real vLLM takes it, the client that did not ask sees none of it, and a stream the client
    leaves is counted from the last chunk relayed, exactly, nothing estimated (R-6.9a). Whether
    the tiny model has finished by the time the client leaves does not matter to the assertions:
    either way the counts are vLLM's own."""
    gw = await start_router(catalog(model("m")), {"m": [Endpoint("real-1", "m", vllm, KEY)]})
    async with gw.client(timeout=120) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count"}], max_tokens=900, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": 900})
        read = 0
        async for chunk in stream:
            assert chunk.usage is None  # the client asked for no usage
            read += 1
            if read == 20:
                break
        await stream.close()
    keys = {k.name: k.id for k in gw.store.read_sync(list_keys)}

    async def row():
        await gw.feed.report()
        return next((r for r in await gw.usage_rows() if r["key_id"] == keys["test-0"]), None)
    found = await apoll(row, what="the stream's usage row")
    print("vLLM stream left after 20 chunks:", found)
    assert found["requests"] == 1 and found["unmetered"] == 0 and found["estimated_tokens"] == 0
    assert found["prompt_tokens"] > 0 and 19 <= found["completion_tokens"] <= 900


async def test_r6_13_anthropic_messages_on_the_real_vllm(vllm, start_router):  # noqa: F811
    gw = await start_router(catalog(model("m")), {"m": [Endpoint("real-1", "m", vllm, KEY)]})
    hello = [{"role": "user", "content": "hello there"}]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=gw.secret, max_retries=0, timeout=120) as client:
        message = await client.messages.create(model="m", max_tokens=8, messages=hello)
        async with client.messages.stream(model="m", max_tokens=6, messages=hello) as stream:
            async for _ in stream.text_stream:
                pass
            final = await stream.get_final_message()
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(model="nope", max_tokens=8, messages=hello)
    print("vLLM Messages usage:", message.usage, final.usage)
    assert message.type == "message" and message.usage.output_tokens > 0
    assert unknown.value.body["type"] == "error"

    def prompt(usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert await recorded(gw, 2) == (prompt(message.usage) + prompt(final.usage),
                                     message.usage.output_tokens + final.usage.output_tokens)


async def test_r6_12_tokenize_detokenize_and_count_tokens_on_the_real_vllm(vllm, start_router):  # noqa: F811
    """/tokenize is outside vLLM's /v1 key check; the router sends the key on it anyway."""
    import aiohttp

    gw = await start_router(catalog(model("m")), {"m": [Endpoint("real-1", "m", vllm, KEY)]})
    auth = {"Authorization": f"Bearer {gw.secret}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/tokenize", json={"model": "m", "prompt": "hello there"}, headers=auth) as r:
            tokenized = await r.json()
        assert r.status == 200 and tokenized["count"] == len(tokenized["tokens"]) > 0, tokenized
        async with session.post(gw.url + "/detokenize", json={"model": "m", "tokens": tokenized["tokens"]},
                                headers=auth) as r:
            detokenized = await r.json()
        assert r.status == 200 and "hello" in detokenized["prompt"], detokenized
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=gw.secret, max_retries=0, timeout=120) as client:
        counted = await client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello there"}])
    print("vLLM tokenize:", tokenized, "count_tokens:", counted.input_tokens)
    assert counted.input_tokens > 0


async def test_r6_12_score_and_rerank_on_the_real_vllm(vllm_pooling, start_router):  # noqa: F811
    import aiohttp

    gw = await start_router(catalog(model("e")), {"e": [Endpoint("real-e", "e", vllm_pooling, KEY)]})
    auth = {"Authorization": f"Bearer {gw.secret}"}
    reported = []
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/score", json={"model": "e", "text_1": "hello there",
                                                             "text_2": ["hello there", "one two"]}, headers=auth) as r:
            scored = await r.json()
        assert r.status == 200 and len(scored["data"]) == 2, scored
        reported.append(scored["usage"]["prompt_tokens"])
        for path in ("/v1/rerank", "/rerank"):
            async with session.post(gw.url + path, json={"model": "e", "query": "hello",
                                                         "documents": ["hello there", "one two"]}, headers=auth) as r:
                ranked = await r.json()
            assert r.status == 200 and ranked["results"][0]["index"] == 0, ranked
            reported.append(ranked["usage"]["prompt_tokens"])
    print("vLLM score/rerank prompt tokens:", reported)
    assert await recorded(gw, 3) == (sum(reported), 0)
