"""A base model with LoRA adapters on a testbed node (R-8.8, R-8.6, R-5.1–R-5.3).

One CPU node, `lora`, running the engine double as vLLM. The inventory's base `tiny` (its weights
a directory of the node's model dir) has two preloaded adapters fetched over HTTPS, `lora-a` and
`lora-b` (each an adapter_config.json and its weights): both are fetched into the node's cache and sealed,
listed with their sizes in `ctl storage`, and the base is launched with `--enable-lora` and both
by name from the cache, the engine listing each with `tiny` as its parent. Then, at runtime, a
base `small` and an adapter `lora-c` from the model dir: `small` rolls onto a replica holding it
(named in its endpoint's adapters, given at launch from the model dir), `small` cannot be removed
while `lora-c` exists, and removing `lora-c` rolls `small` back to a replica without adapters.
Each of those rollouts stops at a canary, where `ctl replicas` says what each replica holds: the
old one its revision's adapters, the new one the new revision's.
Last, a runtime adapter of `tiny` outlives `tiny` in the file across a restart: not in force, said,
and removable.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.request

import pytest
import yaml

from llmgw.weights import parse_weights
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

PROFILES = {"cpu": {"engine": "vllm", "start_timeout": "60s", "max_adapters": 2, "max_lora_rank": 8}}
WAIT = 90


def adapter_files(rank: int, seed: int) -> dict[str, bytes]:
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": bytes([seed]) * 4096}


@pytest.fixture
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("lora", gpus=None, mem_gb=32, cache_mb=64)])
    yield tb
    tb.close()


def test_a_base_is_launched_with_its_adapters_fetched_sealed_and_counted(bed, tmp_path):
    node = bed["lora"]
    models_dir = node.host_path(node.models_dir)
    for base in ("tiny", "small"):
        (models_dir / base).mkdir()
        (models_dir / base / "config.json").write_text("{}")
    for name, content in adapter_files(8, 3).items():
        (models_dir / "loras" / "lora-c").mkdir(parents=True, exist_ok=True)
        (models_dir / "loras" / "lora-c" / name).write_bytes(content)
    sources = {}
    for seed, adapter in enumerate(("lora-a", "lora-b"), 1):
        sources[adapter] = [bed.weights.add(f"{adapter}/{name}", content=content)
                            for name, content in adapter_files(8, seed).items()]
    cache_names = {name: parse_weights(urls).cache_name for name, urls in sources.items()}
    models = [{"name": "tiny", "profile": "cpu", "weights": "tiny"},
              {"name": "lora-b", "base": "tiny", "adapter": sources["lora-b"], "preload": True},
              {"name": "lora-a", "base": "tiny", "adapter": sources["lora-a"], "preload": True}]
    inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=models, profiles=PROFILES)
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    ctl = Ctl(gateway)
    cache = node.host_path(node.cache_dir)

    def replicas(model, serving=True):
        return [r for r in ctl.json("replicas")["replicas"]
                if r["model"] == model and r["serving"] == serving and not r["retired"] and not r["retiring"]]

    def launched(model):
        """(argv, port, key) of the model's live replicas' engines, from the state database."""
        with sqlite3.connect(tmp_path / "state" / "state.db") as db:
            rows = db.execute("SELECT s.argv, s.port, r.api_key, r.id FROM shards s JOIN replicas r ON s.replica_id = r.id "
                              "WHERE r.model = ?", [model]).fetchall()
        live = {r["id"] for r in replicas(model)}
        return [(json.loads(argv), port, key) for argv, port, key, rid in rows if rid in live]

    def engine_models(port, key):
        request = urllib.request.Request(f"http://{node.address}:{port}/v1/models",
                                         headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return {m["id"]: m for m in json.load(answer)["data"]}

    def held_as_canary(model, old):
        """Once the model's rollout holds at its canary, the old replica (id `old`) beside the new:
        the adapters `ctl replicas` says each holds, its revision's (R-8.8); then the canary is promoted."""
        both = wait_for(lambda: len(r := replicas(model)) == 2 and r, WAIT, f"{model}'s canary\n{gateway.log()[-3000:]}")
        ctl.ok("rollout", "promote", model)
        return {"old" if r["id"] == old else "new": r["adapters"] for r in both}

    try:
        wait_for(lambda: replicas("tiny"), WAIT, f"tiny to serve\n{gateway.log()[-3000:]}")
        [(argv, port, key)] = launched("tiny")
        lora = argv[argv.index("--enable-lora"):argv.index("--middleware")]
        assert lora == ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"lora-a={node.cache_dir}/{cache_names['lora-a']}",
                        f"lora-b={node.cache_dir}/{cache_names['lora-b']}"]
        for name in ("lora-a", "lora-b"):  # fetched whole and sealed
            entry = cache / cache_names[name]
            assert (entry / ".llmgw-complete").exists()
            assert (entry / "adapter_config.json").read_bytes() == adapter_files(8, 1)["adapter_config.json"]
        listed = engine_models(port, key)
        assert listed["lora-a"]["parent"] == "tiny" and listed["lora-b"]["parent"] == "tiny"
        assert listed["lora-a"]["root"] == f"{node.cache_dir}/{cache_names['lora-a']}"
        assert [r["adapters"] for r in replicas("tiny")] == [["lora-a", "lora-b"]]  # what ctl replicas says it holds
        holdings = wait_for(lambda: {h["model"]: h for h in ctl.json("storage")["nodes"][0]["holdings"] or []}
                            if {"lora-a", "lora-b"} <= {h["model"] for h in ctl.json("storage")["nodes"][0]
                                                        ["holdings"] or []} else None,
                            WAIT, "the adapters counted in ctl storage")
        assert holdings["lora-a"]["path"] == f"{node.cache_dir}/{cache_names['lora-a']}"
        assert holdings["lora-a"]["bytes"] >= 4096 and holdings["lora-b"]["bytes"] >= 4096
        explained = ctl.run("explain-placement", "lora-a")
        assert explained.code != 0 and "lora-a is an adapter: it runs on the replicas of its base 'tiny'" in explained.stderr
        [listed_tiny] = [m for m in ctl.json("models")["models"] if m["name"] == "tiny"]
        assert [a["name"] for a in listed_tiny["adapters"]] == ["lora-a", "lora-b"]

        # At runtime: a base, then its adapter from the model dir; the base rolls onto it.
        # A canary holds each of small's rollouts with an old and a new replica side by side.
        (tmp_path / "small.yaml").write_text("name: small\nprofile: cpu\nweights: small\nrollout: {canary: 50}\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "small.yaml"))
        [before] = wait_for(lambda: replicas("small"), WAIT, f"small to serve\n{gateway.log()[-3000:]}")
        [(plain, _, _)] = launched("small")
        assert "--enable-lora" not in plain
        (tmp_path / "lora-c.yaml").write_text("name: lora-c\nbase: small\nadapter: loras/lora-c\npreload: true\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "lora-c.yaml"))
        assert held_as_canary("small", before["id"]) == {"old": [], "new": ["lora-c"]}
        wait_for(lambda: [a for a, _, _ in launched("small") if "--enable-lora" in a] and len(replicas("small")) == 1
                 and len(launched("small")) == 1, WAIT, f"small to roll onto lora-c\n{gateway.log()[-3000:]}")
        [(argv, port, key)] = launched("small")
        assert argv[argv.index("--lora-modules") + 1] == f"lora-c={node.models_dir}/loras/lora-c"
        assert engine_models(port, key)["lora-c"]["parent"] == "small"

        refused = ctl.run("model", "remove", "small")
        assert refused.code != 0 and "is the base of the adapters lora-c; remove them first" in refused.stderr
        bad = tmp_path / "bad.yaml"
        bad.write_text("name: lora-d\nbase: lora-c\nadapter: loras/lora-c\n")
        refused = ctl.run("model", "add", "-f", str(bad))
        assert refused.code != 0 and "its base 'lora-c' is itself an adapter" in refused.stderr

        [before] = replicas("small")
        ctl.ok("model", "remove", "lora-c")
        assert held_as_canary("small", before["id"]) == {"old": ["lora-c"], "new": []}
        wait_for(lambda: len(launched("small")) == 1 and "--enable-lora" not in launched("small")[0][0],
                 WAIT, f"small to roll back without adapters\n{gateway.log()[-3000:]}")
        ctl.ok("model", "remove", "small")
        assert yaml.safe_load(inventory.read_text())["models"][1]["name"] == "lora-b"  # the file is left as it was

        # An adapter added at runtime on a base of the file, which a restart's file no longer has:
        # the gateway starts without it, says so, and `ctl model remove` forgets it.
        (tmp_path / "lora-d.yaml").write_text("name: lora-d\nbase: tiny\nadapter: loras/lora-c\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "lora-d.yaml"))
        gateway.stop()
        doc = yaml.safe_load(inventory.read_text())
        doc["models"] = []
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        gateway = GatewayProcess(inventory, tmp_path / "state").start()
        ctl = Ctl(gateway)
        assert "adapter lora-d (added at runtime) has the base tiny, which the inventory no longer has" in gateway.log()
        assert ctl.json("models")["models"] == []
        ctl.ok("model", "remove", "lora-d")
        with sqlite3.connect(tmp_path / "state" / "state.db") as db:
            assert db.execute("SELECT name FROM models").fetchall() == []
    finally:
        gateway.stop()
