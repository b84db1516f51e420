"""A model's revision: what changes it, what does not, and what a diff shows (R-8.6)."""

from __future__ import annotations

from llmgw import revisions
from llmgw.catalog import Catalog
from llmgw.config import EngineConfig, ModelConfig, ProfileConfig


def model(profile: dict | None = None, engines: dict | None = None, **fields):
    profile = {"engine": "vllm", "args": ["--max-model-len", "1024"], "env": {"HF_TOKEN": "s3cret"}, **(profile or {})}
    config = ModelConfig(name="m", profile=fields.pop("profile_name", "p"), weights="hf:org/m", **fields)
    return Catalog.build(file_models=[config], profiles={config.profile: ProfileConfig(**profile)},
                         engines=engines).get("m")


def test_r8_6_what_runs_makes_a_revision():
    base = revisions.of(model())
    assert base is not None and len(base) == revisions.ID_LENGTH
    assert revisions.of(model()) == base  # stable
    for changed in (model({"args": ["--max-model-len", "2048"]}), model({"env": {"HF_TOKEN": "other"}}),
                    model({"gpus": 1}), model({"runtime": "venv", "packages": ["vllm==0.32.0"]}),
                    model(served_name="other"), model({"engine": "llama-server"})):
        assert revisions.of(changed) != base
    weights = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m@v2")],
                            profiles={"p": ProfileConfig(engine="vllm", args=["--max-model-len", "1024"],
                                                         env={"HF_TOKEN": "s3cret"})}).get("m")
    assert revisions.of(weights) != base


def test_r8_6_what_applies_in_place_is_not_a_revision():
    base = revisions.of(model())
    for same in (model({"concurrency": 8}), model({"start_timeout": 60}), model(scaling={"min": 2, "max": 4}),
                 model(routing="prefix"), model(profile_name="renamed")):
        assert revisions.of(same) == base


def test_r8_6_a_custom_engines_templates_are_part_of_it():
    def custom(command):
        return model({"engine": "mine"}, engines={"mine": EngineConfig(command=command)})
    assert revisions.of(custom(["serve", "{model}"])) != revisions.of(custom(["serve2", "{model}"]))


def test_r8_6_a_diff_names_environment_variables_never_their_values():
    old = revisions.definition(model())
    new = revisions.definition(model({"env": {"HF_TOKEN": "n3w", "EXTRA": "x1"}, "args": ["--a"]}))
    lines = revisions.diff(old, new)
    assert "profile.env.HF_TOKEN: changed" in lines and "profile.env.EXTRA: added" in lines
    assert 'profile.args: ["--max-model-len", "1024"] -> ["--a"]' in lines
    assert not any(secret in line for line in lines for secret in ("s3cret", "n3w", "x1"))
    assert revisions.diff(old, old) == []
    assert revisions.of(Catalog.build(file_models=[ModelConfig(name="s", endpoints=[{"url": "http://e:1"}])]).get("s")) is None


def test_r8_6_a_model_made_again_at_an_earlier_revision():
    old = model({"args": ["--a"], "concurrency": 4})
    now = model({"args": ["--b"], "concurrency": 9}, scaling={"min": 3})
    back = revisions.model_at(now, revisions.definition(old), Catalog.build().engines)
    assert revisions.of(back) == revisions.of(old) != revisions.of(now)
    assert back.profile.args == ["--a"] and back.profile.concurrency == 9 and back.min_replicas == 3
    assert back.source == old.source
    for weights in ("hf:org/m@v3", "https://example.com/m.gguf", ["https://e/a", "https://e/b"], "models/m"):
        then = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights=weights)],
                             profiles={"p": ProfileConfig(engine="vllm")}).get("m")
        assert revisions.of(revisions.model_at(now, revisions.definition(then), {})) == revisions.of(then)
    custom = model({"engine": "mine"}, engines={"mine": EngineConfig(command=["serve", "{model}"])})
    assert revisions.of(revisions.model_at(now, revisions.definition(custom), {})) == revisions.of(custom)
