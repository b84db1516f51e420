"""What a request body says about streaming, checked strictly, and the body its engine gets (R-6.9).

The router counts tokens from the engine's `usage`, which a streaming engine sends only when it is
asked (`stream_options.include_usage`). So the fields that decide whether an answer streams and
carries usage must mean one thing to the router and to the engine: `stream` is a boolean or
absent/null, `stream_options` an object or absent/null and allowed only with `stream: true` (as
OpenAI's API has it), `include_usage` a boolean. Anything else is refused, naming the field,
before an engine sees the request: an engine that took `"stream": 1` as true would stream an
answer the router expected whole, and its tokens would go uncounted. `continuous_usage_stats`
(vLLM's and SGLang's usage in every chunk) is a boolean too: the router asks those engines for it on
every stream, so a stream the client cuts short is still counted exactly (R-6.9a).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmgw.router.errors import BadRequest, InvalidType

_ASK_FOR_USAGE = b'{"stream_options": {"include_usage": true}, '
_ASK_FOR_EVERY_USAGE = b'{"stream_options": {"include_usage": true, "continuous_usage_stats": true}, '
# The engines whose streams put usage in every chunk when asked (`continuous_usage_stats`): vLLM
# and SGLang. llama-server has no such option; a custom engine or a provider may refuse the field.
CONTINUOUS_USAGE_ENGINES = frozenset({"vllm", "sglang"})


@dataclass(frozen=True)
class Streaming:
    """How a request is answered: streamed or not, and whether the client asked for the usage event."""

    stream: bool
    client_wants_usage: bool
    client_wants_continuous: bool = False  # usage in every chunk, as vLLM has it with include_usage


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def streaming(document: dict) -> Streaming:
    """Read `stream` and `stream_options` from a request; InvalidType or BadRequest names the field."""
    stream = document.get("stream")
    if stream is not None and type(stream) is not bool:
        raise InvalidType(f"'stream' must be a boolean (true or false), got {_json_type(stream)}",
                          param="stream")
    options = document.get("stream_options")
    if options is None:
        return Streaming(stream is True, False)
    if type(options) is not dict:
        raise InvalidType(f"'stream_options' must be an object, got {_json_type(options)}",
                          param="stream_options")
    if stream is not True:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        if name in options and type(options[name]) is not bool:
            raise InvalidType(f"'{name}' in 'stream_options' must be a boolean (true or false), "
                              f"got {_json_type(options[name])}", param=f"stream_options.{name}")
    usage = options.get("include_usage") is True
    return Streaming(True, usage, usage and options.get("continuous_usage_stats") is True)


def ask_for_usage(document: dict, body: bytes, continuous: bool = False) -> bytes:
    """The body of a streamed request with `include_usage: true` (and `continuous_usage_stats: true`
    when `continuous`); `document` is changed to match.

    The engine sends usage in a stream only when asked, and the router counts every answer.
    """
    wanted = {"include_usage": True, "continuous_usage_stats": True} if continuous else {"include_usage": True}
    options = document.get("stream_options")
    if options is not None:
        if all(options.get(name) is True for name in wanted):
            return body
        options.update(wanted)
        return json.dumps(document).encode()
    present = "stream_options" in document  # as null: a key put first would be overridden by it
    document["stream_options"] = wanted
    if not present:
        # The body is a JSON object without the key, so it can go first without re-encoding.
        start = body.find(b"{")
        if start >= 0 and not body[:start].strip() and json.detect_encoding(body) == "utf-8":
            return (_ASK_FOR_EVERY_USAGE if continuous else _ASK_FOR_USAGE) + body[start + 1:]
    # A null to replace, a byte-order mark or another encoding (UTF-16 and -32 need no mark).
    return json.dumps(document).encode()
