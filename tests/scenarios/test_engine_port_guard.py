"""A vLLM replica llmgw starts on a node answers nothing without its key but /health: the built-in
template ships the guard, the helper writes it beside the engine (R-4.6). Against the engine
double, which honours the guard as the real vLLM does (tests/real_engines checks the real one)."""

from __future__ import annotations

import urllib.error
import urllib.request

import openai
import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]


def _status(url: str, data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_vllm_replica_serves_only_the_router(testbed_factory, tmp_path):
    bed = testbed_factory([NodeSpec.gpu_node("g1", count=1)])
    try:
        inventory = write_inventory(bed, tmp_path / "inventory.yaml", profiles={"v": {"engine": "vllm", "gpus": 1}},
                                    models=[{"name": "chat", "profile": "v", "scaling": {"min": 1}}])
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        try:
            ctl = Ctl(gateway)
            replica = wait_for(lambda: next((r for r in ctl.json("replicas")["replicas"] if r["serving"]), None),
                               60, f"chat to serve\n{gateway.log()[-2000:]}")
            engine = f"http://{bed.nodes['g1'].address}:{replica['shards'][0]['port']}"
            assert _status(engine + "/health") == 200
            for path, data in (("/metrics", None), ("/v1/models", None), ("/invocations", b"{}"),
                               ("/tokenize", b"{}"), ("/no-such-path", None)):
                assert _status(engine + path, data) == 401, path
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.create_key("guard"), max_retries=0)
            # Keys reach the router within its refresh period: ask until it knows this one.
            reply = wait_for(lambda: client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}]), 30, "an answer through the router")
            assert reply.choices[0].message.content.startswith("chat")
        finally:
            gateway.stop()
    finally:
        bed.close()
