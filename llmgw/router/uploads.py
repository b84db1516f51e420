"""Multipart uploads (audio): the model is a form field, the file is streamed to the engine.

Only the head of the body is read before an engine is chosen: up to and including the `model`
field, which must come before the file (OpenAI's clients send fields first; with curl, put
`-F model=...` before `-F file=@...`). The rest goes from the client to the engine as it arrives,
counted against gateway.max_body. The head can be sent again, the rest cannot: once the engine
has started to take the file, a failure is not retried elsewhere (the router keeps no copy).

A form has one `model` field (R-6.15): the key was checked against that one, so a second one
anywhere in the form, which an engine or provider might read instead, is a 400. The streamed
rest is searched for part headers as it passes (no copy is kept); one naming `model` ends the
upload, and the client gets the 400 since the engine answers only once it has the whole body.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from aiohttp import web

from llmgw.router.errors import BadRequest, BodyTooLarge, RouterError, UnsupportedEncoding

HEAD_LIMIT = 64 * 1024  # the fields before the file; a model name is far shorter
PART_HEADERS_LIMIT = 16 * 1024  # a part's headers longer than this are not read for its name
_BOUNDARY = re.compile(r';\s*boundary=("?)([^";]+)\1', re.I)
_NAME = re.compile(r'(?:^|;)\s*name="([^"]*)"', re.I)
_FILENAME = re.compile(r";\s*filename\*?=", re.I)
NEED_MORE = object()


def find_model_field(data: bytes, delimiter: bytes):
    """(model, start, end) of the `model` field's value in a multipart head; NEED_MORE when the
    head does not reach it yet; BadRequest when a file or the end of the form comes first."""
    pos = data.find(delimiter)
    if pos < 0:
        return NEED_MORE
    while True:
        after = pos + len(delimiter)
        if data[after:after + 2] == b"--":
            raise BadRequest("the form has no 'model' field: send the model name as a form field", param="model")
        headers_end = data.find(b"\r\n\r\n", after)
        if headers_end < 0:
            return NEED_MORE
        headers = data[after:headers_end].decode("latin-1")
        disposition = next((line.partition(":")[2] for line in headers.split("\r\n")
                            if line.lower().startswith("content-disposition:")), "")
        name = _NAME.search(disposition)
        value_start = headers_end + 4
        if _FILENAME.search(disposition):
            raise BadRequest("the 'model' field must come before the file in the form (with curl: "
                             "-F model=NAME before -F file=@PATH)", param="model")
        end = data.find(b"\r\n" + delimiter, value_start)
        if end < 0:
            return NEED_MORE
        if name is not None and name.group(1) == "model":
            try:
                model = data[value_start:end].decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest("the 'model' field is not UTF-8 text", param="model") from None
            return model, value_start, end
        pos = end + 2


def _second_model() -> BadRequest:
    return BadRequest("the form has more than one 'model' field; send the model name once", param="model")


def _names_model(headers: bytes) -> bool:
    for line in headers.decode("latin-1").split("\r\n"):
        if line.lower().startswith("content-disposition:"):
            name = _NAME.search(line.partition(":")[2])
            return name is not None and name.group(1) == "model"
    return False


class PartNames:
    """Finds, in a form's bytes as they pass, a part whose headers name it `model`."""

    def __init__(self, delimiter: bytes):
        self.marker = b"\r\n" + delimiter
        self.tail = b""

    def has_model(self, data: bytes) -> bool:
        window = self.tail + data if self.tail else data
        marker = self.marker
        pos = window.find(marker)
        keep_from = max(0, len(window) - len(marker) + 1)  # a marker cut between two reads
        while pos >= 0:
            start = pos + len(marker)
            end = window.find(b"\r\n\r\n", start)
            if end < 0:
                if len(window) - start <= PART_HEADERS_LIMIT:
                    keep_from = min(keep_from, pos)  # these headers end in a later read
                break
            if _names_model(window[start:end]):
                return True
            pos = window.find(marker, end)
        self.tail = window[keep_from:]
        return False


class Upload:
    """One multipart request: its head, held, and the rest of its body, still with the client."""

    def __init__(self, request: web.BaseRequest, head: bytes, model: str, span: tuple[int, int], limit: int,
                 parts: PartNames, delimiter: bytes):
        self.delimiter = delimiter
        self.content = request.content
        self.content_type = request.headers["Content-Type"]
        self.head = head
        self.model = model
        self.span = span
        self.limit = limit
        self.parts = parts  # for a second `model` field in the rest of the form
        self.started = False  # bytes past the head went to an engine: nothing can be resent
        self.problem: RouterError | None = None

    def ask_for_usage(self) -> None:
        """vLLM's transcription form gets `stream_include_usage=true` right after its model field
        (only a stream reads it). The rest of the form is not read before the engine is asked, so
        a field of the client's later on wins (the last of a repeated field does, in Starlette's
        forms), and the usage event is relayed as it comes: the router cannot tell whether the
        client asked for it."""
        if b'name="stream_include_usage"' in self.head:
            return
        start, end = self.span
        field = (b"\r\n" + self.delimiter + b'\r\nContent-Disposition: form-data; name="stream_include_usage"'
                 b"\r\n\r\ntrue")
        self.head = self.head[:end] + field + self.head[end:]

    @property
    def replayable(self) -> bool:
        return not self.started

    async def chunks(self, upstream_model: str) -> AsyncIterator[bytes]:
        """The body for one attempt, with `model` rewritten when the engine knows another name."""
        start, end = self.span
        head = self.head if upstream_model == self.model else \
            self.head[:start] + upstream_model.encode() + self.head[end:]
        yield head
        total = len(self.head)
        while True:
            chunk = await self.content.readany()
            if not chunk:
                return
            self.started = True
            total += len(chunk)
            if total > self.limit:
                self.problem = BodyTooLarge(f"request body is over the limit of {self.limit} bytes (gateway.max_body)")
                raise self.problem
            if self.parts.has_model(chunk):
                self.problem = _second_model()
                raise self.problem
            yield chunk


async def read_upload(request: web.BaseRequest, limit: int) -> Upload:
    """The head of a multipart request, up to its model field; refusals name what to change."""
    content_type = request.headers.get("Content-Type", "")
    boundary = _BOUNDARY.search(content_type)
    if not content_type.lower().startswith("multipart/form-data") or boundary is None:
        raise BadRequest("send this request as multipart/form-data, with the model name as the form field 'model'")
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported for uploads; send the form uncompressed")
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body is {length} bytes; the limit is {limit} (gateway.max_body)")
    delimiter = b"--" + boundary.group(2).encode("latin-1")
    head = b""
    while True:
        chunk = await request.content.readany()
        if not chunk:
            raise BadRequest("the form ends before its 'model' field", param="model")
        head += chunk
        found = find_model_field(head, delimiter)
        if found is not NEED_MORE:
            break
        if len(head) > HEAD_LIMIT:
            raise BadRequest(f"no 'model' field in the first {HEAD_LIMIT} bytes of the form; send it "
                             "before the file", param="model")
    if len(head) > limit:
        raise BodyTooLarge(f"request body is over the limit of {limit} bytes (gateway.max_body)")
    model, start, end = found
    parts = PartNames(delimiter)
    if parts.has_model(head[end:]):  # the fields after it that came in the same reads
        raise _second_model()
    return Upload(request, head, model, (start, end), limit, parts, delimiter)
