"""The pure parts of the API surface: the route table, response ids, multipart heads, usage per dialect."""

from __future__ import annotations

import pytest

from llmgw.catalog import Catalog
from llmgw.config import EngineConfig, ModelConfig, ProfileConfig
from llmgw.router import response_ids
from llmgw.router.errors import BadRequest
from llmgw.control.feed import routed_models
from llmgw.router.routes import ROUTES, serves
from llmgw.router.uploads import NEED_MORE, find_model_field
from llmgw.router.usage import anthropic_stream_usage, find_usage, tokens

ROUTE = {route.name: route for route in ROUTES}


def test_r6_12_the_table_says_which_engine_serves_which_route():
    vllm, sglang, llama = "vllm", "sglang", "llama-server"
    assert serves(ROUTE["POST /v1/messages"], vllm) and serves(ROUTE["POST /v1/messages"], llama)
    assert not serves(ROUTE["POST /v1/messages"], sglang)
    assert not serves(ROUTE["POST /v1/score"], llama) and serves(ROUTE["POST /v1/score"], sglang)
    assert not serves(ROUTE["GET /v1/responses/{response_id}"], llama)  # it stores nothing
    assert [r.name for r in ROUTES if serves(r, sglang) and r.path.startswith("/v1/audio")] == []
    assert [r.path for r in ROUTES if serves(r, llama) and r.path.startswith("/v1/audio")] == ["/v1/audio/transcriptions"]
    assert ROUTE["POST /rerank"].upstream_path("sglang") == "/v1/rerank"  # SGLang has no /rerank
    assert ROUTE["POST /v1/responses/{response_id}/cancel"].upstream_path("vllm", "resp_1") == "/v1/responses/resp_1/cancel"


def test_r6_12_custom_engines_and_static_endpoints_get_every_route():
    catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="c")],
                            profiles={"c": ProfileConfig(engine="vllm")}, engines={"vllm": EngineConfig(command=["x"])})
    # a custom engine may even take a built-in's name: the feed says it is no built-in engine
    assert routed_models(catalog)["m"].engine is None
    assert all(serves(route, None) for route in ROUTES)
    assert ROUTE["POST /rerank"].upstream_path(None) == "/rerank"


IDS = response_ids.ResponseIds("ab" * 32)


@pytest.mark.parametrize("model,replica", [("m", "m-1a2b3c4d"), ("qwen-0.5b:q4", "static:qwen-0.5b:q4:0"), ("é", "r.1")])
def test_r6_14_response_ids_carry_model_replica_and_key(model, replica):
    client_id = IDS.seal(model, replica, "key-1", "resp_abc-123_x")
    assert client_id.startswith("resp_") and "/" not in client_id and "resp_abc" not in client_id
    assert IDS.open(client_id).fields() == (model, replica, "key-1", "resp_abc-123_x")
    # another gateway's secret (or none) opens nothing
    assert response_ids.ResponseIds("cd" * 32).open(client_id) is None


def _tampered(client_id: str) -> str:
    token, seal = client_id[len("resp_"):].split(".")
    other = response_ids.ResponseIds("cd" * 32).seal("m", "r", "key-2", "resp_1")
    return "resp_" + other[len("resp_"):].split(".")[0] + "." + seal


@pytest.mark.parametrize("client_id", [
    "resp_abc", "resp_.x", "resp_x.", "chatcmpl-1", "resp_bm90IGpzb24.x", "resp_WyJtIl0.x", "resp_%%%.x", "",
    IDS.seal("m", "r", "k", "resp_1")[:-1] + "A", IDS.seal("m", "r", "k", "resp_1") + "x",
    _tampered(IDS.seal("m", "r", "k", "resp_1")), "resp_" + "A" * 3000 + ".AAAAAAAAAAAAAAAAAAAAAA",
])
def test_r6_14_ids_not_sealed_by_this_gateway_open_to_none(client_id):
    assert IDS.open(client_id) is None


@pytest.mark.parametrize("engine_id", ["resp_x/../metrics", "resp_x?z=1", "resp_x#y", "resp_x\\y", "resp_x\0",
                                       "resp_x\u2024", "resp_", "x_1", "resp_" + "a" * 129])
def test_r6_14a_only_an_engine_id_as_engines_write_it_is_sealed_or_put_in_a_path(engine_id):
    with pytest.raises(ValueError):
        IDS.seal("m", "r", "k", engine_id)
    with pytest.raises(ValueError):
        ROUTE["GET /v1/responses/{response_id}"].upstream_path("vllm", engine_id)


def test_r6_14_rewrite_touches_response_ids_only():
    body = (b'{"id": "resp_1", "previous_response_id":"resp_0", "output": [{"id": "msg_1", "text": "\\"id\\": resp_9"}],'
            b' "item_id": "resp_2"}')
    out = IDS.rewrite(body, "m", "r", "k")
    assert IDS.seal("m", "r", "k", "resp_1").encode() in out
    assert IDS.seal("m", "r", "k", "resp_0").encode() in out
    assert b'"id": "msg_1"' in out and b'"item_id": "resp_2"' in out and b"resp_9" in out
    assert IDS.rewrite(b'{"id": "chatcmpl-1"}', "m", "r", "k") == b'{"id": "chatcmpl-1"}'
    assert "ab" * 32 not in repr(IDS)


D = b"--xyz"


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    extra = f'; filename="{filename}"' if filename else ""
    return D + f'\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode() + value + b"\r\n"


def test_r6_15_the_model_field_is_found_before_the_file():
    head = part("language", b"en") + part("model", b"whisper-small") + part("file", b"RIFF", "a.wav") + D + b"--\r\n"
    model, start, end = find_model_field(head, D)
    assert model == "whisper-small" and head[start:end] == b"whisper-small"
    assert find_model_field(head[:len(part("language", b"en")) + 20], D) is NEED_MORE
    assert find_model_field(b"", D) is NEED_MORE


@pytest.mark.parametrize("head,fragment", [
    pytest.param(part("file", b"RIFF", "a.wav") + part("model", b"m"), "before the file", id="file-first"),
    pytest.param(part("language", b"en") + D + b"--\r\n", "no 'model' field", id="no-model"),
    pytest.param(part("model", b"\xff\xfe") + D + b"--\r\n", "not UTF-8", id="not-utf8"),
    pytest.param(D + b'\r\nContent-Disposition: form-data; name="model"; filename*=UTF-8\'\'m\r\n\r\nx\r\n', "before the file",
                 id="model-as-a-file"),
])
def test_r6_15_bad_multipart_heads_are_refused(head, fragment):
    with pytest.raises(BadRequest, match=fragment):
        find_model_field(head, D)


def test_r6_13_tokens_are_counted_alike_in_every_dialect():
    assert tokens({"prompt_tokens": 3, "completion_tokens": 5}) == (3, 5)
    assert tokens({"input_tokens": 3, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 2}}) == (3, 5)
    # Anthropic's input_tokens leave out what came from its cache: added back
    assert tokens({"input_tokens": 1, "cache_read_input_tokens": 2, "cache_creation_input_tokens": 4, "output_tokens": 5}) == (7, 5)
    assert tokens({"input_tokens": None, "output_tokens": "5"}) == (0, 0)
    assert tokens(None) == (0, 0)
    assert find_usage(b'{"usage": {"total_tokens": 4}}') is None  # nothing that says prompt or completion
    assert find_usage(b'{"usage": {"input_tokens": 4}}') == {"input_tokens": 4}


def test_r6_13_anthropic_stream_usage_merges_start_and_delta():
    start = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":5,"output_tokens":1}}}\n\n'
    delta = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":9}}\n\n'
    assert tokens(anthropic_stream_usage(start + delta, delta)) == (5, 9)
    # a short stream: head and tail hold both; message_start's input still counts
    assert tokens(anthropic_stream_usage(start + delta, start + delta)) == (5, 9)
    # message_delta with input counts (vLLM) wins
    full = b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":6,"output_tokens":9}}\n\n'
    assert tokens(anthropic_stream_usage(start, full)) == (6, 9)
    assert anthropic_stream_usage(b": ping\n\n", b"") is None
