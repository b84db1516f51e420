"""The real vLLM from an environment llmgw builds itself (`runtime: venv`) on a testbed node
that has no engine at all on its PATH (R-4.11).

The profile is tests/testbed/engines.py's VLLM_VENV_PROFILE: the suite's CPU vLLM recipe, built
by the node's helper from the wheelhouse `scripts/engines wheelhouse` fills (testbed nodes reach
no package index), its fix-ups as post_install commands. The node has uv on its PATH with a cache
kept beside the engines, so the helper installs with uv, and from the second run on copies the
wheels out of that cache instead of unpacking 3.5 GB again. One build and one engine for the
module.
Checked: the replica serves chat and a stream with usage through the router to the official
`openai` client; the engine runs from the sealed environment under the helper's root (not from
PATH, where there is none); a second replica of the same recipe reuses it without a build; and
what was built is left sealed and is refused once changed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration import real_engines as rt
from tests.testbed import NodeSpec, network
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.testbed, pytest.mark.timeout(1500)]  # the build and the start in a setup

MODEL = "tiny-venv"
KEY = "venv-tests"
WEIGHTS = "hf:tiny/venv-chat"
NODE = "bare"
START_TIMEOUT = 600.0  # the environment's build (pip from the wheelhouse) and vLLM's first start


@pytest.fixture(scope="module")
def made():
    real.require("vllm")
    reason = real.wheelhouse_missing()
    if reason is not None:
        pytest.skip(reason)
    return real.models()


@pytest.fixture(scope="module")
def bed(made, testbed_factory):
    tb = testbed_factory([NodeSpec(NODE, engines="none", uv=True, mem_gb=16, models_mb=32, cache_mb=64, tmp_mb=512)])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, made, tmp_path_factory):
    weights = rt.publish_hf_dir(bed, "tiny/venv-chat", made["chat"])
    assert weights == WEIGHTS
    profile = {"engine": "vllm", **real.VLLM_VENV_PROFILE, "env": dict(real.VLLM_TEST_ENV),
               "start_timeout": f"{START_TIMEOUT:.0f}s"}
    models = [{"name": MODEL, "profile": "vllm-venv", "weights": weights, "scaling": {"min": 1}}]
    began = time.monotonic()
    gw = rt.start_gateway(bed, tmp_path_factory.mktemp("venv"), models=models, profiles={"vllm-venv": profile})
    try:
        rt.wait_serving(gw, MODEL, START_TIMEOUT + 60)
        print(f"venv vLLM: gateway start to a serving replica (build included) in {time.monotonic() - began:.1f} s")
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return rt.new_client(gateway, KEY)[0]


def _engine_argv(bed, gateway) -> list[str]:
    """The command line of the engine's main process, read from the node's own processes."""
    shard = rt.wait_serving(gateway, MODEL, 60)[0]["shards"][0]
    for pid in network.netns_pids(bed.node(NODE).netns):
        try:
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == str(shard["port"]):
            return argv
    raise AssertionError(f"no engine process listens on port {shard['port']} on {NODE}")


def test_the_node_has_no_engine_of_its_own(bed):
    found = bed.run(NODE, ["sh", "-c", "command -v vllm || echo none"])
    assert found.stdout.strip() == "none"


def test_chat_and_a_stream_with_usage_through_the_router(gateway, client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 0


def test_the_engine_runs_from_the_environment_llmgw_built(bed, gateway):
    argv = _engine_argv(bed, gateway)
    (program,) = [a for a in argv[:2] if a.endswith("/bin/vllm")]  # argv[0] is the env's python
    assert "/envs/venv-" in program, argv
    env_dir = program.rsplit("/bin/", 1)[0]
    sealed = bed.run(NODE, ["sh", "-c", f"test -f {env_dir}/.llmgw-complete && echo sealed"])
    assert sealed.stdout.strip() == "sealed"
    assert "built the environment" in gateway.log()


def test_a_second_replica_of_the_recipe_reuses_the_environment(gateway, client):
    before = gateway.log().count("built the environment")
    status, answer = gateway.admin("/api/models", "POST", (
        f"name: {MODEL}-2\nprofile: vllm-venv\nweights: {WEIGHTS}\nscaling: {{min: 1}}\n").encode())
    assert status == 201, answer
    rt.wait_serving(gateway, f"{MODEL}-2", START_TIMEOUT)
    assert gateway.log().count("built the environment") == before
    status, answer = gateway.admin(f"/api/models/{MODEL}-2", "DELETE")
    assert status == 200, answer
