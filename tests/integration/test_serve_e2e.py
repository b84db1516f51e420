"""End to end: `llmgw serve` places replicas on real SSH hosts and serves them (R-4.x, R-5.x, R-6.x)."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.testbed import GPU, NodeSpec

pytestmark = pytest.mark.testbed

SPECS = [
    NodeSpec.gpu_node("gpu1", 4, fabric="ib-a", mem_gb=256, cache_mb=64),
    NodeSpec.gpu_node("gpu2", 4, fabric="ib-a", mem_gb=256, cache_mb=64),
    NodeSpec("cpu1", gpus=None, mem_gb=16, cache_mb=64),
]


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory(SPECS)
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    weights = bed.weights
    gguf = weights.add("gguf/tiny-q4.gguf", size=2 << 20)
    weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 1 << 20})
    profiles = {
        "h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "60s"},
        "h100-2x2": {"engine": "vllm", "gpus": 2, "nodes": 2, "gpu_class": "h100-80gb", "start_timeout": "60s"},
        "cpu": {"engine": "llama-server", "min_memory_gb": 8, "start_timeout": "60s"},
    }
    models = [
        {"name": "chat", "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.002, "scaling": {"min": 2}},
        {"name": "big", "profile": "h100-2x2", "weights": "hf:org/tiny", "scaling": {"min": 1}},
        {"name": "gguf", "profile": "cpu", "weights": gguf, "scaling": {"min": 1}},
    ]
    inventory = bed.write_inventory(tmp / "inventory.yaml", models=models, profiles=profiles)
    process = GatewayProcess(inventory, tmp / "state", env={"HF_ENDPOINT": weights.hf_endpoint})
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.create_key("e2e"), max_retries=0)


def _serves(client, model):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi there"}])
    return reply.choices[0].message.content


def test_replicas_come_up_and_serve(client, gateway, bed):
    """R-4.1, R-4.2, R-5.2: weights fetched, engines launched with real command lines, traffic served."""
    for model in ("chat", "big", "gguf"):
        text = wait_for(lambda: _serves(client, model), 90, f"{model} to serve\n{gateway.log()[-3000:]}")
        assert model in text
    stream = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}], stream=True)
    chunks = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) > 1
    # Two replicas of chat on GPU nodes, a multi-node replica spanning both, llama-server on the CPU node.
    engines = {name: bed.engine_pids(name) for name in ("gpu1", "gpu2", "cpu1")}
    assert len(engines["cpu1"]) >= 1
    assert len(engines["gpu1"]) + len(engines["gpu2"]) >= 4


def test_engine_key_never_in_argv(client, bed):
    """R-1.6: the engine API key reaches the engine through its environment only."""
    wait_for(lambda: _serves(client, "chat"), 90, "chat to serve")
    for name in ("gpu1", "gpu2", "cpu1"):
        for pid in bed.engine_pids(name):
            cmdline = bed.run(name, ["cat", f"/proc/{pid}/cmdline"]).stdout
            assert "llmgw-engine-" not in cmdline


def test_killed_engine_is_replaced(client, gateway, bed):
    """R-4.1: a crashed engine fails its replica, which is replaced; traffic keeps succeeding."""
    wait_for(lambda: _serves(client, "gguf"), 90, "gguf to serve")
    nodes = ("gpu1", "gpu2", "cpu1")
    before = {n: set(bed.engine_pids(n)) for n in nodes}
    bed.kill_engines("cpu1")
    # The replacement may land on another node: a node where a replica just failed is avoided.
    wait_for(lambda: any(set(bed.engine_pids(n)) - before[n] for n in nodes), 90, "a new llama-server")
    wait_for(lambda: _serves(client, "gguf"), 90, "gguf to serve again")
    assert "failed" in gateway.log() and "engine exited" in gateway.log()


def test_restart_adopts_running_engines(client, gateway, bed):
    """R-4.5: a control-plane restart does not restart engines."""
    wait_for(lambda: _serves(client, "chat"), 90, "chat to serve")
    before = {name: sorted(bed.engine_pids(name)) for name in ("gpu1", "gpu2", "cpu1")}
    assert gateway.stop() == 0
    gateway.start()
    for model in ("chat", "big", "gguf"):
        wait_for(lambda: _serves(client, model), 60, f"{model} to serve after the restart")
    after = {name: sorted(bed.engine_pids(name)) for name in ("gpu1", "gpu2", "cpu1")}
    assert after == before
