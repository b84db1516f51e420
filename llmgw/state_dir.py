"""`llmgw serve`'s state directory: what it holds, made private on every start (R-9.3), taken by one
serve at a time (R-10.4), and the admin token kept in it.

    state.db (+ -wal, -shm)   the SQLite state (llmgw.store): engine keys, key hashes, usage
    admin-token               the admin token (0600)
    admin-address             where the TCP admin listener is bound, for local ctl
    admin.sock                the admin listener on a Unix socket, for local ctl
    feed.sock                 the router feed (llmgw.control.feedserver)
    serve.lock                held by the running serve (flock), holding its pid
    router/, router.log       the router supervisor serve spawns, and its log (llmgw.router_process)

A start that cannot go on raises `StartupError`, whose message says why and what to do.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.admin.tokens import write_token_file
from llmgw.router import pidlock
from llmgw.router.private import untrusted

TOKEN_FILE = "admin-token"
ADMIN_ADDRESS_FILE = "admin-address"
ADMIN_SOCKET = "admin.sock"
DATABASE = "state.db"
# Made 0600 on every start, whatever they were: the database holds engine keys and key hashes.
PRIVATE_FILES = (DATABASE, DATABASE + "-wal", DATABASE + "-shm", TOKEN_FILE, ADMIN_ADDRESS_FILE)
LOCK_FILE = "serve.lock"
ROUTER_DIR = "router"  # the spawned supervisor's state directory, inside serve's
ROUTER_LOG = "router.log"


class StartupError(LlmgwError):
    """`llmgw serve` cannot start; the message says why and what to do."""

    category = Category.STARTUP


def secure_state_dir(state_dir: Path) -> None:
    """The state directory 0700 and its files 0600, on every start (R-9.3).

    A directory or database left readable by an earlier version, a restored backup or a
    hand-made directory is closed up here rather than trusted; symlinks are left alone. What
    another user owns is refused, by the rule the router applies to its state too (R-10.9): as
    root, the chmod alone would succeed on it.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)
        problems = [untrusted(state_dir, follow=True)]
        for name in PRIVATE_FILES:
            path = state_dir / name
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.chmod(path, 0o600)
                    problems.append(untrusted(path))
            except FileNotFoundError:
                pass
    except PermissionError as exc:
        # Another user's directory (or one inside it): serve runs as the user who owns its state.
        raise StartupError(f"cannot make the state directory private: {exc.strerror}: {exc.filename} "
                           f"(owner uid {_owner(exc.filename)}, this process runs as uid {os.geteuid()}); "
                           "run llmgw serve as its owner or give --state-dir") from None
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise StartupError(f"refusing the state directory: {problem}") from None


def _owner(path) -> str:
    try:
        return str(os.stat(path).st_uid)
    except (OSError, TypeError):
        return "-"


def hold_instance_lock(state_dir: Path) -> int:
    """Take the state directory for this process: an exclusive lock on a file that holds its pid.

    The kernel drops the lock when the process ends, however it ends, so a stale file never
    blocks a start. Returns the open descriptor; closing it releases the lock."""
    path = state_dir / LOCK_FILE
    try:
        return pidlock.take(path)
    except OSError as exc:  # a symlink planted there is refused, not followed
        raise StartupError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
    except pidlock.LockHeld as held:
        raise StartupError(_held(held.holder, state_dir)) from None


def refuse_if_held(state_dir: Path) -> None:
    """End a start at once when another serve holds the state directory, without taking it: a serve
    that would adopt the router must know before it looks at the router (R-10.4)."""
    holder = instance_lock_holder(state_dir)
    if holder is not None:
        raise StartupError(_held(holder, state_dir))


def _held(holder: str, state_dir: Path) -> str:
    return (f"another llmgw serve (pid {holder}) is already running with the state directory {state_dir}; "
            "stop it first, or give this one its own --state-dir")


def instance_lock_holder(state_dir: Path) -> str | None:
    """The pid in serve.lock while another serve holds it, without taking it."""
    try:
        fd = os.open(state_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def admin_token(state_dir: Path) -> str:
    """The admin token, kept in a 0600 file of the state directory (R-9.3)."""
    path = state_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if token:
            os.chmod(path, 0o600)
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    write_token_file(path, token)
    return token
