"""LoRA adapters in the control plane (R-8.8): the entry, the catalog's refusals, the routed
models, the base's revision and the command lines that launch a base with its adapters."""

from __future__ import annotations

import pytest

from llmgw import revisions
from llmgw.catalog import Catalog, StoredModel
from llmgw.config import ConfigError, EngineConfig, ModelConfig, ProfileConfig, load_inventory_text
from llmgw.control.feed.routing import routed_models
from llmgw.engines import BUILTIN_ENGINES, LoRA, ShardVars

PROFILES = {"v": ProfileConfig(engine="vllm", args=["--max-model-len", "1024"], env={"HF_TOKEN": "s3cret"}),
            "l": ProfileConfig(engine="llama-server"), "s": ProfileConfig(engine="sglang", gpus=1),
            "c": ProfileConfig(engine="mine")}
ENGINES = {"mine": EngineConfig(command=["serve", "{model}"])}


def base(name="base", profile="v", **kw) -> ModelConfig:
    return ModelConfig(name=name, profile=profile, weights=kw.pop("weights", "hf:org/m"), **kw)


def adapter(name, of="base", source=None, preload=False) -> ModelConfig:
    return ModelConfig(name=name, base=of, adapter=source or f"loras/{name}", preload=preload)


def build(*models, stored=(), aliases=()):
    from llmgw.catalog import Alias
    return Catalog.build(file_models=list(models), stored=[StoredModel(m) for m in stored], profiles=PROFILES,
                         engines=ENGINES, aliases=[Alias(n, t, "file") for n, t in aliases])


# -- the entry ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    pytest.param({"profile": "v"}, "an adapter entry has no profile of its own", id="profile"),
    pytest.param({"weights": "hf:org/x"}, "an adapter entry has no weights of its own", id="weights"),
    pytest.param({"endpoints": [{"url": "http://h:1"}]}, "has no endpoints of its own", id="endpoints"),
    pytest.param({"scaling": {"min": 2}}, "has no scaling of its own", id="scaling"),
    pytest.param({"served_name": "x"}, "has no served_name of its own", id="served-name"),
])
def test_an_adapter_entry_has_nothing_of_its_own(fields, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_inventory_text("models:\n  - {name: a, base: base, adapter: loras/a, %s}\n"
                            % ", ".join(f"{k}: {v!r}".replace("'", '"') for k, v in fields.items()), "inv.yaml")
    assert str(raised.value).startswith("inv.yaml:2: models[0]:")


@pytest.mark.parametrize("fields, message", [
    pytest.param({"base": "b"}, "needs both base", id="no-source"),
    pytest.param({"adapter": "hf:org/a"}, "needs both base", id="no-base"),
    pytest.param({"base": "a", "adapter": "x"}, "cannot be its own base", id="own-base"),
    pytest.param({"base": "b", "adapter": "hf:not a repo"}, "expected hf:org/repo", id="bad-source"),
])
def test_an_adapter_entry_needs_a_base_and_a_source(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(name="a", **fields)


def test_an_adapter_source_is_parsed_like_weights():
    assert ModelConfig(name="a", base="b", adapter="hf:org/a@v1").adapter_source.canonical == "hf:org/a@v1"
    assert ModelConfig(name="a", base="b", adapter="https://h/a.gguf").adapter_source.fetched
    assert not ModelConfig(name="a", base="b", adapter="loras/a").adapter_source.fetched


@pytest.mark.parametrize("rank", [1, 8, 16, 32, 64, 128, 256, 320, 512])
def test_the_ranks_vllm_accepts(rank):
    assert ProfileConfig(engine="vllm", max_lora_rank=rank).max_lora_rank == rank


@pytest.mark.parametrize("rank", [0, 2, 12, 24, 1024])
def test_other_ranks_are_refused_with_the_list(rank):
    with pytest.raises(ValueError, match=r"choose from 1, 8, 16, 32, 64, 128, 256, 320, 512"):
        ProfileConfig(engine="vllm", max_lora_rank=rank)


def test_max_adapters_is_at_least_one():
    assert ProfileConfig(engine="vllm").max_adapters == 4
    with pytest.raises(ValueError):
        ProfileConfig(engine="vllm", max_adapters=0)


# -- the catalog --------------------------------------------------------------------------------


@pytest.mark.parametrize("models, aliases, message", [
    pytest.param([adapter("a", of="nope")], (), "its base 'nope' is not a model of the catalog", id="missing"),
    pytest.param([base(), adapter("a"), adapter("b", of="a")], (), "its base 'a' is itself an adapter",
                 id="adapter-of-adapter"),
    pytest.param([base(), adapter("a", of="chat")], (("chat", "base"),), r"its base 'chat' is an alias \(of 'base'\)",
                 id="alias"),
    pytest.param([ModelConfig(name="base", endpoints=[{"url": "http://h:1"}]), adapter("a")], (),
                 "is served by static endpoints", id="static"),
    pytest.param([base(profile="s"), adapter("a")], (), "runs engine sglang.*adapters need a base on vllm or "
                 "llama-server", id="sglang"),
    pytest.param([base(profile="c"), adapter("a")], (), "runs engine mine.*vllm or llama-server", id="custom"),
    pytest.param([base(), adapter("base2"), base(name="base2")], (), "model 'base2' is already declared",
                 id="name-taken"),
    pytest.param([base(), adapter("a")], (("a", "base"),), "alias 'a' is also the name of an adapter",
                 id="alias-name-taken"),
])
def test_catalog_refusals(models, aliases, message):
    with pytest.raises(ConfigError, match=message):
        build(*models, aliases=aliases)


def test_a_refusal_names_the_file_line_and_field():
    text = ("profiles:\n  s: {engine: sglang, gpus: 1}\nmodels:\n  - {name: base, profile: s, weights: m}\n"
            "  - name: a\n    base: base\n    adapter: loras/a\n")
    inventory, document = load_inventory_text(text, "inv.yaml")
    with pytest.raises(ConfigError) as raised:
        Catalog.from_inventory(inventory, document)
    assert str(raised.value).startswith("inv.yaml:6: models[1].base: adapter 'a': its base 'base' runs engine sglang")


def test_a_stored_adapter_is_refused_as_stored():
    with pytest.raises(ConfigError, match="stored models: a.base: adapter 'a': its base 'nope'"):
        build(base(), stored=[adapter("a", of="nope")])


def test_adapters_are_not_models_and_their_base_holds_them_by_name():
    catalog = build(base(), adapter("b"), adapter("a", source="hf:org/lora-a"), base(name="plain"))
    assert set(catalog.models) == {"base", "plain"}  # nothing to place, scale or wait on for an adapter
    assert set(catalog.adapters) == {"a", "b"}
    assert [a.name for a in catalog.models["base"].adapters] == ["a", "b"]
    assert catalog.models["plain"].adapters == ()
    assert catalog.adapters["a"].base == "base" and catalog.adapters["a"].declared_in == "file"
    # A fetched adapter's cache entry is wanted like weights are.
    assert catalog.adapters["a"].source.cache_name in catalog.wanted_cache_names()


def test_an_adapter_of_llama_server():
    catalog = build(base(profile="l", weights="m.gguf"), adapter("a", source="loras/a.gguf"))
    assert [a.name for a in catalog.models["base"].adapters] == ["a"]


def test_routed_adapters_are_served_by_their_base():
    catalog = build(base(fallback="plain"), base(name="plain"), adapter("a"))
    routed = routed_models(catalog)
    assert routed["a"].adapter_of == "base"
    assert routed["a"].served_name == "a" and routed["a"].upstream_name == "a"
    assert routed["a"].engine == "vllm" == routed["base"].engine
    assert routed["a"].fallbacks == ()
    assert routed["base"].adapter_of is None and routed["base"].fallbacks == ("plain",)


# -- the base's revision ------------------------------------------------------------------------


def test_a_base_without_adapters_keeps_its_revision_id():
    # The ids these definitions had before adapters existed.
    assert revisions.of(build(base()).get("base")) == "0416b699c2a2"
    gguf = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="m.gguf")],
                         profiles={"p": ProfileConfig(engine="llama-server")}).get("m")
    assert revisions.of(gguf) == "6c0195001862"


def test_adapter_support_and_preloaded_adapters_roll_a_vllm_base_and_loaded_ones_do_not():
    plain = revisions.of(build(base()).get("base"))
    one = revisions.of(build(base(), adapter("a")).get("base"))
    two = revisions.of(build(base(), adapter("a"), adapter("b")).get("base"))
    assert one != plain  # adapter support turned on: --enable-lora and the runtime-update environment
    assert two == one  # an adapter loaded on demand is no part of what the replicas run
    preloaded = revisions.of(build(base(), adapter("a", preload=True)).get("base"))
    moved = revisions.of(build(base(), adapter("a", source="loras/other", preload=True)).get("base"))
    assert len({one, preloaded, moved}) == 3
    assert revisions.of(build(base(), adapter("a", preload=True)).get("base")) == preloaded
    ranked = Catalog.build(file_models=[base(), adapter("a")], engines=ENGINES,
                           profiles={**PROFILES, "v": PROFILES["v"].model_copy(update={"max_lora_rank": 32})})
    assert revisions.of(ranked.get("base")) != one


def test_every_adapter_rolls_a_llama_server_base():
    def llama(*adapters):
        return revisions.of(Catalog.build(file_models=[base(profile="l", weights="m.gguf"), *adapters],
                                          profiles=PROFILES, engines=ENGINES).get("base"))
    plain, one = llama(), llama(adapter("a", source="a.gguf"))
    two = llama(adapter("a", source="a.gguf"), adapter("b", source="b.gguf"))
    assert len({plain, one, two}) == 3
    assert llama(adapter("a", source="a.gguf", preload=True)) == one  # every one is given at launch anyway


def test_preload_is_for_adapter_entries():
    with pytest.raises(ValueError, match="preload is for adapter entries"):
        ModelConfig(name="m", profile="v", weights="hf:org/m", preload=True)


def test_the_adapter_fields_of_a_llama_server_profile_launch_nothing():
    def llama(rank):
        profiles = {"l": ProfileConfig(engine="llama-server", max_lora_rank=rank)}
        return Catalog.build(file_models=[base(profile="l", weights="m.gguf"), adapter("a", source="a.gguf")],
                             profiles=profiles).get("base")
    assert revisions.of(llama(8)) == revisions.of(llama(64))


def test_a_revision_says_its_adapters_and_makes_them_again():
    model = build(base(), adapter("b", source="hf:org/b", preload=True), adapter("a", preload=True)).get("base")
    defined = revisions.definition(model)
    assert revisions.adapter_names(defined) == ("a", "b")
    assert revisions.adapter_names(revisions.definition(build(base()).get("base"))) == ()
    assert "adapters.a: \"path:loras/a\" (new)" in revisions.diff(revisions.definition(build(base()).get("base")),
                                                                   defined)
    # An undo holds the base on a revision whose adapters the catalog no longer has.
    at = revisions.model_at(build(base()).get("base"), defined, {})
    assert [(a.name, a.source.canonical) for a in at.adapters] == [("a", "path:loras/a"), ("b", "hf:org/b@main")]
    assert revisions.of(at) == revisions.of(model)


# -- command lines ------------------------------------------------------------------------------

VARS = ShardVars(model="/models/m", name="base", host="0.0.0.0", port=20000, gpus_per_node=0, nnodes=1,
                 node_rank=0, leader_addr="", leader_port=0)
LORA = LoRA(adapters=(("a", "/cache/llmgw-a"), ("b", "/models/loras/b")), max_adapters=4, max_rank=16)


def test_vllm_is_launched_with_its_adapters():
    spec = BUILTIN_ENGINES["vllm"].render(VARS, ["--max-model-len", "1024"], {}, "k", LORA)
    argv = spec.argv
    assert argv[argv.index("--enable-lora"):argv.index("--middleware")] == [
        "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "4", "--max-lora-rank", "16",
        "--lora-modules", "a=/cache/llmgw-a", "b=/models/loras/b"]
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_vllm_holds_at_least_its_adapters():
    many = LoRA(adapters=tuple((f"a{i}", f"/p/{i}") for i in range(6)), max_adapters=2, max_rank=8)
    argv = BUILTIN_ENGINES["vllm"].render(VARS, [], {}, "k", many).argv
    assert argv[argv.index("--max-loras") + 1] == "6" == argv[argv.index("--max-cpu-loras") + 1]


def test_vllm_flags_the_profile_gives_win():
    args = ["--max-loras=8", "--max-lora-rank", "64", "--enable-lora"]
    spec = BUILTIN_ENGINES["vllm"].render(VARS, args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}, "k", LORA)
    argv = spec.argv
    assert argv.count("--enable-lora") == 1 and "--max-loras" not in argv
    assert [a for a in argv if a.startswith("--max-lora-rank")] == ["--max-lora-rank"]
    assert argv[argv.index("--max-lora-rank") + 1] == "64"
    assert argv[argv.index("--max-cpu-loras") + 1] == "8"  # never below --max-loras: vLLM exits then
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "0"


def test_vllm_without_adapters_is_launched_as_before():
    spec = BUILTIN_ENGINES["vllm"].render(VARS, [], {}, "k")
    assert not any("lora" in a for a in spec.argv) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in spec.env


def test_llama_server_is_launched_with_its_adapters_in_order():
    argv = BUILTIN_ENGINES["llama-server"].render(VARS, [], {}, "k", LORA).argv
    assert argv[argv.index("--metrics") + 1:] == ["--lora", "/cache/llmgw-a", "--lora", "/models/loras/b",
                                                  "--lora-init-without-apply", "--cache-ram", "0"]


def test_llama_server_flags_the_profile_gives_win():
    argv = BUILTIN_ENGINES["llama-server"].render(VARS, ["--cache-ram", "512", "--lora-init-without-apply"], {},
                                                  "k", LORA).argv
    assert argv.count("--cache-ram") == 1 and argv[argv.index("--cache-ram") + 1] == "512"
    assert argv.count("--lora-init-without-apply") == 1
    assert argv.count("--lora") == 2


@pytest.mark.parametrize("engine, words", [("vllm", 2), ("llama-server", 1)])
def test_the_adapter_flags_are_flags_of_the_real_engine(engine, words):
    from tests.unit.test_engine_flags import double
    argv = BUILTIN_ENGINES[engine].render(VARS, [], {}, "k", LORA).argv
    assert double.unknown_flags(engine, argv[words:]) == []


# -- what a replica holds, and the cache entries it keeps -----------------------------------------


def test_a_replicas_endpoint_says_the_adapters_of_its_revision_and_keeps_their_entries():
    from llmgw.config import NodeConfig
    from llmgw.control.rollouts import RolloutMemory
    from llmgw.control.state import SERVING, Records, Replica, Shard

    old = build(base(), adapter("b", source="hf:org/b", preload=True), adapter("a", source="hf:org/a", preload=True))
    new = build(base(), adapter("c", source="hf:org/c", preload=True))  # a and b removed, c added: the base rolls
    memory = RolloutMemory()
    memory.note(old.get("base"), 0.0)
    records = Records(revision_adapters=memory.adapters)
    shard = Shard("r1-0", "r1", 0, "n1", (), state=SERVING, port=20001)
    replica = Replica("r1", "base", "k", [shard], revision=revisions.of(old.get("base")), serving_since=1.0)
    records.replicas["r1"] = replica
    nodes = {"n1": NodeConfig(name="n1", host="10.0.0.1")}
    [endpoint] = records.endpoints(nodes)["base"]
    assert endpoint.adapters == ("a", "b")  # what its engine was launched with, not the catalog's c
    kept = records.cache_in_use(new.models, "n1", memory.cache_names)
    assert {old.adapters["a"].source.cache_name, old.adapters["b"].source.cache_name,
            new.adapters["c"].source.cache_name} <= kept
    assert records.cache_in_use(new.models, "n2", memory.cache_names) == set()


# -- the engine double refuses what the real engines refuse at start ----------------------------


def _adapter_dir(root, name, rank):
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": %d}' % rank)
    return folder


@pytest.mark.parametrize("extra, refusal", [
    pytest.param(["--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras (1) must be >= max_loras (2).",
                 id="cpu-loras-below-loras"),
    pytest.param(["--max-lora-rank", "8", "--lora-modules", "big={big}"], "LoRA rank 32 is greater than max_lora_rank 8",
                 id="rank-above"),
    pytest.param(["--lora-modules", "gone={root}/gone"], "No adapter found for {root}/gone", id="missing"),
    pytest.param(["--lora-modules", "small={small}"], None, id="fits"),
])
def test_the_double_refuses_vllm_adapters_as_vllm_does(tmp_path, extra, refusal):
    from tests.unit.test_engine_flags import double
    paths = {"root": tmp_path, "big": _adapter_dir(tmp_path, "big", 32), "small": _adapter_dir(tmp_path, "small", 8)}
    argv = ["serve", "/m", "--enable-lora", *(a.format(**paths) for a in extra)]
    found = double.Engine("vllm", argv, {}).lora_refusal()
    assert found == refusal if refusal is None else refusal.format(**paths) in found


def test_the_double_refuses_a_rank_vllm_does_not_offer():
    from tests.unit.test_engine_flags import double
    with pytest.raises(double.UsageError, match="invalid choice: 12"):
        double.Engine("vllm", ["serve", "/m", "--max-lora-rank", "12"], {})


def test_the_double_refuses_a_missing_llama_server_adapter(tmp_path):
    from tests.unit.test_engine_flags import double
    present = tmp_path / "a.gguf"
    present.write_bytes(b"GGUF")
    engine = double.Engine("llama-server", ["-m", "/m.gguf", "--lora", str(present), "--lora", str(tmp_path / "b.gguf")],
                           {})
    assert engine.lora_files == [str(present), str(tmp_path / "b.gguf")]
    assert engine.lora_refusal() == f"failed to load lora adapter '{tmp_path / 'b.gguf'}'"


@pytest.mark.parametrize("adapter_lines, line, message", [
    pytest.param("    base: big\n    adapter: loras/a\n", 7, "models[1].base: adapter 'a': its base 'big' runs engine sglang",
                 id="engine"),
    pytest.param("    base: nope\n    adapter: loras/a\n", 7, "models[1].base: adapter 'a': its base 'nope' is not a model",
                 id="missing-base"),
    pytest.param("    base: small\n    adapter: loras/a\n    profile: v\n", 6,
                 "models[1]: an adapter entry has no profile of its own", id="own-profile"),
])
def test_llmgw_check_reports_adapter_refusals(tmp_path, adapter_lines, line, message):
    import subprocess
    import sys
    path = tmp_path / "inventory.yaml"
    path.write_text("profiles:\n  v: {engine: vllm}\n  s: {engine: sglang, gpus: 1}\nmodels:\n"
                    "  - {name: big, profile: s, weights: m}\n"
                    "  - name: a\n" + adapter_lines + "  - {name: small, profile: v, weights: m}\n")
    result = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i", str(path), "--no-connect"],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stdout
    assert f"{path}:{line}: {message}" in result.stderr


def test_llmgw_check_counts_adapters(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "inventory.yaml"
    path.write_text("profiles:\n  v: {engine: vllm}\nmodels:\n  - {name: small, profile: v, weights: m}\n"
                    "  - {name: a, base: small, adapter: loras/a}\n")
    result = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i", str(path), "--no-connect"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1 models, 1 adapters" in result.stdout
