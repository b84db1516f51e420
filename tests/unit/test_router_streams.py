"""The stream fields of a request, read strictly, and the body a stream's engine gets (R-6.9)."""

from __future__ import annotations

import json

import pytest

from llmgw.router.errors import BadRequest, InvalidType
from llmgw.router.streams import Streaming, ask_for_usage, streaming


@pytest.mark.parametrize("fields,expected", [
    pytest.param({}, Streaming(False, False), id="absent"),
    pytest.param({"stream": None, "stream_options": None}, Streaming(False, False), id="nulls"),
    pytest.param({"stream": False}, Streaming(False, False), id="false"),
    pytest.param({"stream": True}, Streaming(True, False), id="true"),
    pytest.param({"stream": True, "stream_options": None}, Streaming(True, False), id="options-null"),
    pytest.param({"stream": True, "stream_options": {}}, Streaming(True, False), id="options-empty"),
    pytest.param({"stream": True, "stream_options": {"include_usage": False}}, Streaming(True, False),
                 id="usage-false"),
    pytest.param({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                 Streaming(True, True, True), id="usage-true-continuous"),
    pytest.param({"stream": True, "stream_options": {"continuous_usage_stats": True}}, Streaming(True, False, False),
                 id="continuous-without-usage-is-none"),
])
def test_r6_9_accepted_stream_fields(fields, expected):
    assert streaming({"model": "m", **fields}) == expected


@pytest.mark.parametrize("fields,error,param", [
    pytest.param({"stream": 1}, InvalidType, "stream", id="stream-1"),
    pytest.param({"stream": 0}, InvalidType, "stream", id="stream-0"),
    pytest.param({"stream": "true"}, InvalidType, "stream", id="stream-string"),
    pytest.param({"stream": [True]}, InvalidType, "stream", id="stream-array"),
    pytest.param({"stream": True, "stream_options": True}, InvalidType, "stream_options", id="options-bool"),
    pytest.param({"stream": True, "stream_options": "x"}, InvalidType, "stream_options", id="options-string"),
    pytest.param({"stream_options": {}}, BadRequest, "stream_options", id="options-without-stream"),
    pytest.param({"stream": None, "stream_options": {}}, BadRequest, "stream_options", id="options-stream-null"),
    pytest.param({"stream": False, "stream_options": {"include_usage": True}}, BadRequest, "stream_options",
                 id="options-stream-false"),
    pytest.param({"stream": True, "stream_options": {"include_usage": None}}, InvalidType,
                 "stream_options.include_usage", id="usage-null"),
    pytest.param({"stream": True, "stream_options": {"include_usage": 1}}, InvalidType,
                 "stream_options.include_usage", id="usage-1"),
])
def test_r6_1_refused_stream_fields_name_the_field(fields, error, param):
    with pytest.raises(error) as refused:
        streaming({"model": "m", **fields})
    assert refused.value.param == param and refused.value.status == 400
    assert f"'{param.rpartition('.')[2]}'" in refused.value.message


@pytest.mark.parametrize("body", [
    pytest.param(b'{"model": "m", "stream": true}', id="absent"),
    pytest.param(b'  {"model": "m", "stream": true}', id="leading-space"),
    pytest.param(b'{"model": "m", "stream": true, "stream_options": null}', id="null"),
    pytest.param(b'{"stream_options": null, "model": "m", "stream": true}', id="null-first"),
    pytest.param(b'{"model": "m", "stream": true, "stream_options": {"include_usage": false, "x": 1}}', id="false"),
    pytest.param(b'{"model": "m", "stream": true, "stream_options": {}}', id="empty"),
    pytest.param('\ufeff{"model": "m", "stream": true}'.encode(), id="utf8-bom"),
    pytest.param('{"model": "m", "stream": true}'.encode("utf-16-le"), id="utf16"),
])
def test_r6_9_a_stream_always_asks_the_engine_for_usage(body):
    document = json.loads(body)
    sent = json.loads(ask_for_usage(document, body))
    assert sent["stream_options"]["include_usage"] is True
    assert sent == document  # the document the router keeps says what the engine was sent
    assert sent["model"] == "m" and sent["stream"] is True
    assert sent["stream_options"].get("x", 1) == 1  # other options pass through


def test_r6_9_a_body_that_already_asks_is_sent_as_it_came():
    body = b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'
    assert ask_for_usage(json.loads(body), body) is body
