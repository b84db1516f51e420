"""The guard vLLM loads on an engine port, called as an ASGI app would be (R-4.6), and how the
vLLM template ships it. The real vLLM behind it: tests/real_engines/test_engine_ports.py."""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util

import pytest

from llmgw.engines import BUILTIN_ENGINES, VLLM_GUARD_FILE, ShardVars, vllm_guard

KEY = "llmgw-engine-0123456789abcdef"


def _guard_module():
    """The guard loaded from the package file the template ships (the bytes its hash names)."""
    with importlib.resources.as_file(importlib.resources.files("llmgw.remote") / VLLM_GUARD_FILE) as path:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == vllm_guard().sha256
        spec = importlib.util.spec_from_file_location("llmgw_vllm_guard", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


class App:
    def __init__(self):
        self.scopes = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"served"})


async def _call(monkeypatch, scope, key=KEY):
    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    app = App()
    guard = _guard_module().EngineKeyGuard(app)
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await guard(scope, receive, send)
    return app.scopes, sent


def _http(method, path, authorization=None, extra=()):
    headers = [(b"content-type", b"application/json"), *extra]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    return {"type": "http", "method": method, "path": path, "headers": headers}


@pytest.mark.parametrize("scope", [
    pytest.param(_http("POST", "/invocations"), id="invocations"),
    pytest.param(_http("POST", "/tokenize"), id="tokenize"),
    pytest.param(_http("GET", "/metrics"), id="metrics"),
    pytest.param(_http("POST", "/v1/chat/completions", "Bearer wrong"), id="wrong-key"),
    pytest.param(_http("POST", "/v1/chat/completions", KEY), id="no-scheme"),
    pytest.param(_http("POST", "/v1/chat/completions", f"Basic {KEY}"), id="other-scheme"),
    pytest.param(_http("POST", "/v1/chat/completions", f"Bearer {KEY}", [(b"authorization", b"Bearer x")]),
                 id="two-headers"),
    pytest.param(_http("POST", "/health"), id="health-not-get"),
    pytest.param(_http("GET", "/health/"), id="health-lookalike"),
    pytest.param(_http("OPTIONS", "/v1/models"), id="preflight"),
])
async def test_requests_without_the_key_are_refused(monkeypatch, scope):
    served, sent = await _call(monkeypatch, scope)
    assert served == []
    assert sent[0]["status"] == 401
    assert b"unauthorized" in sent[1]["body"]


async def test_the_key_opens_every_path_and_health_needs_none(monkeypatch):
    for scope in (_http("POST", "/invocations", f"Bearer {KEY}"), _http("GET", "/metrics", f"bearer  {KEY} "),
                  _http("GET", "/health")):
        served, sent = await _call(monkeypatch, scope)
        assert served == [scope] and sent[0]["status"] == 200


async def test_without_a_key_in_the_environment_only_health_is_served(monkeypatch):
    assert (await _call(monkeypatch, _http("GET", "/v1/models", "Bearer "), key=None))[1][0]["status"] == 401
    assert (await _call(monkeypatch, _http("GET", "/health"), key=None))[1][0]["status"] == 200


async def test_websockets_without_the_key_are_closed_and_lifespan_passes(monkeypatch):
    served, sent = await _call(monkeypatch, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert served == [] and sent == [{"type": "websocket.close", "code": 1008}]
    lifespan = {"type": "lifespan"}
    assert (await _call(monkeypatch, lifespan))[0] == [lifespan]


def test_the_vllm_template_ships_the_guard_and_keeps_the_key_out_of_argv():
    variables = ShardVars(model="/m", name="chat", host="0.0.0.0", port=20000, gpus_per_node=1, nnodes=1,
                          node_rank=0, leader_addr="", leader_port=0)
    spec = BUILTIN_ENGINES["vllm"].render(variables, [], {"PYTHONPATH": "/opt/extra"}, KEY)
    assert spec.argv[spec.argv.index("--middleware") + 1] == "llmgw_vllm_guard.EngineKeyGuard"
    assert spec.env["PYTHONPATH"] == "{shard_dir}:/opt/extra"
    assert spec.env["VLLM_API_KEY"] == KEY and KEY not in " ".join(spec.argv)
    text = spec.files[VLLM_GUARD_FILE]
    assert spec.file_sha256 == {VLLM_GUARD_FILE: hashlib.sha256(text.encode()).hexdigest()}
    worker = BUILTIN_ENGINES["vllm"].render(
        ShardVars(model="/m", name="chat", host="0.0.0.0", port=20000, gpus_per_node=8, nnodes=2, node_rank=1,
                  leader_addr="10.0.0.1", leader_port=29501), [], {}, KEY)
    assert "--headless" in worker.argv and "--middleware" not in worker.argv, "a headless rank serves no HTTP"
