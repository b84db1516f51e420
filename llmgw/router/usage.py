"""Token usage per key and model (R-6.9): found in the engine's answer, counted in memory, reported in batches.

Answers are never parsed whole on the hot path: `usage` sits at the end of an OpenAI answer and in
the last event of a stream (Responses: `response.completed`; Anthropic: `message_delta`, with the
input counts also in `message_start` at the head), so it is looked for in the tail. For a stream the router asks the
engine for `stream_options.include_usage` and, when the client did not ask for it, removes the
usage-only event (`"choices": []` with `usage`) before it reaches the client. vLLM and SGLang are
also asked for `continuous_usage_stats` (usage in every chunk), removed from each chunk unless the
client asked for it, so a stream cut before its end still has exact counts.

A stream that ends without usage (cut by the client or the engine before the usage event, or from
an engine that sends none) is counted from what was relayed (R-6.9a): the prompt from the engine's
own count where an event carried it (Anthropic's message_start), else the request body's bytes / 4
as the limits estimate it; the completion as one token per event relayed. That is an estimate,
reported apart (`estimated_tokens`). A request with no usage and nothing relayed is `unmetered`:
its tokens are unknown, not 0.
"""

from __future__ import annotations

import json
import time

from llmgw.contracts.feed import USAGE_BUCKET_SECONDS, UsageRow
from llmgw.router.engine_figures import add, clamp
from llmgw.router.limits import BYTES_PER_TOKEN

TAIL_BYTES = 4096
_USAGE = b'"usage"'
_decoder = json.JSONDecoder()


def find_usage(data: bytes, start: int = 0) -> dict | None:
    """The last `"usage": {...}` object in data[start:], or None (a `"usage": null` is skipped)."""
    end = len(data)
    while True:
        pos = data.rfind(_USAGE, start, end)
        if pos < 0:
            return None
        end = pos
        if pos and data[pos - 1] == 0x5C:  # \"usage\" inside a string, not a key
            continue
        text = data[pos + len(_USAGE):pos + len(_USAGE) + TAIL_BYTES].decode("utf-8", "replace").lstrip()
        if not text.startswith(":"):
            continue
        try:
            value, _ = _decoder.raw_decode(text[1:].lstrip())
        except ValueError:
            continue
        if isinstance(value, dict) and ("prompt_tokens" in value or "input_tokens" in value
                                        or "output_tokens" in value):
            return value


def usage_from_body(body: bytes) -> dict | None:
    """Usage of a non-streamed answer: from its tail, else from the whole document."""
    usage = find_usage(body, max(0, len(body) - TAIL_BYTES))
    if usage is None and len(body) > TAIL_BYTES:
        try:
            document = json.loads(body)
        except ValueError:
            return None
        usage = document.get("usage") if isinstance(document, dict) else None
        if not isinstance(usage, dict):
            return None
    return usage


def complete_events_end(data: bytes) -> int:
    """Index just past the last complete SSE event in data (0 when there is none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _usage_member(event: bytes, at: int) -> tuple[int, int, dict] | None:
    """(start, end, value) of the `"usage": {...}` member at `at` in a JSON event, with the comma
    that separates it from its neighbour, so that event[:start] + event[end:] is the event without it."""
    i = at + len(_USAGE)
    while i < len(event) and event[i] in b" \t":
        i += 1
    if i >= len(event) or event[i] != 0x3A:  # ':'
        return None
    i += 1
    while i < len(event) and event[i] in b" \t":
        i += 1
    try:
        value, size = _decoder.raw_decode(event[i:].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not ("prompt_tokens" in value or "completion_tokens" in value):
        return None
    end = i + size
    start = at
    while start > 0 and event[start - 1] in b" \t":
        start -= 1
    if start > 0 and event[start - 1] == 0x2C:  # ',' before: the member is not the first
        return start - 1, end, value
    while end < len(event) and event[end] in b" \t":
        end += 1
    if end < len(event) and event[end] == 0x2C:
        end += 1
    return at, end, value


def strip_usage(data: bytes, final: bool, continuous: bool) -> tuple[bytes, dict | None]:
    """Complete SSE events without their usage: the usage-only event when `final`, the usage
    member of every other chunk when `continuous`; returns what is left and the last usage seen
    (the engine's counts are cumulative, so the last is the latest)."""
    usage = None
    kept = []
    for event in data.split(b"\n\n"):
        at = event.rfind(_USAGE)
        if at < 0:
            kept.append(event)
            continue
        if b"[]" in event:
            payload = event.strip()
            document = None
            if payload.startswith(b"data:"):
                try:
                    document = json.loads(payload[5:])
                except ValueError:
                    pass
            if isinstance(document, dict) and document.get("choices") == [] \
                    and isinstance(document.get("usage"), dict):
                usage = document["usage"]
                if not final:
                    kept.append(event)
                continue
        if continuous and (member := _usage_member(event, at)) is not None:
            start, end, usage = member
            event = event[:start] + event[end:]
        kept.append(event)
    return b"\n\n".join(kept), usage


def _count(usage: dict, name: str) -> int:
    """A token count of the engine's usage: 0 when it is not an integer, clamped to [0, MAX_COUNT]
    (logged) when it is out of range, so that no figure an engine makes up stops the reports (R-10.8)."""
    value = usage.get(name)
    return clamp(value, f"usage.{name}") if type(value) is int else 0


def tokens(usage: dict | None) -> tuple[int, int]:
    """(prompt, completion) from OpenAI's usage, or from Responses' and Anthropic's.

    Anthropic's `input_tokens` leaves out the prompt tokens read from or written to its cache
    (vLLM subtracts them from its prompt tokens), so those are added back: the prompt is counted
    the same in every dialect.
    """
    if not usage:
        return 0, 0
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    prompt = add(add(_count(usage, "input_tokens"), _count(usage, "cache_read_input_tokens")),
                 _count(usage, "cache_creation_input_tokens"))
    return prompt, _count(usage, "output_tokens")


def anthropic_stream_usage(head: bytes, tail: bytes) -> dict | None:
    """An Anthropic stream's usage: message_start's (in the head), updated by message_delta's (in the tail).

    message_delta's counts are cumulative and win; its input counts may be absent, then
    message_start's stand.
    """
    at = head.find(b"message_start")
    start = None
    if at >= 0:
        end = head.find(b"\n\n", at)
        start = find_usage(head[at:end if end >= 0 else len(head)])
    end = find_usage(tail)
    if start is None:
        return end
    return {**start, **(end or {})}


def estimate_stream(body_size: int, events: int, prompt: int | None = None) -> tuple[int, int, int]:
    """(prompt, completion, estimated) of a stream that carried no usage (R-6.9a): the prompt the
    engine reported, else body bytes / 4 (as limits.estimate reads a body); a token per event relayed."""
    guessed = prompt is None
    if guessed:
        prompt = body_size // BYTES_PER_TOKEN
    return prompt, events, (prompt if guessed else 0) + events


class UsageMeter:
    """Counts per (key id, model) in memory; `drain` hands them over once, for the router's next report.
    Sums saturate at MAX_COUNT, the most a report's row may carry (R-10.8)."""

    def __init__(self):
        self._counts: dict[tuple[str, str, str], list[int]] = {}  # (key id, model, via alias) ->
        self._key_use: dict[str, float] = {}

    def add(self, key_id: str, model: str, prompt: int, completion: int, estimated: int = 0,
            unmetered: bool = False, via: str = "") -> None:
        """One request: its tokens (`estimated` of them estimated), or `unmetered`: tokens unknown;
        `via`, the alias the client named the model by (R-8.7)."""
        counts = self._counts.get((key_id, model, via))
        if counts is None:
            counts = self._counts[(key_id, model, via)] = [0, 0, 0, 0, 0]
        counts[0] = add(counts[0], 1)
        counts[1] = add(counts[1], prompt)
        counts[2] = add(counts[2], completion)
        counts[3] = add(counts[3], estimated)
        counts[4] = add(counts[4], int(unmetered))

    def key_used(self, key_id: str, when: float) -> None:
        self._key_use[key_id] = when

    def drain(self) -> tuple[tuple[UsageRow, ...], dict[str, float]]:
        """Everything counted since the previous call: usage rows of the current hour and each
        key's last use. Counted once: a second call returns only what came after the first."""
        counts, self._counts = self._counts, {}
        key_use, self._key_use = self._key_use, {}
        bucket = int(time.time()) // USAGE_BUCKET_SECONDS * USAGE_BUCKET_SECONDS
        rows = tuple(UsageRow(bucket, key_id, model, *c, via) for (key_id, model, via), c in counts.items())
        return rows, key_use
