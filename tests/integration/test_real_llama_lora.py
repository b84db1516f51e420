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
