"""One client request as the router holds it from intake to its last attempt.

`Exchange` is built once, by the intake (router/intake.py), when the request has been read,
checked and admitted; the dispatch (router/dispatch.py) chooses endpoints for it and the forwarder
(router/proxy.py) sends every attempt of it (retries, fallbacks) with the same value. What differs
per endpoint — the path, the body with the engine's own model name, the headers — it says through
its methods, so nothing per request is wrapped in a closure.

It is a NamedTuple rather than a frozen dataclass: as immutable, and built at a fifth of the cost
of a frozen dataclass of as many fields on the per-request path (object.__setattr__ per field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import NamedTuple

from aiohttp import web

from llmgw.contracts.feed import KeyEntry, RoutedModel
from llmgw.router import limits
from llmgw.router.balancer import Upstream
from llmgw.router.routes import ANTHROPIC, RESPONSE_ID, Route
from llmgw.router.trail import REQUEST_ID_HEADER, Trail
from llmgw.router.uploads import Upload

ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")  # passed on to engines that read them


class Pinned:
    """A follow-up of a stored response: the replica that holds it and the engine's own id."""

    __slots__ = ("model", "replica_id", "engine_id", "client_id")

    def __init__(self, model: str, replica_id: str, engine_id: str, client_id: str):
        self.model, self.replica_id, self.engine_id, self.client_id = model, replica_id, engine_id, client_id


class Exchange(NamedTuple):
    """A client request, read and admitted: what it asks of which model, for whom, and how its
    answer is relayed and counted."""

    route: Route
    # The model the client asked for: its name is the one the request named (the snapshot's
    # models are keyed by name). An endpoint of a fallback serves another (`Upstream.model`).
    model: RoutedModel
    key: KeyEntry  # whose request: its usage, its limits, its place in the fair queue
    models: Mapping[str, RoutedModel]  # the snapshot's models as of intake: fallbacks and engines' names
    document: dict | None  # the parsed JSON body; None for a form or a stored response's route
    body: bytes | Upload | None  # as the engine of the model asked gets it; None: no body
    stream: bool | None  # None: relayed as a stream when the engine sends an event stream (forms)
    strip_usage: bool  # remove the usage-only event the router asked for, not the client
    strip_continuous: bool  # remove the usage of every chunk, likewise
    pinned: Pinned | None  # the stored response this request reads or continues: its replica only
    affinity: bytes | None  # the prefix-routing key, for inference routes of models routed by prefix
    admission: limits.Admission | None  # a limited key's reservation, settled to the answer's usage
    trail: Trail  # its id and what happens to it on the way, for the request log
    via: str = ""  # the alias the client named the model by; "": the model's own name

    @property
    def read_back(self) -> bool:
        """A stored answer read back (by its response id): counted as a request, its usage not again."""
        return self.route.model_from == RESPONSE_ID

    def upstream_path(self, up: Upstream) -> str:
        """The path on `up`'s engine: the route's own unless that engine serves it elsewhere."""
        route = self.route
        fixed = route.fixed_path
        if fixed is not None:
            return fixed
        served = self.models.get(up.model)
        engine = served.engine if served is not None else None
        if route.model_from == RESPONSE_ID:
            return route.upstream_path(engine, self.pinned.engine_id)
        return route.upstream_path(engine)

    def upstream_body(self, up: Upstream):
        """The body for `up`: `model` rewritten only when its engine knows another name."""
        body = self.body
        if body is None:
            return None
        if up.adapters or self.model.adapter_of is not None:
            return self._adapter_body(up, body)
        served = self.models.get(up.model)
        upstream_name = served.upstream_name if served is not None else up.model
        if isinstance(body, Upload):
            return body.chunks(upstream_name)
        if upstream_name == (self.via or self.model.name) and self.pinned is None:
            return body
        return json.dumps({**self.document, "model": upstream_name}).encode()

    def _adapter_body(self, up: Upstream, body: bytes | Upload):
        """The body for an engine that holds LoRA adapters, or for a request naming one (R-8.8).

        vLLM (and any engine but llama-server) serves an adapter by its own name in `model`.
        llama-server serves one model name and takes the adapters' scales in the body's `lora`,
        by launch position: the adapter asked for at 1.0, every other at 0.0, and for the base
        model all at 0.0, since a request without `lora` gets every adapter at once. A client's
        own `lora` is replaced: which adapter answers is the gateway's to say."""
        model = self.model
        base = self.models.get(up.model)
        adapter = model.name if model.adapter_of is not None else None
        if base is None or base.engine != "llama-server":
            name = model.upstream_name if adapter is not None else (base.upstream_name if base else up.model)
            if isinstance(body, Upload):
                return body.chunks(name)
            if name == (self.via or model.name) and self.pinned is None:
                return body
            return json.dumps({**self.document, "model": name}).encode()
        if isinstance(body, Upload):  # a form has no `lora` (the intake refuses an adapter's)
            return body.chunks(base.upstream_name)
        lora = [{"id": i, "scale": 1.0 if held == adapter else 0.0} for i, held in enumerate(up.adapters)]
        return json.dumps({**self.document, "model": base.upstream_name, "lora": lora}).encode()

    def upstream_headers(self, request: web.BaseRequest, up: Upstream) -> dict:
        """Headers for the engine: always its key as Bearer (every engine reads that), never the
        client's, and the request's id as X-Request-Id (R-6.20)."""
        headers = up.stream_headers if self.stream else up.headers
        route = self.route
        if route.plain:  # a JSON body: the endpoint's prebuilt headers and the id
            return {**headers, REQUEST_ID_HEADER: self.trail.id}
        body = self.body
        if route.dialect == ANTHROPIC:
            headers = {**headers, **{name: request.headers[name] for name in ANTHROPIC_HEADERS
                                     if name in request.headers}}
        elif isinstance(body, Upload):
            headers = {**headers, "Content-Type": body.content_type}
        elif body is None:
            headers = {name: value for name, value in headers.items() if name != "Content-Type"}
        else:
            headers = dict(headers)
        headers[REQUEST_ID_HEADER] = self.trail.id
        return headers
