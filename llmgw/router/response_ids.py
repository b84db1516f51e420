"""Response ids that name their replica, so follow-ups find the engine that holds the response.

A stored response lives only in the engine process that made it (vLLM keeps it in a dict in that
process). The id a client gets is the engine's id with the model and replica folded in:
`resp_<base64url of ["model", "replica"]>.<engine's id>`. Any router worker on any host can read
it back without shared state; the client's key is checked against the model it names before
anything else. Nothing in it is secret: forging one only points at a replica of a model the key
may use anyway.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

PREFIX = "resp_"
# A Responses id as an engine writes it: the value of "id" or "previous_response_id", "resp_..."
_ENGINE_ID = re.compile(rb'"(id|previous_response_id)"(\s*:\s*)"(resp_[A-Za-z0-9_\-]*)"')


def encode(model: str, replica_id: str, engine_id: str) -> str:
    token = base64.urlsafe_b64encode(json.dumps([model, replica_id]).encode()).rstrip(b"=").decode()
    return f"{PREFIX}{token}.{engine_id}"


def decode(response_id: str) -> tuple[str, str, str] | None:
    """(model, replica id, the engine's id), or None when the id was not issued by this router."""
    if not response_id.startswith(PREFIX):
        return None
    token, dot, engine_id = response_id[len(PREFIX):].partition(".")
    if not dot or not engine_id or not token:
        return None
    try:
        names = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    if type(names) is not list or len(names) != 2 or not all(type(n) is str and n for n in names):
        return None
    return names[0], names[1], engine_id


def rewrite(data: bytes, model: str, replica_id: str) -> bytes:
    """Every engine response id in `data` (a body, or whole SSE events) replaced by one naming its replica."""
    if b'"resp_' not in data:
        return data

    def replace(match: re.Match) -> bytes:
        engine_id = match.group(3).decode()
        return b'"%s"%s"%s"' % (match.group(1), match.group(2), encode(model, replica_id, engine_id).encode())
    return _ENGINE_ID.sub(replace, data)
