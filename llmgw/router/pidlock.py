"""One process per state directory (stdlib only, so the router supervisor may use it): an exclusive flock on a file that then holds the owner's pid.

Both `llmgw serve` (serve.lock) and the router supervisor (supervisor.lock) take their state
directory this way. The kernel drops the lock when the process ends, however it ends, so a stale
file never blocks a start; a symlink planted in the lock file's place is refused, not followed.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError


class LockHeld(LlmgwError):
    """Another process holds the lock; `holder` is the pid it wrote ("unknown" when none)."""

    category = Category.STARTUP

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def take(path: Path) -> int:
    """The open descriptor of the locked file, now holding this pid; closing it releases the lock.
    Raises LockHeld, or OSError when the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LockHeld(holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
