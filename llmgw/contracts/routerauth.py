"""How a router and the control plane prove to each other that they hold the router's credential
(R-10.7), without the credential crossing the wire.

A router credential is `llmgw-router.NAME.SECRET`; the control plane keeps only its verifier,
SHA-256 of the whole credential, and the router derives the same verifier from its copy. Every
feed request goes through one exchange:

1. the router asks `POST /v1/feed/challenge {"router": NAME, "nonce": N}`; the control plane
   answers a fresh single-use `challenge` C and, for each verifier it accepts for NAME (two
   while a rotation's grace runs), `server_proof(V, NAME, N, C)`. The router goes on only when
   one of them is its own: whoever answered knows the verifier.
2. the router sends the request with `Authorization: Llmgw-Router NAME:C:router_proof(V, ...)`,
   bound to the method and path; the control plane checks it and forgets C (no replay).
3. the answer carries `X-Llmgw-Proof: answer_proof(V, ...)`: the router reads no feed line and
   takes no ack from an answer without it.

A process that took the port of a plain-http control plane on loopback gets a name, nonces and
proofs that are useless anywhere else, and cannot make a proof the router accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

CREDENTIAL_PREFIX = "llmgw-router."
SCHEME = "Llmgw-Router"
PROOF_HEADER = "X-Llmgw-Proof"
CHALLENGE_PATH = "/v1/feed/challenge"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
NAME_RULE = "1 to 63 letters, digits, '-' or '_', starting with a letter or digit"


def valid_name(name: str) -> bool:
    return bool(NAME_RE.match(name))


def new_credential(name: str) -> str:
    if not valid_name(name):
        raise ValueError(f"router name {name!r}: {NAME_RULE}")
    return f"{CREDENTIAL_PREFIX}{name}.{secrets.token_urlsafe(32)}"


def credential_name(credential: str) -> str:
    """The router name a credential carries; ValueError when the text is not a router credential."""
    body = credential.strip()
    if not body.startswith(CREDENTIAL_PREFIX):
        raise ValueError(f"not a router credential (those start with {CREDENTIAL_PREFIX!r}; make one with "
                         "`llmgw ctl routers add NAME`)")
    name, dot, secret = body[len(CREDENTIAL_PREFIX):].partition(".")
    if not dot or not secret or not valid_name(name):
        raise ValueError(f"a router credential is {CREDENTIAL_PREFIX}NAME.SECRET, and this one is not")
    return name


def verifier(credential: str) -> bytes:
    """What the control plane keeps of a credential, and the key of every proof."""
    return hashlib.sha256(credential.strip().encode()).digest()


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def server_proof(key: bytes, name: str, nonce: str, challenge: str) -> str:
    return _mac(key, "llmgw feed server", name, nonce, challenge)


def router_proof(key: bytes, name: str, nonce: str, challenge: str, method: str, path: str) -> str:
    return _mac(key, "llmgw feed router", name, nonce, challenge, method.upper(), path)


def answer_proof(key: bytes, name: str, nonce: str, challenge: str) -> str:
    return _mac(key, "llmgw feed answer", name, nonce, challenge)


def same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(errors="surrogateescape"), expected.encode())


def authorization(name: str, challenge: str, proof: str) -> str:
    return f"{SCHEME} {name}:{challenge}:{proof}"


def parse_authorization(header: str) -> tuple[str, str, str] | None:
    """(name, challenge, proof) of an `Authorization: Llmgw-Router ...` header, None for any other."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != SCHEME.lower():
        return None
    parts = value.strip().split(":")
    if len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


def router_of(router_id: str) -> str:
    """The router name a router id belongs to: ids are `NAME/...` (R-10.7)."""
    return router_id.partition("/")[0]
