"""The affinity key of a request routed by prefix (R-6.5): what its engine can reuse from cache.

An explicit key wins, first found in this order: the body's `prompt_cache_key` (OpenAI's field for
exactly this), the `X-Session-ID` header, the body's `user`. A client chooses these, so each is
taken within its API key (`tenant`): two tenants choosing the same string do not share a home, nor
can one aim its requests at another's. Without one, the key is taken from
the content every request of a conversation starts with:

- chat: the system (or developer) messages before the first user message, and that first user
  message; every turn of a conversation repeats them. When those leading messages are long
  (SHARED_PREFIX_BYTES or more), they alone are the key: a long system prompt is what a tenant's
  conversations share and what the engine's cache saves most on, so they all go where it is
  cached (the bound spreads them when they are too many for one replica);
- completions and embeddings: the prompt's (input's) first PROMPT_KEY_BYTES bytes (token ids:
  its first PROMPT_KEY_BYTES / 4). Not more: every prompt that shares that much shares a cached
  prefix worth its prefill, and a longer key would split prompts that share a long prefix but
  differ before the key ends. vLLM's own benchmark (`prefix_repetition`, 16 prefixes of 1,024
  tokens, random tokens of a 512-word vocabulary: about 1.9 KB each) made 263 keys of its 320
  prompts with a 2 KiB key, and each prefix reached both engines; with 1 KiB, 16.

Each chat part is cut to KEY_BYTES bytes, so hashing stays cheap whatever the prompt's length. A
request with none of these has no key and is balanced by load alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

KEY_BYTES = 2048
PROMPT_KEY_BYTES = 1024  # about 250 tokens of English; see the module docstring
SHARED_PREFIX_BYTES = 1024  # about 250 tokens: a prefix worth more cached than one conversation
SESSION_HEADER = "X-Session-ID"
_LEADING_ROLES = ("system", "developer")


def _text(content: object) -> bytes:
    if isinstance(content, str):
        return content.encode()[:KEY_BYTES]
    if content is None:
        return b""
    return json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()[:KEY_BYTES]


def affinity_key(document: Mapping, headers: Mapping[str, str], tenant: str) -> bytes | None:
    """The request's affinity key; `tenant`, the id of its API key, namespaces the explicit ones."""
    explicit = document.get("prompt_cache_key")
    if isinstance(explicit, str) and explicit:
        return b"k\0" + tenant.encode() + b"\0" + explicit.encode()[:KEY_BYTES]
    session = headers.get(SESSION_HEADER)
    if session:
        return b"s\0" + tenant.encode() + b"\0" + session.encode()[:KEY_BYTES]
    user = document.get("user")
    if isinstance(user, str) and user:
        return b"u\0" + tenant.encode() + b"\0" + user.encode()[:KEY_BYTES]
    messages = document.get("messages")
    if isinstance(messages, list):
        parts = [b"c"]
        for message in messages:
            if not isinstance(message, dict):
                break
            role = message.get("role")
            if role in _LEADING_ROLES:
                parts.append(_text(message.get("content")))
                if sum(map(len, parts)) >= SHARED_PREFIX_BYTES:
                    return b"\0".join(parts)
            elif role == "user":
                parts.append(_text(message.get("content")))
                return b"\0".join(parts)
            else:
                break
        return b"\0".join(parts) if len(parts) > 1 else None
    for field in ("prompt", "input"):
        prompt = document.get(field)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, list):
            prompt = prompt[:PROMPT_KEY_BYTES // 4]  # token ids: a bounded count of them
        if prompt:
            return b"p\0" + _text(prompt)[:PROMPT_KEY_BYTES]
    return None
