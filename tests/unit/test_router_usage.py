"""Finding usage in answers and streams without parsing them whole (R-6.9)."""

from __future__ import annotations

import json

import pytest

from llmgw.contracts.feed import USAGE_BUCKET_SECONDS as BUCKET_SECONDS
from llmgw.router.usage import (TAIL_BYTES, UsageMeter, complete_events_end, find_usage, strip_usage,
                                tokens, usage_from_body)

USAGE = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def event(document) -> bytes:
    return b"data: " + json.dumps(document).encode() + b"\n\n"


@pytest.mark.parametrize("body", [
    pytest.param(json.dumps({"id": "x", "choices": [], "usage": USAGE, "kv_transfer_params": None}), id="compact"),
    pytest.param(json.dumps({"usage": USAGE}, indent=2), id="indented"),
    pytest.param(json.dumps({"data": [{"embedding": [0.1] * 3000}], "usage": USAGE}), id="big-embedding"),
    pytest.param(json.dumps({"choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 99}'}}],
                            "usage": USAGE}), id="usage-in-content"),
])
def test_r6_9_usage_from_body(body):
    assert usage_from_body(body.encode()) == USAGE


def test_r6_9_usage_far_from_the_end_falls_back_to_a_full_parse():
    body = json.dumps({"usage": USAGE, "padding": "x" * (2 * TAIL_BYTES)}).encode()
    assert usage_from_body(body) == USAGE


@pytest.mark.parametrize("body", [b"", b"not json", b'{"usage": null}', b'{"usage": "many"}', b"[1]"])
def test_r6_9_no_usage(body):
    assert usage_from_body(body) is None
    assert tokens(usage_from_body(body)) == (0, 0)


def test_r6_9_usage_null_chunks_are_skipped_for_the_real_one():
    stream = event({"choices": [{"delta": {}}], "usage": None}) + event({"choices": [], "usage": USAGE}) \
        + b"data: [DONE]\n\n"
    assert find_usage(stream) == USAGE


def test_r6_9_strip_the_usage_only_event():
    content = event({"choices": [{"delta": {"content": "[]"}}]})
    usage_event = event({"id": "c", "choices": [], "usage": USAGE})
    data = content + usage_event + b"data: [DONE]\n\n"
    kept, usage = strip_usage(data, final=True, continuous=False)
    assert usage == USAGE
    assert kept == content + b"data: [DONE]\n\n"


def test_r6_9_events_with_empty_choices_but_no_usage_are_kept():
    data = event({"choices": [], "usage": None}) + event({"choices": [], "note": "usage"})
    assert strip_usage(data, final=True, continuous=True) == (data, None)


@pytest.mark.parametrize("spacing", [pytest.param(b",", id="compact"), pytest.param(b", ", id="spaced")])
def test_r6_9a_continuous_usage_is_cut_from_each_chunk_and_the_last_kept(spacing):
    """vLLM's `continuous_usage_stats` puts cumulative usage last in every chunk; a client that did
    not ask gets each chunk as it would have without it, and the router keeps the latest counts."""
    def chunk(n):
        return (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"la"}}]' + spacing
                + b'"usage":{"prompt_tokens":5,"total_tokens":%d,"completion_tokens":%d}}' % (5 + n, n))
    data = chunk(1) + b"\n\n" + chunk(2) + b"\n\n"
    final = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    kept, usage = strip_usage(data, final=False, continuous=True)
    plain = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"la"}}]}'
    assert kept == plain + b"\n\n" + plain + b"\n\n"
    assert usage == {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
    assert strip_usage(data + final, final=False, continuous=True)[0] == kept + final  # include_usage kept
    first = b'data: {"usage":{"prompt_tokens":5,"completion_tokens":0},"choices":[]}'.replace(b"[]", b"[{}]")
    assert strip_usage(first + b"\n\n", final=True, continuous=True)[0] == b'data: {"choices":[{}]}\n\n'


@pytest.mark.parametrize("data,end", [
    (b"data: a\n\ndata: b", 9), (b"data: a\n\n", 9), (b"data: partial", 0),
    (b"data: a\r\n\r\ndata: b", 11), (b"", 0),
])
def test_complete_events_end(data, end):
    assert complete_events_end(data) == end


def test_meter_drains_once_into_report_rows():
    meter = UsageMeter()
    assert meter.drain() == ((), {})  # nothing counted when idle
    meter.add("k1", "m", 3, 5)
    meter.add("k1", "m", 1, 0)
    meter.add("k2", "m", 2, 2)
    meter.key_used("k1", 123.0)
    rows, key_use = meter.drain()
    assert meter.drain() == ((), {})  # handed over once
    assert {row.key_id: (row.requests, row.prompt_tokens, row.completion_tokens) for row in rows} == \
        {"k1": (2, 4, 5), "k2": (1, 2, 2)}
    assert {row.bucket % BUCKET_SECONDS for row in rows} == {0}
    assert key_use == {"k1": 123.0}
