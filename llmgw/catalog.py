"""The catalog: the validated set of models and profiles in force (R-8.1).

A Catalog cannot be changed once built, and exists only through `Catalog.build`, which checks
everything that spans more than one model: unique names, profiles and engines that exist,
fallbacks that exist and form no cycle, scaling bounds. Its attributes are fixed and its mappings
read-only; its models, profiles and engines are frozen values, though some of the dicts and lists
they hold (a profile's args, env and node_selector) are the configuration's own, shared and never
changed in place. Changes build a new Catalog and swap `CatalogHolder.current`; readers finish
with the catalog they took.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal

from llmgw.config import (ConfigError, Document, EngineConfig, Inventory, ModelConfig, Problem,
                          ProfileConfig)
from llmgw.engines import TEMPLATE_VARIABLES, Engine, adapter_support, engine_table, loads_adapters, template_fields
from llmgw.weights import WeightsSource

FILE = "file"
STORE = "store"
STORED_SOURCE = "stored models"  # where a problem of a model or alias added at runtime is said to be


@dataclass(frozen=True)
class StoredModel:
    """A model added at runtime, as the store keeps it."""

    config: ModelConfig
    actor: str | None = None


@dataclass(frozen=True)
class Model:
    """One model of the catalog, with its references resolved."""

    name: str
    config: ModelConfig
    declared_in: Literal["file", "store"]
    min_replicas: int
    max_replicas: int
    profile_name: str | None = None
    profile: ProfileConfig | None = None
    engine: Engine | None = None
    source: WeightsSource | None = None
    actor: str | None = None
    # The LoRA adapters the catalog gives this model, by name: the order its engine is
    # given them at launch, and so llama-server's id of each.
    adapters: tuple[Adapter, ...] = ()

    @property
    def launch_adapters(self) -> tuple[Adapter, ...]:
        """The adapters its replicas are launched with (R-8.8): on an engine that loads adapters
        while it runs (vLLM) the preloaded ones, the rest loaded where requests want them; on
        llama-server every one."""
        if loads_adapters(self.engine):
            return tuple(a for a in self.adapters if a.preload)
        return self.adapters

    @property
    def loads_adapters(self) -> bool:
        """Whether its replicas load adapters on demand (R-8.8): it has adapters, on vLLM."""
        return bool(self.adapters) and loads_adapters(self.engine)

    @property
    def on_demand(self) -> bool:
        return self.min_replicas == 0

    @property
    def static(self) -> bool:
        return self.config.endpoints is not None

    @property
    def fallback(self) -> str | None:
        return self.config.fallback

    @property
    def idle_timeout(self) -> float | None:
        """How long an on-demand model's replicas stay unused before they stop (R-6.8): its
        `idle_timeout`, 10 minutes when it sets none; None: they never stop on their own."""
        return self.config.scaling.idle_timeout

    def evict_idle(self, gateway_evict_idle: float) -> float:
        """How long a replica of this model must be unused before it may be evicted (R-6.8c): the
        model's own `idle_timeout` where its definition sets one, else `gateway.evict_idle`."""
        scaling = self.config.scaling
        if "idle_timeout" in scaling.model_fields_set and scaling.idle_timeout is not None:
            return scaling.idle_timeout
        return gateway_evict_idle

    @property
    def evictable(self) -> bool:
        """May its idle replicas be stopped to make room for another model: as set, else when on demand."""
        evictable = self.config.scaling.evictable
        return self.on_demand if evictable is None else evictable

    @property
    def disk_bytes(self) -> int | None:
        gb = self.config.disk_gb
        return None if gb is None else int(gb * 1000**3)

    @property
    def scales(self) -> bool:
        """Whether load can add replicas: max above min (and above 1 for an on-demand model).
        Without max in the definition it is min (1 for on-demand): no load-based scaling."""
        return self.max_replicas > max(self.min_replicas, 1)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter (R-8.8): served by the replicas of its base model, which hold it; it has
    no replicas, profile or scaling of its own."""

    name: str
    base: str
    source: WeightsSource
    config: ModelConfig
    declared_in: Literal["file", "store"]
    actor: str | None = None

    @property
    def preload(self) -> bool:
        return self.config.preload


@dataclass(frozen=True)
class Alias:
    """A stable name clients call for a model (R-8.7): `target` serves it."""

    name: str
    target: str
    declared_in: Literal["file", "store"]
    actor: str | None = None


class Catalog:
    """Never changed once built; build it with `Catalog.build`."""

    __slots__ = ("models", "profiles", "engines", "version", "aliases", "adapters")

    def __init__(self, *, _token: object, models: dict[str, Model], profiles: dict[str, ProfileConfig],
                 engines: dict[str, Engine], version: int, aliases: dict[str, Alias] | None = None,
                 adapters: dict[str, Adapter] | None = None):
        if _token is not _BUILD_TOKEN:
            raise TypeError("use Catalog.build(...): a catalog is only made through its validation")
        object.__setattr__(self, "models", MappingProxyType(dict(models)))
        object.__setattr__(self, "profiles", MappingProxyType(dict(profiles)))
        object.__setattr__(self, "engines", MappingProxyType(dict(engines)))
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "aliases", MappingProxyType(dict(aliases or {})))
        object.__setattr__(self, "adapters", MappingProxyType(dict(adapters or {})))

    def __setattr__(self, name, value):
        raise AttributeError("a Catalog is immutable; build a new one")

    models: Mapping[str, Model]
    profiles: Mapping[str, ProfileConfig]
    engines: Mapping[str, Engine]
    version: int
    aliases: Mapping[str, Alias]  # alias name -> the alias (its target a model of this catalog)
    # adapter name -> the adapter (its base a model of this catalog); never in `models`: an
    # adapter has no replicas of its own to place, scale or wait on
    adapters: Mapping[str, Adapter]

    def get(self, name: str) -> Model | None:
        return self.models.get(name)

    def fallback_chain(self, name: str) -> list[str]:
        """The model's fallbacks in order (without the model itself)."""
        chain, current = [], self.models[name].fallback
        while current is not None:
            chain.append(current)
            current = self.models[current].fallback
        return chain

    def wanted_cache_names(self) -> frozenset[str]:
        """Cache entries the catalog still needs: computed exactly from the sources (R-5.5)."""
        sources = [m.source for m in self.models.values()] + [a.source for a in self.adapters.values()]
        return frozenset(s.cache_name for s in sources if s is not None and s.fetched)

    @classmethod
    def build(cls, *, file_models: list[ModelConfig] = (), stored: list[StoredModel] = (),
              profiles: Mapping[str, ProfileConfig] | None = None,
              engines: Mapping[str, EngineConfig] | None = None,
              document: Document | None = None, version: int = 1,
              aliases: list[Alias] = ()) -> Catalog:
        """Validate and build; raises ConfigError listing every problem found."""
        profiles = dict(profiles or {})
        engines_cfg = dict(engines or {})
        file_problems: list[Problem] = []
        store_problems: list[Problem] = []

        def file_problem(loc: tuple, message: str) -> None:
            line = document.lines.line(loc) if document is not None else None
            file_problems.append(Problem(loc, message, line))

        for name, config in engines_cfg.items():
            for key in ("command", "leader_command", "worker_command"):
                for index, part in enumerate(getattr(config, key) or []):
                    try:
                        unknown = [f for f in template_fields(part) if f not in TEMPLATE_VARIABLES]
                    except ValueError as exc:
                        file_problem(("engines", name, key, index), f"bad template {part!r}: {exc}")
                        continue
                    if unknown:
                        file_problem(("engines", name, key, index),
                                     f"unknown template variable {{{unknown[0]}}}; known: "
                                     + ", ".join(sorted(TEMPLATE_VARIABLES)))
        table = engine_table(engines_cfg)
        for name, profile in profiles.items():
            engine = table.get(profile.engine)
            if engine is None:
                file_problem(("profiles", name, "engine"),
                             f"unknown engine {profile.engine!r}; known: {', '.join(sorted(table))}")
            elif profile.nodes > 1 and not engine.multi_node:
                file_problem(("profiles", name, "nodes"),
                             f"engine {profile.engine} has no multi-node mode; use nodes: 1")

        models: dict[str, Model] = {}
        adapters: dict[str, Adapter] = {}
        adapter_locs: dict[str, tuple] = {}
        entries = [(FILE, ("models", i), m, None) for i, m in enumerate(file_models)]
        entries += [(STORE, (s.config.name,), s.config, s.actor) for s in stored]
        for declared_in, loc, config, actor in entries:
            report = file_problem if declared_in == FILE else (
                lambda loc, message: store_problems.append(Problem(loc, message)))
            if config.name in models or config.name in adapters:
                other = models.get(config.name) or adapters[config.name]
                where = "in the inventory file" if other.declared_in == FILE else "at runtime"
                report(loc + ("name",), f"model {config.name!r} is already declared {where}")
                continue
            if config.adapter is not None:
                adapters[config.name] = Adapter(name=config.name, base=config.base, source=config.adapter_source,
                                                config=config, declared_in=declared_in, actor=actor)
                adapter_locs[config.name] = loc
                continue
            profile = None
            engine = None
            if config.profile is not None:
                profile = profiles.get(config.profile)
                if profile is None:
                    known = ", ".join(sorted(profiles)) or "none are defined"
                    report(loc + ("profile",), f"unknown profile {config.profile!r} (known: {known})")
                    continue
                engine = table.get(profile.engine)
            scaling = config.scaling
            maximum = scaling.max if scaling.max is not None else max(scaling.min, 1)
            models[config.name] = Model(
                name=config.name, config=config, declared_in=declared_in, min_replicas=scaling.min,
                max_replicas=maximum, profile_name=config.profile, profile=profile, engine=engine,
                source=config.source, actor=actor)

        for declared_in, loc, config, _ in entries:
            if config.fallback is None or models.get(config.name) is None or \
                    models[config.name].config is not config:
                continue
            report = file_problem if declared_in == FILE else (
                lambda loc, message: store_problems.append(Problem(loc, message)))
            if config.fallback == config.name:
                report(loc + ("fallback",), "a model cannot be its own fallback")
            elif config.fallback not in models:
                report(loc + ("fallback",), f"fallback {config.fallback!r} is not a model of the catalog")
            else:
                cycle = _cycle_from(config.name, models)
                if cycle:
                    report(loc + ("fallback",), "fallbacks form a cycle: " + " -> ".join(cycle))

        named: dict[str, Alias] = {}
        for alias in aliases:  # a name of its own, pointing at a model (not at another alias)
            report = file_problem if alias.declared_in == FILE else (
                lambda loc, message: store_problems.append(Problem(loc, message)))
            loc = ("aliases", alias.name)
            if alias.name in adapters:
                report(loc, f"alias {alias.name!r} is also the name of an adapter; an alias needs a name of its own")
            elif alias.name in models:
                report(loc, f"alias {alias.name!r} is also the name of a model; an alias needs a name of its own")
            elif alias.name in named:
                report(loc, f"alias {alias.name!r} is declared twice")
            elif alias.target not in models:
                hint = " (an alias points at a model, not at another alias)" if any(
                    a.name == alias.target for a in aliases) else ""
                report(loc, f"alias {alias.name!r} points at {alias.target!r}, which is not a model of the "
                            f"catalog{hint}")
            else:
                named[alias.name] = alias

        held: dict[str, list[Adapter]] = {}
        for adapter in list(adapters.values()):
            loc = adapter_locs[adapter.name]
            report = file_problem if adapter.declared_in == FILE else (
                lambda loc, message: store_problems.append(Problem(loc, message)))
            problem = _adapter_problem(adapter, models, adapters, aliases)
            if problem is not None:
                report(loc + ("base",), problem)
                del adapters[adapter.name]
            else:
                held.setdefault(adapter.base, []).append(adapter)
        for base, own in held.items():
            models[base] = replace(models[base], adapters=tuple(sorted(own, key=lambda a: a.name)))

        if file_problems:
            raise ConfigError(document.source if document else "inventory", file_problems + store_problems)
        if store_problems:
            raise ConfigError(STORED_SOURCE, store_problems)
        return cls(_token=_BUILD_TOKEN, models=models, profiles=profiles, engines=table, version=version,
                   aliases=named, adapters=adapters)

    @classmethod
    def from_inventory(cls, inventory: Inventory, document: Document | None = None,
                       stored: list[StoredModel] = (), version: int = 1,
                       stored_aliases: list[Alias] = ()) -> Catalog:
        file_aliases = [Alias(name, target, FILE) for name, target in inventory.aliases.items()]
        return cls.build(file_models=inventory.models, stored=stored, profiles=inventory.profiles,
                         engines=inventory.engines, document=document, version=version,
                         aliases=[*file_aliases, *stored_aliases])


_BUILD_TOKEN = object()


def _adapter_problem(adapter: Adapter, models: Mapping[str, Model], adapters: Mapping[str, Adapter],
                     aliases: list[Alias]) -> str | None:
    """Why `adapter`'s base cannot hold it (R-8.8), or None."""
    base = adapter.base
    model = models.get(base)
    if model is None:
        if base in adapters:
            return (f"adapter {adapter.name!r}: its base {base!r} is itself an adapter; an adapter's base is a "
                    "model with a profile")
        target = next((a.target for a in aliases if a.name == base), None)
        if target is not None:
            return (f"adapter {adapter.name!r}: its base {base!r} is an alias (of {target!r}); name the model "
                    "itself as the base")
        return f"adapter {adapter.name!r}: its base {base!r} is not a model of the catalog"
    if model.static or model.profile is None:
        return (f"adapter {adapter.name!r}: its base {base!r} is served by static endpoints; llmgw launches no "
                "engine there to hold an adapter")
    if not adapter_support(model.engine):
        return (f"adapter {adapter.name!r}: its base {base!r} runs engine {model.profile.engine}, which llmgw "
                "cannot give adapters; adapters need a base on vllm or llama-server")
    return None


def _cycle_from(start: str, models: dict[str, Model]) -> list[str] | None:
    seen = [start]
    current = models[start].fallback
    while current is not None and current in models:
        if current in seen:
            return seen[seen.index(current):] + [current] if current == start else None
        seen.append(current)
        current = models[current].fallback
    return None


class CatalogHolder:
    """Holds the catalog in force; `swap` replaces it atomically and tells subscribers."""

    def __init__(self, catalog: Catalog):
        self._current = catalog
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[Catalog], None]] = []

    @property
    def current(self) -> Catalog:
        return self._current

    def subscribe(self, callback: Callable[[Catalog], None]) -> None:
        self._subscribers.append(callback)

    def swap(self, catalog: Catalog) -> Catalog:
        with self._lock:
            previous, self._current = self._current, catalog
        for callback in list(self._subscribers):
            callback(catalog)
        return previous
