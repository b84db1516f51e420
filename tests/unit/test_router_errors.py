"""One table of router errors, one OpenAI error shape (R-6.1)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from llmgw.router import errors
from llmgw.router.errors import error_response, from_http_exception


@pytest.mark.parametrize("error,status,code,retryable", [
    pytest.param(errors.InvalidKey("x"), 401, "invalid_api_key", False, id="401"),
    pytest.param(errors.ModelNotFound("x"), 404, "model_not_found", False, id="404"),
    pytest.param(errors.BadRequest("x"), 400, "invalid_request", False, id="400"),
    pytest.param(errors.BodyTooLarge("x"), 413, "request_too_large", False, id="413"),
    pytest.param(errors.UnsupportedEncoding("x"), 415, "unsupported_content_encoding", False, id="415"),
    pytest.param(errors.NoCapacity("x"), 503, "no_capacity", False, id="503"),
    pytest.param(errors.ModelLoading("x"), 503, "model_loading", False, id="503-loading"),
    pytest.param(errors.UpstreamConnectFailed("x"), 502, "upstream_unavailable", True, id="502-connect"),
    pytest.param(errors.UpstreamRefused("x"), 502, "upstream_unavailable", True, id="502-refused"),
    pytest.param(errors.UpstreamFailed("x"), 502, "upstream_unavailable", False, id="502-spent"),
    pytest.param(errors.UpstreamRejectedKey("x"), 502, "upstream_auth_failed", False, id="502-engine-key"),
    pytest.param(errors.UpstreamTimeout("x"), 504, "upstream_timeout", False, id="504"),
    pytest.param(errors.InternalError("x"), 500, "internal_error", False, id="500"),
])
def test_r6_1_error_table(error, status, code, retryable):
    response = error_response(error)
    assert response.status == status
    assert response.content_type == "application/json"
    assert json.loads(response.body) == {"error": {"message": "x", "type": error.type, "code": code, "param": None}}
    assert error.retryable_before_first_byte is retryable
    assert ("Retry-After" in response.headers) is (status == 503)


def test_r6_1_the_field_at_fault_is_named_in_param():
    response = error_response(errors.InvalidType("'stream' must be a boolean", param="stream"))
    assert response.status == 400
    assert json.loads(response.body)["error"] == {"message": "'stream' must be a boolean",
                                                  "type": "invalid_request_error", "code": "invalid_type",
                                                  "param": "stream"}


def test_r6_1_aiohttp_refusals_are_translated():
    assert from_http_exception(web.HTTPNotFound()).status == 404
    assert from_http_exception(web.HTTPMethodNotAllowed("GET", ["POST"])).code == "method_not_allowed"
    assert from_http_exception(web.HTTPRequestEntityTooLarge(10, 20)).status == 413
    other = from_http_exception(web.HTTPUnsupportedMediaType())
    assert other.status == 415 and other.type == "invalid_request_error"
