"""Catalog: built only through validation, immutable, swapped atomically (R-8.1, R-6.7, R-8.5)."""

from __future__ import annotations

import threading

import pytest

from llmgw.catalog import Catalog, CatalogHolder, StoredModel
from llmgw.config import ConfigError, ModelConfig, ProfileConfig

PROFILES = {"p": ProfileConfig(engine="vllm", gpus=1)}


def model(name, **kw) -> ModelConfig:
    return ModelConfig(name=name, profile=kw.pop("profile", "p"), weights=kw.pop("weights", f"hf:org/{name}"), **kw)


def test_catalog_cannot_be_made_without_build():
    with pytest.raises(TypeError, match="Catalog.build"):
        Catalog(_token=None, models={}, profiles={}, engines={}, version=1)


def test_catalog_is_immutable():
    catalog = Catalog.build(file_models=[model("a")], profiles=PROFILES)
    with pytest.raises(AttributeError):
        catalog.version = 2
    with pytest.raises(TypeError):
        catalog.models["b"] = catalog.models["a"]  # type: ignore[index]


def test_inventory_and_stored_models_are_merged():
    catalog = Catalog.build(file_models=[model("a")], stored=[StoredModel(model("b"), actor="alice")],
                            profiles=PROFILES)
    assert catalog.models["a"].declared_in == "file"
    assert catalog.models["b"].declared_in == "store"
    assert catalog.models["b"].actor == "alice"


@pytest.mark.parametrize("stored,message", [
    pytest.param([model("a")], "model 'a' is already declared in the inventory file", id="collision"),
    pytest.param([model("b", profile="nope")], "unknown profile 'nope'", id="unknown-profile"),
    pytest.param([model("b", fallback="zzz")], "fallback 'zzz' is not a model", id="missing-fallback"),
    pytest.param([model("b", fallback="b")], "cannot be its own fallback", id="self-fallback"),
])
def test_stored_model_refusals(stored, message):
    with pytest.raises(ConfigError, match=message):
        Catalog.build(file_models=[model("a")], stored=[StoredModel(m) for m in stored], profiles=PROFILES)


def test_fallback_cycle_of_three_is_refused():
    models = [model("a", fallback="b"), model("b", fallback="c"), model("c", fallback="a")]
    with pytest.raises(ConfigError, match="a -> b -> c -> a"):
        Catalog.build(file_models=models, profiles=PROFILES)


def test_fallback_chain_and_on_demand():
    catalog = Catalog.build(file_models=[model("a", fallback="b", scaling={"min": 0, "max": 4}),
                                         model("b", fallback="c"), model("c")], profiles=PROFILES)
    assert catalog.fallback_chain("a") == ["b", "c"]
    assert catalog.models["a"].on_demand and catalog.models["a"].max_replicas == 4
    assert not catalog.models["b"].on_demand


def test_multi_node_profile_needs_a_multi_node_engine():
    with pytest.raises(ConfigError, match="engine llama-server has no multi-node mode"):
        Catalog.build(profiles={"p": ProfileConfig(engine="llama-server", gpus=1, nodes=2)})


def test_wanted_cache_names_are_exact():
    catalog = Catalog.build(file_models=[model("a"), model("local", weights="llama/7b")], profiles=PROFILES)
    assert catalog.wanted_cache_names() == {catalog.models["a"].source.cache_name}


def test_holder_swap_is_atomic_for_readers():
    """Readers always see one whole catalog, never a mix, while writers swap."""
    catalogs = [Catalog.build(file_models=[model(f"m{i}")], profiles=PROFILES, version=i) for i in range(50)]
    holder = CatalogHolder(catalogs[0])
    seen = []
    errors = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            current = holder.current
            names = list(current.models)
            if names != [f"m{current.version}"]:
                errors.append((current.version, names))
            seen.append(current.version)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for catalog in catalogs[1:]:
        holder.swap(catalog)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert holder.current.version == 49


def test_holder_tells_subscribers():
    a = Catalog.build(file_models=[model("a")], profiles=PROFILES)
    b = Catalog.build(file_models=[model("b")], profiles=PROFILES, version=2)
    holder = CatalogHolder(a)
    got = []
    holder.subscribe(got.append)
    assert holder.swap(b) is a
    assert got == [b]
