"""The router feed (R-10.1): what the control plane tells routers, and what routers report back.

The control plane publishes one versioned `Snapshot` of everything routing needs and then a
`Change` per decision; routers answer with `Report`s. Both sides import this module and nothing
of each other: it is the whole contract between the control plane and the data plane, in process
or across a socket.

- A snapshot belongs to one run of the control plane (`epoch`, random per start); versions count
  up from 1 within it. A `Change` applies to the version just below its own, and a router that
  sees a gap (or another epoch) asks for the whole snapshot again instead of guessing.
- Reports carry the router's id and a sequence number per router id. The control plane applies a
  report's counted parts (usage, key use) once per (router, seq), in the same transaction that
  records the seq, and acknowledges it; the router keeps a report on disk until it is
  acknowledged. So nothing is counted twice or lost when either side restarts.
- The state parts of a report (requests in flight, last use, engine load, demand) replace what
  that router said before; they are not counted, so a repeat changes nothing.
- A router that cannot apply a Snapshot or Change says so in its reports (`Report.unapplied`:
  which epoch and version, why, when), as xDS's NACK does, then takes the whole snapshot again;
  the control plane shows each router's last one to operators (R-10.10).
- Engine keys, key hashes and the secret that seals Responses ids travel here. No type below puts
  them in its repr, so a log line or a traceback through one never shows them (R-4.6, R-6.2,
  R-6.14).

Wire form: each message is one JSON object (`to_wire` / `from_wire`), one per line on a stream.
`from_wire` checks every field's type and says which one is wrong (`FeedError`): a snapshot read
back from disk or from a peer is input like any other.
"""

from __future__ import annotations

import math
import operator
import enum
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.errors import Category, LlmgwError

PROTOCOL = 1  # bumped when a message changes meaning; a peer speaking another is refused
ABANDONED_KEPT = 256  # replicas given up that a snapshot still names (Snapshot.abandoned)


class RoutingPolicy(enum.StrEnum):
    """A model's balancing policy (R-6.5): the one place their names are written."""

    LEAST_OUTSTANDING = "least-outstanding"
    PREFIX = "prefix"


ROUTING_POLICIES = tuple(RoutingPolicy)
ENGINE_KINDS = ("vllm", "sglang", "llama-server")  # built-in engines; None: any command or a static endpoint
# The largest count a report carries (tokens, requests, queue lengths): 2^53, what every JSON
# reader holds exactly, far below SQLite's 2^63. Routers clamp engine figures to it and sums
# saturate at it, so no number an engine makes up can make a report unwritable.
MAX_COUNT = 2**53
USAGE_BUCKET_SECONDS = 3600  # usage rows are per hour: a row's `bucket` is the unix time its hour starts


class FeedError(LlmgwError, ValueError):
    """A feed message (or a snapshot file) that is not what this protocol says, naming the field."""

    category = Category.PROTOCOL


# -- what routing needs ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoutedModel:
    """One catalog model as the router sees it."""

    name: str
    engine: str | None  # one of ENGINE_KINDS, or None (custom command, static endpoints): every route passes
    served_name: str | None  # the name the engine knows the model by, when not `name`
    routing: str  # one of ROUTING_POLICIES
    on_demand: bool  # no replica until asked for
    fallbacks: tuple[str, ...] = ()  # the fallback chain in order, the model itself left out
    concurrency: int | None = None  # requests one replica accepts at once, as configured; None: not set
    background_responses: bool = False  # Responses `background: true` allowed (R-6.9b)
    responses_store: bool = False  # SGLang: keep stored Responses (else the router sends it `store: false`)
    # An alias: a name clients call, served by the model `alias_of`; its other fields are
    # the target's. A router resolves it to the target before anything else: it has no pool.
    alias_of: str | None = None
    # A LoRA adapter: served by replicas of the base model `adapter_of` that hold it (their
    # Endpoint.adapters name it); `served_name` is the name its engine serves it by. It has no
    # endpoints of its own; its engine is the base's.
    adapter_of: str | None = None
    # An adapter its base's replicas load when a request asks for it (R-8.8: vLLM, not preloaded):
    # a request that finds no replica holding it asks the control plane for a load and waits.
    loadable: bool = False

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's budget (R-6.16): requests and tokens per minute, requests at once; None: no limit."""

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    def __bool__(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.concurrency is not None


LIMIT_FIELDS = ("rpm", "tpm", "concurrency")
NO_MODEL_LIMITS: Mapping[str, Limits] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """A client API key the router accepts: only its SHA-256 travels (R-6.2). A revoked key is absent."""

    id: str
    name: str
    hash: str = field(repr=False)
    prefix: str
    models: frozenset[str] | None  # None: every model
    priority: int = 0  # under saturation a higher class is served first
    weight: int = 1  # within a class, keys share what is served in proportion to their weights
    limits: Limits | None = None  # None: the key has no limit of its own
    model_limits: Mapping[str, Limits] = field(default_factory=lambda: NO_MODEL_LIMITS, hash=False)  # model -> on top of `limits`


@dataclass(frozen=True, slots=True)
class Lease:
    """One router's share (0..1] of every limit of one key, rpm, tpm and concurrency alike, its
    per-model limits too (R-6.16). The control plane splits each key's limits among the routers."""

    share: float


NO_LEASES: Mapping[str, Mapping[str, Lease]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway settings a router reads (the rest of `gateway:` is the control plane's)."""

    max_body: int
    request_timeout: float
    on_demand_wait: float
    queue_wait: float = 30.0  # seconds a request waits for a place of a saturated model
    max_waiting_per_key: int = 256  # requests of one key waiting for places in one router (R-6.17a)
    max_answer: int = 64 * 1024**2  # bytes of a non-streamed engine answer
    request_log: bool = True  # a RequestRecord per request: gateway.request_log.enabled
    request_log_sample: float = 1.0  # the share of requests recorded, 0..1 (gateway.request_log.sample)
    request_log_path: str | None = None  # a file each router appends its records to as JSON lines; None: none
    otlp_endpoint: str | None = None  # OTLP/HTTP traces collector (gateway.tracing.otlp_endpoint); None: no tracing


@dataclass(frozen=True)
class Snapshot:
    """Everything routing needs at one version. `endpoints` holds pushed and static endpoints alike.

    `abandoned` names the replicas last given up (the newest last, at most ABANDONED_KEPT), so
    that a router that gets this snapshot in place of the changes that abandoned them (it fell
    behind, or it was away) still stops waiting on them."""

    epoch: str
    version: int
    models: Mapping[str, RoutedModel]
    endpoints: Mapping[str, tuple[Endpoint, ...]]
    keys: tuple[KeyEntry, ...]
    gateway: GatewaySettings
    leases: Mapping[str, Mapping[str, Lease]] = field(default_factory=lambda: NO_LEASES)  # router id -> key id -> lease
    abandoned: tuple[str, ...] = ()
    homes: Mapping[str, Mapping[int, str]] = field(default_factory=lambda: NO_HOMES)  # model -> ring point -> replica id
    # The secret that seals the Responses ids routers hand out, 64 hex digits: the control
    # plane's, kept in its state directory; one made here when a snapshot is built without it.
    response_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    def apply(self, change: Change) -> Snapshot:
        """The snapshot after `change`; FeedError when the change does not follow this version."""
        if change.epoch != self.epoch or change.version != self.version + 1:
            raise FeedError(f"change {change.epoch}/{change.version} does not follow snapshot "
                            f"{self.epoch}/{self.version}")
        endpoints = self.endpoints
        if change.endpoints:
            merged = dict(endpoints)
            for model, members in change.endpoints.items():
                if members is None:
                    merged.pop(model, None)
                else:
                    merged[model] = members
            endpoints = MappingProxyType(merged)
        return Snapshot(epoch=self.epoch, version=change.version,
                        models=self.models if change.models is None else change.models,
                        endpoints=endpoints,
                        keys=self.keys if change.keys is None else change.keys,
                        gateway=self.gateway if change.gateway is None else change.gateway,
                        leases=self.leases if change.leases is None else change.leases,
                        abandoned=(self.abandoned + change.abandon)[-ABANDONED_KEPT:] if change.abandon
                        else self.abandoned,
                        homes=self.homes if change.homes is None else merge_homes(self.homes, change.homes),
                        response_secret=self.response_secret)


@dataclass(frozen=True)
class Change:
    """What changed since the previous version. A section left None is unchanged; `endpoints` maps
    only the models whose lists changed (None: the model has no list any more). `abandon` names
    replicas the control plane gave up: their requests waiting for a first byte go elsewhere."""

    epoch: str
    version: int
    models: Mapping[str, RoutedModel] | None = None
    endpoints: Mapping[str, tuple[Endpoint, ...] | None] | None = None
    keys: tuple[KeyEntry, ...] | None = None
    gateway: GatewaySettings | None = None
    abandon: tuple[str, ...] = ()
    leases: Mapping[str, Mapping[str, Lease]] | None = None  # all of them, when the split changed
    # Affinity homes set (a replica id) or forgotten (None), per model and ring point (R-6.5d).
    homes: Mapping[str, Mapping[int, str | None]] | None = None


NO_HOMES: Mapping[str, Mapping[int, str]] = MappingProxyType({})
# A key is live while it had a request within HOME_IDLE_SECONDS; at most HOMES_KEPT live keys per
# model, the least recently used forgotten first (R-6.5b). Routers and the control plane's table alike.
HOME_IDLE_SECONDS = 300.0
HOMES_KEPT = 65536
HOMES_PER_REPORT = 4096  # keys one report names at most (about 190 KB); a router sends the rest with its next one


def merge_homes(homes: Mapping[str, Mapping[int, str]],
                change: Mapping[str, Mapping[int, str | None]]) -> Mapping[str, Mapping[int, str]]:
    """`homes` with `change` applied: a replica id sets a point's home, None forgets it."""
    merged = dict(homes)
    for model, entries in change.items():
        table = dict(merged.get(model, {}))
        for point, replica in entries.items():
            if replica is None:
                table.pop(point, None)
            else:
                table[point] = replica
        if table:
            merged[model] = MappingProxyType(table)
        else:
            merged.pop(model, None)
    return MappingProxyType(merged)


# -- what routers report -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Counts of one (hour, key, model) gathered by one router since its previous report (R-6.9)."""

    bucket: int  # unix time the hour starts
    key_id: str
    model: str
    requests: int
    prompt_tokens: int  # estimated tokens included (R-6.9a)
    completion_tokens: int
    estimated_tokens: int = 0  # the part of prompt + completion estimated from what a cut stream relayed
    unmetered: int = 0  # requests whose tokens nobody knows: no usage, nothing to estimate from (not 0 tokens)
    via: str = ""  # the alias the client called `model` by; "": its own name


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as a router saw it (R-6.20): the request log's line. Never a body, never a key:
    the key's name only. What was not known stays None (a 401 has no key, a request refused before
    any engine no replica, tokens nobody counted no tokens), never 0."""

    at: float  # time.time() the request arrived
    id: str  # its X-Request-Id: the client's own when usable, else the router's
    route: str  # "POST /v1/chat/completions": the method and the route's path pattern
    status: int  # the HTTP status the client got (a stream cut mid-way: 200, with `error` set)
    duration: float  # seconds from arrival to the answer's last byte
    key: str | None = None  # the API key's name; None: no key was accepted
    model: str | None = None  # the model that was to serve it (an alias's target), None: none resolved
    asked: str | None = None  # the name the client used when not the model's own: an alias, or no model's
    replica: str | None = None  # the replica of the last attempt
    node: str | None = None  # that replica's node (its head node for a multi-node replica)
    error: str | None = None  # the error's code as the client saw it ("model_not_found", "upstream_interrupted")
    attempts: int = 0  # endpoints tried; retries are attempts - 1
    fallback: str | None = None  # the fallback model that served, None: the model itself or none
    queued: float | None = None  # seconds waiting for a place and for an on-demand replica; None: never waited
    ttfb: float | None = None  # seconds from arrival to the first byte of the answer sent; None: none sent
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    estimated: bool = False  # tokens estimated from what was relayed (R-6.9a), not the engine's count
    stream: bool = False  # relayed as a stream
    client: str | None = None  # the client's address as the router saw the connection
    client_request_id: str | None = None  # an X-Request-Id the client sent that was not usable (cut to 128)


# Wire names of RequestRecord's fields: each record is a JSON object of those that are not at their default.
REQUEST_RECORD_FIELDS = tuple(RequestRecord.__slots__)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading of an engine's load; None where the engine does not say (never 0)."""

    source: str  # "vllm", "llama-server", "sglang"
    waiting: int | None = None
    running: int | None = None
    kv_cache: float | None = None  # fraction of the KV cache in use, 0..1
    prefix_hits: int | None = None  # cumulative, tokens (vLLM)
    prefix_queries: int | None = None
    at: float | None = None  # time.time() of the reading
    slots: int | None = None  # requests the engine runs at once, where it says (llama-server's slots)
    preemptions: int | None = None  # cumulative: requests the engine took out of its batch for lack of KV cache (vLLM)
    # The LoRA adapters the engine lists (vLLM's /v1/models, R-8.8), read for engines that may
    # load them at runtime; None: not read.
    adapters: tuple[str, ...] | None = None

    def as_dict(self) -> dict:
        return {"source": self.source, "waiting": self.waiting, "running": self.running,
                "kv_cache": self.kv_cache, "prefix_hits": self.prefix_hits,
                "prefix_queries": self.prefix_queries, "at": self.at, "slots": self.slots,
                "preemptions": self.preemptions,
                **({"adapters": list(self.adapters)} if self.adapters is not None else {})}


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """A router process's request counters since it started, for the admin listener's /metrics
    (R-9.7). A state part of a report: each replaces the one before; the control plane sums the
    routers' latest."""

    requests: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (model, status class)
    tokens: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (model, prompt|completion)
    retries: Mapping[str, int] = field(default_factory=dict)  # model -> retries before the first byte
    ejections: Mapping[str, int] = field(default_factory=dict)  # model -> endpoints ejected
    latency: Mapping[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)  # model -> (bucket counts, s)
    # (replica id, status class) -> attempts it answered so (an attempt that failed before its
    # first byte: its error's status): a rollout's revisions side by side
    replicas: Mapping[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Unapplied:
    """A Snapshot or Change a router could not apply (R-10.10): which one, why, and when.

    `epoch`/`version` are None when the message did not say (a line that is not JSON, a version of
    the wrong type). `reason` is a line of this router's words: a FeedError's message, which names
    the field and never the value of a key or secret, else only the kind of fault (the rest is in
    the router's log)."""

    epoch: str | None
    version: int | None
    reason: str
    at: float  # time.time() on the router

    @classmethod
    def of(cls, message, error: BaseException, at: float) -> Unapplied:
        """What a router reports of `message` (a Snapshot, a Change or a wire document) that `error` kept out."""
        if isinstance(message, (Snapshot, Change)):
            epoch, version = message.epoch, message.version
        elif isinstance(message, dict):
            epoch, version = message.get("epoch"), message.get("version")
        else:
            epoch = version = None
        reason = str(error) if isinstance(error, FeedError) else f"{type(error).__name__} in the router (see its log)"
        return cls(epoch=epoch if type(epoch) is str else None, version=version if type(version) is int else None,
                   reason=reason[:UNAPPLIED_REASON_KEPT], at=at)


UNAPPLIED_REASON_KEPT = 300  # characters of an Unapplied's reason a router sends; the control plane takes no longer


@dataclass(frozen=True)
class Report:
    """One router's report. `usage` and `key_use` are counted once per (router, seq); `homes` is
    taken once per (router, seq) too, and taking it again would change nothing (the first home
    reported for a key stays); the rest is the router's state as of `sent_at` and replaces its
    previous report's."""

    router: str
    seq: int
    sent_at: float  # time.time()
    usage: tuple[UsageRow, ...] = ()
    key_use: Mapping[str, float] = field(default_factory=dict)  # key id -> last use
    last_used: Mapping[str, float] = field(default_factory=dict)  # replica id -> last request
    inflight: Mapping[str, int] = field(default_factory=dict)  # replica id -> requests in flight; absent: none
    engine_load: Mapping[str, EngineLoad] = field(default_factory=dict)  # replica id -> latest reading
    demand: tuple[str, ...] = ()  # on-demand models asked for while they had no replica
    snapshot: tuple[str, int] | None = None  # (epoch, version) the router routes with, None before any
    counters: RouterCounters | None = None  # None: not reported (a router that keeps its own /metrics)
    asked: Mapping[str, int] = field(default_factory=dict)  # key id -> requests of a limited key since the last report
    # model -> ring point -> replica id: the affinity keys this router homed or sent home since its
    # last report (R-6.5d), so that the control plane keeps one table of homes for every router
    homes: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    # The last Snapshot or Change this router could not apply, None: none since it started.
    # A state part like the others; absent on the wire from a router that predates it.
    unapplied: Unapplied | None = None
    # The request log's records since the last report: counted parts, taken once per (router, seq).
    requests: tuple[RequestRecord, ...] = ()
    # replica id -> adapter -> (its requests in flight there, unix time of its last request there):
    # the adapters this router sent requests for, what the control plane unloads by.
    adapter_use: Mapping[str, Mapping[str, tuple[int, float]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refusal:
    """One part of a report the control plane did not take (a usage row, an entry of a state part),
    named by its place in the report (`report.usage[3]`), with why (R-10.8)."""

    where: str
    message: str


@dataclass(frozen=True, slots=True)
class Ack:
    """The control plane has applied (or had already applied) the router's reports up to `seq`;
    `refused` names the rows of this report it left out, the rest being applied."""

    router: str
    seq: int
    refused: tuple[Refusal, ...] = ()


# -- wire form ---------------------------------------------------------------------------------


# The wire path builds a snapshot's entries (10,000 keys, thousands of endpoints) without the frozen
# dataclasses' __init__, whose object.__setattr__ per field costs more than every check of the
# entry. Each class below has its dataclass's slots and no frozen __setattr__: its __init__ stores
# each field directly and then makes the object an instance of the dataclass, which equal slots
# allow. What it returns is the dataclass's ordinary frozen instance.
_object_setattr = object.__setattr__


class _KeyEntryFields:
    """A key without limits of its own (the fast path takes no other: a key with limits takes the checks)."""

    __slots__ = KeyEntry.__slots__

    def __init__(self, id, name, hash, prefix, models, priority, weight):
        self.id = id
        self.name = name
        self.hash = hash
        self.prefix = prefix
        self.models = models
        self.priority = priority
        self.weight = weight
        self.limits = None
        self.model_limits = NO_MODEL_LIMITS
        _object_setattr(self, "__class__", KeyEntry)


class _EndpointFields:
    __slots__ = Endpoint.__slots__

    def __init__(self, replica_id, model, url, api_key, draining, revision, node):
        self.replica_id = replica_id
        self.model = model
        self.url = url
        self.api_key = api_key
        self.draining = draining
        self.revision = revision
        self.canary = None
        self.node = node
        self.adapters = ()
        self.adapter_errors = ()
        _object_setattr(self, "__class__", Endpoint)


# The fields the *_to_wire functions always write: a row without one of them takes the checks.
_KEY_FIELDS = operator.itemgetter("id", "name", "hash", "prefix", "models")
_ENDPOINT_FIELDS = operator.itemgetter("replica", "model", "url", "key", "draining")
_MODEL_FIELDS = operator.itemgetter("name", "engine", "served_name", "routing", "on_demand", "fallbacks", "concurrency")
_ONLY_STR = frozenset({str})


def _expect(value, kinds, where: str):
    if type(value) not in kinds or (float in kinds and type(value) is float and not math.isfinite(value)):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise FeedError(f"{where}: expected {names}, got {type(value).__name__}")
    return value


def _str(value, where):
    return _expect(value, (str,), where)


def _opt_str(value, where):
    return _expect(value, (str, type(None)), where)


def _int(value, where, minimum: int = 0, maximum: int | None = None):
    value = _expect(value, (int,), where)
    if value < minimum:
        raise FeedError(f"{where}: must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FeedError(f"{where}: must be at most {maximum}, got {value}")
    return value


def _count(value, where):
    return _int(value, where, 0, MAX_COUNT)


def _opt_count(value, where):
    return None if value is None else _count(value, where)


def _opt_int(value, where):
    return None if value is None else _int(value, where)


def _num(value, where):
    return float(_expect(value, (int, float), where))


def _opt_num(value, where):
    return None if value is None else _num(value, where)


def _obj(value, where) -> dict:
    return _expect(value, (dict,), where)


def _list(value, where) -> list:
    return _expect(value, (list,), where)


_SECRET = re.compile(r"[0-9a-f]{64}")


def _secret(value, where: str) -> str:
    if not _SECRET.fullmatch(_str(value, where)):  # the value itself is never shown
        raise FeedError(f"{where}: expected 64 hex digits")
    return value


def _field(document: dict, name: str, where: str):
    try:
        return document[name]
    except KeyError:
        raise FeedError(f"{where}: {name!r} is missing") from None


def endpoint_to_wire(e: Endpoint) -> dict:
    return {"replica": e.replica_id, "model": e.model, "url": e.url, "key": e.api_key, "draining": e.draining,
            **({"revision": e.revision} if e.revision is not None else {}),
            **({"canary": e.canary} if e.canary is not None else {}),
            **({"node": e.node} if e.node is not None else {}),
            **({"adapters": list(e.adapters)} if e.adapters else {}),
            **({"adapter_errors": [list(pair) for pair in e.adapter_errors]} if e.adapter_errors else {})}


def endpoint_from_wire(d, where: str) -> Endpoint:
    if type(d) is dict:  # the fast path, as for keys
        try:
            r, m, u, k, dr = _ENDPOINT_FIELDS(d)
        except KeyError:  # the checks below name what is missing, or take the default
            pass
        else:
            rev = d.get("revision")
            node = d.get("node")
            if type(r) is str and type(m) is str and type(u) is str and (k is None or type(k) is str) \
                    and type(dr) is bool and (rev is None or type(rev) is str) and (node is None or type(node) is str) \
                    and "canary" not in d and "adapters" not in d and "adapter_errors" not in d:
                return _EndpointFields(r, m, u, k, dr, rev, node)
    d = _obj(d, where)
    return Endpoint(replica_id=_str(_field(d, "replica", where), f"{where}.replica"),
                    model=_str(_field(d, "model", where), f"{where}.model"),
                    url=_str(_field(d, "url", where), f"{where}.url"),
                    api_key=_opt_str(d.get("key"), f"{where}.key"),
                    draining=_expect(d.get("draining", False), (bool,), f"{where}.draining"),
                    revision=_opt_str(d.get("revision"), f"{where}.revision"),
                    canary=None if d.get("canary") is None else _int(d["canary"], f"{where}.canary", 1, 99),
                    node=_opt_str(d.get("node"), f"{where}.node"),
                    adapters=tuple(_str(a, f"{where}.adapters[{i}]")
                                   for i, a in enumerate(_list(d.get("adapters", []), f"{where}.adapters"))),
                    adapter_errors=tuple(_pair(p, f"{where}.adapter_errors[{i}]") for i, p in
                                         enumerate(_list(d.get("adapter_errors", []), f"{where}.adapter_errors"))))


def _pair(value, where: str) -> tuple[str, str]:
    pair = _list(value, where)
    if len(pair) != 2:
        raise FeedError(f"{where}: expected [name, message]")
    return _str(pair[0], f"{where}[0]"), _str(pair[1], f"{where}[1]")


def model_to_wire(m: RoutedModel) -> dict:
    return {"name": m.name, "engine": m.engine, "served_name": m.served_name, "routing": m.routing,
            "on_demand": m.on_demand, "fallbacks": list(m.fallbacks), "concurrency": m.concurrency,
            **({"background_responses": True} if m.background_responses else {}),
            **({"responses_store": True} if m.responses_store else {}),
            **({"alias_of": m.alias_of} if m.alias_of is not None else {}),
            **({"adapter_of": m.adapter_of} if m.adapter_of is not None else {}),
            **({"loadable": True} if m.loadable else {})}


def model_from_wire(d, where: str) -> RoutedModel:
    if type(d) is dict:  # the fast path, as for keys
        try:
            n, e, s, r, od, fb, c = _MODEL_FIELDS(d)
        except KeyError:  # the checks below name what is missing, or take the default
            pass
        else:
            if type(n) is str and (e is None or e in ENGINE_KINDS) and (s is None or type(s) is str) \
                    and r in ROUTING_POLICIES and type(od) is bool and type(fb) is list \
                    and _ONLY_STR.issuperset(map(type, fb)) and (c is None or type(c) is int and c >= 1) \
                    and type(d.get("background_responses", False)) is bool \
                    and type(d.get("responses_store", False)) is bool and "alias_of" not in d \
                    and "adapter_of" not in d and "loadable" not in d:
                return RoutedModel(n, e, s, r, od, tuple(fb), c, d.get("background_responses", False),
                                   d.get("responses_store", False))
    d = _obj(d, where)
    engine = _opt_str(d.get("engine"), f"{where}.engine")
    if engine is not None and engine not in ENGINE_KINDS:
        raise FeedError(f"{where}.engine: {engine!r} is not one of {', '.join(ENGINE_KINDS)}")
    routing = _str(_field(d, "routing", where), f"{where}.routing")
    if routing not in ROUTING_POLICIES:
        raise FeedError(f"{where}.routing: {routing!r} is not one of {', '.join(ROUTING_POLICIES)}")
    fallbacks = tuple(_str(f, f"{where}.fallbacks[{i}]")
                      for i, f in enumerate(_list(d.get("fallbacks", []), f"{where}.fallbacks")))
    return RoutedModel(name=_str(_field(d, "name", where), f"{where}.name"), engine=engine,
                       served_name=_opt_str(d.get("served_name"), f"{where}.served_name"), routing=routing,
                       on_demand=_expect(d.get("on_demand", False), (bool,), f"{where}.on_demand"),
                       fallbacks=fallbacks,
                       concurrency=None if d.get("concurrency") is None else _int(d["concurrency"], f"{where}.concurrency", 1),
                       background_responses=_expect(d.get("background_responses", False), (bool,),
                                                    f"{where}.background_responses"),
                       responses_store=_expect(d.get("responses_store", False), (bool,), f"{where}.responses_store"),
                       alias_of=_opt_str(d.get("alias_of"), f"{where}.alias_of"),
                       adapter_of=_opt_str(d.get("adapter_of"), f"{where}.adapter_of"),
                       loadable=_expect(d.get("loadable", False), (bool,), f"{where}.loadable"))


def key_to_wire(k: KeyEntry) -> dict:
    out = {"id": k.id, "name": k.name, "hash": k.hash, "prefix": k.prefix,
           "models": None if k.models is None else sorted(k.models)}
    if k.priority:
        out["priority"] = k.priority
    if k.weight != 1:
        out["weight"] = k.weight
    if k.limits is not None:
        out["limits"] = limits_to_wire(k.limits)
    if k.model_limits:
        out["model_limits"] = {m: limits_to_wire(lim) for m, lim in k.model_limits.items()}
    return out


def limits_to_wire(lim: Limits) -> dict:
    return {"rpm": lim.rpm, "tpm": lim.tpm, "concurrency": lim.concurrency}


def limits_from_wire(d, where: str) -> Limits:
    d = _obj(d, where)
    return Limits(*(None if d.get(name) is None else _int(d[name], f"{where}.{name}", 1) for name in LIMIT_FIELDS))


def key_from_wire(d, where: str) -> KeyEntry:
    # The fast path checks types inline: a snapshot holds one entry per key, tens of thousands of them.
    if type(d) is dict:
        try:
            i, n, h, p, models = _KEY_FIELDS(d)
        except KeyError:  # the checks below name what is missing, or take the default
            pass
        else:
            priority, weight, limits, model_limits = (0, 1, None, None) if len(d) == 5 else \
                (d.get("priority", 0), d.get("weight", 1), d.get("limits"), d.get("model_limits"))
            if type(i) is str and type(n) is str and type(h) is str and type(p) is str and type(priority) is int \
                    and type(weight) is int and weight >= 1 and limits is None and model_limits is None:
                if models is None:
                    return _KeyEntryFields(i, n, h, p, None, priority, weight)
                if type(models) is list and _ONLY_STR.issuperset(map(type, models)):
                    return _KeyEntryFields(i, n, h, p, frozenset(models), priority, weight)
    d = _obj(d, where)  # something is wrong, or the key has limits: check each field, naming a wrong one
    models = d.get("models")
    if models is not None:
        models = frozenset(_str(m, f"{where}.models[{i}]") for i, m in enumerate(_list(models, f"{where}.models")))
    return KeyEntry(id=_str(_field(d, "id", where), f"{where}.id"), name=_str(_field(d, "name", where), f"{where}.name"),
                    hash=_str(_field(d, "hash", where), f"{where}.hash"),
                    prefix=_str(_field(d, "prefix", where), f"{where}.prefix"), models=models,
                    priority=_expect(d.get("priority", 0), (int,), f"{where}.priority"),
                    weight=_int(d.get("weight", 1), f"{where}.weight", 1),
                    limits=None if d.get("limits") is None else limits_from_wire(d["limits"], f"{where}.limits"),
                    model_limits=_model_limits_from_wire(d.get("model_limits"), f"{where}.model_limits"))


def _model_limits_from_wire(d, where: str) -> Mapping[str, Limits]:
    if d is None:
        return NO_MODEL_LIMITS
    return MappingProxyType({_str(m, f"{where} key"): limits_from_wire(lim, f"{where}[{m!r}]")
                             for m, lim in _obj(d, where).items()})


def gateway_to_wire(g: GatewaySettings) -> dict:
    return {"max_body": g.max_body, "request_timeout": g.request_timeout, "on_demand_wait": g.on_demand_wait,
            "queue_wait": g.queue_wait, "max_waiting_per_key": g.max_waiting_per_key, "max_answer": g.max_answer,
            "request_log": g.request_log, "request_log_sample": g.request_log_sample,
            **({"request_log_path": g.request_log_path} if g.request_log_path is not None else {}),
            **({"otlp_endpoint": g.otlp_endpoint} if g.otlp_endpoint is not None else {})}


def gateway_from_wire(d, where: str) -> GatewaySettings:
    d = _obj(d, where)
    return GatewaySettings(max_body=_int(_field(d, "max_body", where), f"{where}.max_body", 1),
                           request_timeout=_num(_field(d, "request_timeout", where), f"{where}.request_timeout"),
                           on_demand_wait=_num(_field(d, "on_demand_wait", where), f"{where}.on_demand_wait"),
                           queue_wait=_num(d.get("queue_wait", 30.0), f"{where}.queue_wait"),
                           max_waiting_per_key=_int(d.get("max_waiting_per_key", 256), f"{where}.max_waiting_per_key", 1),
                           max_answer=_int(d.get("max_answer", 64 * 1024**2), f"{where}.max_answer", 1),
                           request_log=_expect(d.get("request_log", True), (bool,), f"{where}.request_log"),
                           request_log_sample=_share(d.get("request_log_sample", 1.0), f"{where}.request_log_sample"),
                           request_log_path=_opt_str(d.get("request_log_path"), f"{where}.request_log_path"),
                           otlp_endpoint=_opt_str(d.get("otlp_endpoint"), f"{where}.otlp_endpoint"))


def _share(value, where: str) -> float:
    number = _num(value, where)
    if not 0.0 <= number <= 1.0:
        raise FeedError(f"{where}: expected a share from 0 to 1, got {number!r}")
    return float(number)


def _models_from_wire(d, where: str) -> Mapping[str, RoutedModel]:
    models = {}
    for i, item in enumerate(_list(d, where)):
        model = model_from_wire(item, f"{where}[{i}]")
        models[model.name] = model
    return MappingProxyType(models)


def _endpoint_lists_from_wire(d, where: str, allow_none: bool) -> dict:
    out = {}
    for model, members in _obj(d, where).items():
        if members is None and allow_none:
            out[model] = None
            continue
        members = members if type(members) is list else _list(members, f"{where}[{model!r}]")
        try:
            out[model] = tuple([endpoint_from_wire(e, where) for e in members])
        except FeedError:  # again, slowly, to name the entry
            out[model] = tuple(endpoint_from_wire(e, f"{where}[{model!r}][{i}]") for i, e in enumerate(members))
    return out


def _keys_from_wire(d, where: str) -> tuple[KeyEntry, ...]:
    items = _list(d, where)
    try:
        return tuple([key_from_wire(k, where) for k in items])
    except FeedError:  # again, slowly, to name the entry
        return tuple(key_from_wire(k, f"{where}[{i}]") for i, k in enumerate(items))


def _load_to_wire(load: EngineLoad) -> dict:
    return load.as_dict()


def _load_from_wire(d, where: str) -> EngineLoad:
    d = _obj(d, where)
    return EngineLoad(source=_str(_field(d, "source", where), f"{where}.source"),
                      waiting=_opt_count(d.get("waiting"), f"{where}.waiting"),
                      running=_opt_count(d.get("running"), f"{where}.running"),
                      kv_cache=_opt_num(d.get("kv_cache"), f"{where}.kv_cache"),
                      prefix_hits=_opt_count(d.get("prefix_hits"), f"{where}.prefix_hits"),
                      prefix_queries=_opt_count(d.get("prefix_queries"), f"{where}.prefix_queries"),
                      at=_opt_num(d.get("at"), f"{where}.at"),
                      slots=None if d.get("slots") is None else _int(d["slots"], f"{where}.slots", 1, MAX_COUNT),
                      preemptions=_opt_count(d.get("preemptions"), f"{where}.preemptions"),
                      adapters=None if d.get("adapters") is None else tuple(
                          _str(a, f"{where}.adapters[{i}]") for i, a in enumerate(_list(d["adapters"], f"{where}.adapters"))))


def _counters_to_wire(c: RouterCounters) -> dict:
    return {"requests": [[m, code, n] for (m, code), n in c.requests.items()],
            "tokens": [[m, kind, n] for (m, kind), n in c.tokens.items()],
            "retries": dict(c.retries), "ejections": dict(c.ejections),
            "latency": {m: {"counts": list(counts), "total": total} for m, (counts, total) in c.latency.items()},
            **({"replicas": [[r, code, n] for (r, code), n in c.replicas.items()]} if c.replicas else {})}


def _counters_from_wire(value, where: str = "report.counters") -> RouterCounters:
    d = _obj(value, where)

    def pairs(name: str) -> dict[tuple[str, str], int]:
        out = {}
        for i, row in enumerate(_list(d.get(name, []), f"{where}.{name}")):
            row = _list(row, f"{where}.{name}[{i}]")
            if len(row) != 3:
                raise FeedError(f"{where}.{name}[{i}]: expected [model, label, count]")
            out[(_str(row[0], f"{where}.{name}[{i}][0]"), _str(row[1], f"{where}.{name}[{i}][1]"))] = \
                _int(row[2], f"{where}.{name}[{i}][2]")
        return out

    def per_model(name: str) -> dict[str, int]:
        return {m: _int(n, f"{where}.{name}[{m!r}]") for m, n in _obj(d.get(name, {}), f"{where}.{name}").items()}

    latency = {}
    for m, h in _obj(d.get("latency", {}), f"{where}.latency").items():
        h = _obj(h, f"{where}.latency[{m!r}]")
        counts = tuple(_int(n, f"{where}.latency[{m!r}].counts[{i}]")
                       for i, n in enumerate(_list(_field(h, "counts", f"{where}.latency[{m!r}]"),
                                                   f"{where}.latency[{m!r}].counts")))
        latency[m] = (counts, _num(_field(h, "total", f"{where}.latency[{m!r}]"), f"{where}.latency[{m!r}].total"))
    return RouterCounters(requests=pairs("requests"), tokens=pairs("tokens"), retries=per_model("retries"),
                          ejections=per_model("ejections"), latency=latency, replicas=pairs("replicas"))


def _unapplied_to_wire(u: Unapplied) -> dict:
    return {"epoch": u.epoch, "version": u.version, "reason": u.reason, "at": u.at}


def _unapplied_from_wire(value, where: str = "report.unapplied") -> Unapplied:
    d = _obj(value, where)
    reason = _str(_field(d, "reason", where), f"{where}.reason")
    if len(reason) > UNAPPLIED_REASON_KEPT:
        raise FeedError(f"{where}.reason: at most {UNAPPLIED_REASON_KEPT} characters, got {len(reason)}")
    version = d.get("version")
    return Unapplied(epoch=_opt_str(d.get("epoch"), f"{where}.epoch"),
                     version=None if version is None else _int(version, f"{where}.version", 1),
                     reason=reason, at=_num(_field(d, "at", where), f"{where}.at"))


def _leases_to_wire(leases: Mapping[str, Mapping[str, Lease]]) -> dict:
    return {router: {key_id: lease.share for key_id, lease in per_key.items()} for router, per_key in leases.items()}


def _leases_from_wire(d, where: str) -> Mapping[str, Mapping[str, Lease]]:
    out = {}
    for router, per_key in _obj(d, where).items():
        leases = {}
        for key_id, share in _obj(per_key, f"{where}[{router!r}]").items():
            share = _num(share, f"{where}[{router!r}][{key_id!r}]")
            if not 0 < share <= 1:
                raise FeedError(f"{where}[{router!r}][{key_id!r}]: a share must be above 0 and at most 1, got {share}")
            leases[key_id] = Lease(share)
        out[router] = MappingProxyType(leases)
    return MappingProxyType(out)


_POINT = re.compile(r"[0-9a-f]{16}")


def _homes_to_wire(homes: Mapping[str, Mapping[int, str | None]]) -> dict:
    """model -> [[point as 16 hex digits, replica id or null], ...]: a point is 64 bits, more than
    every JSON reader holds exactly as a number."""
    return {model: [[f"{point:016x}", replica] for point, replica in entries.items()]
            for model, entries in homes.items()}


def _home_point(value, where: str) -> int:
    if type(value) is not str or not _POINT.fullmatch(value):
        raise FeedError(f"{where}: expected a ring point as 16 lowercase hex digits")
    return int(value, 16)


def _home_entries_from_wire(value, where: str, allow_none: bool) -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for i, row in enumerate(_list(value, where)):
        if type(row) is not list or len(row) != 2:
            raise FeedError(f"{where}[{i}]: expected [point, replica]")
        replica = row[1]
        if not (type(replica) is str or (allow_none and replica is None)):
            raise FeedError(f"{where}[{i}][1]: expected a replica id{' or null' if allow_none else ''}")
        out[_home_point(row[0], f"{where}[{i}][0]")] = replica
    return out


def _homes_from_wire(d, where: str, allow_none: bool) -> Mapping[str, Mapping[int, str | None]]:
    return MappingProxyType({_str(model, f"{where} key"): MappingProxyType(
        _home_entries_from_wire(entries, f"{where}[{model!r}]", allow_none)) for model, entries in _obj(d, where).items()})


def to_wire(message: Snapshot | Change | Report | Ack) -> dict:
    """The JSON-ready form of a message, tagged with its type and the protocol."""
    if isinstance(message, Snapshot):
        return {"type": "snapshot", "protocol": PROTOCOL, "epoch": message.epoch, "version": message.version,
                "models": [model_to_wire(m) for m in message.models.values()],
                "endpoints": {model: [endpoint_to_wire(e) for e in members]
                              for model, members in message.endpoints.items()},
                "keys": [key_to_wire(k) for k in message.keys], "gateway": gateway_to_wire(message.gateway),
                **({"leases": _leases_to_wire(message.leases)} if message.leases else {}),
                **({"abandoned": list(message.abandoned)} if message.abandoned else {}),
                **({"homes": _homes_to_wire(message.homes)} if message.homes else {}),
                "response_secret": message.response_secret}
    if isinstance(message, Change):
        out = {"type": "change", "protocol": PROTOCOL, "epoch": message.epoch, "version": message.version}
        if message.models is not None:
            out["models"] = [model_to_wire(m) for m in message.models.values()]
        if message.endpoints is not None:
            out["endpoints"] = {model: None if members is None else [endpoint_to_wire(e) for e in members]
                                for model, members in message.endpoints.items()}
        if message.keys is not None:
            out["keys"] = [key_to_wire(k) for k in message.keys]
        if message.gateway is not None:
            out["gateway"] = gateway_to_wire(message.gateway)
        if message.abandon:
            out["abandon"] = list(message.abandon)
        if message.leases is not None:
            out["leases"] = _leases_to_wire(message.leases)
        if message.homes is not None:
            out["homes"] = _homes_to_wire(message.homes)
        return out
    if isinstance(message, Report):
        return {"type": "report", "protocol": PROTOCOL, "router": message.router, "seq": message.seq,
                "sent_at": message.sent_at,
                "usage": [[u.bucket, u.key_id, u.model, u.requests, u.prompt_tokens, u.completion_tokens,
                           u.estimated_tokens, u.unmetered, *((u.via,) if u.via else ())] for u in message.usage],
                "key_use": dict(message.key_use), "last_used": dict(message.last_used),
                "inflight": dict(message.inflight),
                "engine_load": {r: _load_to_wire(load) for r, load in message.engine_load.items()},
                "demand": list(message.demand),
                "snapshot": None if message.snapshot is None else list(message.snapshot),
                "counters": None if message.counters is None else _counters_to_wire(message.counters),
                **({"asked": dict(message.asked)} if message.asked else {}),
                **({"homes": _homes_to_wire(message.homes)} if message.homes else {}),
                **({"unapplied": _unapplied_to_wire(message.unapplied)} if message.unapplied is not None else {}),
                **({"requests": [request_record_to_wire(r) for r in message.requests]} if message.requests else {}),
                **({"adapter_use": {r: {a: list(use) for a, use in per.items()}
                                    for r, per in message.adapter_use.items()}} if message.adapter_use else {})}
    if isinstance(message, Ack):
        return {"type": "ack", "protocol": PROTOCOL, "router": message.router, "seq": message.seq,
                **({"refused": [{"where": r.where, "status": 400, "message": r.message} for r in message.refused]}
                   if message.refused else {})}
    raise TypeError(f"not a feed message: {type(message).__name__}")


def from_wire(document) -> Snapshot | Change | Report | Ack:
    """The message a JSON document holds; FeedError naming the field that is wrong."""
    d = _obj(document, "message")
    kind = _str(_field(d, "type", "message"), "message.type")
    protocol = _field(d, "protocol", kind)
    if protocol != PROTOCOL:
        raise FeedError(f"{kind}: protocol {protocol!r}, this llmgw speaks {PROTOCOL}")
    if kind == "snapshot":
        return Snapshot(epoch=_str(_field(d, "epoch", kind), "snapshot.epoch"),
                        version=_int(_field(d, "version", kind), "snapshot.version", 1),
                        models=_models_from_wire(_field(d, "models", kind), "snapshot.models"),
                        endpoints=MappingProxyType(_endpoint_lists_from_wire(_field(d, "endpoints", kind),
                                                                             "snapshot.endpoints", False)),
                        keys=_keys_from_wire(_field(d, "keys", kind), "snapshot.keys"),
                        gateway=gateway_from_wire(_field(d, "gateway", kind), "snapshot.gateway"),
                        leases=_leases_from_wire(d["leases"], "snapshot.leases") if "leases" in d else NO_LEASES,
                        abandoned=tuple(_str(r, f"snapshot.abandoned[{i}]") for i, r in
                                        enumerate(_list(d.get("abandoned", []), "snapshot.abandoned"))),
                        homes=_homes_from_wire(d["homes"], "snapshot.homes", False) if "homes" in d else NO_HOMES,
                        response_secret=_secret(_field(d, "response_secret", kind), "snapshot.response_secret"))
    if kind == "change":
        return Change(epoch=_str(_field(d, "epoch", kind), "change.epoch"),
                      version=_int(_field(d, "version", kind), "change.version", 2),
                      models=_models_from_wire(d["models"], "change.models") if "models" in d else None,
                      endpoints=(MappingProxyType(_endpoint_lists_from_wire(d["endpoints"], "change.endpoints", True))
                                 if "endpoints" in d else None),
                      keys=_keys_from_wire(d["keys"], "change.keys") if "keys" in d else None,
                      gateway=gateway_from_wire(d["gateway"], "change.gateway") if "gateway" in d else None,
                      abandon=tuple(_str(r, f"change.abandon[{i}]")
                                    for i, r in enumerate(_list(d.get("abandon", []), "change.abandon"))),
                      leases=_leases_from_wire(d["leases"], "change.leases") if "leases" in d else None,
                      homes=_homes_from_wire(d["homes"], "change.homes", True) if "homes" in d else None)
    if kind == "report":
        report, refused = _report_from_wire(d)
        if refused:
            raise FeedError(refused[0].message)
        return report
    if kind == "ack":
        refused = tuple(_refusal_from_wire(r, f"ack.refused[{i}]")
                        for i, r in enumerate(_list(d.get("refused", []), "ack.refused")))
        return Ack(router=_str(_field(d, "router", kind), "ack.router"), seq=_int(_field(d, "seq", kind), "ack.seq"),
                   refused=refused)
    raise FeedError(f"message.type: {kind!r} is not a feed message (snapshot, change, report, ack)")


def read_report(document) -> tuple[Report, tuple[Refusal, ...]]:
    """A report as the control plane takes it (R-10.8): the rows that parse, and a Refusal for
    each one that does not (a usage row, an entry of key_use, last_used, in flight, engine load,
    asked or demand, the counters, a model's homes, the message not applied), so that one bad row does not cost the rest. FeedError when
    the report itself is wrong (its type, protocol, router, seq, sent_at, a part of the wrong shape)."""
    d = _obj(document, "message")
    kind = _str(_field(d, "type", "message"), "message.type")
    if kind != "report":
        raise FeedError(f"message.type: expected a report, got {kind!r}")
    protocol = _field(d, "protocol", kind)
    if protocol != PROTOCOL:
        raise FeedError(f"{kind}: protocol {protocol!r}, this llmgw speaks {PROTOCOL}")
    return _report_from_wire(d)


def _usage_row_from_wire(row, where: str) -> UsageRow:
    row = _list(row, where)
    # 6: a router from before estimates and unmetered requests (R-6.9a); 9: a request through an alias
    if len(row) not in (6, 8, 9):
        raise FeedError(f"{where}: expected [bucket, key, model, requests, prompt, completion, estimated, unmetered"
                        "[, alias]]")
    return UsageRow(_int(row[0], f"{where}[0]"), _str(row[1], f"{where}[1]"), _str(row[2], f"{where}[2]"),
                    _count(row[3], f"{where}[3]"), _count(row[4], f"{where}[4]"), _count(row[5], f"{where}[5]"),
                    *(_count(row[i], f"{where}[{i}]") for i in range(6, min(len(row), 8))),
                    *((_str(row[8], f"{where}[8]"),) if len(row) == 9 else ()))


_RECORD_DEFAULTS = {name: getattr(RequestRecord(0.0, "", "", 0, 0.0), name) for name in REQUEST_RECORD_FIELDS}
_RECORD_REQUIRED = ("at", "id", "route", "status", "duration")
_RECORD_TEXT_KEPT = 256  # characters of a record's text fields the control plane takes


def request_record_to_wire(r: RequestRecord) -> dict:
    """A record as a JSON object of its fields that are not at their default."""
    defaults = _RECORD_DEFAULTS
    out = {}
    for name in REQUEST_RECORD_FIELDS:
        value = getattr(r, name)
        if name in _RECORD_REQUIRED or value != defaults[name]:
            out[name] = value
    return out


def request_record_from_wire(d, where: str) -> RequestRecord:
    d = _obj(d, where)
    unknown = d.keys() - _RECORD_DEFAULTS.keys()
    if unknown:
        raise FeedError(f"{where}: unknown field {sorted(unknown)[0]!r}")

    def text(name: str) -> str | None:
        value = _opt_str(d.get(name), f"{where}.{name}")
        if value is not None and len(value) > _RECORD_TEXT_KEPT:
            raise FeedError(f"{where}.{name}: longer than {_RECORD_TEXT_KEPT} characters")
        return value

    def seconds(name: str) -> float | None:
        value = _opt_num(d.get(name), f"{where}.{name}")
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise FeedError(f"{where}.{name}: expected a finite number of seconds, not negative")
        return value

    for name in _RECORD_REQUIRED:
        _field(d, name, where)
    return RequestRecord(at=_num(d["at"], f"{where}.at"), id=text("id"), route=text("route"),
                         status=_int(d["status"], f"{where}.status", 100, 599), duration=seconds("duration"),
                         key=text("key"), model=text("model"), asked=text("asked"), replica=text("replica"),
                         node=text("node"), error=text("error"),
                         attempts=_int(d.get("attempts", 0), f"{where}.attempts", 0, 1000),
                         fallback=text("fallback"), queued=seconds("queued"), ttfb=seconds("ttfb"),
                         prompt_tokens=_opt_count(d.get("prompt_tokens"), f"{where}.prompt_tokens"),
                         completion_tokens=_opt_count(d.get("completion_tokens"), f"{where}.completion_tokens"),
                         estimated=_expect(d.get("estimated", False), (bool,), f"{where}.estimated"),
                         stream=_expect(d.get("stream", False), (bool,), f"{where}.stream"),
                         client=text("client"), client_request_id=text("client_request_id"))


def _opt_count(value, where):
    return None if value is None else _count(value, where)


def _refusal_from_wire(d, where: str) -> Refusal:
    d = _obj(d, where)
    return Refusal(_str(_field(d, "where", where), f"{where}.where"), _str(_field(d, "message", where), f"{where}.message"))


def _report_from_wire(d: dict) -> tuple[Report, tuple[Refusal, ...]]:
    kind = "report"
    refused: list[Refusal] = []

    def rows(name: str, parse, container=_obj, default=None) -> list:
        """(key, parsed) of each entry of part `name` that parses; a Refusal for each that does not."""
        part = container(d.get(name, {} if default is None else default), f"report.{name}")
        entries = enumerate(part) if container is _list else part.items()
        out = []
        for key, value in entries:
            where = f"report.{name}[{key!r}]" if container is _obj else f"report.{name}[{key}]"
            try:
                out.append((key, parse(value, where)))
            except FeedError as exc:
                refused.append(Refusal(where, str(exc)))
        return out

    snapshot = d.get("snapshot")
    if snapshot is not None:
        pair = _list(snapshot, "report.snapshot")
        if len(pair) != 2:
            raise FeedError("report.snapshot: expected [epoch, version]")
        snapshot = (_str(pair[0], "report.snapshot[0]"), _int(pair[1], "report.snapshot[1]"))
    router = _str(_field(d, "router", kind), "report.router")
    seq = _int(_field(d, "seq", kind), "report.seq", 1)
    sent_at = _num(_field(d, "sent_at", kind), "report.sent_at")
    counters = None
    if d.get("counters") is not None:
        try:
            counters = _counters_from_wire(d["counters"])
        except FeedError as exc:
            refused.append(Refusal("report.counters", str(exc)))
    unapplied = None
    if d.get("unapplied") is not None:
        try:
            unapplied = _unapplied_from_wire(d["unapplied"])
        except FeedError as exc:
            refused.append(Refusal("report.unapplied", str(exc)))
    report = Report(router=router, seq=seq, sent_at=sent_at,
                    usage=tuple(row for _, row in rows("usage", _usage_row_from_wire, _list, [])),
                    key_use=dict(rows("key_use", _num)), last_used=dict(rows("last_used", _num)),
                    inflight=dict(rows("inflight", _count)), engine_load=dict(rows("engine_load", _load_from_wire)),
                    demand=tuple(m for _, m in rows("demand", _str, _list, [])), snapshot=snapshot,
                    counters=counters, asked=dict(rows("asked", _count)),
                    homes={model: MappingProxyType(entries) for model, entries in
                           rows("homes", lambda v, where: _home_entries_from_wire(v, where, False))},
                    unapplied=unapplied,
                    requests=tuple(r for _, r in rows("requests", request_record_from_wire, _list, [])),
                    adapter_use=dict(rows("adapter_use", _adapter_use_from_wire)))
    return report, tuple(refused)


def _adapter_use_from_wire(value, where: str) -> Mapping[str, tuple[int, float]]:
    out = {}
    for adapter, use in _obj(value, where).items():
        pair = _list(use, f"{where}[{adapter!r}]")
        if len(pair) != 2:
            raise FeedError(f"{where}[{adapter!r}]: expected [in flight, last use]")
        out[adapter] = (_count(pair[0], f"{where}[{adapter!r}][0]"), _num(pair[1], f"{where}[{adapter!r}][1]"))
    return out
