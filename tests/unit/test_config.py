"""Inventory loading: every broken file names file, line and field, and exits 2 (R-8.2, R-9.8)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmgw.catalog import Catalog
from llmgw.cli.check import load_checked
from llmgw.config import ConfigError, load_inventory, load_inventory_text, parse_model_text
from llmgw.units import parse_duration, parse_port_range, parse_size

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
nodes:
  - name: n1
    host: 10.0.0.1
    fabric: ib-a
profiles:
  small:
    engine: vllm
    gpus: 1
models:
  - name: a
    profile: small
    weights: hf:org/a
    scaling: {min: 1, max: 2}
  - name: b
    profile: small
    weights: hf:org/b
    fallback: a
"""


def test_example_inventory_is_valid():
    inventory, _, catalog = load_checked(ROOT / "inventory.example.yaml")
    assert {n.fabric for n in inventory.nodes} >= {"ib-a", "ib-b"}
    assert catalog.models["qwen-coder-32b"].on_demand
    assert catalog.models["qwen-coder-32b"].fallback == "qwen-small"
    assert catalog.profiles["h100-2x8"].nodes == 2
    assert {p.engine for p in catalog.profiles.values()} == {"vllm", "sglang", "llama-server"}


def test_good_inventory_fills_in_max():
    inventory, doc = load_inventory_text(GOOD, "inv.yaml")
    catalog = Catalog.from_inventory(inventory, doc)
    assert catalog.models["b"].max_replicas == 1
    assert catalog.models["a"].max_replicas == 2
    assert catalog.models["a"].declared_in == "file"


def test_evictable_is_as_set_else_on_demand_models_only():
    inventory, doc = load_inventory_text(_variant("{min: 1, max: 2}", "{min: 1, max: 2, evictable: true}")
                                         + "    scaling: {min: 0}\n", "inv.yaml")
    catalog = Catalog.from_inventory(inventory, doc)
    assert catalog.models["a"].evictable is True
    assert catalog.models["b"].evictable is True  # on demand, evictable not set
    inventory, doc = load_inventory_text(GOOD, "inv.yaml")
    assert Catalog.from_inventory(inventory, doc).models["a"].evictable is False  # min 1, not set


def test_scaling_defaults_and_values():
    inventory, doc = load_inventory_text(_variant("{min: 1, max: 2}", "{min: 1, max: 4, target: 1.5, up_delay: 10s, "
                                                                      "down_delay: 2m}"), "inv.yaml")
    scaling = inventory.models[0].scaling
    assert (scaling.target, scaling.up_delay, scaling.down_delay) == (1.5, 10, 120)
    # Unset: 2 requests in flight per replica, 30 s up, 10 min down.
    default = inventory.models[1].scaling
    assert (default.target, default.up_delay, default.down_delay) == (2.0, 30.0, 600.0)
    catalog = Catalog.from_inventory(inventory, doc)
    assert catalog.models["a"].scales and not catalog.models["b"].scales


def _variant(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


BROKEN = [
    pytest.param("nodes:\n  - name: n1\n    host: [unclosed\nprofiles: {}\n", 4,
                 "not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence started on line 3)",
                 id="bad-yaml"),
    pytest.param(_variant("    fabric: ib-a\n", "    fabirc: ib-a\n"), 4, "nodes[0].fabirc: unknown field",
                 id="unknown-key"),
    pytest.param(_variant("    profile: small\n    weights: hf:org/a", "    profile: large\n    weights: hf:org/a"),
                 11, "models[0].profile: unknown profile 'large'", id="missing-profile"),
    pytest.param(_variant("    weights: hf:org/a\n", "    weights: hf:org/a\n    fallback: b\n"), 13,
                 "models[0].fallback: fallbacks form a cycle: a -> b -> a", id="fallback-cycle"),
    pytest.param(_variant("fallback: a", "fallback: zzz"), 17, "models[1].fallback: fallback 'zzz' is not a model",
                 id="missing-fallback"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 3, max: 2}"), 13, "models[0].scaling: max (2) must be >= min (3)",
                 id="max-below-min"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, evictable: sometimes}"), 13,
                 "models[0].scaling.evictable: Input should be a valid boolean", id="evictable-not-a-bool"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, target: 0}"), 13,
                 "models[0].scaling.target: Input should be greater than 0", id="zero-target"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, target: lots}"), 13,
                 "models[0].scaling.target: Input should be a valid number", id="bad-target"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, up_delay: soon}"), 13,
                 "models[0].scaling.up_delay: 'soon' is not a duration", id="bad-up-delay"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, down_delay: -5}"), 13,
                 "models[0].scaling.down_delay: a duration cannot be negative", id="negative-down-delay"),
    pytest.param(_variant("{min: 1, max: 2}", "{min: 1, max: 2, up_dealy: 5s}"), 13,
                 "models[0].scaling.up_dealy: unknown field", id="misspelt-scaling-field"),
    pytest.param(_variant("  - name: b\n", "  - name: a\n"), 14, "models[1].name: model 'a' is already declared",
                 id="duplicate-model"),
    pytest.param(_variant("    gpus: 1\n", "    gpus: 1\n    start_timeout: soon\n"), 9,
                 "profiles.small.start_timeout: 'soon' is not a duration", id="bad-duration"),
    pytest.param(_variant("    engine: vllm\n", "    engine: tgi\n"), 7, "profiles.small.engine: unknown engine 'tgi'",
                 id="unknown-engine"),
    pytest.param(_variant("    host: 10.0.0.1\n", ""), 2, "nodes[0]: an ssh node needs a host", id="node-without-host"),
    pytest.param(_variant("weights: hf:org/b", "weights: http://plain.example/b.gguf"), 16,
                 "models[1].weights: 'http://plain.example/b.gguf': weights are fetched over https:// only",
                 id="plain-http-weights"),
    pytest.param(_variant("    gpus: 1\n", "    gpus: -1\n"), 8, "profiles.small.gpus: Input should be greater than",
                 id="negative-gpus"),
    pytest.param(_variant("    host: 10.0.0.1\n", "    host: 10.0.0.1\n    host: 10.0.0.2\n"), 4,
                 "duplicate key 'host'", id="duplicate-key"),
    pytest.param(_variant("    weights: hf:org/a\n", "    weights: ../../etc\n"), 12,
                 "models[0].weights: '../../etc': a weights path may not climb", id="weights-traversal"),
    pytest.param(_variant("  - name: n1\n", "  - name: n1\n    ports: 30000-20000\n"), 3,
                 "nodes[0].ports: port range 30000-20000 must lie within", id="bad-port-range"),
]


def assert_refused(tmp_path, text: str, line: int, message: str) -> None:
    """The inventory `text` is refused naming its file, the line and the message."""
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_checked(path)
    rendered = str(info.value)
    assert rendered.startswith(f"{path}:{line}: "), rendered
    assert message in rendered, rendered


@pytest.mark.parametrize("text,line,message", BROKEN)
def test_broken_inventory_names_file_line_and_field(tmp_path, text, line, message):
    assert_refused(tmp_path, text, line, message)


@pytest.mark.parametrize("text,line,message", BROKEN[:3])
def test_check_command_exits_2_with_the_message(tmp_path, text, line, message):
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i", str(path), "--no-connect"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert f"{path}:{line}: " in result.stderr
    assert message in result.stderr


def test_check_command_passes_on_the_example():
    result = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "check", "-i",
                             str(ROOT / "inventory.example.yaml"), "--no-connect"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout


EMPTY = [pytest.param("", id="empty"), pytest.param("\n  \n", id="blank-lines"),
         pytest.param("# nodes: none yet\n# models: later\n", id="only-comments"),
         pytest.param("null\n", id="null"), pytest.param("---\n~\n", id="tilde")]


@pytest.mark.parametrize("text", EMPTY)
def test_empty_inventory_is_refused_as_empty(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_checked(path)
    assert str(info.value).startswith(f"{path}: the file is empty"), str(info.value)


@pytest.mark.parametrize("command", [pytest.param(["check", "--no-connect"], id="check"),
                                     pytest.param(["serve"], id="serve")])
def test_empty_inventory_exits_2_naming_the_file(tmp_path, command):
    path = tmp_path / "empty.yaml"
    path.write_text("# to be filled in\n")
    result = subprocess.run([sys.executable, "-m", "llmgw.cli.main", *command, "-i", str(path),
                             "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{path}: the file is empty" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_inventory(tmp_path / "absent.yaml")


def test_model_file_uses_the_same_class():
    model, _ = parse_model_text(textwrap.dedent("""\
        name: extra
        profile: small
        weights: hf:org/extra@v2
        scaling: {min: 0, max: 3, idle_timeout: 5m}
        """), "extra.yaml")
    assert model.scaling.idle_timeout == 300
    assert model.source.cache_name.startswith("llmgw-")
    with pytest.raises(ConfigError) as info:
        parse_model_text("name: x\nprofile: p\nscaling:\n  max: -1\n", "x.yaml")
    assert str(info.value).startswith("x.yaml:4: scaling.max:")


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("10m", 600), ("1.5h", 5400), ("250ms", 0.25), (12, 12)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text,size", [("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5TB", 15 * 10**11), (7, 7)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_port_ranges():
    assert parse_port_range("20000-20099") == (20000, 20099)
    assert parse_port_range(8000) == (8000, 8000)
    with pytest.raises(ValueError):
        parse_port_range("http")


# ---------------------------------------------------------------------------------------------
# The embedded default


@pytest.mark.parametrize("profile", ["llama-server", "vllm-cpu"])
def test_embedded_default_places_a_model_on_a_machine_without_gpus(profile):
    """A model added at runtime with a CPU profile of the embedded default lands on a node
    without GPUs; the GPU profiles do not."""
    from llmgw.catalog import Catalog
    from llmgw.config import ModelConfig, embedded_inventory
    from llmgw.control.placement import NodeView, place

    inventory = embedded_inventory()
    machine = NodeView(name="local", state="ready", fabric=None, gpu_class=None, gpus=(),
                       memory_bytes=16 * 1000**3, cache_free_bytes=100 * 1000**3, holds=frozenset())
    catalog = Catalog.build(file_models=[ModelConfig(name="m", profile=profile, weights="hf:org/m", disk_gb=1)],
                            profiles=dict(inventory.profiles))
    plan = place(catalog.models["m"], [machine], {})
    assert plan is not None and [s.node for s in plan.shards] == ["local"]
    gpu_only = Catalog.build(file_models=[ModelConfig(name="g", profile="vllm", weights="hf:org/g", disk_gb=1)],
                             profiles=dict(inventory.profiles))
    assert place(gpu_only.models["g"], [machine], {}) is None


def test_embedded_vllm_cpu_profile_lets_replicas_share_the_cores():
    """vllm-cpu runs the vllm template with unpinned OpenMP threads and a small KV cache."""
    from llmgw.config import embedded_inventory

    profile = embedded_inventory().profiles["vllm-cpu"]
    assert profile.engine == "vllm" and profile.gpus == 0
    assert profile.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert profile.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


# -- static endpoints: what a model may read from the gateway's environment (R-6.10, R-8.2) --------

RUNTIME_ENDPOINT = "name: ext\nendpoints:\n  - url: https://api.example.com/v1\n    api_key_env: {env}\n"


@pytest.mark.parametrize("env", [
    pytest.param("AWS_SECRET_ACCESS_KEY", id="any-variable"),
    pytest.param("HF_TOKEN", id="hub-token"),
    pytest.param("LLMGW_ENDPOINT_KEY_", id="prefix-alone"),
    pytest.param("llmgw_endpoint_key_x", id="lower-case"),
])
def test_a_runtime_model_names_only_endpoint_key_variables(env):
    with pytest.raises(ConfigError) as info:
        parse_model_text(RUNTIME_ENDPOINT.format(env=env), "ext.yaml")
    rendered = str(info.value)
    assert rendered.startswith("ext.yaml:4: endpoints[0].api_key_env: "), rendered
    assert "LLMGW_ENDPOINT_KEY_" in rendered


def test_a_runtime_model_may_name_an_endpoint_key_variable_and_the_inventory_any():
    model, _ = parse_model_text(RUNTIME_ENDPOINT.format(env="LLMGW_ENDPOINT_KEY_OPENAI"), "ext.yaml")
    assert model.endpoints[0].api_key_env == "LLMGW_ENDPOINT_KEY_OPENAI"
    inventory, _ = load_inventory_text("models:\n  - " + RUNTIME_ENDPOINT.format(env="OPENAI_API_KEY")
                                       .replace("\n", "\n    ").rstrip() + "\n", "inv.yaml")
    assert inventory.models[0].endpoints[0].api_key_env == "OPENAI_API_KEY"


@pytest.mark.parametrize("url, said", [
    pytest.param("https://api.example.com/v1?key=s3cr3t", "no query string", id="query"),
    pytest.param("https://api.example.com/v1?", "no query string", id="empty-query"),
    pytest.param("https://api.example.com/v1#frag", "no query string", id="fragment"),
    pytest.param("https://user:s3cr3t@api.example.com/v1", "give the endpoint's key with api_key_env", id="user-password"),
    pytest.param("https://s3cr3t@api.example.com", "give the endpoint's key with api_key_env", id="user-only"),
])
def test_a_static_endpoint_url_carries_no_query_and_no_credentials(url, said):
    with pytest.raises(ConfigError) as info:
        parse_model_text(f"name: ext\nendpoints:\n  - url: '{url}'\n", "ext.yaml")
    rendered = str(info.value)
    assert rendered.startswith("ext.yaml:3: endpoints[0].url: ") and said in rendered, rendered
    assert "s3cr3t" not in rendered
    with pytest.raises(ConfigError, match=said):
        load_inventory_text(f"models:\n  - name: ext\n    endpoints:\n      - url: '{url}'\n", "inv.yaml")


def test_a_static_endpoint_url_may_carry_an_at_sign_in_its_path():
    model, _ = parse_model_text("name: ext\nendpoints:\n  - url: 'https://api.example.com/@team/v1'\n", "ext.yaml")
    assert model.endpoints[0].url == "https://api.example.com/@team/v1"


def test_a_stored_runtime_model_reads_no_other_variable(monkeypatch, caplog):
    """A model stored before the rule keeps working, without the variable it names."""
    from llmgw.catalog import StoredModel
    from llmgw.config import ModelConfig
    from llmgw.control.feed import static_endpoints

    monkeypatch.setenv("SOME_SECRET", "s3cr3t")
    monkeypatch.setenv("LLMGW_ENDPOINT_KEY_EXT", "endpoint-key")
    stored = [ModelConfig.model_validate({"name": name, "endpoints": [{"url": "https://api.example.com",
                                                                       "api_key_env": env}]})
              for name, env in (("old", "SOME_SECRET"), ("new", "LLMGW_ENDPOINT_KEY_EXT"))]
    from_file = ModelConfig.model_validate({"name": "file", "endpoints": [{"url": "https://api.example.com",
                                                                          "api_key_env": "SOME_SECRET"}]})
    catalog = Catalog.build(file_models=[from_file], stored=[StoredModel(m, "ops") for m in stored])
    endpoints = static_endpoints(catalog)
    assert endpoints["old"][0].api_key is None
    assert endpoints["new"][0].api_key == "endpoint-key"
    assert endpoints["file"][0].api_key == "s3cr3t"
    assert "model old: endpoint https://api.example.com is used without a key" in caplog.text


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
    ("gw.example.com", False), ("", False),
])
def test_which_admin_addresses_are_loopback(host, loopback):
    from llmgw.contracts.addresses import is_loopback

    assert is_loopback(host) is loopback


# -- the cache low-water mark and pinned weights (R-5.5) -----------------------------------------

LOW_WATER = """\
gateway:
  cache_low_water: 10%
  pinned_weights:
    - hf:org/keep@v1
    - [https://files.example/a.gguf, https://files.example/b.gguf]
nodes:
  - {name: n1, host: 10.0.0.1, cache_low_water: 50GB}
  - {name: n2, host: 10.0.0.2, cache_low_water: off}
  - {name: n3, host: 10.0.0.3}
"""


def test_low_water_marks_a_node_overrides_the_gateway_and_off_turns_it_off():
    from llmgw.control.cleanup import mark_of, pinned_names
    from llmgw.weights import parse_weights

    inventory, _ = load_inventory_text(LOW_WATER, "inventory.yaml")
    marks = [mark_of(inventory.gateway, node) for node in inventory.nodes]
    assert [str(m) if m else None for m in marks] == ["50.0 GB", None, "10%"]
    assert marks[0].threshold(None) == 50 * 1000**3  # an absolute size needs no total
    assert marks[2].threshold(200 * 1000**3) == 20 * 1000**3
    assert marks[2].threshold(None) is None  # a share of an unknown size is unknown, not 0
    assert pinned_names(inventory.gateway) == {
        parse_weights("hf:org/keep@v1").cache_name,
        parse_weights(["https://files.example/a.gguf", "https://files.example/b.gguf"]).cache_name}


def test_the_clean_up_is_off_by_default():
    from llmgw.control.cleanup import mark_of

    inventory, _ = load_inventory_text(GOOD, "inventory.yaml")
    assert inventory.gateway.cache_low_water is None and inventory.gateway.pinned_weights == []
    assert mark_of(inventory.gateway, inventory.nodes[0]) is None


@pytest.mark.parametrize("text,line,message", [
    pytest.param(LOW_WATER.replace("10%", "120%"), 2,
                 "gateway.cache_low_water: '120%': a share is a number above 0 and below 100", id="share-over-100"),
    pytest.param(LOW_WATER.replace("10%", "0%"), 2, "gateway.cache_low_water: '0%': a share is", id="share-zero"),
    pytest.param(LOW_WATER.replace("10%", "lots"), 2,
                 "gateway.cache_low_water: 'lots' is not a low-water mark; write a share (10%), a size (50GB) or off",
                 id="not-a-mark"),
    pytest.param(LOW_WATER.replace("50GB", "0"), 7, "nodes[0].cache_low_water: a low-water size must be above 0",
                 id="size-zero"),
    pytest.param(LOW_WATER.replace("cache_low_water: 50GB", "cache_low_water: yes"), 7,
                 "nodes[0].cache_low_water: a low-water mark is a share (10%), a size (50GB) or off", id="boolean"),
    pytest.param(LOW_WATER.replace("hf:org/keep@v1", "models/local"), 4,
                 "gateway.pinned_weights[0]: 'models/local' is a path on the nodes, never fetched", id="pinned-path"),
    pytest.param(LOW_WATER.replace("hf:org/keep@v1", "http://plain.example/x.gguf"), 4,
                 "gateway.pinned_weights[0]: 'http://plain.example/x.gguf': weights are fetched over https:// only",
                 id="pinned-plain-http"),
    pytest.param(LOW_WATER.replace("cache_low_water: 10%", "cache_low_watr: 10%"), 2,
                 "gateway.cache_low_watr: unknown field", id="misspelt"),
])
def test_a_broken_low_water_mark_or_pin_names_file_line_and_field(tmp_path, text, line, message):
    assert_refused(tmp_path, text, line, message)


RUNTIME_BASE = "nodes: [{name: n1, host: 10.0.0.1}]\nprofiles:\n  p:\n    engine: vllm\n"


@pytest.mark.parametrize("lines, said", [
    ("    runtime: conda\n", "profiles.p.runtime: Input should be 'host', 'container' or 'venv'"),
    ("    runtime: container\n", "profiles.p: runtime: container needs an image"),
    ("    runtime: venv\n", "profiles.p: runtime: venv needs packages"),
    ("    image: vllm/vllm-openai:v0.32.0\n", "image belongs to runtime: container, not to runtime: host"),
    ("    runtime: venv\n    packages: [vllm]\n    shm_size: 1GB\n",
     "shm_size belongs to runtime: container, not to runtime: venv"),
    ("    runtime: container\n    image: x:1\n    packages: [vllm]\n",
     "packages belongs to runtime: venv, not to runtime: container"),
    ("    runtime: container\n    image: 'Bad Image'\n", "profiles.p.image: String should match pattern"),
    ("    runtime: container\n    image: x:1\n    container: lxc\n",
     "profiles.p.container: Input should be 'docker' or 'podman'"),
    ("    runtime: venv\n    packages: ['']\n", "packages and post_install are single non-empty lines"),
])
def test_a_profile_runtime_and_its_fields_are_checked_naming_the_field(lines, said):
    with pytest.raises(ConfigError) as caught:
        load_inventory_text(RUNTIME_BASE + lines, "inv.yaml")
    assert said in str(caught.value), str(caught.value)
    assert str(caught.value).startswith("inv.yaml:")


def test_each_runtime_takes_its_own_fields():
    inventory, _ = load_inventory_text(RUNTIME_BASE + (
        "    runtime: container\n"
        "    image: vllm/vllm-openai:v0.32.0@sha256:0123abcd\n"
        "    container: podman\n"
        "    pull: always\n"
        "    shm_size: 2GB\n"
        "  q:\n"
        "    engine: vllm\n"
        "    runtime: venv\n"
        '    packages: ["vllm==0.32.0"]\n'
        "    find_links: [/srv/wheels]\n"
        '    post_install: ["pip uninstall -y triton"]\n'
        "  h:\n"
        "    engine: llama-server\n"), "inv.yaml")
    p, q, h = (inventory.profiles[name] for name in "pqh")
    assert (p.runtime, p.container, p.pull, p.shm_size) == ("container", "podman", "always", 2 * 10**9)
    assert (q.runtime, q.packages, q.find_links) == ("venv", ["vllm==0.32.0"], ["/srv/wheels"])
    assert h.runtime == "host" and h.image is None
