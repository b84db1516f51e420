"""llmgw's guard on a vLLM engine port: nothing is served without the replica's key (R-4.6).

vLLM checks VLLM_API_KEY only on paths under /v1, /v2, /inference and /cohere; /invocations,
/tokenize, /detokenize, /metrics and the rest answer anyone. This pure ASGI middleware refuses
every HTTP request and websocket that lacks ``Authorization: Bearer <VLLM_API_KEY>`` with 401,
except ``GET /health``, the node helper's readiness probe. Without a key in the environment it
refuses everything but that probe.

Shipped as package data by the control plane, written 0600 into the shard's 0700 directory by
the node helper (which checks its SHA-256 first), and loaded by vLLM in its API server process
through ``--middleware llmgw_vllm_guard.EngineKeyGuard`` with that directory on PYTHONPATH. vLLM
adds it last, so it runs first. Standard library only; it never imports llmgw.
"""

import hashlib
import hmac
import os

KEY_VARIABLE = "VLLM_API_KEY"
OPEN_ROUTES = frozenset([("GET", "/health")])
REFUSAL = (b'{"error":{"message":"this engine port serves llmgw only: a bearer key is required",'
           b'"type":"invalid_request_error","code":"unauthorized"}}')
REFUSAL_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(REFUSAL)).encode("ascii")),
    (b"www-authenticate", b"Bearer"),
]
POLICY_VIOLATION = 1008  # websocket close code


def _digest(data):
    return hashlib.sha256(data).digest()


class EngineKeyGuard:
    def __init__(self, app):
        self.app = app
        key = os.environ.get(KEY_VARIABLE, "")
        # Digests of equal length, so the comparison time says nothing about the key.
        self.key_digest = _digest(key.encode("utf-8")) if key else None

    def authorized(self, scope):
        if self.key_digest is None:
            return False
        values = [value for name, value in scope.get("headers") or () if name.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self.key_digest)

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan: start-up and shut-down of the app
            return
        if (kind == "http" and (scope.get("method"), scope.get("path")) in OPEN_ROUTES) or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        await send({"type": "http.response.start", "status": 401, "headers": REFUSAL_HEADERS})
        await send({"type": "http.response.body", "body": REFUSAL})
