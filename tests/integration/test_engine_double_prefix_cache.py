"""The engine double's SIMULATED prefix cache (tests/testbed/doubles/engine_double.py): what the
routing bench's fleet of doubles rests on. Leading blocks of words found in cache are not prefilled
again; the least recently used blocks go first; /metrics counts queries and hits as vLLM does."""

from __future__ import annotations

import json
import urllib.request

import pytest

from llmgw.router.engineload import parse_metrics
from tests.integration.test_router_support import engines  # noqa: F401

SYSTEM = {"role": "system", "content": " ".join(f"rule{i}" for i in range(64))}  # 65 words with the role


@pytest.fixture
def engine(engines):  # noqa: F811
    return engines.start("m", prefix_cache_blocks=8, block_words=16, prefill_per_token=0)


def _chat(engine, messages: list[dict]) -> dict:
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 2}).encode()
    request = urllib.request.Request(engine.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["usage"]


def _load(engine):
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as answer:
        return parse_metrics(answer.read().decode())


def test_leading_blocks_seen_before_are_cached_and_counted(engine):
    first = _chat(engine, [SYSTEM, {"role": "user", "content": "hello there"}])
    second = _chat(engine, [SYSTEM, {"role": "user", "content": "another question"}])
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # 65 system words + "user": the first 4 blocks of 16 words are shared; the 5th holds the user words.
    assert second["prompt_tokens_details"]["cached_tokens"] == 64
    load = _load(engine)
    assert (load.prefix_queries, load.prefix_hits) == (2 * 68, 64)
    assert load.waiting == 0


def test_least_recently_used_blocks_are_evicted_first(engine):
    other = {"role": "system", "content": " ".join(f"other{i}" for i in range(64))}
    _chat(engine, [SYSTEM, {"role": "user", "content": "hello"}])  # 4 blocks of 8
    _chat(engine, [other, {"role": "user", "content": "hello"}])  # 4 more: the cache is full
    _chat(engine, [other, {"role": "user", "content": "again"}])  # other's blocks most recent now
    third = {"role": "system", "content": " ".join(f"third{i}" for i in range(32))}
    _chat(engine, [third, {"role": "user", "content": "hi"}])  # 2 blocks: SYSTEM's oldest two go
    assert _chat(engine, [other, {"role": "user", "content": "x"}])["prompt_tokens_details"]["cached_tokens"] == 64
    assert _chat(engine, [SYSTEM, {"role": "user", "content": "x"}])["prompt_tokens_details"]["cached_tokens"] == 0
