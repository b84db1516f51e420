"""A model's revisions: each distinct definition of what its replicas run (R-8.6).

Pure. A revision is the part of a model's definition that changes what an engine process is:
its weights (source and revision), the name the engine serves, and its profile as launched —
engine (a custom engine's command templates included), runtime, image or environment, GPUs,
nodes, placement constraints, arguments and environment. Scaling bounds, routing policy,
limits, fallbacks, a profile's `concurrency`, `start_timeout` and `responses_store` are not part
of it: they apply in place, to the replicas already running.

A revision's id is the first 12 hex digits of the SHA-256 of its definition as canonical JSON:
two catalogs that define a model alike give it the same id, whatever the names of their
profiles. Environment values are hashed into the id, never shown: `describe` and `diff` name
the variables only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.catalog import Model

from llmgw.config import ADAPTER_PROFILE_FIELDS
from llmgw.engines import VLLM

ID_LENGTH = 12
# Profile fields that act on running replicas in place, or only on the router: not a revision.
IN_PLACE_PROFILE_FIELDS = frozenset({"concurrency", "start_timeout", "responses_store"})
HIDDEN = "(value not shown)"


def definition(model: Model) -> dict[str, Any] | None:
    """What the model's replicas run, as plain JSON values; None for a model served by fixed
    URLs (`endpoints:`), which llmgw does not run."""
    if model.static or model.profile is None:
        return None
    # A model without adapters keeps the definition (and id) it had before adapters existed: the
    # adapter fields of its profile launch nothing then, nor on llama-server, which has no such flags.
    launched = bool(model.adapters) and isinstance(model.engine, VLLM)
    excluded = set(IN_PLACE_PROFILE_FIELDS) | (set() if launched else set(ADAPTER_PROFILE_FIELDS))
    profile = model.profile.model_dump(mode="json", exclude=excluded)
    engine_config = getattr(model.engine, "config", None)  # a custom engine's templates
    defined = {
        "weights": model.source.canonical if model.source is not None else None,
        "served_name": model.config.served_name,
        "profile": profile,
        "engine": engine_config.model_dump(mode="json") if engine_config is not None else None,
    }
    if model.launch_adapters:  # in launch order, each with its source
        defined["adapters"] = {a.name: a.source.canonical for a in model.launch_adapters}
    return defined


def revision_id(defined: Mapping[str, Any]) -> str:
    """The short, stable id of a definition."""
    text = json.dumps(defined, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LENGTH]


def of(model: Model) -> str | None:
    """The id of the revision `model` defines; None when llmgw runs nothing for it."""
    defined = definition(model)
    return None if defined is None else revision_id(defined)


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{path}.{key}" if path else str(key)))
        if not out and path:
            out[path] = {}
        return out
    return {path: value}


def _shown(path: str, value: Any) -> str:
    if path.startswith("profile.env."):
        return HIDDEN
    return json.dumps(value, ensure_ascii=False)


def diff(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[str]:
    """What changed from `old` to `new`, one line per field (`profile.args: [..] -> [..]`),
    environment variables by name only. Empty when they are alike."""
    before, after = _flat(dict(old or {})), _flat(dict(new or {}))
    lines = []
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            lines.append(f"{path}: removed")
        elif path not in before:
            lines.append(f"{path}: added" if path.startswith("profile.env.")
                         else f"{path}: {_shown(path, after[path])} (new)")
        elif before[path] != after[path]:
            lines.append(f"{path}: changed" if path.startswith("profile.env.")
                         else f"{path}: {_shown(path, before[path])} -> {_shown(path, after[path])}")
    return lines


def model_at(model: Model, defined: Mapping[str, Any], engines: Mapping[str, Any]) -> Model:
    """`model` as it was at the revision `defined` describes: what its replicas run from there,
    what applies in place (scaling, routing, limits, fallbacks, concurrency...) as it is now.
    `engines` is the catalog's engine table, for an engine the definition names but does not
    define (a built-in one is found without it). Raises ValueError when the definition no longer makes a valid model."""
    from llmgw.config import EngineConfig, ProfileConfig
    from llmgw.engines import BUILTIN_ENGINES, CustomEngine
    from llmgw.weights import parse_weights

    current = model.profile.model_dump(mode="json", include=set(IN_PLACE_PROFILE_FIELDS)) if model.profile else {}
    profile = ProfileConfig(**{**current, **defined["profile"]})
    if defined.get("engine") is not None:
        engine = CustomEngine(profile.engine, EngineConfig(**defined["engine"]))
    else:
        engine = engines.get(profile.engine) or BUILTIN_ENGINES.get(profile.engine)
        if engine is None:
            raise ValueError(f"engine {profile.engine!r} of that revision is not defined any more")
    weights = defined.get("weights")
    config = model.config.model_copy(update={"served_name": defined.get("served_name"),
                                             "weights": weights_field(weights)})
    launched = adapters_at(model.name, defined)
    if isinstance(engine, VLLM) and "max_adapters" in defined["profile"]:
        # That revision ran with adapter support: the catalog's adapters loaded on demand
        # are loaded on its replicas as on any other.
        named = {a.name for a in launched}
        launched += tuple(a for a in model.adapters if not a.preload and a.name not in named)
    return replace(model, config=config, profile=profile, engine=engine,
                   source=parse_weights(config.weights) if config.weights is not None else None,
                   adapters=launched)


def adapters_at(base: str, defined: Mapping[str, Any]) -> tuple:
    """The adapters a revision's definition launches its model with, in launch order (R-8.8):
    preloaded, since every replica of the revision holds them from its start."""
    from llmgw.catalog import FILE, Adapter
    from llmgw.config import ModelConfig
    from llmgw.weights import parse_weights

    out = []
    for name, canonical in sorted((defined.get("adapters") or {}).items()):
        value = weights_field(canonical)
        out.append(Adapter(name=name, base=base, source=parse_weights(value),
                           config=ModelConfig(name=name, base=base, adapter=value, preload=True), declared_in=FILE))
    return tuple(out)


def adapter_names(defined: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The names of the adapters a revision's replicas hold, in launch order (R-8.8)."""
    return tuple(sorted((defined or {}).get("adapters") or {}))


def weights_field(canonical: str | None) -> str | list[str] | None:
    """The `weights:` value a source's canonical form came from."""
    if canonical is None:
        return None
    if canonical.startswith("path:"):
        return canonical[len("path:"):]
    if canonical.startswith("https:"):
        urls = canonical[len("https:"):].split(" ")
        return urls[0] if len(urls) == 1 else urls
    return canonical  # hf:REPO@REVISION is its own weights value
