"""An engine port serves nothing without the replica's key, on every route the engine has, except
its health probe (R-4.6) — checked on the real vLLM and llama-server, launched through the
built-in templates and the helper's launch op as llmgw launches them.

The routes come from the engine itself (vLLM's OpenAPI document, read with the key) or from its
documentation (llama-server's README routes, captured in fixtures/), plus paths that engines
serve outside those lists and a path that does not exist, so a route added later is covered.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmgw.router.engineload import parse_metrics
from tests.real_engines.engines import bin_dir, launch_engine, stop_engine
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a CPU engine start on a busy machine

FIXTURES = Path(__file__).with_name("fixtures")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# Served by engines outside their route lists, or named by ENGINES.md as open on some engine.
EXTRA_ROUTES = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                ("GET", "/slots"), ("GET", "/props"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
                ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/llmgw-no-such-path")]
REFUSED = {401, 403, 404}


def _concrete(path: str) -> str:
    """A route template with its parameters filled in: /v1/models/{model} -> /v1/models/x."""
    return re.sub(r"\{[^}]+\}", "x", path)


def _probe_all(engine, routes, open_routes):
    """Every route without the key (and with a wrong one): status per route, and what was served."""
    served = []
    seen = []
    for method, path in sorted(set(routes)):
        url = _concrete(path)
        body = CHAT if method in ("POST", "PUT", "PATCH") else None
        for key in (None, "not-the-key"):
            status, data = engine.request(method, url, body=body, key=key)
            seen.append((method, url, key is not None, status))
            if (method, url) in open_routes:
                continue
            if status not in REFUSED:
                served.append((method, url, "wrong key" if key else "no key", status, data[:120]))
    return seen, served


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    directory = bin_dir("vllm")
    model = real.models()["chat"]
    root = tmp_path_factory.mktemp("node") / "llmgw"
    root.mkdir()
    engine = launch_engine(root, "vllm", directory, str(model), args=["--max-model-len", "1024"],
                           env=real.VLLM_TEST_ENV)
    yield engine
    stop_engine(engine, root)


def test_vllm_serves_no_route_without_the_key(vllm):
    status, data = vllm.request("GET", "/openapi.json", key=vllm.key)
    assert status == 200, data[:200]
    document = json.loads(data)
    routes = [(method.upper(), path) for path, methods in document["paths"].items() for method in methods]
    assert ("POST", "/invocations") in routes and ("POST", "/v1/chat/completions") in routes
    seen, served = _probe_all(vllm, routes + EXTRA_ROUTES, open_routes={("GET", "/health")})
    print(f"\nvLLM: {len(set(routes))} routes from its OpenAPI document, {len(seen)} requests without the key "
          f"or with a wrong one; statuses {sorted({s for *_, s in seen})}")
    assert served == [], served
    assert vllm.request("GET", "/health")[0] == 200
    # The key still opens what llmgw uses, and what vLLM alone left open is now behind it too.
    assert vllm.request("POST", "/v1/chat/completions", body=CHAT, key=vllm.key)[0] == 200
    assert vllm.request("POST", "/invocations", body=CHAT, key=vllm.key)[0] == 200
    assert vllm.request("POST", "/tokenize", body={"model": "tiny", "prompt": "hello"}, key=vllm.key)[0] == 200
    assert vllm.key not in " ".join(vllm.argv), "the key is never in argv (R-1.6)"


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
    seen, served = _probe_all(llama, routes + EXTRA_ROUTES, open_routes={("GET", "/health"), ("GET", "/v1/health")})
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
