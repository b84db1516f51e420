"""The helper session over an in-memory byte stream: hello, routing, limits and checks (R-1.2)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from llmgw.fleet.errors import BadAnswer, BadArguments, NodeTimeout, NodeUnavailable
from llmgw.fleet.session import HelperFailed, HelperSession, LineReader, NodeError, Overlong

HELLO = {"hello": {"protocol": 1, "version": "test", "root": "/r", "home": "/h"}}


class Pipe:
    """One direction of a byte stream: `read(n)` returns at most `piece` bytes at a time, the
    way an SSH channel hands data over in window-sized packets."""

    def __init__(self, piece: int | None = None):
        self._data = bytearray()
        self._eof = False
        self._more = asyncio.Event()
        self.piece = piece

    def feed(self, data: bytes) -> None:
        self._data += data
        self._more.set()

    def close(self) -> None:
        self._eof = True
        self._more.set()

    async def read(self, n: int) -> bytes:
        while not self._data and not self._eof:
            self._more.clear()
            await self._more.wait()
        n = min(n, self.piece or n)
        chunk = bytes(self._data[:n])
        del self._data[:n]
        return chunk

    def drained(self) -> bool:
        return not self._data


class Requests:
    """The session's writer: the request lines it sent, decoded."""

    def __init__(self):
        self.lines: list[dict] = []
        self.sent = asyncio.Event()

    def write(self, data: bytes) -> None:
        for line in data.splitlines():
            self.lines.append(json.loads(line))
        self.sent.set()

    async def next_id(self, count: int = 1) -> list[int]:
        while len(self.lines) < count:
            self.sent.clear()
            await self.sent.wait()
        return [line["id"] for line in self.lines[:count]]


def line(message) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


async def started(piece: int | None = None, **kw) -> tuple[HelperSession, Pipe, Requests]:
    out, requests = Pipe(piece), Requests()
    session = HelperSession("n1", out, requests, **kw)
    out.feed(line(HELLO))
    await session.start(timeout=5)
    return session, out, requests


@pytest.mark.parametrize("first,expected", [
    pytest.param({"nope": 1}, "not a hello", id="json-object-without-hello"),
    pytest.param({"hello": "yes"}, "not a hello", id="hello-not-an-object"),
    pytest.param([1, 2], "something unexpected", id="json-array"),
    pytest.param("text", "something unexpected", id="json-string"),
])
async def test_a_first_line_that_is_not_hello_fails_the_start_with_the_line(first, expected):
    out = Pipe()
    session = HelperSession("n1", out, Requests())
    out.feed(line(first))
    with pytest.raises(HelperFailed) as info:
        await session.start(timeout=5)
    assert expected in info.value.reason and json.dumps(first, separators=(",", ":"))[:5] in info.value.reason


async def test_a_hello_with_a_field_of_the_wrong_type_fails_the_start_naming_it():
    out = Pipe()
    session = HelperSession("n1", out, Requests())
    out.feed(line({"hello": {"protocol": 1, "root": ["/r"], "home": "/h"}}))
    with pytest.raises(HelperFailed, match=r"the helper's hello is malformed: root is a list, not a string"):
        await session.start(timeout=5)


async def test_the_hello_is_typed():
    session, out, requests = await started()
    try:
        assert (session.hello.protocol, session.hello.root, session.hello.home, session.hello.sha256) == (1, "/r", "/h", None)
    finally:
        await session.close()


async def test_no_answer_in_time_is_a_timeout_and_a_lost_session_fails_what_waits():
    session, out, requests = await started()
    try:
        with pytest.raises(NodeTimeout) as info:
            await session.call("status", timeout=0.01)
        assert info.value.phase == "timeout" and info.value.op == "status"
        waiting = asyncio.create_task(session.call("ping", timeout=30))
        await requests.next_id(2)
        out.close()
        with pytest.raises(NodeUnavailable) as info:
            await asyncio.wait_for(waiting, 10)
        assert info.value.phase == "connection lost" and isinstance(info.value, NodeError)
    finally:
        await session.close()


async def test_answers_and_events_are_routed_by_id():
    session, out, requests = await started()
    try:
        first = asyncio.create_task(session.call("ping"))
        second = asyncio.create_task(session.call("status"))
        ids = await requests.next_id(2)
        out.feed(line({"id": ids[1], "ok": True, "result": {"which": 2}}) +
                 line({"id": ids[0], "ok": False, "error": {"kind": "bad_args", "message": "no"}}))
        assert await second == {"which": 2}
        with pytest.raises(BadArguments) as info:  # the class of the helper's kind
            await first
        assert (info.value.op, info.value.phase, info.value.kind, info.value.message) == ("ping", "remote", "bad_args", "no")
    finally:
        await session.close()


@pytest.mark.parametrize("text", [
    pytest.param(b"[1, 2]\n", id="array"),
    pytest.param(b'"hello"\n', id="string"),
    pytest.param(b"42\n", id="number"),
    pytest.param(b"null\n", id="null"),
    pytest.param(b'{"id": "7", "ok": true, "result": {}}\n', id="id-is-a-string"),
    pytest.param(b'{"id": true, "ok": true, "result": {}}\n', id="id-is-a-bool"),
    pytest.param(b'{"ok": true, "result": {}}\n', id="no-id"),
])
async def test_a_message_that_names_no_request_ends_the_session_with_a_clear_error(text):
    session, out, requests = await started()
    try:
        waiting = asyncio.create_task(session.call("ping", timeout=30))
        await requests.next_id()
        out.feed(text)
        with pytest.raises(NodeUnavailable) as info:
            await asyncio.wait_for(waiting, 10)  # a hang check: the call must not wait for its timeout
        assert info.value.phase == "protocol"
        assert "broke the protocol" in info.value.message and text.strip()[:20].decode() in info.value.message
        assert session.closed
        assert "broke the protocol" in await asyncio.wait_for(session.lost, 5)
        with pytest.raises(NodeUnavailable, match="closed"):
            await session.call("ping")
    finally:
        await session.close()


@pytest.mark.parametrize("answer,problem", [
    pytest.param({"ok": "yes", "result": {}}, "without ok", id="ok-not-a-bool"),
    pytest.param({"result": {}}, "without ok", id="no-ok"),
    pytest.param({"ok": False, "error": "boom"}, "error that is not an object", id="error-not-an-object"),
    pytest.param({"event": 3, "data": {}}, "event name", id="event-name-not-a-string"),
    pytest.param({"event": "progress", "data": [1]}, "data is not an object", id="event-data-not-an-object"),
])
async def test_a_malformed_answer_fails_its_request_and_the_session_goes_on(answer, problem):
    session, out, requests = await started()
    try:
        bad = asyncio.create_task(session.call("storage", timeout=30))
        (bad_id,) = await requests.next_id()
        out.feed(line({"id": bad_id, **answer}))
        with pytest.raises(BadAnswer) as info:
            await asyncio.wait_for(bad, 10)
        assert info.value.op == "storage" and info.value.phase == "protocol" and problem in info.value.message
        good = asyncio.create_task(session.call("ping"))
        good_id = (await requests.next_id(2))[1]
        out.feed(line({"id": good_id, "ok": True, "result": {"time": 1.0}}))
        assert await good == {"time": 1.0}
        assert not session.closed
    finally:
        await session.close()


async def test_a_malformed_event_fails_its_stream():
    session, out, requests = await started()
    try:
        stream = session.stream("logs", {"follow": True})
        (stream_id,) = await requests.next_id()
        out.feed(line({"id": stream_id, "event": "lines", "data": {"lines": ["a"]}}) +
                 line({"id": stream_id, "event": None, "data": {}}))

        async def answer_the_cancel():
            cancel_id = (await requests.next_id(2))[1]
            out.feed(line({"id": cancel_id, "ok": True, "result": {}}))

        answering = asyncio.create_task(answer_the_cancel())
        seen = []
        with pytest.raises(BadAnswer, match="event name"):
            async with stream:
                async for event in stream:
                    seen.append(event)
        assert seen == [("lines", {"lines": ["a"]})]
        await asyncio.wait_for(answering, 5)
        # Failed on this side: the node is told to stop streaming.
        assert requests.lines[1]["op"] == "cancel" and requests.lines[1]["args"] == {"target": stream_id}
    finally:
        await session.close()


async def test_a_5_mib_answer_arriving_in_window_sized_pieces_is_one_answer():
    """Over SSH a line longer than the channel window arrives in pieces; it is still one line."""
    session, out, requests = await started(piece=64 * 1024)
    try:
        call = asyncio.create_task(session.call("logs"))
        (request_id,) = await requests.next_id()
        big = ["x" * 1024] * (5 * 1024)  # 5 MiB of log lines
        out.feed(line({"id": request_id, "ok": True, "result": {"lines": big}}))
        result = await asyncio.wait_for(call, 30)
        assert result == {"lines": big}
        after = asyncio.create_task(session.call("ping"))
        out.feed(line({"id": (await requests.next_id(2))[1], "ok": True, "result": {}}))
        assert await after == {}
    finally:
        await session.close()


async def test_a_line_over_the_limit_fails_that_request_only():
    session, out, requests = await started(piece=64 * 1024, max_line=1024 * 1024)
    try:
        big = asyncio.create_task(session.call("logs", timeout=30))
        small = asyncio.create_task(session.call("ping", timeout=30))
        big_id, small_id = await requests.next_id(2)
        out.feed(line({"id": big_id, "ok": True, "result": {"lines": ["y" * 1024] * 5 * 1024}}) +
                 line({"id": small_id, "ok": True, "result": {"time": 2.0}}))
        with pytest.raises(BadAnswer) as info:
            await asyncio.wait_for(big, 10)
        assert info.value.op == "logs" and info.value.phase == "answer"
        assert "5.0 MiB, over the 1.0 MiB limit" in info.value.message
        assert await asyncio.wait_for(small, 10) == {"time": 2.0}  # the line after it is intact
        assert not session.closed
    finally:
        await session.close()


@pytest.mark.parametrize("piece", [1, 7, 4096])
async def test_lines_split_anywhere_are_put_back_together(piece):
    session, out, requests = await started(piece=piece)
    try:
        calls = [asyncio.create_task(session.call("ping")) for _ in range(50)]
        ids = await requests.next_id(50)
        out.feed(b"".join(line({"id": i, "ok": True, "result": {"n": i, "pad": "z" * i}}) for i in reversed(ids)))
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r["n"] for r in results] == ids
    finally:
        await session.close()


async def test_line_reader_returns_a_last_line_without_newline_and_then_eof():
    pipe = Pipe(piece=3)
    pipe.feed(b'{"a":1}\n' + b"q" * 50 + b"\ntail")
    pipe.close()
    reader = LineReader(pipe, limit=20)
    assert await reader.next() == b'{"a":1}\n'
    skipped = await reader.next()
    assert isinstance(skipped, Overlong) and skipped.size == 51 and skipped.head.startswith(b"qqq")
    assert await reader.next() == b"tail"
    assert await reader.next() == b""


async def test_line_reader_skips_an_overlong_line_that_ends_inside_one_chunk():
    pipe = Pipe()
    pipe.feed(b"a" * 30 + b"\n" + b"b" * 20 + b"\n" + b"c" * 21 + b"\n")
    reader = LineReader(pipe, limit=20)
    assert await reader.next() == Overlong(b"a" * 30 + b"\n", 31)
    assert await reader.next() == b"b" * 20 + b"\n"
    assert await reader.next() == Overlong(b"c" * 21 + b"\n", 22)


async def test_helper_stderr_is_drained_to_the_log(caplog):
    """A helper that writes a lot to stderr is read (a full pipe would block it), line by line."""
    stderr = Pipe(piece=64 * 1024)
    caplog.set_level(logging.WARNING, logger="llmgw.fleet.session")
    session, out, requests = await started(stderr=stderr)
    try:
        stderr.feed(b"Traceback (most recent call last):\n  \x1b[31mred\x1b[0m\n" + b"z" * 100_000 + b"\n")
        stderr.feed(b"chatter\n" * 10_000 + b"last words\n")  # more than a pipe holds
        stderr.close()
        for _ in range(200):
            if stderr.drained() and "last words" in caplog.text:  # named at EOF
                break
            await asyncio.sleep(0.01)
        assert stderr.drained()
        assert "n1: helper stderr: Traceback (most recent call last):" in caplog.text
        assert "\x1b" not in caplog.text and "?[31mred?[0m" in caplog.text
        assert "(100001 bytes)" in caplog.text  # an overlong line is cut, with its size
        # The flood past STDERR_BURST lines a second is counted, not logged, and its last line named.
        assert "not logged; the last: last words" in caplog.text
        assert sum("helper stderr: chatter" in r.getMessage() for r in caplog.records) < 10_000
    finally:
        await session.close()


async def test_the_helpers_last_words_on_stderr_are_logged_when_it_exits(caplog):
    stderr = Pipe()
    caplog.set_level(logging.WARNING, logger="llmgw.fleet.session")
    session, out, requests = await started(stderr=stderr)
    out.close()
    await asyncio.wait_for(session.lost, 5)

    async def last_words():
        await asyncio.sleep(0.05)
        stderr.feed(b"MemoryError\n")
        stderr.close()

    writer = asyncio.create_task(last_words())
    await session.close()
    await writer
    assert "n1: helper stderr: MemoryError" in caplog.text
