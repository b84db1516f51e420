"""The one root of every error llmgw raises on purpose, and what kind of trouble each is.

    LlmgwError                         category: what the operator or client can do about it
    ├── ConfigError                    INPUT      an inventory or model file, with file/line/field (config)
    ├── KeyRefused                     INPUT      an API key operation refused (keys)
    ├── RouterRefused                  INPUT      a router credential operation refused (routers)
    ├── ServiceError                   by its ErrorKind: INPUT, NOT_FOUND, CONFLICT, NODE (contracts.refusals)
    ├── NodeError                      NODE       a node operation failed; one class per way (fleet.errors)
    │   ├── NodeUnavailable, NodeTimeout, BadAnswer …   this side of the wire
    │   └── RemoteError …                               the helper's refusals, by kind
    ├── RouterError                    what a client is told, in OpenAI's error shape (router.errors)
    │   ├── InvalidKey, BadRequest, BodyTooLarge …      INPUT
    │   ├── ModelNotFound, NotFound …                   NOT_FOUND
    │   ├── NoCapacity, NotReady, ModelLoading …        CAPACITY
    │   ├── Upstream* …                                 UPSTREAM
    │   └── InternalError                               INTERNAL
    ├── EngineMissing, HelperFailed    NODE       a node lacks an engine; its helper cannot run (control.actions, fleet.session)
    ├── FeedError                      PROTOCOL   a router feed message that does not parse (contracts.feed)
    ├── FeedClientError                PROTOCOL   a router that cannot be fed (router.statedir)
    ├── facts.Malformed                PROTOCOL   a helper answer without the protocol's shape (fleet.facts)
    ├── engineload.Malformed           UPSTREAM   an engine's load reading that does not parse (router.engineload)
    ├── CredentialError, SecretError   SECURITY   a credential or the fleet secret unusable
    ├── NotText                        SECURITY   an admin token that is not text (admin.tokens)
    ├── SupervisorError, StartupError, LockHeld   STARTUP    serve or its router process cannot start
    └── AdminError                     by the admin's answer: the CLI's view of a refusal (admin.client)

Each family keeps its own fields (a node error its node, operation and phase; a router error its
status and OpenAI type) and is translated in one place (the admin's HTTP table, the router's
error_response, the CLI's exits). Families that were ValueErrors still are, so code that catches
ValueError is unchanged. tests/unit/test_errors.py checks that every exception class of llmgw
descends from LlmgwError.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Category(StrEnum):
    """What kind of trouble an error is."""

    INPUT = "input"  # the request, file or argument is wrong: fix it and send it again
    NOT_FOUND = "not_found"  # it names something that does not exist
    CONFLICT = "conflict"  # what runs now refuses it: wait, or change that first
    CAPACITY = "capacity"  # nothing can take it now: retry later
    UPSTREAM = "upstream"  # an engine failed or answered wrong
    NODE = "node"  # a node could not do what was asked
    PROTOCOL = "protocol"  # two parts of llmgw do not understand each other
    SECURITY = "security"  # a credential, secret or permission is missing or unsafe
    STARTUP = "startup"  # a process of llmgw cannot start
    INTERNAL = "internal"  # a bug in llmgw


class LlmgwError(Exception):
    """The root of llmgw's errors; `category` says what kind of trouble it is."""

    category: ClassVar[Category] = Category.INTERNAL
