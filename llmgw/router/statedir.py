"""The router's state directory (R-10.2, R-10.9): the rule that makes a directory of it private or
refuses it, and the last-known-good snapshot kept there.

What a router keeps in its state directory (0700; files 0600, written atomically):

- `snapshot.json`: the router's latest snapshot (`to_wire`), written at most once a second after
  a change and on close. At start it is given to the router before anything is connected, so a
  router whose control plane is away serves with what it was last told (last-known-good). A file
  that does not parse is set aside as `snapshot.json.bad` and not used.
- `slots/N/`: one per running router process, with its router id and report spool (llmgw.router.spool).
- `refused/ROUTER-SEQ.json`: the reports the control plane refused as a whole (R-10.8, llmgw.router.spool).

Every directory and file here is used only when it is this user's and nobody else may write it
(`private.untrusted`, R-10.9): a planted snapshot would route clients, a planted spool would
count usage. A state directory or slot that is not is refused (the worker does not start, saying
why); a snapshot file that is not is left unused, with the reason in the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import partial
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.feed import FeedError, Snapshot, from_wire, to_wire
from llmgw.contracts.privatefiles import write_private
from llmgw.router.private import untrusted

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "snapshot.json"

_dumps = partial(json.dumps, separators=(",", ":"))


class FeedClientError(LlmgwError, ValueError):
    """A --control address or state directory this client cannot use, with what to do."""

    category = Category.PROTOCOL


def private_dir(path: Path) -> None:
    """Make `path` (and its parents) a 0700 directory of this user's; FeedClientError when another
    user owns it or may write it (R-10.9)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = untrusted(path)
    if problem is not None:
        raise FeedClientError(f"refusing the router state directory: {problem}")
    os.chmod(path, 0o700)


def load_snapshot_file(path: Path) -> Snapshot | None:
    """The snapshot kept in `path`, or None when there is none or it does not parse (then it is
    renamed `*.bad` and the reason logged: a router starts without it rather than with a guess).
    One that another user owns or may write is not read (R-10.9)."""
    problem = untrusted(path)
    if problem is not None:
        log.warning("not using the last-known-good snapshot: %s; starting without it", problem)
        return None
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the last-known-good snapshot %s (%s); starting without it", path, exc.strerror)
        return None
    try:
        message = from_wire(json.loads(text))
        if not isinstance(message, Snapshot):
            raise FeedError(f"message.type: expected a snapshot, got {type(message).__name__.lower()}")
    except (ValueError, FeedError) as exc:  # json.JSONDecodeError is a ValueError
        bad = path.with_name(path.name + ".bad")
        with contextlib.suppress(OSError):
            os.replace(path, bad)
        log.warning("the last-known-good snapshot %s is not usable (%s); set aside as %s, starting without it",
                    path, exc, bad.name)
        return None
    return message


def write_snapshot_file(path: Path, snapshot: Snapshot) -> None:
    """Keep `snapshot` in `path` (0600, replaced whole and durably). Blocks: call it off the loop."""
    write_private(path, _dumps(to_wire(snapshot)).encode())
