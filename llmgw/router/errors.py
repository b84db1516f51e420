"""What can go wrong between a client and an engine, and how each failure looks on the wire.

Every refusal of the router is a `RouterError` subclass carrying the HTTP status, OpenAI's error
`type` and `code`, and whether it is safe to try another endpoint while nothing has reached the
client yet (R-6.6). `error_response` is the one place that turns them into OpenAI's error JSON
(R-6.1); the handler in `app.py` (`Router._handle`) is the one place that calls it.
"""

from __future__ import annotations

import json

from aiohttp import web

from llmgw.contracts.errors import Category, LlmgwError

from llmgw.router.routes import served_list

RETRY_AFTER_NO_CAPACITY = 5  # seconds; a replica may come back or be placed elsewhere soon
RETRY_AFTER_LOADING = 15  # seconds; an on-demand model that is still loading takes longer
RETRY_AFTER_NOT_READY = 5  # seconds; a router without a snapshot has it as soon as the control plane answers


class RouterError(LlmgwError):
    """A failure the client is told about in OpenAI's error shape."""

    status = 500
    type = "server_error"
    code = "internal_error"
    retryable_before_first_byte = False

    def __init__(self, message: str, *, retry_after: int | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.param = param  # the request field at fault, as OpenAI names it ("stream_options.include_usage")


# -- the client's mistakes --------------------------------------------------------------------

class InvalidKey(RouterError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"
    category = Category.INPUT


class ModelNotFound(RouterError):
    status, type, code = 404, "invalid_request_error", "model_not_found"
    category = Category.NOT_FOUND


class NotFound(RouterError):
    status, type, code = 404, "invalid_request_error", "not_found"
    category = Category.NOT_FOUND


class RouteNotServed(RouterError):
    """The model's built-in engine does not serve this route (llmgw/router/routes.py)."""

    status, type, code = 404, "invalid_request_error", "route_not_served"
    category = Category.NOT_FOUND


class ResponseNotFound(RouterError):
    """A response id this router did not issue, or whose replica no longer serves."""

    status, type, code = 404, "invalid_request_error", "response_not_found"
    category = Category.NOT_FOUND


class MethodNotAllowed(RouterError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"
    category = Category.INPUT


class BadRequest(RouterError):
    status, type, code = 400, "invalid_request_error", "invalid_request"
    category = Category.INPUT


class InvalidType(BadRequest):
    """A request field the router reads has a value of the wrong JSON type."""

    code = "invalid_type"


class BodyTooLarge(RouterError):
    status, type, code = 413, "invalid_request_error", "request_too_large"
    category = Category.INPUT


class UnsupportedEncoding(RouterError):
    status, type, code = 415, "invalid_request_error", "unsupported_content_encoding"
    category = Category.INPUT


# -- capacity and upstream failures ----------------------------------------------------------

class NoCapacity(RouterError):
    status, type, code = 503, "service_unavailable", "no_capacity"
    category = Category.CAPACITY

    def __init__(self, message: str, *, retry_after: int = RETRY_AFTER_NO_CAPACITY):
        super().__init__(message, retry_after=retry_after)


class NotReady(RouterError):
    """The router has no snapshot from the control plane yet: it knows no key and no model."""
    status, type, code = 503, "service_unavailable", "not_ready"

    def __init__(self, message: str, *, retry_after: int = RETRY_AFTER_NOT_READY):
        super().__init__(message, retry_after=retry_after)


class ModelLoading(NoCapacity):
    code = "model_loading"

    def __init__(self, message: str, *, retry_after: int = RETRY_AFTER_LOADING):
        super().__init__(message, retry_after=retry_after)


class AdapterNotLoaded(NoCapacity):
    """No replica of its base holds a LoRA adapter, and the control plane's latest load of it
    failed (R-8.8): the engine's reason, at once, rather than a wait for a load that is not coming."""

    code = "adapter_load_failed"


class UpstreamConnectFailed(RouterError):
    """The engine could not be reached, or dropped the connection before answering."""

    status, type, code = 502, "upstream_error", "upstream_unavailable"
    category = Category.UPSTREAM
    category = Category.CAPACITY
    retryable_before_first_byte = True


class UpstreamRefused(RouterError):
    """The engine answered 502 or 503: it is alive but cannot take the request."""

    status, type, code = 502, "upstream_error", "upstream_unavailable"
    category = Category.UPSTREAM
    retryable_before_first_byte = True


class UpstreamRejectedKey(RouterError):
    """The engine refused the replica's key: the router's configuration, not the client's key."""

    status, type, code = 502, "upstream_error", "upstream_auth_failed"
    category = Category.UPSTREAM


class UpstreamFailed(RouterError):
    """Every attempt failed; what the client gets once retries are spent."""

    status, type, code = 502, "upstream_error", "upstream_unavailable"
    category = Category.UPSTREAM


class UploadNotReplayed(RouterError):
    """An engine failed after the streamed upload had started: the router holds no copy to resend."""

    status, type, code = 502, "upstream_error", "upstream_unavailable"
    category = Category.UPSTREAM


class UpstreamAnswerTooLarge(RouterError):
    """A non-streamed answer past gateway.max_answer: another engine would answer the same."""

    status, type, code = 502, "upstream_error", "upstream_answer_too_large"
    category = Category.UPSTREAM


class UpstreamTimeout(RouterError):
    """The engine accepted the request but went silent: retrying would double its load."""

    status, type, code = 504, "timeout", "upstream_timeout"
    category = Category.UPSTREAM


class InternalError(RouterError):
    category = Category.INTERNAL
    pass


def error_body(exc: RouterError, request_id: str | None = None) -> bytes:
    error = {"message": exc.message, "type": exc.type, "code": exc.code, "param": exc.param}
    if request_id is not None:  # what the client quotes to whoever reads the request log
        error["request_id"] = request_id
    return json.dumps({"error": error}).encode()


# Anthropic's error types by status (its SDK picks the exception class by status, the type says why).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(exc: RouterError, request_id: str | None = None) -> bytes:
    """Anthropic's error shape: its `request_id` at the top level, as Anthropic's API puts it."""
    kind = ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    document = {"type": "error", "error": {"type": kind, "message": exc.message}}
    if request_id is not None:
        document["request_id"] = request_id
    return json.dumps(document).encode()


def error_response(exc: RouterError, anthropic: bool = False, request_id: str | None = None) -> web.Response:
    """The answer for a RouterError: OpenAI's shape (R-6.1), or Anthropic's on its Messages routes,
    naming the request's id (R-6.20)."""
    body = anthropic_error_body(exc, request_id) if anthropic else error_body(exc, request_id)
    response = web.Response(status=exc.status, body=body, content_type="application/json")
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def from_http_exception(exc: web.HTTPException) -> RouterError:
    """aiohttp's own refusals (unknown path, wrong method, body too large) in our terms."""
    if exc.status == 404:
        return NotFound(f"no such endpoint; this server offers {served_list()}")
    if exc.status == 405:
        return MethodNotAllowed(f"method not allowed here ({exc.reason})")
    if exc.status == 413:
        return BodyTooLarge("request body too large")
    error = RouterError(exc.reason or "error")
    error.status = exc.status
    error.type = "invalid_request_error" if 400 <= exc.status < 500 else "server_error"
    error.code = None
    return error
