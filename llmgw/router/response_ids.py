"""Response ids that name their replica and their key, sealed, so follow-ups find the engine that
holds the response and no one else's key can reach it (R-6.14).

A stored response lives only in the engine process that made it (vLLM keeps it in a dict in that
process). The id a client gets folds the model, the replica, the id of the API key that made it
and the engine's own id into `resp_<base64url of the JSON list>.<seal>`, the seal being an HMAC
of that text under the secret the router feed carries (Snapshot.response_secret; made once by the
control plane and kept in its state directory, so ids outlive restarts). Any router worker on any
host opens it without shared state; an id whose seal does not match, or that another key made,
is refused like an unknown one.

The engine's id is the only part of an id that reaches an engine's URL (R-6.14a), and only in the
form engines write it (ENGINE_ID), checked when the id is sealed and again when it is opened.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re

PREFIX = "resp_"
# A Responses id as engines write it (vLLM `resp_<hex>`, SGLang `resp_<uuid hex>`): nothing else
# is ever sealed, so nothing else can be put into an engine's path.
ENGINE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,128}")
MAX_ID = 2048  # characters of an id handed out: longer ones are refused before any decoding
SEAL_BYTES = 16  # of the HMAC-SHA256: 128 bits, base64url in 22 characters
_SHAPE = re.compile(r"resp_([A-Za-z0-9_-]{1,%d})\.([A-Za-z0-9_-]{22})" % MAX_ID)
_DOMAIN = b"llmgw response id\0"  # the secret seals nothing else by this
# The value of "id" or "previous_response_id" in an engine's answer
_IN_ANSWER = re.compile(rb'"(id|previous_response_id)"(\s*:\s*)"(resp_[A-Za-z0-9_\-]{1,128})"')


class Sealed:
    """What an id the router handed out says: where the response is held, and whose it is."""

    __slots__ = ("model", "replica_id", "key_id", "engine_id")

    def __init__(self, model: str, replica_id: str, key_id: str, engine_id: str):
        self.model, self.replica_id, self.key_id, self.engine_id = model, replica_id, key_id, engine_id

    def __eq__(self, other) -> bool:
        return isinstance(other, Sealed) and self.fields() == other.fields()

    def fields(self) -> tuple[str, str, str, str]:
        return self.model, self.replica_id, self.key_id, self.engine_id

    def __repr__(self) -> str:
        return f"Sealed{self.fields()!r}"


class ResponseIds:
    """Seals and opens response ids with one secret (64 hex digits; never in a repr)."""

    __slots__ = ("_key",)

    def __init__(self, secret: str):
        self._key = bytes.fromhex(secret)

    def __repr__(self) -> str:
        return "ResponseIds(<secret>)"

    def _seal(self, token: str) -> str:
        digest = hmac.new(self._key, _DOMAIN + token.encode(), hashlib.sha256).digest()[:SEAL_BYTES]
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def seal(self, model: str, replica_id: str, key_id: str, engine_id: str) -> str:
        if not ENGINE_ID.fullmatch(engine_id):
            raise ValueError(f"not an engine's response id: {engine_id[:200]!r}")
        names = json.dumps([model, replica_id, key_id, engine_id], separators=(",", ":"))
        token = base64.urlsafe_b64encode(names.encode()).rstrip(b"=").decode()
        return f"{PREFIX}{token}.{self._seal(token)}"

    def open(self, response_id: str) -> Sealed | None:
        """What the id says, or None when this gateway did not hand it out (any other text: a
        forged, tampered, cut or overlong id, an engine's own id)."""
        if len(response_id) > MAX_ID:
            return None
        shape = _SHAPE.fullmatch(response_id)
        if shape is None:
            return None
        token, seal = shape.groups()
        if not hmac.compare_digest(seal, self._seal(token)):
            return None
        try:
            names = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        except (binascii.Error, ValueError, UnicodeDecodeError):
            return None
        if type(names) is not list or len(names) != 4 or not all(type(n) is str and n for n in names):
            return None
        if not ENGINE_ID.fullmatch(names[3]):  # sealed only in this form; checked again all the same
            return None
        return Sealed(*names)

    def rewrite(self, data: bytes, model: str, replica_id: str, key_id: str) -> bytes:
        """Every engine response id in `data` (a body, or whole SSE events) replaced by a sealed one."""
        if b'"resp_' not in data:
            return data

        def replace(match: re.Match) -> bytes:
            sealed = self.seal(model, replica_id, key_id, match.group(3).decode())
            return b'"%s"%s"%s"' % (match.group(1), match.group(2), sealed.encode())
        return _IN_ANSWER.sub(replace, data)
