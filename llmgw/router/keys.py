"""Client API keys as the router holds them (R-6.2): constant-time checks against the keys in force.

The control plane publishes the keys in force (`KeyEntry`: id, name, hash, model limits) in the
router feed; a revoked key is simply absent. The request path only looks a hash up in one dict.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from llmgw.contracts.feed import KeyEntry
from llmgw.contracts.keyhash import hash_secret
from llmgw.router.errors import InvalidKey

CREATE_HINT = "an operator creates one with `llmgw keys create NAME`"


def allows(key: KeyEntry, model: str) -> bool:
    return key.models is None or model in key.models


class KeyRing:
    """The keys in force, in memory; `authenticate` is all the request path does."""

    def __init__(self, keys: Iterable[KeyEntry] = ()):
        self._by_hash: dict[str, KeyEntry] = {}
        self.replace(keys)

    def replace(self, keys: Iterable[KeyEntry]) -> None:
        self._by_hash = {key.hash: key for key in keys}

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> KeyEntry:
        """The key an `Authorization: Bearer ...` header carries, or else an `x-api-key` header
        (as Anthropic's clients send it); raises InvalidKey otherwise."""
        if authorization:
            scheme, _, secret = authorization.partition(" ")
            if scheme.lower() != "bearer" or not secret.strip():
                raise InvalidKey("the Authorization header must be 'Bearer <key>'")
        elif x_api_key and x_api_key.strip():
            secret = x_api_key
        else:
            raise InvalidKey("no API key: send it as 'Authorization: Bearer sk-llmgw-...' or "
                             f"'x-api-key: sk-llmgw-...' ({CREATE_HINT})")
        try:
            digest = hash_secret(secret.strip())
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as surrogates: no key looks like that
            raise InvalidKey("invalid API key") from None
        # The dict finds the candidate by the secret's hash; compare_digest then confirms it in
        # constant time, so response timing says nothing about how close a guess was.
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(key.hash, digest):
            raise InvalidKey("invalid API key")
        return key
