"""The router in front of the real vLLM and llama-server holding LoRA adapters (R-8.8): a request
naming an adapter gets the adapter's answer (greedy, the same as the engine's own for that
adapter), and a base request to a llama-server holding adapters gets the base model's answer.

Each engine is launched as test_lora_engines.py launches it (built-in template, node helper, the
replica's key, the adapters of tests/testbed/make_models.py) once for the module; the real router
is fed endpoints naming the adapters each engine holds, and adapter entries as the control plane
publishes them. Requests go one at a time: vLLM's CPU build answers a base request batched with
an adapter request with an adapter (docs/architecture.md, "LoRA adapters: what the engines do").
"""

from __future__ import annotations

import json
import time

import aiohttp
import pytest

from llmgw.contracts.endpoints import Endpoint
from llmgw.control.feed import publisher as publisher_module
from tests.integration.test_router_support import catalog, model, start_router, with_adapters  # noqa: F401
from tests.real_engines.engines import bin_dir, launch_engine, stop_engine
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # CPU vLLM starts on a busy machine

PROMPT = "hello there"
# The catalog's names: bases `tiny-v` (vLLM) and `tiny-l` (llama-server), both served as `tiny`,
# and their adapters, vLLM's served by the names given in --lora-modules.
ADAPTERS = {"support-a": ("tiny-v", "lora-a"), "support-b": ("tiny-v", "lora-b"),
            "llama-a": ("tiny-l", None), "llama-b": ("tiny-l", None)}


@pytest.fixture(scope="module")
def made():
    return real.models()


def _launch(tmp_path_factory, engine: str, model_path: str, args: list[str], env=None):
    root = tmp_path_factory.mktemp("node") / "llmgw"
    root.mkdir()
    began = time.monotonic()
    launched = launch_engine(root, engine, bin_dir(engine), model_path, args=args, env=env)
    print(f"\n{engine}: healthy in {time.monotonic() - began:.1f} s")
    return launched, root


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, made):
    """lora-a and lora-b given at launch, one adapter per batch."""
    launched, root = _launch(tmp_path_factory, "vllm", str(made["chat"]),
                             ["--max-model-len", "1024", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                              "--max-cpu-loras", "2", "--lora-modules", f"lora-a={made['lora-a']}",
                              f"lora-b={made['lora-b']}"], env=real.VLLM_CPU_ENV)
    yield launched
    stop_engine(launched, root)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, made):
    """ids 0, 1 = lora-a, lora-b; no prompt cache in host memory, as llmgw launches it with adapters."""
    reason = real.lora_gguf_missing()
    if reason:
        pytest.skip(reason)
    launched, root = _launch(tmp_path_factory, "llama-server", str(made["gguf"]),
                             ["-c", "2048", "--parallel", "1", "--cache-ram", "0", "--lora-init-without-apply",
                              "--lora", f"{made['lora-a-gguf']},{made['lora-b-gguf']}"])
    yield launched
    stop_engine(launched, root)


def direct(engine, body: dict) -> dict:
    """The engine's own answer, asked with the replica's key."""
    status, data = engine.request("POST", "/v1/completions", body, engine.key)
    assert status == 200, data
    return json.loads(data)


async def through(gw, body: dict) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {gw.secret}"}) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()


def endpoint(engine, base: str, adapters: tuple[str, ...]) -> Endpoint:
    return Endpoint(f"{base}-r0", base, f"http://127.0.0.1:{engine.port}", engine.key, adapters=adapters)


@pytest.fixture
async def gw(start_router, monkeypatch):  # noqa: F811
    monkeypatch.setattr(publisher_module, "routed_models", with_adapters(ADAPTERS))

    async def start(endpoints):
        return await start_router(catalog(model("tiny-v", served_name="tiny"),
                                          model("tiny-l", profile="llama", served_name="tiny")), endpoints)
    return start


GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


async def test_r8_8_vllm_through_the_router_answers_with_the_adapter_named(gw, vllm):
    router = await gw({"tiny-v": [endpoint(vllm, "tiny-v", ("support-a", "support-b"))]})
    answers = {}
    for name, served in (("support-a", "lora-a"), ("support-b", "lora-b"), ("tiny-v", "tiny")):
        routed = await through(router, {"model": name, **GREEDY, "return_token_ids": True})
        own = direct(vllm, {"model": served, **GREEDY, "return_token_ids": True})
        assert routed["choices"][0]["token_ids"] == own["choices"][0]["token_ids"], name
        answers[name] = own["choices"][0]["token_ids"]
    print("greedy token ids:", answers)
    assert len({tuple(ids) for ids in answers.values()}) == 3  # each adapter answers its own way


async def test_r8_8_llama_server_through_the_router_answers_with_the_adapter_named_and_the_base_without(gw, llama):
    router = await gw({"tiny-l": [endpoint(llama, "tiny-l", ("llama-a", "llama-b"))]})
    base = direct(llama, {"model": "tiny", **GREEDY, "lora": [{"id": 0, "scale": 0.0}]})["choices"][0]["text"]
    every = direct(llama, {"model": "tiny", **GREEDY})["choices"][0]["text"]  # no `lora`: every adapter at once
    own = {name: direct(llama, {"model": "tiny", **GREEDY, "lora": [{"id": i, "scale": 1.0}]})["choices"][0]["text"]
           for i, name in enumerate(("llama-a", "llama-b"))}
    print("greedy texts: base", repr(base), "every adapter", repr(every), "adapters", own)
    assert len({base, every, *own.values()}) == 4
    for name in ("llama-a", "llama-b"):
        assert (await through(router, {"model": name, **GREEDY}))["choices"][0]["text"] == own[name], name
    # A base request, even one whose own `lora` asks for an adapter, gets the base model's answer.
    for asked in ({}, {"lora": [{"id": 1, "scale": 1.0}]}):
        assert (await through(router, {"model": "tiny-l", **GREEDY, **asked}))["choices"][0]["text"] == base
