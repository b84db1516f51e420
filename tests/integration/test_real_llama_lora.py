"""The real llama-server launched by llmgw with LoRA adapters (R-8.8).

A module of its own: an engine holding adapters answers a request without `lora` with every
adapter applied (docs/architecture.md, "LoRA adapters: what the engines do"), which would change
the answers test_real_llama.py's engine gives. One node; the base GGUF and two GGUF adapters of
tests/testbed/make_models.py fetched from HTTPS URLs. Checked on the engine itself: the command
line llmgw gave it, its adapters listed by id in name order from the node's cache, and a request
choosing the first adapter answered otherwise than one choosing none.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration import real_engines as rt
from tests.testbed import NodeSpec
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

BASE = "tiny-gguf"
ADAPTERS = ("lora-a-gguf", "lora-b-gguf")
START_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def made():
    real.require("llama-server")
    missing = real.lora_gguf_missing()
    if missing:
        pytest.skip(missing)
    return real.models()


@pytest.fixture(scope="module")
def bed(made, testbed_factory):
    tb = testbed_factory([NodeSpec("cpu1", engines="real", mem_gb=16, models_mb=32, cache_mb=64)])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, made, tmp_path_factory):
    url = bed.weights.add("tiny/chat.gguf", content=Path(made["gguf"]).read_bytes())
    models = [{"name": BASE, "profile": "cpu", "weights": url}]
    for name in reversed(ADAPTERS):  # launched in name order whatever the file's
        source = bed.weights.add(f"tiny/{name}.gguf", content=Path(made[name]).read_bytes())
        models.append({"name": name, "base": BASE, "adapter": source})
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": f"{START_TIMEOUT:.0f}s"}}
    began = time.monotonic()
    gw = rt.start_gateway(bed, tmp_path_factory.mktemp("llama-lora"), models=models, profiles=profiles)
    try:
        rt.wait_serving(gw, BASE, START_TIMEOUT * 2)
        print(f"\nllama-server with two adapters: gateway start to a serving replica in {time.monotonic() - began:.1f} s")
        yield gw
    finally:
        gw.stop()


def test_llama_server_is_launched_with_its_adapters_and_applies_the_one_a_request_chooses(bed, gateway):
    replica = rt.wait_serving(gateway, BASE, START_TIMEOUT)[0]
    shard = replica["shards"][0]
    node = bed[shard["node"]]
    [pid] = bed.engine_pids(node.name)
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    given = argv[argv.index("--metrics") + 1:]
    files = [given[1], given[3]]
    assert given == ["--lora", files[0], "--lora", files[1], "--lora-init-without-apply", "--cache-ram", "0"]
    assert all(f.startswith(f"{node.cache_dir}/llmgw-") and f.endswith(".gguf") for f in files)
    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        [(key,)] = db.execute("SELECT api_key FROM replicas WHERE id = ?", [replica["id"]]).fetchall()

    def engine(path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://{node.address}:{shard['port']}{path}",
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)

    listed = engine("/lora-adapters")
    assert [(a["id"], a["path"]) for a in listed] == [(0, files[0]), (1, files[1])]

    def answer(scales: tuple[float, float]) -> str:
        done = engine("/v1/completions", {"model": BASE, "prompt": "hello there", "max_tokens": 8, "temperature": 0,
                                          "lora": [{"id": i, "scale": s} for i, s in enumerate(scales)]})
        return done["choices"][0]["text"]

    base, adapted = answer((0, 0)), answer((1, 0))
    print(f"greedy answers: base {base!r}, {ADAPTERS[0]} {adapted!r}")
    assert adapted != base
    assert answer((0, 0)) == base  # the prompt cache in host memory is off: no adapter carried over


def test_through_the_router_an_adapter_gets_its_answer_and_the_base_the_bases(bed, gateway):
    """R-8.8: the router asks the engine for the base by its name with every adapter's scale in
    `lora`: the adapter named at 1, the others 0, and for the base all 0 — a client's own `lora`
    replaced —, so each answer through the router is the engine's own for that model."""
    replica = rt.wait_serving(gateway, BASE, START_TIMEOUT)[0]
    shard = replica["shards"][0]
    node = bed[shard["node"]]
    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        [(key,)] = db.execute("SELECT api_key FROM replicas WHERE id = ?", [replica["id"]]).fetchall()
    greedy = {"prompt": "hello there", "max_tokens": 8, "temperature": 0}

    def direct(scales: tuple[float, float]) -> str:
        body = {"model": BASE, **greedy, "lora": [{"id": i, "scale": s} for i, s in enumerate(scales)]}
        request = urllib.request.Request(f"http://{node.address}:{shard['port']}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)["choices"][0]["text"]

    client, _ = rt.new_client(gateway, "adapter-client")

    def routed(model: str, **extra) -> str:
        done = client.completions.create(model=model, max_tokens=8, temperature=0, prompt=greedy["prompt"],
                                         extra_body=extra or None)
        return done.choices[0].text

    own = {BASE: direct((0, 0)), ADAPTERS[0]: direct((1, 0)), ADAPTERS[1]: direct((0, 1))}
    assert len(set(own.values())) == 3
    assert {model: routed(model) for model in (ADAPTERS[0], ADAPTERS[1], BASE)} == own
    assert routed(BASE, lora=[{"id": 1, "scale": 1.0}]) == own[BASE]  # the client's `lora` is not passed on
    listed = {m.id: m.model_extra.get("parent") for m in client.models.list()}
    assert listed == {BASE: None, ADAPTERS[0]: BASE, ADAPTERS[1]: BASE}
