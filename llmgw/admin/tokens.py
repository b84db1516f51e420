"""The admin tokens the admin listener accepts (R-9.3): the one in the admin-token file, and while a
rotation's grace runs the one it replaced (`llmgw ctl token rotate --grace DURATION`).

The previous token's grace is kept in memory: a restart of `llmgw serve` ends it early.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.privatefiles import write_private


class NotText(LlmgwError, ValueError):
    """A token that is not UTF-8 text (a header of raw bytes): refused, never compared."""

    category = Category.SECURITY


def _bytes(given: str) -> bytes:
    try:
        return given.encode()
    except UnicodeEncodeError:  # aiohttp hands undecodable header bytes on as surrogates
        raise NotText("the admin token sent is not UTF-8 text") from None


def cookie_value(token: str) -> str:
    """What the dashboard cookie holds: derived from the token, useless as an API token."""
    return hmac.new(token.encode(), b"llmgw dashboard cookie", hashlib.sha256).hexdigest()


def write_token_file(path: Path, token: str) -> None:
    """Write the token file (0600) so that a reader sees the old token or the new one, never a part."""
    write_private(path, (token + "\n").encode())


class AdminTokens:
    """The current admin token and, until `previous_until`, the previous one."""

    def __init__(self, token: str, path: Path | None = None, clock: Callable[[], float] = time.time):
        self.current = token
        self.path = path
        self.clock = clock
        self.previous: str | None = None
        self.previous_until: float | None = None

    def __repr__(self) -> str:  # the tokens stay out of tracebacks
        return "AdminTokens()"

    def _in_force(self) -> list[str]:
        tokens = [self.current]
        if self.previous is not None and self.previous_until is not None and self.clock() < self.previous_until:
            tokens.append(self.previous)
        return tokens

    def accepts(self, given: str | None) -> bool:
        """True for a token in force; NotText for one that is not text."""
        if given is None:
            return False
        offered = _bytes(given)
        return any(hmac.compare_digest(offered, token.encode()) for token in self._in_force())

    def accepts_cookie(self, given: str | None) -> bool:
        if given is None:
            return False
        offered = _bytes(given)
        return any(hmac.compare_digest(offered, cookie_value(token).encode()) for token in self._in_force())

    def rotate(self, grace: float) -> tuple[str, float | None]:
        """A new token, written to the token file; the current one stays accepted for `grace` seconds.
        Returns the new token and when the old one stops being accepted (None: at once)."""
        if grace < 0:
            raise ValueError(f"grace {grace}: must not be negative")
        token = secrets.token_urlsafe(32)
        if self.path is not None:
            write_token_file(self.path, token)
        until = self.clock() + grace if grace > 0 else None
        self.previous, self.previous_until = (self.current, until) if until is not None else (None, None)
        self.current = token
        return token, until
