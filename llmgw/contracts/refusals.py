"""An operator action the control plane refused, as the admin maps it to HTTP (R-9.1).

The control plane's service raises it; the admin turns its kind into a status in one table
(llmgw.admin.app.HTTP_STATUS), as the router maps RouterError. It lives here, with the other
values both sides share, so that the admin imports nothing of the control plane to read it.
"""

from __future__ import annotations

from enum import StrEnum

from llmgw.contracts.errors import Category, LlmgwError


class ErrorKind(StrEnum):
    """What kind of refusal a ServiceError is: what the caller can do about it."""

    INVALID = "invalid"  # the request is wrong: an argument, a definition, an inventory with a problem
    NOT_FOUND = "not_found"  # it names a model, node or replica that does not exist
    CONFLICT = "conflict"  # what runs now refuses it: a reload under way, a node leaving, no inventory file
    NODE_FAILED = "node_failed"  # a node could not answer (a log read)


class ServiceError(LlmgwError):
    """An operator action refused, with its kind, a code for scripts and the problems found."""

    def __init__(self, kind: ErrorKind, message: str, *, code: str = "bad_request",
                 problems: list[str] | None = None):
        super().__init__(message)
        self.kind, self.message, self.code, self.problems = kind, message, code, problems or []

    @property
    def category(self) -> Category:  # type: ignore[override]
        return _CATEGORIES[self.kind]


_CATEGORIES = {ErrorKind.INVALID: Category.INPUT, ErrorKind.NOT_FOUND: Category.NOT_FOUND,
               ErrorKind.CONFLICT: Category.CONFLICT, ErrorKind.NODE_FAILED: Category.NODE}
