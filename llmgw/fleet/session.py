"""The JSON-lines protocol with one running helper process, over any byte stream pair.

The same session runs over an SSH channel (asyncssh process) and over a local subprocess: both
give a `readline()` coroutine and a `write(bytes)` method. Requests carry an id; answers and
streamed events name it (R-1.2). The protocol itself is documented in the helper's docstring.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from llmgw.aio import cancel_and_wait

log = logging.getLogger(__name__)

# Exit codes of the helper (documented in its docstring).
EXIT_MISSING = 96  # from the bootstrap: stdin ended before the helper's upload was complete
EXIT_INTEGRITY = 97
EXIT_PERMISSIONS = 98


class NodeError(Exception):
    """A node operation failed. Carries the node, the operation and the phase it failed in."""

    def __init__(self, node: str, op: str, phase: str, message: str, kind: str | None = None):
        self.node, self.op, self.phase, self.kind, self.message = node, op, phase, kind, message
        super().__init__(f"{node}: {op}: {phase}: {message}")


class HelperFailed(Exception):
    """The helper could not be started or refused to run; `reason` is for the operator."""

    def __init__(self, reason: str, *, fatal: dict | None = None, exit_status: int | None = None):
        super().__init__(reason)
        self.reason, self.fatal, self.exit_status = reason, fatal, exit_status


class LineReader(Protocol):
    async def readline(self) -> bytes: ...


class LineWriter(Protocol):
    def write(self, data: bytes) -> Any: ...


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
            else:  # error
                self._done = True
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

    def __init__(self, node: str, reader: LineReader, writer: LineWriter):
        self.node = node
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._streams: dict[int, Stream] = {}
        self.hello: dict | None = None
        self.uploaded: str | None = None  # "missing" or "mismatch" when this start deployed the helper
        self.closed = False
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._encoder = json.JSONEncoder(separators=(",", ":"))
        self._outgoing: list[bytes] = []

    async def start(self, timeout: float, upload: bytes | None = None) -> dict:
        """Wait for the hello line; a fatal line or EOF raises HelperFailed. When the bootstrap
        asks for the helper (missing or mismatched copy on the node), `upload` is sent first."""
        message = await self._first_message(timeout)
        if "upload" in message and upload is not None:
            self.uploaded = message.get("found", "missing")
            self._writer.write(upload)
            message = await self._first_message(timeout)
        if "upload" in message:
            raise HelperFailed("the node's helper is missing or changed and no copy was sent")
        if "fatal" in message:
            raise HelperFailed(_fatal_reason(message), fatal=message)
        if "hello" not in message:
            raise HelperFailed(f"the helper's first line is not hello: {line[:200]!r}")
        self.hello = message["hello"]
        self._task = asyncio.create_task(self._read_loop(), name=f"helper-read-{self.node}")
        return self.hello

    async def _first_message(self, timeout: float) -> dict:
        try:
            line = await asyncio.wait_for(self._reader.readline(), timeout)
        except asyncio.TimeoutError:
            raise HelperFailed(f"the helper did not say hello within {timeout:.0f}s") from None
        if not line:
            raise HelperFailed("the helper exited before saying hello")
        try:
            message = json.loads(line)
        except ValueError:
            raise HelperFailed(f"the helper said something that is not JSON: {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise HelperFailed(f"the helper said something unexpected: {line[:200]!r}")
        return message

    async def _read_loop(self) -> None:
        reason = "the helper's output ended (connection lost or helper exited)"
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    log.warning("%s: helper wrote a line that is not JSON: %.200r", self.node, line)
                    continue
                self._dispatch(message)
        except (asyncio.CancelledError, GeneratorExit):
            reason = "the session was closed"
            raise
        except Exception as exc:  # a broken transport ends the session the same way as EOF
            reason = f"reading from the helper failed: {exc}"
        finally:
            self._fail_all(reason)

    def _dispatch(self, message: dict) -> None:
        request_id = message.get("id")
        if "event" in message:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(("event", (message["event"], message.get("data") or {})))
            return
        stream = self._streams.get(request_id)
        entry = self._pending.pop(request_id, None)
        if message.get("ok"):
            if stream is not None:
                stream.queue.put_nowait(("result", message.get("result")))
            elif entry is not None and not entry[1].done():
                entry[1].set_result(message.get("result"))
            return
        error = message.get("error") or {}
        op = stream.op if stream is not None else (entry[0] if entry else "?")
        exc = NodeError(self.node, op, "remote", error.get("message", "failed"), kind=error.get("kind"))
        if stream is not None:
            stream.queue.put_nowait(("error", exc))
        elif entry is not None and not entry[1].done():
            entry[1].set_exception(exc)

    def _fail_all(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        for op, future in self._pending.values():
            if not future.done():
                future.set_exception(NodeError(self.node, op, "connection lost", reason))
        self._pending.clear()
        for stream in self._streams.values():
            stream.queue.put_nowait(("error", NodeError(self.node, stream.op, "connection lost", reason)))
        if not self.lost.done():
            self.lost.set_result(reason)

    def _send(self, request_id: int, op: str, args: dict | None) -> None:
        """Queue one request line; lines queued in the same loop turn leave in one write.

        Over SSH every write is an encrypted packet (asyncssh adds a padding packet to each), so
        64 concurrent calls cost one packet instead of 64."""
        if self.closed:
            raise NodeError(self.node, op, "not connected", "the helper session is closed")
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
            raise NodeError(self.node, op, "send", str(exc)) from exc
        try:
            if timeout is None:
                return await future
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(request_id, None)
            raise NodeError(self.node, op, "timeout", f"no answer within {timeout:g}s") from None

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
        await cancel_and_wait(self._task)
        self._fail_all("the session was closed")


def _fatal_reason(message: dict) -> str:
    if message.get("fatal") == "integrity":
        return (f"helper failed its integrity check (expected sha256 {str(message.get('expected'))[:16]}…, "
                f"file has {str(message.get('actual'))[:16]}…)")
    if message.get("fatal") == "missing":
        return "helper not installed at its expected path"
    if message.get("fatal") == "permissions":
        return f"helper refused to run: {message.get('message') or message}"
    return f"helper refused to run: {message}"
