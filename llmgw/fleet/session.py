"""The JSON-lines protocol with one running helper process, over any byte stream pair.

The same session runs over an SSH channel (asyncssh process) and over a local subprocess: both
give a `read(n)` coroutine and a `write(bytes)` method. Requests carry an id; answers and
streamed events name it (R-1.2). The protocol itself is documented in the helper's docstring.

Lines are assembled here from chunks, up to MAX_LINE bytes: asyncssh's readline hands a line
longer than the channel's window (about 2 MiB) back in pieces, and asyncio's raises. A longer
line fails the request it answers, and the session goes on. What the helper sends is checked
before it is used: a line that is not a JSON object, or a message without an integer id, ends
the session (the other end is not speaking the protocol); a malformed answer or event fails
its request. Failures are `NodeError` subclasses (errors.py): a refusal of the helper is the
class of its kind, a session that is gone `NodeUnavailable`, no answer in time `NodeTimeout`,
an unusable answer `BadAnswer`. The typed operations on top of `call` and `stream` are ops.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.aio import cancel_and_wait
from llmgw.fleet.errors import BadAnswer, NodeError, NodeTimeout, NodeUnavailable, RemoteError
from llmgw.fleet.facts import Malformed
from llmgw.fleet.ops import Hello

__all__ = ["HelperFailed", "HelperSession", "LineReader", "NodeError", "Overlong", "Stream"]

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024 * 1024  # one answer or event; the largest legitimate ones are log tails
MAX_STDERR_LINE = 4096  # what one log record of the helper's stderr carries
READ_CHUNK = 256 * 1024
STDERR_GRACE = 1.0  # after the helper's output ended, for its last words on stderr


class HelperFailed(LlmgwError):
    """The helper could not be started or refused to run; `reason` is for the operator."""

    category = Category.NODE

    def __init__(self, reason: str, *, fatal: dict | None = None, exit_status: int | None = None):
        super().__init__(reason)
        self.reason, self.fatal, self.exit_status = reason, fatal, exit_status


class ChunkReader(Protocol):
    async def read(self, n: int) -> bytes: ...


class LineWriter(Protocol):
    def write(self, data: bytes) -> Any: ...


@dataclass(frozen=True)
class Overlong:
    """A line longer than the reader's limit, skipped: its first bytes and its full size."""

    head: bytes
    size: int


class LineReader:
    """Whole lines of at most `limit` bytes from a stream read in chunks (`b""` at EOF)."""

    HEAD = 200

    def __init__(self, reader: ChunkReader, limit: int = MAX_LINE):
        self._reader = reader
        self._limit = limit
        self._buffer = bytearray()

    async def next(self) -> bytes | Overlong:
        scanned = 0
        while True:
            end = self._buffer.find(b"\n", scanned)
            if end > self._limit:  # over the limit, though it ended within the last chunk read
                skipped = Overlong(bytes(self._buffer[:min(end + 1, self.HEAD)]), end + 1)
                del self._buffer[:end + 1]
                return skipped
            if end >= 0:
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                return line
            if len(self._buffer) > self._limit:
                return await self._skip_rest()
            scanned = len(self._buffer)
            chunk = await self._reader.read(READ_CHUNK)
            if not chunk:  # EOF: a last line without its newline is still a line
                line = bytes(self._buffer)
                self._buffer.clear()
                return line
            self._buffer += chunk

    async def _skip_rest(self) -> Overlong:
        """Drop the rest of an overlong line, up to and including its newline."""
        head, size = bytes(self._buffer[:self.HEAD]), len(self._buffer)
        self._buffer.clear()
        while True:
            chunk = await self._reader.read(READ_CHUNK)
            if not chunk:
                return Overlong(head, size)
            end = chunk.find(b"\n")
            if end >= 0:
                self._buffer += chunk[end + 1:]
                return Overlong(head, size + end + 1)
            size += len(chunk)


_LEADING_ID = re.compile(rb'^\s*\{\s*"id"\s*:\s*(\d+)\s*[,}]')


def _mib(size: int) -> str:
    return f"{size / 1024**2:.1f} MiB"


STDERR_BURST = 200  # helper stderr lines logged per second and node; the rest are counted


def _printable(text: str) -> str:
    """Node-written text for the log: control characters (terminal sequences) become '?'."""
    return "".join(c if c.isprintable() or c == "\t" else "?" for c in text)


async def drain_to_log(node: str, stderr: ChunkReader) -> None:
    """Log what the helper writes on stderr, line by line, until EOF; a pipe nobody reads
    fills up and then blocks the helper's next write, and with it the helper.

    At most STDERR_BURST lines a second are logged: a node that floods its stderr must not
    flood the control plane's log or hold its loop. The lines left out are counted, and a line
    says how many and what the last one was (at the next line after the second, or when the
    session ends)."""
    lines = LineReader(stderr, MAX_STDERR_LINE)
    window, budget, left_out, last = time.monotonic(), STDERR_BURST, 0, ""

    def say_left_out() -> None:
        log.warning("%s: helper stderr: %d more line(s) not logged; the last: %s", node, left_out, _printable(last))

    try:
        while True:
            line = await lines.next()
            if not line:
                return
            now = time.monotonic()
            if now - window >= 1.0:
                if left_out:
                    say_left_out()
                window, budget, left_out = now, STDERR_BURST, 0
            if budget <= 0:
                left_out += 1
                last = (f"{line.head.decode(errors='replace')}… ({line.size} bytes)" if isinstance(line, Overlong)
                        else line.decode(errors="replace").rstrip())
                continue
            budget -= 1
            if isinstance(line, Overlong):
                log.warning("%s: helper stderr: %s… (%d bytes)", node,
                            _printable(line.head.decode(errors="replace")), line.size)
                continue
            text = line.decode(errors="replace").rstrip()
            if text:
                log.warning("%s: helper stderr: %s", node, _printable(text))
    finally:
        if left_out:
            say_left_out()


class Stream:
    """Events of one streaming request; `result` holds the final answer once iteration ends."""

    def __init__(self, session: HelperSession, request_id: int, op: str):
        self._session = session
        self.id = request_id
        self.op = op
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result: Any = None
        self._done = False

    def __aiter__(self) -> AsyncIterator[tuple[str, dict]]:
        return self._iterate()

    async def _iterate(self):
        while True:
            kind, payload = await self.queue.get()
            if kind == "event":
                yield payload
            elif kind == "result":
                self.result = payload
                self._done = True
                return
            elif kind == "error":  # the request ended, on the node or with the session
                self._done = True
                raise payload
            else:  # abort: failed on this side; the node may still be streaming (cancelled on exit)
                raise payload

    async def cancel(self) -> None:
        if not self._done and not self._session.closed:
            try:
                await self._session.call("cancel", {"target": self.id}, timeout=10)
            except NodeError:
                pass

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._done:
            await self.cancel()
        self._session._streams.pop(self.id, None)


class HelperSession:
    """One running helper: send requests, route answers and events by id."""

    def __init__(self, node: str, reader: ChunkReader, writer: LineWriter, *,
                 stderr: ChunkReader | None = None, max_line: int = MAX_LINE):
        self.node = node
        self._lines = LineReader(reader, max_line)
        self._max_line = max_line
        self._stderr = stderr
        self._stderr_task: asyncio.Task | None = None
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._streams: dict[int, Stream] = {}
        self.hello: Hello | None = None
        self.uploaded: str | None = None  # "missing" or "mismatch" when this start deployed the helper
        self.closed = False
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._encoder = json.JSONEncoder(separators=(",", ":"))
        self._outgoing: list[bytes] = []

    async def start(self, timeout: float, upload: bytes | None = None) -> Hello:
        """Wait for the hello line; a fatal line or EOF raises HelperFailed. When the bootstrap
        asks for the helper (missing or mismatched copy on the node), `upload` is sent first.
        Once the helper said hello, its stderr (when given) is drained to the log."""
        message, line = await self._first_message(timeout)
        if "upload" in message and upload is not None:
            self.uploaded = message.get("found", "missing")
            self._writer.write(upload)
            message, line = await self._first_message(timeout)
        if "upload" in message:
            raise HelperFailed("the node's helper is missing or changed and no copy was sent")
        if "fatal" in message:
            raise HelperFailed(_fatal_reason(message), fatal=message)
        if not isinstance(message.get("hello"), dict):
            raise HelperFailed(f"the helper's first line is not a hello: {line[:200]!r}")
        try:
            self.hello = Hello.from_helper(message["hello"])
        except Malformed as exc:
            raise HelperFailed(f"the helper's hello is malformed: {exc}: {line[:200]!r}") from None
        self._task = asyncio.create_task(self._read_loop(), name=f"helper-read-{self.node}")
        if self._stderr is not None:
            self._stderr_task = asyncio.create_task(drain_to_log(self.node, self._stderr),
                                                    name=f"helper-stderr-{self.node}")
        return self.hello

    async def _first_message(self, timeout: float) -> tuple[dict, bytes]:
        try:
            line = await asyncio.wait_for(self._lines.next(), timeout)
        except asyncio.TimeoutError:
            raise HelperFailed(f"the helper did not say hello within {timeout:.0f}s") from None
        if isinstance(line, Overlong):
            raise HelperFailed(f"the helper's first line is {_mib(line.size)}, over the "
                               f"{_mib(self._max_line)} limit: {line.head[:200]!r}")
        if not line:
            raise HelperFailed("the helper exited before saying hello")
        try:
            message = json.loads(line)
        except ValueError:
            raise HelperFailed(f"the helper said something that is not JSON: {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise HelperFailed(f"the helper said something unexpected: {line[:200]!r}")
        return message, line

    async def _read_loop(self) -> None:
        reason, phase = "the helper's output ended (connection lost or helper exited)", "connection lost"
        try:
            while True:
                line = await self._lines.next()
                if isinstance(line, Overlong):
                    self._overlong(line)
                    continue
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    log.warning("%s: helper wrote a line that is not JSON: %.200r", self.node, line)
                    continue
                problem = _unroutable(message)
                if problem is not None:
                    reason, phase = f"the helper broke the protocol ({problem}): {line[:200]!r}", "protocol"
                    log.warning("%s: %s; ending the session", self.node, reason)
                    break
                self._dispatch(message)
        except (asyncio.CancelledError, GeneratorExit):
            reason = "the session was closed"
            raise
        except Exception as exc:  # a broken transport ends the session the same way as EOF
            reason = f"reading from the helper failed: {exc}"
        finally:
            self._fail_all(reason, phase)

    def _overlong(self, line: Overlong) -> None:
        """Fail the request an overlong line answers (its id leads the line); the rest go on."""
        found = _LEADING_ID.match(line.head)
        request_id = int(found.group(1)) if found else None
        message = (f"the helper's answer is {_mib(line.size)}, over the {_mib(self._max_line)} "
                   f"limit of one line; it was dropped")
        log.warning("%s: %s (request %s)", self.node, message, request_id if request_id is not None else "unknown")
        if request_id is not None:
            self._fail_request(request_id, "answer", message)

    def _fail_request(self, request_id: int, phase: str, message: str) -> None:
        """One request fails on this side of the wire; a stream is also cancelled on the node."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(("abort", BadAnswer(self.node, stream.op, phase, message)))
            return
        entry = self._pending.pop(request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(BadAnswer(self.node, entry[0], phase, message))

    def _dispatch(self, message: dict) -> None:
        request_id = message["id"]
        if request_id is None:  # the helper could not read one of our lines
            log.warning("%s: the helper refused a request it could not read: %.200r", self.node, message.get("error"))
            return
        problem = _malformed(message)
        if problem is not None:
            log.warning("%s: malformed message from the helper (%s): %.200r", self.node, problem, message)
            self._fail_request(request_id, "protocol", f"the helper's answer is malformed: {problem}")
            return
        if "event" in message:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(("event", (message["event"], message.get("data") or {})))
            return
        stream = self._streams.get(request_id)
        entry = self._pending.pop(request_id, None)
        if message["ok"]:
            if stream is not None:
                stream.queue.put_nowait(("result", message.get("result")))
            elif entry is not None and not entry[1].done():
                entry[1].set_result(message.get("result"))
            return
        error = message.get("error") or {}
        op = stream.op if stream is not None else (entry[0] if entry else "?")
        kind = error.get("kind") if isinstance(error.get("kind"), str) else None
        exc = RemoteError(self.node, op, "remote", str(error.get("message") or "failed"), kind=kind)
        if stream is not None:
            stream.queue.put_nowait(("error", exc))
        elif entry is not None and not entry[1].done():
            entry[1].set_exception(exc)

    def _fail_all(self, reason: str, phase: str = "connection lost") -> None:
        if self.closed:
            return
        self.closed = True
        for op, future in self._pending.values():
            if not future.done():
                future.set_exception(NodeUnavailable(self.node, op, phase, reason))
        self._pending.clear()
        for stream in self._streams.values():
            stream.queue.put_nowait(("error", NodeUnavailable(self.node, stream.op, phase, reason)))
        if not self.lost.done():
            self.lost.set_result(reason)

    def _send(self, request_id: int, op: str, args: dict | None) -> None:
        """Queue one request line; lines queued in the same loop turn leave in one write.

        Over SSH every write is an encrypted packet (asyncssh adds a padding packet to each), so
        64 concurrent calls cost one packet instead of 64."""
        if self.closed:
            raise NodeUnavailable(self.node, op, "not connected", "the helper session is closed")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(self._encoder.encode({"id": request_id, "op": op, "args": args or {}}).encode() + b"\n")

    def _flush(self) -> None:
        lines, self._outgoing = self._outgoing, []
        if not lines or self.closed:
            return
        try:
            self._writer.write(b"".join(lines))
        except Exception as exc:  # the transport is gone: every waiting call learns it now
            self._fail_all(f"writing to the helper failed: {exc}")

    async def call(self, op: str, args: dict | None = None, timeout: float | None = 30.0) -> Any:
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (op, future)
        try:
            self._send(request_id, op, args)
        except NodeError:
            self._pending.pop(request_id, None)
            raise
        except Exception as exc:
            self._pending.pop(request_id, None)
            raise NodeUnavailable(self.node, op, "send", str(exc)) from exc
        try:
            if timeout is None:
                return await future
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(request_id, None)
            raise NodeTimeout(self.node, op, "timeout", f"no answer within {timeout:g}s") from None

    def stream(self, op: str, args: dict | None = None) -> Stream:
        request_id = next(self._ids)
        stream = Stream(self, request_id, op)
        self._streams[request_id] = stream
        try:
            self._send(request_id, op, args)
        except Exception:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def close(self) -> None:
        ended = self._task is not None and self._task.done()
        await cancel_and_wait(self._task)
        self._fail_all("the session was closed")
        if ended and self._stderr_task is not None:
            # The helper is gone: what it said last on stderr (a traceback) is the useful part.
            await asyncio.wait([self._stderr_task], timeout=STDERR_GRACE)
        await cancel_and_wait(self._stderr_task)


def _unroutable(message: Any) -> str | None:
    """Why a message cannot be matched to a request, or None; such a helper is not speaking
    the protocol, and nothing it says next can be trusted to name the right request."""
    if not isinstance(message, dict):
        return f"a line is a JSON {type(message).__name__}, not an object"
    request_id = message.get("id")
    if request_id is None and message.get("ok") is False:
        return None  # its answer to a line it could not read
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        return f"id {request_id!r} is not an integer"
    return None


def _malformed(message: dict) -> str | None:
    """What is wrong with an answer's or an event's shape, or None."""
    if "event" in message:
        if not isinstance(message["event"], str):
            return "an event name is not a string"
        if not isinstance(message.get("data"), (dict, type(None))):
            return "an event's data is not an object"
        return None
    if not isinstance(message.get("ok"), bool):
        return "an answer without ok: true or false"
    if not message["ok"] and not isinstance(message.get("error"), (dict, type(None))):
        return "an error that is not an object"
    return None


def _fatal_reason(message: dict) -> str:
    if message.get("fatal") == "integrity":
        return (f"helper failed its integrity check (expected sha256 {str(message.get('expected'))[:16]}…, "
                f"file has {str(message.get('actual'))[:16]}…)")
    if message.get("fatal") == "missing":
        return "helper not installed at its expected path"
    if message.get("fatal") == "permissions":
        return f"helper refused to run: {message.get('message') or message}"
    return f"helper refused to run: {message}"
