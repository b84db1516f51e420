"""How a client API key is hashed (R-6.2): the store keeps this hash and the router compares it."""

from __future__ import annotations

import hashlib

SECRET_PREFIX = "sk-llmgw-"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
