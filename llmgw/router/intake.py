"""A proxied request taken in: its body read (and decompressed) within gateway.max_body, its JSON
parsed, its model found and allowed for the key, its limits applied, and the one `Exchange` the
rest of its way uses built from all that (R-6.1, R-6.16).

A limited key's own place and request are held before the body is read (`hold`), so that a
request over them is refused without the router reading (up to gateway.max_body of) it; its
tokens and its model's limits are admitted once the body is known, and the admission travels in
the Exchange, which the forwarder settles to the answer's usage. The budgets of a limited key's
request are left on its trail (`Trail.budgets`) for its x-ratelimit-* headers, and so is the model
it resolved to (`Trail.model`, and `Trail.asked`: the alias the client named it by) for its metrics
and its record in the request log.
"""

from __future__ import annotations

import json
import time
import zlib

from aiohttp import web

from llmgw.contracts.feed import KeyEntry, RoutedModel
from llmgw.router import limits
from llmgw.router.affinity import affinity_key
from llmgw.router.balancer import PREFIX, Balancer
from llmgw.router.errors import (BadRequest, BodyTooLarge, InvalidType, ModelNotFound, ResponseNotFound,
                                 RouteNotServed, UnsupportedEncoding)
from llmgw.router.exchange import Exchange, Pinned
from llmgw.router.feedstate import FeedState
from llmgw.router.keys import allows
from llmgw.router.listener import PATH_PARAMS
from llmgw.router.routes import FORM, RESPONSE_ID, RESPONSES, Route, serves
from llmgw.router.streams import CONTINUOUS_USAGE_ENGINES, ask_for_usage, streaming
from llmgw.router.trail import Trail
from llmgw.router.uploads import Upload, read_upload

# Content-Encoding -> zlib wbits of each way to read it (deflate is zlib-wrapped, or raw from some clients).
ASKED_KEPT = 128  # characters the request log keeps of a model name no model has (the wire takes up to 256)
BODY_ENCODINGS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
                  "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


class Intake:
    """Takes a proxied request in and makes its Exchange."""

    def __init__(self, feed: FeedState, limiter: limits.Limiter, balancer: Balancer):
        self.feed = feed
        self.limiter = limiter
        self.balancer = balancer

    def hold(self, trail: Trail, key: KeyEntry) -> limits.Admission:
        """The key's own concurrency and requests per minute, which need no body (R-6.16)."""
        try:
            held = self.limiter.hold(key, time.monotonic())
        except limits.RateLimited as exc:
            trail.budgets = exc.budgets
            raise
        trail.budgets = held.budgets
        return held

    async def take(self, request: web.BaseRequest, route: Route, key: KeyEntry,
                   held: limits.Admission | None, trail: Trail) -> Exchange:
        """The request read, checked and admitted as one Exchange. `held`: what `hold` took for a
        limited key's request (None: the key has no limits)."""
        document: dict | None = None
        body: bytes | Upload | None = None
        pinned: Pinned | None = None
        stream = strip_usage = strip_continuous = False
        if route.model_from == RESPONSE_ID:
            pinned = self.pinned(request[PATH_PARAMS]["response_id"], key)
            name = pinned.model
        elif route.model_from == FORM:
            body = await read_upload(request, self.feed.gateway.max_body)
            name = body.model
            if not name:
                raise BadRequest("'model' is required: a model name from GET /v1/models", param="model")
        else:
            body = await read_body(request, self.feed.gateway.max_body)
            document = parse_json(body)
            if "priority" in document:  # the engine's queue order is the gateway's to decide, not the client's
                del document["priority"]
                body = json.dumps(document).encode()
            name = document.get("model")
            if type(name) is not str or not name:
                raise BadRequest("'model' is required: a model name from GET /v1/models", param="model")
            how = streaming(document)
            stream = how.stream
            if route.dialect == RESPONSES:
                pinned = self._previous(document, name, key)
        models = self.feed.models
        try:
            model = self.resolve(name, key)
        except ModelNotFound:
            trail.asked = name[:ASKED_KEPT]  # the request log says what was asked for
            raise
        via = ""
        if model.alias_of is not None:  # served by its target as if the client had named it
            via, name = name, model.alias_of
            model = models[name]
            trail.asked = via
        trail.model = name
        if not serves(route, model.engine):
            served = ", ".join(sorted(route.engines)) or "no built-in engine"
            raise RouteNotServed(f"model {name!r} runs on {model.engine}, which does not serve "
                                 f"{route.name} (served by: {served})")
        if route.dialect == RESPONSES and document is not None and document.get("background") not in (None, False) \
                and not model.background_responses:
            raise BadRequest(f"model {name!r} does not take background responses: send the request without "
                             "'background' (the operator allows it with background_responses: true on the model)",
                             param="background")
        if isinstance(body, Upload) and model.adapter_of is not None and model.engine == "llama-server":
            raise RouteNotServed(f"model {name!r} is a LoRA adapter of {model.adapter_of!r} on llama-server, which "
                                 f"takes adapters in JSON bodies only, not on {route.name}")
        if isinstance(body, Upload) and model.engine == "vllm" and route.path.endswith("transcriptions"):
            body.ask_for_usage()  # a streamed transcription has usage only when its form asks (R-6.9a)
        if route.dialect == RESPONSES and route.model_from != RESPONSE_ID and model.engine == "sglang" \
                and not model.responses_store and document.get("store") is not False:
            # SGLang never empties its response store: kept off unless the profile opts in.
            document["store"] = False
            body = json.dumps(document).encode()
        if stream and route.chat_stream:  # every stream asks for usage; the client sees it only if it asked
            continuous = model.engine in CONTINUOUS_USAGE_ENGINES  # in every chunk, where the engine can (R-6.9a)
            body = ask_for_usage(document, body, continuous)
            strip_usage = not how.client_wants_usage
            strip_continuous = continuous and not how.client_wants_continuous
        admission = None
        if held is not None:  # the key's tokens and its limits for the model (R-6.16, R-6.16a)
            size = len(body) if type(body) is bytes else request.content_length or 0
            try:
                admission = self.limiter.admit(key, name, limits.estimate(size, document), time.monotonic(),
                                               capped=limits.answer_cap(document) is not None, held=held)
            except limits.RateLimited as exc:
                trail.budgets = exc.budgets
                raise
            trail.budgets = admission.budgets
        # Only requests that run the model choose or use a home; tokenizing is balanced by load (R-6.5b).
        # A canary's share is drawn by the same key, so a conversation stays on one revision.
        balancer = self.balancer
        affinity = (affinity_key(document, request.headers, key.id)
                    if pinned is None and document is not None and route.inference
                    and (balancer.policy(name) == PREFIX or balancer.has_canary(name)) else None)
        # A form's `stream` field is not read: whether its answer streams is the engine's Content-Type.
        return Exchange(route, model, key, models, document, body, None if route.model_from == FORM else stream,
                        strip_usage, strip_continuous, pinned, affinity, admission, trail, via)

    def resolve(self, name: str, key: KeyEntry) -> RoutedModel:
        """The model (or alias), when it exists and the key may use it. Both refusals are one answer (R-6.1):
        a key learns nothing of the models it may not use, not even that they exist."""
        model = self.feed.models.get(name)
        # An alias: for a key allowed on its name, or on its target, which it reaches anyway.
        if model is None or not (allows(key, name) or (model.alias_of is not None and allows(key, model.alias_of))):
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the models "
                                "this key may use")
        return model

    def pinned(self, response_id: str, key: KeyEntry, param: str | None = None) -> Pinned:
        """The stored response an id names, when this gateway sealed it for this key (R-6.14).

        Any other id, another key's included, gets the same answer: an id says nothing about
        responses the key did not make."""
        found = self.feed.response_ids.open(response_id)
        if found is None or found.key_id != key.id:
            shown = response_id if len(response_id) <= 256 else response_id[:256] + "..."
            raise ResponseNotFound(f"no response {shown!r} was made through this gateway with this API key",
                                   param=param)
        return Pinned(found.model, found.replica_id, found.engine_id, client_id=response_id)

    def _previous(self, document: dict, name: str, key: KeyEntry) -> Pinned | None:
        """The stored response a Responses request continues, when it names one (previous_response_id)."""
        previous = document.get("previous_response_id")
        if previous is None:
            return None
        if type(previous) is not str:
            raise InvalidType("'previous_response_id' must be a string", param="previous_response_id")
        pinned = self.pinned(previous, key, "previous_response_id")
        named = self.feed.models.get(name)
        if pinned.model != name and (named is None or named.alias_of != pinned.model):
            raise BadRequest(f"previous_response_id {previous!r} was made by model {pinned.model!r}, which "
                             f"holds it; continue it with model {pinned.model!r}", param="previous_response_id")
        document["previous_response_id"] = pinned.engine_id
        return pinned


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request's body, decoded from its Content-Encoding, refused past `limit` (gateway.max_body)."""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body is {length} bytes; the limit is {limit} (gateway.max_body)")
    parts = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes (gateway.max_body)")
        parts.append(chunk)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    return decompress(body, encoding, limit)


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    ways = BODY_ENCODINGS.get(encoding)
    if ways is None:
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported; send the body "
                                  "uncompressed, or as gzip or deflate")
    problem = None
    for wbits in ways:
        decoder = zlib.decompressobj(wbits)
        try:
            # At most one byte past the limit: a small bomb must not expand in memory.
            plain = decoder.decompress(body, limit + 1)
        except zlib.error as exc:
            problem = str(exc)
            continue
        if len(plain) > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes once "
                               "decompressed (gateway.max_body)")
        if decoder.eof:
            return plain
        problem = "the data ends early"
    raise BadRequest(f"the request body is not valid {encoding} data ({problem})")


def parse_json(body: bytes) -> dict:
    try:
        document = json.loads(body)
    except ValueError:
        raise BadRequest("the request body is not valid JSON (send a JSON object with "
                         "Content-Type: application/json)") from None
    except RecursionError:  # the decoder recurses per level: "[[[[..." exhausts the stack
        raise BadRequest("the request body nests JSON arrays or objects too deeply") from None
    if type(document) is not dict:
        raise BadRequest("the request body must be a JSON object")
    return document
