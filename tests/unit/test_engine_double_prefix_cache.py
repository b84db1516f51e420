"""The engine double's SIMULATED prefix cache (tests/testbed/doubles/engine_double.py): what the
routing bench's simulated fleet rests on. Leading blocks of words found in cache are not prefilled
again; the least recently used blocks go first; /metrics counts queries and hits as vLLM does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmgw.router.engineload import parse_metrics

DOUBLES = Path(__file__).resolve().parents[1] / "testbed" / "doubles"
SYSTEM = {"role": "system", "content": " ".join(f"rule{i}" for i in range(64))}  # 65 words with the role


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def engine(tmp_path):
    port = _free_port()
    env = {**os.environ, "HOME": str(tmp_path), "ENGINE_DOUBLE_PREFIX_CACHE_BLOCKS": "8",
           "ENGINE_DOUBLE_BLOCK_WORDS": "16", "ENGINE_DOUBLE_PREFILL_PER_TOKEN": "0"}
    code = (f"import sys; sys.path.insert(0, {str(DOUBLES)!r}); import engine_double; "
            f"sys.exit(engine_double.main('vllm', ['serve', 'm', '--host', '127.0.0.1', '--port', '{port}']))")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("the engine double did not start")
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait()


def _chat(url: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["usage"]


def _counters(url: str):
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        return parse_metrics(answer.read().decode())


def test_leading_blocks_seen_before_are_cached_and_counted(engine):
    first = _chat(engine, [SYSTEM, {"role": "user", "content": "hello there"}])
    second = _chat(engine, [SYSTEM, {"role": "user", "content": "another question"}])
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # 65 system words + "user": the first 4 blocks of 16 words are shared; the 5th holds the user words.
    assert second["prompt_tokens_details"]["cached_tokens"] == 64
    load = _counters(engine)
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
