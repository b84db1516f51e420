"""Where a router finds its credential for the feed (R-10.7): a file, or the environment.

`--credential-file FILE` (default: `credential` in the router's state directory, where `llmgw
serve` writes the one of the router it spawns), else `LLMGW_ROUTER_CREDENTIAL`. Never argv:
other users read /proc/PID/cmdline. The file is read again for every exchange, so a credential
rotated on the control plane is taken up by replacing the file, without a restart.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.routerauth import credential_name

CREDENTIAL_FILE = "credential"
CREDENTIAL_ENV = "LLMGW_ROUTER_CREDENTIAL"
HOW = ("make one on the control plane with `llmgw ctl routers add NAME` and give it with --credential-file FILE "
       f"or {CREDENTIAL_ENV}")


class CredentialError(LlmgwError, ValueError):
    """No usable router credential, with what to do."""

    category = Category.SECURITY


def default_file(state_dir: Path) -> Path:
    return state_dir / CREDENTIAL_FILE


def read_file(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CredentialError(f"no router credential file {path}; {HOW}") from None
    except OSError as exc:
        raise CredentialError(f"cannot read the router credential file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CredentialError(f"the router credential file {path} is not text; {HOW}") from None
    try:
        credential_name(text)
    except ValueError as exc:
        raise CredentialError(f"{path}: {exc}") from None
    return text


def source(path: Path | None) -> Callable[[], str]:
    """A function giving the credential now: the file's content when `path` is given, else the
    environment's. CredentialError when there is none (checked once here, for a clear start)."""
    if path is not None:
        read_file(path)
        return lambda: read_file(path)
    value = os.environ.get(CREDENTIAL_ENV, "").strip()
    if not value:
        raise CredentialError(f"no router credential; {HOW}")
    try:
        credential_name(value)
    except ValueError as exc:
        raise CredentialError(f"{CREDENTIAL_ENV}: {exc}") from None
    return lambda: value


def resolve(path: Path | None, state_dir: Path) -> Path | None:
    """The credential file to use: the one given, else the state directory's when it exists and
    the environment holds none; None: the environment's."""
    if path is not None:
        return path
    if os.environ.get(CREDENTIAL_ENV, "").strip():
        return None
    return default_file(state_dir)
