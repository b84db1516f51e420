"""An engine port serves nothing without the replica's key, on every route the engine has, except
its health probe (R-4.6) — checked here on the real llama-server, launched through the built-in
template and the helper's launch op as llmgw launches it; vLLM's is checked in test_lora_engines.py
on that module's vLLM, whose runtime adapter routes are then among those it must refuse.

The routes come from the engine itself (vLLM's OpenAPI document, read with the key) or from its
documentation (llama-server's README routes, captured in fixtures/), plus paths that engines
serve outside those lists and a path that does not exist, so a route added later is covered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.router.engineload import parse_metrics
from tests.real_engines.engines import CHAT, EXTRA_ROUTES, bin_dir, launch_engine, probe_all, stop_engine
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a CPU engine start on a busy machine

FIXTURES = Path(__file__).with_name("fixtures")
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = bin_dir("llama-server")
    model = real.models()["gguf"]
    root = tmp_path_factory.mktemp("node") / "llmgw"
    root.mkdir()
    engine = launch_engine(root, "llama-server", directory, str(model), args=["-c", "1024"])
    yield engine
    stop_engine(engine, root)


def _llama_routes() -> list[tuple[str, str]]:
    routes = []
    for line in (FIXTURES / "llama-server-routes.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            method, path = line.split()
            routes.append((method, path))
    return routes


def test_llama_server_serves_no_route_without_the_key(llama):
    routes = _llama_routes()
    # llama-server's documented health probes answer anyone, with its status only.
    seen, served = probe_all(llama, routes + EXTRA_ROUTES, open_routes={("GET", "/health"), ("GET", "/v1/health")})
    print(f"\nllama-server: {len(set(routes))} documented routes, {len(seen)} requests without the key "
          f"or with a wrong one; statuses {sorted({s for *_, s in seen})}")
    assert served == [], served
    assert llama.request("GET", "/health")[0] == 200
    assert llama.request("POST", "/v1/chat/completions", body=CHAT, key=llama.key)[0] == 200
    assert llama.key not in " ".join(llama.argv), "the key is never in argv (R-1.6)"


def test_llama_server_metrics_are_on_behind_the_key(llama):
    """R-6.5e, R-4.6: the template turns on llama-server's /metrics, which answers only with the
    key, and the router reads the engine's queue from it."""
    assert "--metrics" in llama.argv
    assert llama.request("GET", "/metrics")[0] == 401
    status, page = llama.request("GET", "/metrics", key=llama.key)
    assert status == 200, page[:200]
    load = parse_metrics(page.decode())
    print(f"\nllama-server /metrics: {len(page)} bytes, read as {load}")
    assert load is not None and load.source == "llama-server"
    assert load.waiting == 0 and load.running is not None  # requests_deferred, requests_processing
