"""The fleet secret: made once in the control plane's state directory, handed to every helper.

Helpers seal the cache entries they fetch with an HMAC keyed by it, and accept an entry only
with a seal that matches, so weights one node fetched onto a shared filer are accepted by the
others while a directory someone else planted there never is. Every node holds it, so the seal
also covers each file's SHA-256 and a helper hashes what it launches (R-5.6). It travels only
inside the helper session (never in an argv, never logged); a helper keeps it in its 0700 root.

The response-id secret is made and kept the same way, beside it: routers seal the Responses ids
they hand out with it (R-6.14), and it travels only in the router feed's snapshot.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError

SECRET_FILE = "fleet.key"
RESPONSE_SECRET_FILE = "responses.key"
_SECRET_RE = re.compile(r"[0-9a-f]{64}")


class SecretError(LlmgwError):
    """A secret of the state directory (the fleet secret, the response-id secret) cannot be read or made; the message says why."""

    category = Category.SECURITY


def fleet_secret(state_dir: str | os.PathLike) -> str:
    """The fleet secret kept in STATE_DIR/fleet.key (0600), made on first use.

    It is written whole into a temp file and hard-linked into place, so a concurrent first use
    by another llmgw process reads either nothing (and makes none) or the whole secret."""
    return _state_secret(Path(state_dir), SECRET_FILE, "the fleet secret", "every node then fetches its weights again")


def response_secret(state_dir: str | os.PathLike) -> str:
    """The response-id secret kept in STATE_DIR/responses.key (0600), made on first use like the fleet secret."""
    return _state_secret(Path(state_dir), RESPONSE_SECRET_FILE, "the response-id secret",
                         "the Responses ids handed out so far are then refused")


def _state_secret(directory: Path, name: str, what: str, remedy: str) -> str:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    try:
        return _read(path, what, remedy)
    except FileNotFoundError:
        pass
    temp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            pass  # made by another llmgw process at the same moment: theirs is the one
    finally:
        os.unlink(temp)
    return _read(path, what, remedy)


def _read(path: Path, what: str, remedy: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretError(f"{path} is a symbolic link; {what} must be a file of its own") from None
        raise SecretError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{path} is not a regular file")
        if info.st_mode & 0o077:
            os.fchmod(handle.fileno(), 0o600)
        value = handle.read(200).strip()
    if not _SECRET_RE.fullmatch(value):
        raise SecretError(f"{path} does not hold {what} (64 hex digits); remove it to make a new one ({remedy})")
    return value
