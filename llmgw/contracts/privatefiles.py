"""Private state files written whole: the one way llmgw replaces a file only its user may read.

Tokens, credentials, the router's snapshot, report spool and status files are written through
`write_private`, on the control plane's side and the router's alike.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, mode 0600, so that a reader sees the old file or the new one,
    never a part, and after a crash (of the process or the machine) one of the two is on disk.

    The bytes go to a temporary file of the same directory (created exclusively, never through a
    link planted in its place), are fsynced, renamed over `path`, and the directory is fsynced so
    that the rename itself survives a power loss. A failure leaves `path` as it was and no
    temporary file behind."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
