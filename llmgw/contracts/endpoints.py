"""Where a model can be reached: the endpoints the control plane publishes, or written in the catalog.

The contract between control plane and router: the reconciler makes `Endpoint`s of serving
replicas, the router balances over them, and models with static `endpoints:` make theirs here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from llmgw.catalog import Catalog
from llmgw.config import runtime_key_env_problem

log = logging.getLogger(__name__)

STATIC_PREFIX = "static:"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One serving replica of a model, as the router reaches it."""

    replica_id: str
    model: str  # catalog model name
    url: str  # base URL of the engine, e.g. "http://10.213.7.10:20001" (no trailing /)
    # The replica's engine key, sent upstream as Authorization: Bearer; never in a repr, so never
    # in a log line or a traceback through one.
    api_key: str | None = field(repr=False)
    draining: bool = False  # marked for a rolling move: still serving until its replacement does


def static_endpoints(catalog: Catalog) -> dict[str, list[Endpoint]]:
    """Endpoints of the models that declare `endpoints:` (R-6.10): served with no control plane.

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
                                      url=static.url.rstrip("/"), api_key=key))
        out[model.name] = endpoints
    return out
