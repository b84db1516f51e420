"""What a model's target revision is, and an undo's hold (R-8.6, R-4.13)."""

from __future__ import annotations

from llmgw import revisions
from llmgw.catalog import Catalog
from llmgw.control.rollouts import RolloutMemory, load, save_rollout, save_revision
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.store import Store


def catalog(args: list[str]) -> Catalog:
    return Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m")],
                         profiles={"p": ProfileConfig(engine="vllm", args=args)})


def test_r8_6_revisions_are_numbered_in_the_order_a_model_had_them():
    memory = RolloutMemory()
    first, second = catalog(["--a"]).get("m"), catalog(["--b"]).get("m")
    assert memory.note(first, 1.0).number == 1
    assert memory.note(first, 2.0) is None  # known
    assert memory.note(second, 3.0).number == 2
    assert memory.number("m", revisions.of(first)) == 1 and memory.number("m", "nope") is None


def test_r4_13_an_undo_holds_the_model_while_the_catalog_defines_what_it_undid():
    memory = RolloutMemory()
    v1, v2, v3 = (catalog([arg]) for arg in ("--a", "--b", "--c"))
    for c in (v1, v2):
        memory.note(c.get("m"), 0.0)
    r1, r2 = revisions.of(v1.get("m")), revisions.of(v2.get("m"))
    assert memory.target(v2.get("m"), v2)[0] == r2
    rollout = memory.start("m", r1, r2, 10.0, actor="ops")
    memory.update(rollout, held_over=r2)
    target, launch = memory.target(v2.get("m"), v2)  # the file still says v2: held on v1
    assert target == r1 and revisions.of(launch) == r1 and launch.profile.args == ["--a"]
    assert memory.target(v3.get("m"), v3)[0] == revisions.of(v3.get("m"))  # a new definition ends the hold


def test_r4_13_revisions_and_rollouts_survive_in_the_store(tmp_path):
    store = Store.open(tmp_path / "state.db")
    memory = RolloutMemory()
    revision = memory.note(catalog(["--a"]).get("m"), 1.0)
    rollout = memory.start("m", revision.id, None, 2.0)
    rollout = memory.update(rollout, paused="replica r1 failed: health timeout", canary=25)
    store.write_sync(lambda db: (save_revision(db, revision), save_rollout(db, rollout)))
    again = RolloutMemory()
    again.adopt(*store.read_sync(load))
    assert again.revisions == memory.revisions and again.rollouts == memory.rollouts


def test_r4_13_a_replica_of_an_earlier_revision_keeps_its_weights_in_use():
    from llmgw.control.state import Records, Replica, Shard
    memory = RolloutMemory()
    old = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m@v1")],
                        profiles={"p": ProfileConfig(engine="vllm")})
    new = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m@v2")],
                        profiles={"p": ProfileConfig(engine="vllm")})
    memory.note(old.get("m"), 0.0)
    records = Records()
    replica = Replica("r1", "m", "k", [Shard("r1-0", "r1", 0, "a", ())], revision=revisions.of(old.get("m")))
    records.replicas["r1"] = replica
    assert records.cache_in_use(new.models, "a") == {new.get("m").source.cache_name}
    assert records.cache_in_use(new.models, "a", memory.cache_names) == {new.get("m").source.cache_name,
                                                                         old.get("m").source.cache_name}


def test_r8_6_a_rollouts_status_names_what_changed_never_an_environment_value():
    from llmgw.control.rollouts import status
    memory = RolloutMemory()
    old = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m")],
                        profiles={"p": ProfileConfig(engine="vllm", env={"TOKEN": "s3cret"})})
    new = Catalog.build(file_models=[ModelConfig(name="m", profile="p", weights="hf:org/m")],
                        profiles={"p": ProfileConfig(engine="vllm", env={"TOKEN": "n3w"}, args=["--a"])})
    a, b = memory.note(old.get("m"), 0.0), memory.note(new.get("m"), 1.0)
    memory.start("m", b.id, a.id, 2.0)
    shown = status(memory, new.get("m"), new, [])
    assert shown["changes"] == ['profile.args: [] -> ["--a"]', "profile.env.TOKEN: changed"]
    assert "s3cret" not in str(shown) and "n3w" not in str(shown)
