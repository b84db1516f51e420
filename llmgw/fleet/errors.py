"""What a failed node operation raises: `NodeError` and its subclasses, one per way it fails.

Every failure carries the node, the operation, the phase it failed in and a message. A refusal
the helper sent is a `RemoteError` whose class is picked from the helper's kind in one table,
`REMOTE_ERRORS`; a kind this side does not know (a newer helper's) stays a `RemoteError` with
that kind. Failures on this side of the wire have their own classes: no session (`NodeUnavailable`),
no answer in time (`NodeTimeout`), an answer that cannot be used (`BadAnswer`; `MalformedAnswer`
when a field of it is wrong). Match on the classes, not on the kind's spelling.

As `OSError(errno.ENOENT, ...)` is a `FileNotFoundError`, `NodeError(node, op, "remote", message,
kind="port_in_use")` is a `PortInUse`: code that still builds node errors from a kind gets the
class the kind maps to.
"""

from __future__ import annotations

from typing import ClassVar

from llmgw.contracts.errors import Category, LlmgwError


class NodeError(LlmgwError):
    """A node operation failed. Carries the node, the operation and the phase it failed in, and
    the helper's kind (a machine word) when the helper refused it."""

    category = Category.NODE

    KIND: ClassVar[str | None] = None

    def __new__(cls, node: str, op: str, phase: str, message: str, kind: str | None = None):
        if kind is not None and cls in (NodeError, RemoteError):
            cls = REMOTE_ERRORS.get(kind, RemoteError)
        return super().__new__(cls)

    def __init__(self, node: str, op: str, phase: str, message: str, kind: str | None = None):
        kind = kind if kind is not None else type(self).KIND
        self.node, self.op, self.phase, self.kind, self.message = node, op, phase, kind, message
        super().__init__(f"{node}: {op}: {phase}: {message}")


# -- this side of the wire ------------------------------------------------------------------------


class NodeUnavailable(NodeError):
    """No helper session to ask (the node is not connected), or the session ended (connection
    lost, closed, the helper broke the protocol) before the answer came."""


class NodeTimeout(NodeError):
    """The helper did not answer within the call's time bound; it may still be working on it."""


class BadAnswer(NodeError):
    """The helper answered, but the answer cannot be used: a message without the protocol's
    shape, or a line over the session's limit."""


class MalformedAnswer(BadAnswer):
    """An answer or event of the protocol's shape whose content is not: a field missing or of
    the wrong type (the message names it)."""


# -- what the helper refused (its ERROR_KINDS) ----------------------------------------------------


class RemoteError(NodeError):
    """The helper refused the request; `kind` says how (its machine word)."""


class BadRequest(RemoteError):
    """The helper could not read a request line."""


class UnknownOperation(RemoteError):
    """The helper has no such operation (an older helper than this control plane)."""


class BadArguments(RemoteError):
    """The request's arguments were refused (a wrong type, a path that is not absolute, ...)."""


class HelperInternalError(RemoteError):
    """An unexpected exception in the helper; it kept running, its stderr has the traceback."""


class RequestCancelled(RemoteError):
    """The request was cancelled on the node (a fetch wait, a download abandoned)."""


class ShardNotFound(RemoteError):
    """The node has no record of the shard (never launched there, or forgotten)."""


class ShardAlive(RemoteError):
    """The shard's engine still runs: it cannot be launched again or forgotten."""


class IdentityMismatch(RemoteError):
    """The process under the shard's pid is not the engine llmgw started; nothing was signalled."""


class PortInUse(RemoteError):
    """The engine's port is already taken on the node; another port may do."""


class EngineProgramMissing(RemoteError):
    """The engine's program is not on the node (the message names it and the PATH searched)."""


class FileIntegrity(RemoteError):
    """A file written for the engine does not have the SHA-256 it was sent with; nothing started."""


class LaunchFailed(RemoteError):
    """The engine's supervisor did not record a start."""


class NoFleetSecret(RemoteError):
    """The helper holds no fleet secret yet, so it cannot seal what it fetches."""


class FetchTooLarge(RemoteError):
    """A download would outgrow its cap, or a file its announced length."""


class FetchStalled(RemoteError):
    """A download received nothing for its stall timeout."""


class UnsafePermissions(RemoteError):
    """A directory of the helper is a link or open to others, or cannot be made."""


class DiskFull(RemoteError):
    """No space (or quota) left in the cache directory."""


class CacheDirUnusable(RemoteError):
    """The cache directory cannot be written, or the entry's name is taken by something that is
    not llmgw's."""


class SourceHTTPError(RemoteError):
    """The weights' source answered with an HTTP error or a listing that is refused."""


class SourceNetworkError(RemoteError):
    """The weights' source could not be reached, or the connection broke mid-download."""


class EmptySource(RemoteError):
    """The weights' source lists no files."""


class WeightsIntegrity(RemoteError):
    """Weights whose bytes are not the ones they should be: a fetched file that does not hash to
    what the hub publishes (nothing was kept), or a cache entry a launch found unsealed or
    changed since its seal (the engine was not started; nothing was removed)."""


class RuntimeMissing(RemoteError):
    """The engine's runtime is not usable on the node: no docker or podman on its PATH or its
    daemon not answering, or no interpreter for an environment (the message names what was
    looked for, and where)."""


class ProvisionFailed(RemoteError):
    """Installing the engine failed: an image that could not be pulled (the message names it and
    the command that loads it), or a step building an environment (pip, uv, a post_install
    command; the message gives the command and its last lines). Nothing of it was kept."""


# The one table from the helper's kind to its class; every kind the helper declares in its
# ERROR_KINDS is in it (tests/unit/test_node_ops.py checks).
REMOTE_ERRORS: dict[str, type[RemoteError]] = {
    "bad_request": BadRequest,
    "unknown_op": UnknownOperation,
    "bad_args": BadArguments,
    "internal": HelperInternalError,
    "cancelled": RequestCancelled,
    "not_found": ShardNotFound,
    "alive": ShardAlive,
    "identity": IdentityMismatch,
    "port_in_use": PortInUse,
    "engine_missing": EngineProgramMissing,
    "integrity": FileIntegrity,
    "launch_failed": LaunchFailed,
    "no_secret": NoFleetSecret,
    "too_large": FetchTooLarge,
    "stalled": FetchStalled,
    "permissions": UnsafePermissions,
    "disk_full": DiskFull,
    "cache_dir": CacheDirUnusable,
    "http": SourceHTTPError,
    "network": SourceNetworkError,
    "empty_source": EmptySource,
    "weights_integrity": WeightsIntegrity,
    "runtime_missing": RuntimeMissing,
    "provision_failed": ProvisionFailed,
}
for _kind, _cls in REMOTE_ERRORS.items():
    _cls.KIND = _kind  # a class built directly (PortInUse(...)) carries its kind too
