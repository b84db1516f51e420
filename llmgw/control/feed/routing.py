"""What routing needs, read from the catalog and the gateway settings (R-10.1): the routed models,
the static endpoints (R-6.10) and the settings routers read, as the feed's types."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig, runtime_key_env_problem
from llmgw.contracts.endpoints import STATIC_PREFIX, Endpoint
from llmgw.contracts.feed import GatewaySettings, RoutedModel
from llmgw.engines import VLLM, LlamaServer, SGLang

log = logging.getLogger(__name__)

_ENGINE_KINDS = {VLLM: "vllm", SGLang: "sglang", LlamaServer: "llama-server"}


def static_endpoints(catalog: Catalog) -> dict[str, list[Endpoint]]:
    """Endpoints of the models that declare `endpoints:` (R-6.10): served with no replica.

    Keys come from the environment variable each endpoint names; a variable that is not set is
    reported once and the endpoint is used without a key (the engine will refuse it if it wants one).
    A model added at runtime reads only `LLMGW_ENDPOINT_KEY_*` variables (config.RUNTIME_KEY_ENV_PREFIX).
    """
    out: dict[str, list[Endpoint]] = {}
    for model in catalog.models.values():
        if not model.static:
            continue
        endpoints = []
        for index, static in enumerate(model.config.endpoints or ()):
            key = None
            refused = model.declared_in != "file" and runtime_key_env_problem(static.api_key_env)
            if refused:  # stored before the rule: never read the variable, say so
                log.warning("model %s: endpoint %s is used without a key: %s", model.name,
                            static.url, refused)
            elif static.api_key_env:
                key = os.environ.get(static.api_key_env)
                if key is None:
                    log.warning("model %s: endpoint %s names api_key_env %s, which is not set",
                                model.name, static.url, static.api_key_env)
            endpoints.append(Endpoint(replica_id=f"{STATIC_PREFIX}{model.name}:{index}", model=model.name,
                                      url=static.root, api_key=key))
        out[model.name] = endpoints
    return out


def routed_models(catalog: Catalog) -> Mapping[str, RoutedModel]:
    """The catalog's models as routers see them, then its aliases (R-8.7): each the target's
    entry under the alias's name, with `alias_of` naming the target; and its LoRA adapters
    (R-8.8): each its base's entry under its own name, which is also the name the engine serves
    it by, with `adapter_of` naming the base and no fallbacks of its own, `loadable` where the
    base's replicas load adapters while they run (vLLM)."""
    models = {
        name: RoutedModel(name=name, engine=_ENGINE_KINDS.get(type(model.engine)) if model.engine else None,
                          served_name=model.config.served_name, routing=model.config.routing,
                          on_demand=model.on_demand, fallbacks=tuple(catalog.fallback_chain(name)),
                          concurrency=model.profile.concurrency if model.profile is not None else None,
                          background_responses=model.config.background_responses,
                          responses_store=model.profile is not None and model.profile.responses_store)
        for name, model in catalog.models.items()}
    for alias in catalog.aliases.values():
        models[alias.name] = replace(models[alias.target], name=alias.name, alias_of=alias.target)
    for adapter in catalog.adapters.values():
        models[adapter.name] = replace(models[adapter.base], name=adapter.name, served_name=adapter.name,
                                       fallbacks=(), adapter_of=adapter.base,
                                       loadable=catalog.models[adapter.base].loads_adapters)
    return MappingProxyType(models)


def gateway_settings(gateway: GatewayConfig) -> GatewaySettings:
    return GatewaySettings(max_body=int(gateway.max_body), request_timeout=float(gateway.request_timeout),
                           on_demand_wait=float(gateway.on_demand_wait), queue_wait=float(gateway.queue_wait),
                           max_waiting_per_key=gateway.max_waiting_per_key, max_answer=int(gateway.max_answer),
                           request_log=gateway.request_log.enabled, request_log_sample=gateway.request_log.sample,
                           request_log_path=gateway.request_log.path, otlp_endpoint=gateway.tracing.otlp_endpoint)


def endpoint_lists(table: Mapping[str, Sequence[Endpoint]]) -> dict[str, tuple[Endpoint, ...]]:
    """model -> its endpoints, as the feed holds them (tuples)."""
    return {model: tuple(members) for model, members in table.items()}
