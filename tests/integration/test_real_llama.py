"""The real llama-server (llama.cpp, CPU) on testbed nodes, launched by llmgw's built-in template.

Placement, launch, readiness (llama-server answers 503 while it loads), the official `openai`
client through the router, usage as the engine reported it, the engine's own log, adoption across
a control-plane restart, replacement after `kill -9`, a drain under traffic, and stop. The GGUF is
made at test time from the tiny random Llama (tests/testbed/make_models.py) and fetched by the
nodes from an HTTPS URL. llama-server is ready in about half a second, so the tests that restart
engines (kill, drain) run here rather than on vLLM.

The tests of this module share one testbed and one gateway, and run in order.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration import real_engines as rt
from tests.integration.gateway import wait_for
from tests.testbed import NodeSpec
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

MODEL = "tiny-gguf"
NODES = ("cpu1", "cpu2")
START_TIMEOUT = 60.0
KEY = "llama-tests"


@pytest.fixture(scope="module")
def made():
    real.require("llama-server")
    return real.models()


@pytest.fixture(scope="module")
def bed(made, testbed_factory):
    tb = testbed_factory([NodeSpec(name, engines="real", mem_gb=16, models_mb=32, cache_mb=64) for name in NODES])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, made, tmp_path_factory):
    url = bed.weights.add("tiny/chat.gguf", content=Path(made["gguf"]).read_bytes())
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": f"{START_TIMEOUT:.0f}s"}}
    began = time.monotonic()
    gw = rt.start_gateway(bed, tmp_path_factory.mktemp("llama"), models=[], profiles=profiles)
    try:
        # Added at runtime from a URL, as `ctl model add -f` does (and the stop test removes it).
        status, answer = gw.admin("/api/models", "POST", f"name: {MODEL}\nprofile: cpu\nweights: {url}\n".encode())
        assert status == 201, answer
        rt.wait_serving(gw, MODEL, START_TIMEOUT * 2)
        print(f"llama-server: gateway start to a serving replica in {time.monotonic() - began:.1f} s")
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return rt.new_client(gateway, KEY)[0]


def _engine(bed, gateway) -> tuple[dict, str, int, list[str]]:
    """(replica, node, pid, argv) of the model's one serving replica's engine process."""
    replica = rt.wait_serving(gateway, MODEL, START_TIMEOUT * 2)[0]
    node = replica["shards"][0]["node"]
    pids = bed.engine_pids(node)
    assert len(pids) == 1, f"engine processes on {node}: {pids}"
    argv = [a.decode() for a in Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0") if a]
    return replica, node, pids[0], argv


def test_built_in_template_serves_chat_streams_and_completions_with_usage(bed, gateway, client):
    """R-4.6, R-6.1, R-6.9: the real llama-server, launched unchanged, answers the openai client;
    the gateway records the usage the engine reported."""
    replica, node, pid, argv = _engine(bed, gateway)
    assert argv[0] == str(real.EXECUTABLES["llama-server"])
    assert argv[1] == "-m" and argv[argv.index("--alias") + 1] == MODEL
    counted = rt.Counted()

    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8
    counted.add(reply.usage)
    rt.wait_usage(gateway, KEY, counted.as_dict())

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a stream"}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None and not chunks[-1].choices
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    counted.add(usage[0])
    rt.wait_usage(gateway, KEY, counted.as_dict())

    done = client.completions.create(model=MODEL, prompt="the model server", max_tokens=6)
    assert done.choices[0].text is not None and done.usage.completion_tokens <= 6
    counted.add(done.usage)

    models = client.models.list()
    assert MODEL in [m.id for m in models.data]
    rt.wait_usage(gateway, KEY, counted.as_dict())
    print(f"usage the engine reported, as recorded: {counted.as_dict()}")


def test_requests_after_a_stream_find_no_dead_connection(gateway, client):
    """R-6.1, R-6.6: llama-server closes its end after a streamed answer without `Connection:
    close`; the request that follows on the one replica is still answered."""
    for n in range(4):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"stream {n}"}],
                                                max_tokens=4, stream=True)
        assert any(c.choices and c.choices[0].finish_reason for c in stream)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"plain {n}"}],
                                               max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_ctl_logs_shows_the_engines_own_log(bed, gateway):
    """R-9.4: `ctl logs` reads the engine's log from its node."""
    replica, *_ = _engine(bed, gateway)
    text = rt.engine_log(gateway, replica["id"])
    # Lines only llama-server itself prints while loading its GGUF and starting to listen.
    assert "load_model: loading model" in text, text[:3000]
    assert "llama_server: listening on http://" in text, text[:3000]


def test_restart_adopts_the_running_engine(bed, gateway, client):
    """R-4.5: a control-plane restart keeps the engine: same pid, no relaunch."""
    replica, node, pid, _ = _engine(bed, gateway)
    assert gateway.stop() == 0
    assert bed.engine_pids(node) == [pid]
    gateway.start()
    again = rt.wait_serving(gateway, MODEL, 30)
    assert [r["id"] for r in again] == [replica["id"]]
    assert bed.engine_pids(node) == [pid]
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert sum(len(bed.engine_pids(n)) for n in NODES) == 1


def test_killed_engine_is_replaced(bed, gateway, client):
    """R-4.1: `kill -9` of the engine fails its replica; a new one is launched and serves."""
    replica, node, pid, _ = _engine(bed, gateway)
    killed = bed.kill_engines(node, signal.SIGKILL)
    assert killed == [pid]

    def replaced():
        found = [r for r in rt.serving(gateway, MODEL) if r["id"] != replica["id"]]
        return found or None
    new = wait_for(replaced, START_TIMEOUT * 2, f"a replacement replica\n{gateway.log()[-3000:]}", interval=0.5)
    new_node = new[0]["shards"][0]["node"]
    assert bed.engine_pids(new_node) and pid not in bed.engine_pids(new_node)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert "engine exited" in gateway.log()


def test_drain_moves_the_replica_with_no_failed_request(bed, gateway, client):
    """R-9.5: a drained node's replica is replaced elsewhere before it stops; traffic sees no error."""
    replica, victim, pid, _ = _engine(bed, gateway)
    spare = next(n for n in NODES if n != victim)
    rt.drain_under_load(bed, gateway, MODEL, victim, spare, key_name="llama-drain", move_timeout=START_TIMEOUT * 2)
    assert pid not in bed.engine_pids(spare)


def test_stop_leaves_no_process_and_frees_the_port(bed, gateway):
    """R-4.1, R-8.3: removing the model stops its engine: no process left, the port free again."""
    replica, node, pid, argv = _engine(bed, gateway)
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    assert not rt.port_free(bed, node, host, port)
    status, answer = gateway.admin(f"/api/models/{MODEL}", "DELETE")
    assert status == 200, answer
    wait_for(lambda: not rt.replicas(gateway, MODEL), 60, "the replica to go")
    wait_for(lambda: not bed.engine_pids(node), 30, "the engine process to end")
    assert not Path(f"/proc/{pid}").exists()
    assert rt.port_free(bed, node, host, port)
