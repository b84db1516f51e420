"""Whether a state file or directory can be trusted: the one rule `llmgw serve` (R-9.3) and
`llmgw router` (R-10.9) apply to what they keep on disk.

Trusted means owned by the user this process runs as and writable by nobody else. A file another
user owns can be rewritten by them whenever they like (they may chmod it back), and one its group
or others may write could already have been; neither is read: a planted snapshot or report spool
would route clients or count usage as someone else says.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def untrusted(path: Path | str, *, follow: bool = False) -> str | None:
    """Why `path` is not this user's own state, or None (also when it does not exist).

    `follow`: a symbolic link is judged by what it points to (a state directory given on the
    command line may be one); otherwise a link is refused, as something planted in its place."""
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link, not a file of this user's"
    uid = os.geteuid()
    if info.st_uid != uid:
        return (f"{path} is owned by uid {info.st_uid}, not by uid {uid} that this process runs as; "
                "run it as the owner, or give it a state directory of its own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        who = "its group and others" if mode & 0o022 == 0o022 else "its group" if mode & 0o020 else "others"
        return (f"{path} is writable by {who} (mode {mode:04o}), so another user may have changed it; "
                f"check it, then `chmod go-w {path}`")
    return None
