"""Router feed messages for tests: a Snapshot made from a catalog and a store as the control plane makes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from llmgw.catalog import Catalog
from llmgw.config import GatewayConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import KeyEntry, Snapshot
from llmgw.control.feed import gateway_settings, routed_models, static_endpoints
from llmgw.keys import key_entries
from llmgw.store import Store


def snapshot(catalog: Catalog, store: Store | None = None, endpoints: Mapping[str, Sequence[Endpoint]] | None = None,
             gateway: GatewayConfig | None = None, *, keys: Sequence[KeyEntry] | None = None, epoch: str = "test",
             version: int = 1) -> Snapshot:
    """Models and static endpoints from `catalog`, the keys in force from `store` (or `keys`),
    `endpoints` as the reconciler would push them."""
    lists = {model: tuple(members) for model, members in (endpoints or {}).items()}
    lists.update({model: tuple(members) for model, members in static_endpoints(catalog).items()})
    if keys is None:
        keys = store.read_sync(key_entries) if store is not None else ()
    return Snapshot(epoch=epoch, version=version, models=routed_models(catalog), endpoints=MappingProxyType(lists),
                    keys=tuple(keys), gateway=gateway_settings(gateway or GatewayConfig()))
