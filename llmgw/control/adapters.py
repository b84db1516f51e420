"""LoRA adapters loaded on the replicas that requests want them on, and unloaded least recently
used first (R-8.8).

On vLLM an adapter need not be given at launch: a replica started with adapter support
(`--enable-lora`, runtime updating on) loads one through its `/v1/load_lora_adapter` and drops
it through `/v1/unload_lora_adapter`. The routers never call those routes (R-6.1's path rule
refuses them); they ask the control plane, which decides here, in one place for every router:

- A router whose request names an adapter that no replica of its base holds, or whose holders
  are all over the load bound, puts the adapter in its next report's `demand`, sent at once
  (`want`). One load per adapter is under way at a time, and a replica does one load or unload
  at a time. A demand that comes within SETTLE_SECONDS of the adapter's last load may be the
  routers catching up with it; it is kept, like one that finds no replica free, and tried again
  after each load and each pass while no replica holds the adapter (WANTED_SECONDS at most).
- The replica chosen (`choose`): a serving, undrained replica of the base running a revision with
  adapter support that does not hold the adapter; one with room under the profile's
  `max_adapters` (launched and loaded adapters together) before one that must unload, then the
  least busy by the routers' reports. One without room unloads a loaded adapter that no router
  has a request in flight for: one another replica holds too before an only copy, then the least
  recently used; a replica with none such is not chosen. A load for more room (the adapter's
  holders all busy) goes only to a replica with room: taking another adapter's place would send
  that adapter's requests waiting for a load in turn, and loads chase each other round.
- A load fetches the adapter to the replica's node as weights are (single-flight per node,
  sealed, counted), then calls the engine, and the endpoint table goes to the routers at once:
  the waiting requests go on. Only then is room made, so that a load the engine refuses costs
  nothing and no request waits for an unload (vLLM takes a load past its `--max-cpu-loras`: its
  worker keeps the most recently used weights). A failed load is kept on the replica's endpoint
  (`adapter_errors`) for RETRY_SECONDS: a request for that adapter that finds no holder fails at
  once with the engine's reason instead of waiting, and no new load of it starts until then.
- An unload first takes the adapter off the replica's endpoint, then waits until every router
  heard lately routes with that endpoint table and reports no request of the adapter in flight
  there (at most QUIET_SECONDS: else the unload is called off and the adapter stays, one over
  the bound until the next load there makes room), then calls the engine. vLLM's unload only
  forgets the name (requests it already runs keep their adapter), so nothing in flight is cut
  either way.

What each replica holds besides its launch adapters is in `AdapterMemory.loaded`. The engine
keeps its adapters when the control plane restarts; this memory does not, so it also learns
them from what the routers poll (`learn`, vLLM's /v1/models): an adapter the engine lists is
adopted, one it no longer lists is forgotten.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from llmgw.catalog import Catalog, Model
from llmgw.contracts.errors import Category, LlmgwError
from llmgw.control.state import Records, Replica, endpoint_url
from llmgw.fleet.errors import NodeError

if TYPE_CHECKING:
    from llmgw.control.actions import Actions
    from llmgw.control.rollouts import RolloutMemory
    from llmgw.control.routers import Routers

log = logging.getLogger(__name__)

SETTLE_SECONDS = 2.0  # a demand this soon after the adapter's last load is the routers catching up
QUIET_SECONDS = 30.0  # the most an unload waits for the routers to stop sending the adapter's requests
RETRY_SECONDS = 30.0  # a failed load is reported, and not tried again, for this long
WANTED_SECONDS = 60.0  # a want that could not be acted on at once is tried again for this long
ENGINE_TIMEOUT = 120.0  # one load or unload call to the engine
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class AdapterLoadFailed(LlmgwError):
    """The engine refused a load or an unload, or did not answer; the message says why."""

    category = Category.UPSTREAM


@dataclass
class Loaded:
    """An adapter a replica loaded while running (not one it was launched with)."""

    since: float  # time.time() of the load
    unloading: bool = False  # taken off the endpoint, waiting for the routers before the engine forgets it


@dataclass(eq=False)
class AdapterMemory:
    """What the control plane knows of the adapters loaded at runtime and of those that failed."""

    loaded: dict[str, dict[str, Loaded]] = field(default_factory=dict)  # replica id -> adapter ->
    busy: set[str] = field(default_factory=set)  # replicas with a load or unload under way
    loading: dict[str, str] = field(default_factory=dict)  # adapter -> the replica it is being loaded on
    last_load: dict[str, float] = field(default_factory=dict)  # adapter -> time.monotonic() its last load ended
    failed: dict[str, dict[str, tuple[float, str]]] = field(default_factory=dict)  # replica -> adapter -> (time.time(), why)
    loads: dict[str, int] = field(default_factory=dict)  # adapter -> loads done, since this control plane started
    unloads: dict[str, int] = field(default_factory=dict)
    load_failures: dict[str, int] = field(default_factory=dict)
    changed_at: dict[str, float] = field(default_factory=dict)  # replica id -> time.time() its last load or unload ended
    wanted: dict[str, float] = field(default_factory=dict)  # adapter -> time.monotonic() of a want kept for later

    def held(self, replica_id: str) -> tuple[str, ...]:
        """The adapters loaded on the replica at runtime that requests may be sent for, by name."""
        return tuple(sorted(name for name, entry in self.loaded.get(replica_id, {}).items() if not entry.unloading))

    def errors(self, replica_id: str, now: float | None = None) -> tuple[tuple[str, str], ...]:
        """(adapter, why) of the loads that failed on the replica within RETRY_SECONDS."""
        now = time.time() if now is None else now
        return tuple(sorted((name, why) for name, (when, why) in self.failed.get(replica_id, {}).items()
                            if now - when < RETRY_SECONDS))

    def failure(self, adapter: str, now: float) -> str | None:
        """Why the adapter's latest load failed, while that is within RETRY_SECONDS."""
        latest = None
        for per in self.failed.values():
            entry = per.get(adapter)
            if entry is not None and now - entry[0] < RETRY_SECONDS and (latest is None or entry[0] > latest[0]):
                latest = entry
        return None if latest is None else latest[1]

    def forget_replicas(self, live: Iterable[str]) -> None:
        """Drop what is remembered of replicas that are gone."""
        alive = set(live)
        for table in (self.loaded, self.failed, self.changed_at):
            for replica_id in [r for r in table if r not in alive]:
                del table[replica_id]


@dataclass(frozen=True)
class Candidate:
    """A replica of the adapter's base as `choose` weighs it."""

    replica_id: str
    busy: int  # requests in flight to it over every router
    launched: tuple[str, ...]  # the adapters its revision launched it with
    loaded: Mapping[str, Loaded]  # those it loaded since
    use: Mapping[str, tuple[int, float]]  # adapter -> (requests in flight, last use) over every router
    capacity: int  # the profile's max_adapters


@dataclass(frozen=True)
class Choice:
    replica_id: str
    victim: str | None  # the loaded adapter it unloads first to make room, None: it has room


def choose(adapter: str, candidates: Iterable[Candidate], copies: Mapping[str, int] | None = None) -> Choice | str:
    """Where `adapter` is loaded (module docstring), or why nowhere. `copies`: how many serving
    replicas of the base hold each adapter. While some replica holds `adapter` (a load for more
    room, its holders being busy), only a replica with room loads it: making room would take
    another adapter's place and send its requests waiting for a load in turn. Making room, a
    replica unloads an adapter another replica also holds before its only copy, then the least
    recently used."""
    copies = copies or {}
    spread = copies.get(adapter, 0) > 0
    ranked: list[tuple[tuple, Choice]] = []
    full = 0
    for c in candidates:
        if adapter in c.launched or adapter in c.loaded:
            continue
        held = len(c.launched) + len(c.loaded)
        if held < c.capacity:
            ranked.append(((0, c.busy, held, c.replica_id), Choice(c.replica_id, None)))
            continue
        idle = [(copies.get(name, 0) < 2, c.use.get(name, (0, 0.0))[1], name) for name, entry in c.loaded.items()
                if not entry.unloading and c.use.get(name, (0, 0.0))[0] == 0]
        if not idle or spread:
            full += 1
            continue
        ranked.append(((1, c.busy, held, c.replica_id), Choice(c.replica_id, min(idle)[2])))
    if ranked:
        return min(ranked, key=lambda pair: pair[0])[1]
    if spread:
        return "its holders are busy, and every other replica holds its max_adapters adapters"
    if full:
        return (f"every replica that could load it holds its max_adapters adapters, each with requests "
                f"in flight ({full} replica{'s' if full != 1 else ''})")
    return "no serving replica of its base can load it now"


# -- talking to the engine --------------------------------------------------------------------


class EngineAdapters:
    """vLLM's load and unload routes, called with the replica's engine key (R-4.6); a session per
    call, since calls are few."""

    @staticmethod
    async def call(url: str, key: str, path: str, body: dict) -> None:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ENGINE_TIMEOUT)) as session:
                async with session.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
                    text = await response.text()
                    if response.status >= 400:
                        raise AdapterLoadFailed(f"the engine answered {response.status}: {_engine_message(text)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise AdapterLoadFailed(f"the engine did not answer: {exc or type(exc).__name__}") from None


def _engine_message(text: str) -> str:
    """The message of an engine's error answer (OpenAI's shape, or FastAPI's), else its start."""
    try:
        document = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:300]
        if isinstance(document.get("message"), str):
            return document["message"][:300]
        if document.get("detail") is not None:
            return str(document["detail"])[:300]
    return text[:300]


class AdapterLoads:
    """Carries out the loads and unloads `want` decides (module docstring)."""

    def __init__(self, memory: AdapterMemory, records: Records, rollouts: RolloutMemory, actions: Actions,
                 routers: Routers, wake: Callable[[], None]):
        self.memory = memory
        self.records = records
        self.rollouts = rollouts  # what each revision launched its replicas with
        self.actions = actions  # fetches the adapter to the replica's node; its fleet knows the nodes
        self.routers = routers
        self._wake = wake
        self.engine = EngineAdapters()
        self._tasks: set[asyncio.Task] = set()
        self._catalog: Catalog | None = None  # the latest one seen, for the wants tried again

    @property
    def tasks(self) -> set[asyncio.Task]:
        """The loads and unloads under way (cancelled when the control plane stops)."""
        return self._tasks

    # -- deciding ----------------------------------------------------------------------------

    def want(self, name: str, catalog: Catalog, since: float | None = None) -> None:
        """A request wants adapter `name` on a replica that does not hold it yet (module docstring).
        A want that cannot be acted on now (a load of it or of its replica under way, the routers
        catching up with its last load, no replica with room) is kept and tried again after each
        load and each pass for WANTED_SECONDS from `since` (its first time), unless a replica holds
        the adapter by then."""
        self._catalog = catalog
        adapter = catalog.adapters.get(name)
        base = catalog.models.get(adapter.base) if adapter is not None else None
        memory = self.memory
        if base is None or not base.loads_adapters or name in memory.loading:
            return
        now = time.monotonic()
        since = now if since is None else since
        if memory.failure(name, time.time()) is not None:
            return
        if now - memory.last_load.get(name, float("-inf")) < SETTLE_SECONDS:
            memory.wanted.setdefault(name, since)
            return
        copies = self._copies(base)
        decision = choose(name, self._candidates(base), copies)
        if isinstance(decision, str):
            # Said once per want kept: a busy holder's want comes with every report while it is busy.
            if name not in memory.wanted:
                log.log(logging.DEBUG if copies.get(name) else logging.INFO,
                        "adapter %s is wanted but not loaded yet: %s", name, decision)
            memory.wanted.setdefault(name, since)
            return
        replica = self.records.replicas[decision.replica_id]
        memory.loading[name] = replica.id
        memory.busy.add(replica.id)
        task = asyncio.create_task(self._carry_out(replica, adapter, decision.victim), name=f"adapter-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _retry(self) -> None:
        """The wants kept for later (`want`): dropped once a replica holds the adapter or they are
        WANTED_SECONDS old, else tried again."""
        catalog, memory = self._catalog, self.memory
        if catalog is None or not memory.wanted:
            return
        now = time.monotonic()
        held = {name for replica in self.records.replicas.values() if replica.serving
                for name in (*self.rollouts.adapters(replica.model, replica.revision), *memory.held(replica.id))}
        for name, since in list(memory.wanted.items()):
            del memory.wanted[name]
            if name not in held and now - since < WANTED_SECONDS:
                self.want(name, catalog, since)

    def _copies(self, base: Model) -> dict[str, int]:
        """adapter -> how many serving replicas of the base hold it (launched or loaded)."""
        out: dict[str, int] = {}
        for replica in self.records.replicas.values():
            if replica.model == base.name and replica.serving:
                for name in {*self.rollouts.adapters(replica.model, replica.revision), *self.memory.held(replica.id)}:
                    out[name] = out.get(name, 0) + 1
        return out

    def _candidates(self, base: Model) -> list[Candidate]:
        use_of = self.routers.adapter_use() if self.routers.adapter_use is not None else {}
        out = []
        for replica in self.records.replicas.values():
            if replica.model != base.name or not replica.serving or replica.draining or replica.id in self.memory.busy:
                continue
            if not self.rollouts.loads_adapters(replica.model, replica.revision):
                continue
            busy = self.routers.outstanding(replica.id) if self.routers.outstanding is not None else 0
            out.append(Candidate(replica.id, busy, self.rollouts.adapters(replica.model, replica.revision),
                                 self.memory.loaded.get(replica.id, {}), use_of.get(replica.id, {}),
                                 base.profile.max_adapters if base.profile is not None else 1))
        return out

    # -- carrying out ------------------------------------------------------------------------

    def _url(self, replica: Replica) -> str | None:
        node = self.actions.fleet.nodes.get(replica.leader.node)
        return endpoint_url(node, replica.leader.port) if node is not None and replica.leader.port else None

    def _push(self) -> None:
        """The endpoint table to the routers now, not at the next pass: an adapter loaded, or
        taken off a replica before it is unloaded."""
        self.routers.push(self.records.endpoints(self.actions.fleet.nodes))

    async def _carry_out(self, replica: Replica, adapter, victim: str | None) -> None:
        memory = self.memory
        try:
            try:
                path = await self.actions.adapter_path(replica, adapter)
                url = self._url(replica)
                if url is None:
                    raise AdapterLoadFailed("the replica has no endpoint any more")
                await self.engine.call(url, replica.api_key, LOAD_PATH, {"lora_name": adapter.name, "lora_path": path})
            except (AdapterLoadFailed, NodeError) as exc:
                why = str(exc)
                memory.failed.setdefault(replica.id, {})[adapter.name] = (time.time(), why)
                memory.load_failures[adapter.name] = memory.load_failures.get(adapter.name, 0) + 1
                log.warning("replica %s could not load adapter %s: %s", replica.id, adapter.name, why)
                return
            memory.loaded.setdefault(replica.id, {})[adapter.name] = Loaded(time.time())
            memory.loads[adapter.name] = memory.loads.get(adapter.name, 0) + 1
            for per in memory.failed.values():
                per.pop(adapter.name, None)
            log.info("replica %s loaded adapter %s", replica.id, adapter.name)
            if victim is not None:
                self._push()  # the waiting requests go on now, while the room is made
                await self._unload(replica, victim)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not leave the adapter marked as loading forever
            log.exception("loading adapter %s on replica %s failed", adapter.name, replica.id)
        finally:
            memory.loading.pop(adapter.name, None)
            memory.busy.discard(replica.id)
            memory.changed_at[replica.id] = time.time()
            memory.last_load[adapter.name] = time.monotonic()
            self._push()
            self._retry()
            self._wake()

    async def _unload(self, replica: Replica, name: str) -> bool:
        """Take `name` off the replica's endpoint, wait for the routers, then unload it; False when
        the routers kept sending it requests for QUIET_SECONDS (it stays loaded then)."""
        entry = self.memory.loaded.get(replica.id, {}).get(name)
        if entry is None:
            return True
        entry.unloading = True
        self._push()
        version = self.routers.version() if self.routers.version is not None else None
        deadline = time.monotonic() + QUIET_SECONDS
        while self.routers.adapter_quiet is not None and not self.routers.adapter_quiet(replica.id, name, version):
            if time.monotonic() >= deadline:
                entry.unloading = False
                log.warning("adapter %s stays on replica %s: routers still send it requests after %.0f s",
                            name, replica.id, QUIET_SECONDS)
                return False
            await asyncio.sleep(0.1)
        url = self._url(replica)
        try:
            if url is not None:
                await self.engine.call(url, replica.api_key, UNLOAD_PATH, {"lora_name": name})
        except AdapterLoadFailed as exc:
            log.warning("replica %s could not unload adapter %s: %s", replica.id, name, exc)
        self.memory.loaded.get(replica.id, {}).pop(name, None)
        self.memory.unloads[name] = self.memory.unloads.get(name, 0) + 1
        log.info("replica %s unloaded adapter %s (least recently used) for room", replica.id, name)
        return True

    # -- what the engines say -----------------------------------------------------------------

    def learn(self, catalog: Catalog) -> None:
        """Each pass: the wants kept for later tried again, then what the engines that load
        adapters at runtime list, as the routers last polled them (vLLM's /v1/models): adapters
        an engine holds that this memory lacks are adopted, those it no longer holds forgotten. A
        reading taken before the replica's last load or unload ended, or during one, says
        nothing of it."""
        memory = self.memory
        memory.forget_replicas(self.records.replicas)
        self._catalog = catalog
        self._retry()
        if self.routers.engine_load is None or not catalog.adapters:
            return
        for replica in self.records.replicas.values():
            model = catalog.models.get(replica.model)
            if model is None or not model.loads_adapters or replica.id in memory.busy or not replica.serving:
                continue
            load = self.routers.engine_load(replica.id)
            if load is None or load.adapters is None or load.at is None \
                    or load.at <= memory.changed_at.get(replica.id, 0.0):
                continue
            launched = set(self.rollouts.adapters(replica.model, replica.revision))
            mine = memory.loaded.setdefault(replica.id, {})
            for name in load.adapters:
                if name not in launched and name not in mine and name in catalog.adapters:
                    mine[name] = Loaded(load.at)
                    log.info("replica %s holds adapter %s (its engine lists it)", replica.id, name)
            for name in [n for n, entry in mine.items() if n not in load.adapters and not entry.unloading]:
                del mine[name]
                log.info("replica %s no longer holds adapter %s (its engine does not list it)", replica.id, name)
