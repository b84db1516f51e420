"""End to end: `llmgw serve` places replicas on real SSH hosts and serves them (R-4.x, R-5.x, R-6.x)."""

from __future__ import annotations


import openai
import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.testbed import GPU, NodeSpec

pytestmark = pytest.mark.testbed

SPECS = [
    NodeSpec.gpu_node("gpu1", 4, fabric="ib-a", mem_gb=256, cache_mb=64),
    NodeSpec.gpu_node("gpu2", 4, fabric="ib-a", mem_gb=256, cache_mb=64),
    NodeSpec.gpu_node("gpu3", 2, gpu=GPU.l40s(), fabric="ib-b", mem_gb=128, cache_mb=64, labels={"pool": "solo"}),
    NodeSpec("cpu1", gpus=None, mem_gb=16, cache_mb=64),
]
NODES = ("gpu1", "gpu2", "gpu3", "cpu1")


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
    # Slow enough that a download is seen in progress (no Content-Length: "so far", no percentage).
    weights.add("slow/weights.bin", size=3 << 20, framing="chunked", throttle=512 << 10)
    weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 1 << 20})
    profiles = {
        "h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "60s"},
        "h100-2x2": {"engine": "vllm", "gpus": 2, "nodes": 2, "gpu_class": "h100-80gb", "start_timeout": "60s"},
        "cpu": {"engine": "llama-server", "min_memory_gb": 8, "start_timeout": "60s"},
        "solo": {"engine": "vllm", "gpus": 1, "gpu_class": "l40s-48gb", "node_selector": {"pool": "solo"},
                 "start_timeout": "60s"},
        "stuck": {"engine": "vllm", "gpus": 1, "gpu_class": "l40s-48gb", "start_timeout": "4s"},
    }
    models = [
        {"name": "chat", "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.002, "scaling": {"min": 2}},
        {"name": "big", "profile": "h100-2x2", "weights": "hf:org/tiny", "scaling": {"min": 1}},
        {"name": "gguf", "profile": "cpu", "weights": gguf, "scaling": {"min": 1}},
    ]
    inventory = bed.write_inventory(tmp / "inventory.yaml", models=models, profiles=profiles)
    inventory.write_text(inventory.read_text() + "gateway:\n  tick: 1s\n  settling_window: 10s\n")
    bed.set_engine_knobs("gpu3", by_model={"stuck": {"start_delay": 3600}})
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
    engines = {name: bed.engine_pids(name) for name in NODES}
    assert len(engines["cpu1"]) >= 1
    assert len(engines["gpu1"]) + len(engines["gpu2"]) >= 4
    big = _replicas(gateway, "big")[0]
    assert [s["rank"] for s in big["shards"]] == [0, 1] and {s["node"] for s in big["shards"]} == {"gpu1", "gpu2"}


def test_engine_key_never_in_argv(client, bed):
    """R-1.6: the engine API key reaches the engine through its environment only."""
    wait_for(lambda: _serves(client, "chat"), 90, "chat to serve")
    for name in NODES:
        for pid in bed.engine_pids(name):
            cmdline = bed.run(name, ["cat", f"/proc/{pid}/cmdline"]).stdout
            assert "llmgw-engine-" not in cmdline


def test_killed_engine_is_replaced(client, gateway, bed):
    """R-4.1: a crashed engine fails its replica, which is replaced; traffic keeps succeeding."""
    wait_for(lambda: _serves(client, "gguf"), 90, "gguf to serve")
    nodes = NODES
    before = {n: set(bed.engine_pids(n)) for n in nodes}
    bed.kill_engines("cpu1")
    # The replacement may land on another node: a node where a replica just failed is avoided.
    wait_for(lambda: any(set(bed.engine_pids(n)) - before[n] for n in nodes), 90, "a new llama-server")
    wait_for(lambda: _serves(client, "gguf"), 90, "gguf to serve again")
    assert "failed" in gateway.log() and "engine exited" in gateway.log()


def test_restart_adopts_running_engines(client, gateway, bed):
    """R-4.5: a control-plane restart does not restart engines."""
    wait_for(lambda: _serves(client, "chat"), 90, "chat to serve")
    before = {name: sorted(bed.engine_pids(name)) for name in NODES}
    assert gateway.stop() == 0
    gateway.start()
    for model in ("chat", "big", "gguf"):
        wait_for(lambda: _serves(client, model), 60, f"{model} to serve after the restart")
    after = {name: sorted(bed.engine_pids(name)) for name in NODES}
    assert after == before


def _replicas(gateway, model):
    status, answer = gateway.admin("/api/replicas")
    assert status == 200
    return [r for r in answer["replicas"] if r["model"] == model]


def test_download_progress_rides_on_the_shard_and_goes_away(client, gateway, bed):
    """R-5.4: bytes so far while fetching (no total without a length); gone once it serves."""
    url = bed.weights.add("slow/weights.bin", size=3 << 20, framing="chunked", throttle=512 << 10)
    status, answer = gateway.admin("/api/models", "POST", f"name: slow\nprofile: h100-1\nweights: {url}\n".encode())
    assert status == 201, answer
    seen = wait_for(lambda: next((s["progress"] for r in _replicas(gateway, "slow") for s in r["shards"]
                                  if s["progress"] and s["progress"]["bytes"] > 0), None), 60, "progress")
    assert seen["total"] is None and "so far" in seen["line"] and "%" not in seen["line"]
    wait_for(lambda: _serves(client, "slow"), 90, "slow to serve")
    live = [r for r in _replicas(gateway, "slow") if not r["retired"]]
    shards = [s for r in live for s in r["shards"]]
    assert shards and all(s["progress"] is None and s["state"] == "serving" for s in shards), \
        _replicas(gateway, "slow")


def test_model_removed_from_the_catalog_has_its_replicas_stopped(client, gateway, bed):
    """R-4.1, R-8.3: removing a runtime model stops its engines."""
    status, answer = gateway.admin("/api/models", "POST", b"name: extra\nprofile: h100-1\nweights: hf:org/tiny\n")
    assert status == 201, answer
    wait_for(lambda: _serves(client, "extra"), 90, "extra to serve")
    before = {n: set(bed.engine_pids(n)) for n in NODES}
    status, _ = gateway.admin("/api/models/extra", "DELETE")
    assert status == 200
    wait_for(lambda: not _replicas(gateway, "extra"), 60, "extra's replicas to go")
    after = {n: set(bed.engine_pids(n)) for n in NODES}
    assert sum(len(before[n] - after[n]) for n in NODES) >= 1
    with pytest.raises(openai.NotFoundError):
        _serves(client, "extra")


def test_start_timeout_fails_with_the_log_tail(gateway, bed):
    """R-4.3: a shard that never becomes healthy fails after its start timeout, with its log."""
    status, answer = gateway.admin("/api/models", "POST", b"name: stuck\nprofile: stuck\nweights: hf:org/tiny\n")
    assert status == 201, answer

    def failure():
        status, answer = gateway.admin("/api/models")
        model = next(m for m in answer["models"] if m["name"] == "stuck")
        return model if model.get("last_failure") else None

    model = wait_for(failure, 90, "the start timeout")
    assert "did not become ready within 4s" in model["last_failure"]
    failed = wait_for(lambda: [s for r in _replicas(gateway, "stuck") for s in r["shards"] if s["log_tail"]], 60,
                      "a failed shard with its log tail")
    assert any("vLLM" in line or "vllm" in line.lower() for line in failed[0]["log_tail"])
    gateway.admin("/api/models/stuck", "DELETE")


def test_drain_of_the_only_capable_node_finishes_after_the_grace(client, gateway, bed):
    """R-9.5: nothing else can host it, so the grace period ends the drain."""
    status, answer = gateway.admin("/api/models", "POST", b"name: pinned\nprofile: solo\nweights: hf:org/tiny\n")
    assert status == 201, answer
    wait_for(lambda: _serves(client, "pinned"), 90, "pinned to serve")
    status, answer = gateway.admin("/api/nodes/gpu3/admin", "POST", {"action": "drain", "grace": "3s"})
    assert status == 200 and answer["admin"] == "draining"
    assert _serves(client, "pinned")  # still serving during the grace
    wait_for(lambda: not [r for r in _replicas(gateway, "pinned") if not r["retired"]], 60, "drain to finish")
    gateway.admin("/api/nodes/gpu3/admin", "POST", {"action": "uncordon"})
    wait_for(lambda: _serves(client, "pinned"), 90, "pinned back after uncordon")
    gateway.admin("/api/models/pinned", "DELETE")


def test_on_demand_model_loads_on_request_and_stops_when_idle(client, gateway, bed):
    """R-6.8: nothing runs until asked; the fallback serves meanwhile; idle replicas stop."""
    wait_for(lambda: _serves(client, "chat"), 90, "chat to serve")
    status, answer = gateway.admin("/api/models", "POST", b"name: lazy\nprofile: h100-1\nweights: hf:org/tiny\n"
                                                         b"fallback: chat\nscaling: {min: 0, max: 3, idle_timeout: 4s}\n")
    assert status == 201, answer
    assert not _replicas(gateway, "lazy")
    first = _serves(client, "lazy")
    assert "chat" in first  # answered by the fallback while lazy loads
    wait_for(lambda: "lazy" in _serves(client, "lazy"), 90, "lazy itself to answer")
    assert len([r for r in _replicas(gateway, "lazy") if not r["retired"]]) == 1  # one: a request at a time needs no more
    wait_for(lambda: not [r for r in _replicas(gateway, "lazy") if not r["retired"]], 60, "the idle replica to stop")
    gateway.admin("/api/models/lazy", "DELETE")
