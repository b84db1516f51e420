"""A rollout in progress survives a control-plane restart (R-4.13, R-8.6, R-4.5).

Two replicas of a model on three single-GPU nodes (one spare for the surge), the official openai
client sending plain requests and streams throughout. The engine doubles take several seconds to
start, so that a rollout is caught in the middle:
1. the model's arguments change; once the first replica of the new revision is starting (or
   serving beside an old one), `llmgw serve` gets SIGTERM and is started again: the rollout goes
   on towards the same target from the same previous revision, every adopted replica keeps its
   revision, and it ends with both replicas on the target;
2. the same in a second rollout with SIGKILL;
3. the model's weights change (a slow download): a restart while the first replica of the new
   revision is still fetching them cuts its start short, which is not a failure: the rollout goes
   on without pausing, and that start is made again;
4. a fourth rollout is paused by the operator in the middle; after a restart it is still paused
   (nothing launched or retired), and `ctl rollout resume` finishes it.
Not one request may fail in all of it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from llmgw.weights import parse_weights
from tests.integration.gateway import wait_for
from tests.scenarios.harness import MODEL, NODES, PLAIN_TOKENS, START_TIMEOUT, STREAM_TOKENS, TOKEN_DELAY, running_fleet
from tests.scenarios.test_rollout import all_on, live, rollout, set_args
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

WAIT = START_TIMEOUT * 4
SLOW_START = 6.0  # seconds an engine double takes to load here: a restart lands in the middle of a rollout
SLOW_REPO, SLOW_BYTES, SLOW_RATE = "org/tiny-v2", 2 << 20, 256 << 10  # weights fetched in about 8 s


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path) as fleet:
        yield fleet


def set_weights(fleet, weights: str) -> None:
    doc = yaml.safe_load(fleet.inventory.read_text())
    doc["models"][0]["weights"] = weights
    fleet.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    done = fleet.ctl("reload")
    assert done.code == 0, done.stdout + done.stderr


def launched(replica: dict) -> bool:
    """Its node answered the launch of every shard (a pid): what a restart adopts (R-4.4). A start
    whose answer is not in yet is made again after a restart, not adopted."""
    return all(shard.get("pid") for shard in replica["shards"])


def caught_mid_rollout(fleet, target: str, when: str = "starting") -> list[dict] | None:
    """The live replicas once one of `target` is in state `when` (starting — launched, its node's
    answer in —, or serving, while one of another revision still runs): a rollout under way."""
    replicas = live(fleet)
    new = [r for r in replicas if r["revision"] == target]
    old = [r for r in replicas if r["revision"] != target]
    if old and any((r["state"] == when and (when != "starting" or launched(r))) or (when == "starting" and r["serving"])
                   for r in new):
        return replicas
    return None


def revisions_of(replicas: list[dict]) -> dict[str, str]:
    return {r["id"]: r["revision"] for r in replicas}


def listed(fleet) -> list[dict]:
    """The live replicas as `ctl replicas --json` lists them."""
    return [r for r in fleet.ctl_json("replicas")["replicas"] if not (r["retired"] or r["retiring"])]


def engine_argv(fleet, replica: dict) -> list[str]:
    engine = fleet.engine_of(replica)
    assert engine is not None, replica
    return [a.decode() for a in Path(f"/proc/{engine.pid}/cmdline").read_bytes().split(b"\0") if a]


def restarted(fleet, how: str) -> None:
    """Stop `llmgw serve` (SIGTERM: `term`, SIGKILL: `kill`) and start it again; the router
    workers serve on meanwhile."""
    if how == "term":
        assert fleet.gateway.stop_serve() == 0, fleet.log_tail()
    else:
        fleet.gateway.kill()
    fleet.start()


def adopted(fleet, before: dict[str, str]) -> dict[str, str]:
    """The revisions of the replicas the restarted control plane lists, once it lists the ones it
    adopted that are still live (an old one may have been retired meanwhile)."""
    def some_listed():
        now = revisions_of(listed(fleet))
        return now if any(rid in now for rid in before) else None
    return wait_for(some_listed, 60, f"the adopted replicas {sorted(before)} listed\n{fleet.log_tail()}", interval=0.2)


def roll_through_a_restart(fleet, traffic: Traffic, previous: str, change, how: str, timings: list,
                           when: str = "starting") -> str:
    """Change the model (`change(fleet)`), restart serve once a replica of the new revision is in
    state `when`, check the rollout goes on and ends with every replica on its target; returns the
    target."""
    started = time.time()
    change(fleet)
    status = wait_for(lambda: (s := rollout(fleet))["target"]["id"] != previous and s, WAIT, "the new revision")
    assert status["state"] == "rolling" and status["previous"]["id"] == previous, status
    target = status["target"]["id"]
    # The admin API answers what `ctl replicas --json` prints, without a process's start-up.
    caught = wait_for(lambda: caught_mid_rollout(fleet, target, when), WAIT,
                      f"a replica of {target} {when} beside an old one\n{fleet.log_tail()}", interval=0.1)
    before = revisions_of(caught)
    newcomers = {r["id"] for r in caught if r["revision"] == target and (when != "starting" or launched(r))}
    cut_short = {r["id"] for r in caught if r["revision"] == target and r["state"] == when}
    log_from = len(fleet.gateway.log())
    restarted_at = time.time()
    restarted(fleet, how)
    after = adopted(fleet, before)
    again = rollout(fleet)
    print(f"   {how}: replicas {before} -> {after}; rollout {status['state']} -> {again['state']}")
    assert again["target"] == status["target"] and again["previous"] == status["previous"], (status, again)
    assert again["started_at"] == status["started_at"], "the same rollout, not a new one"
    assert again["state"] in ("rolling", "done"), again
    kept = {rid: revision for rid, revision in after.items() if rid in before}
    assert kept == {rid: before[rid] for rid in kept}, f"adopted replicas changed revision: {before} -> {after}"
    assert all(revision in (previous, target) for revision in after.values()), after
    if when == "starting":
        assert newcomers and newcomers <= after.keys(), \
            f"the replica of {target} starting at the restart was not adopted: {before} -> {after}"
    else:  # its start was cut short: stopped (not failed, so not listed among the failed) and made again
        assert newcomers - cut_short <= after.keys(), f"a replica of {target} was not adopted: {before} -> {after}"
        wait_for(lambda: not cut_short & {r["id"] for r in fleet.admin.get("/api/replicas")["replicas"]}, 30,
                 f"the replicas {cut_short} whose start was cut short gone\n{fleet.log_tail()}")
        said = fleet.gateway.log()[log_from:]
        for rid in cut_short:
            assert f"retiring replica {rid} of {MODEL}: its start was interrupted by a control-plane restart" in said
        assert f"of {MODEL} failed:" not in said and "paused:" not in said, said
    seen: set[str] = set()

    def finished():
        seen.add(rollout(fleet)["state"])
        return all_on(fleet, target)
    wait_for(finished, WAIT, f"every replica on {target}\n{fleet.log_tail()}", interval=0.3)
    assert "paused" not in seen, f"the rollout paused after the restart: {rollout(fleet)}"
    done = wait_for(lambda: (s := rollout(fleet))["state"] == "done" and s, 20, "the rollout done")
    assert done["previous"]["id"] == previous and done["started_at"] == status["started_at"], done
    traffic.wait_for(lambda t: sum(1 for o in t.succeeded() if o.started > restarted_at) >= 10, 30,
                     "traffic after the restart")
    timings.append((f"roll to #{done['target']['number']} through a {how}", time.time() - started))
    return target


def test_r4_13_a_rollout_goes_on_through_restarts_and_a_paused_one_stays_paused(fleet):
    first = fleet.wait_serving(2, WAIT)
    r1 = first[0]["revision"]
    assert {r["revision"] for r in first} == {r1}
    for node in NODES:
        fleet.bed.set_engine_knobs(node, token_delay=TOKEN_DELAY, start_delay=SLOW_START)
    fleet.bed.weights.add_hf_repo(SLOW_REPO, {"config.json": b"{}", "model.safetensors": SLOW_BYTES},
                                  throttle=SLOW_RATE)

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=3, plain_tokens=PLAIN_TOKENS,
                      stream_tokens=STREAM_TOKENS, max_seconds=900, max_requests=50_000)
    timings: list = []
    with traffic:
        traffic.wait_for(lambda t: len(t.succeeded("plain")) >= 10 and len(t.succeeded("stream")) >= 3, 30,
                         "traffic before the change")

        # 1 and 2. A rollout through a SIGTERM, another through a SIGKILL.
        r2 = roll_through_a_restart(fleet, traffic, r1, lambda f: set_args(f, ["--max-model-len", "2048"]), "term",
                                    timings)
        r3 = roll_through_a_restart(fleet, traffic, r2, lambda f: set_args(f, ["--max-model-len", "4096"]), "kill",
                                    timings)

        # 3. A restart in the middle of a download of the new revision's weights.
        r4 = roll_through_a_restart(fleet, traffic, r3, lambda f: set_weights(f, f"hf:{SLOW_REPO}"), "term", timings,
                                    when="fetching")
        entry = parse_weights(f"hf:{SLOW_REPO}").cache_name
        for replica in live(fleet):  # each engine of the new revision was given its weights, not the old ones
            argv = engine_argv(fleet, replica)
            assert any(entry in arg for arg in argv), (replica["id"], argv)

        # 4. Paused in the middle, still paused after a restart; resumed, it finishes.
        started = time.time()
        set_args(fleet, ["--max-model-len", "1024"])
        r5 = wait_for(lambda: (t := rollout(fleet)["target"]["id"]) != r4 and t, WAIT, "the new revision")
        wait_for(lambda: caught_mid_rollout(fleet, r5), WAIT, f"a replica of {r5} starting\n{fleet.log_tail()}",
                 interval=0.2)
        paused = fleet.ctl("rollout", "pause", MODEL)
        assert paused.code == 0, paused.stdout + paused.stderr
        status = rollout(fleet)
        assert status["state"] == "paused" and status["target"]["id"] == r5, status
        # What a paused rollout holds: the new replica finishes starting, nothing else moves.
        held = wait_for(lambda: (lambda rs: rs if all(r["serving"] for r in rs) else None)(live(fleet)), WAIT,
                        "the replicas of the paused rollout serving")
        assert {r["revision"] for r in held} == {r4, r5}, held
        restarted(fleet, "term")
        again = wait_for(lambda: (lambda rs: rs if sorted(r["id"] for r in rs if r["serving"]) ==
                                  sorted(r["id"] for r in held) else None)(live(fleet)), 60,
                         f"the adopted replicas {sorted(r['id'] for r in held)} serving\n{fleet.log_tail()}")
        assert revisions_of(again) == revisions_of(held)
        status = rollout(fleet)
        assert status["state"] == "paused" and status["target"]["id"] == r5 and status["previous"]["id"] == r4, status
        assert status["paused"] and "paused by" in status["paused"], status
        time.sleep(SLOW_START + 3)  # a few passes: a paused rollout launches and retires nothing
        assert revisions_of(live(fleet)) == revisions_of(held) and rollout(fleet)["state"] == "paused"
        resumed = fleet.ctl("rollout", "resume", MODEL)
        assert resumed.code == 0, resumed.stdout + resumed.stderr
        wait_for(lambda: all_on(fleet, r5), WAIT, f"every replica on {r5}\n{fleet.log_tail()}", interval=0.3)
        done = wait_for(lambda: (s := rollout(fleet))["state"] == "done" and s, 20, "the resumed rollout done")
        assert done["previous"]["id"] == r4 and done["target"]["number"] == 5, done
        timings.append(("roll to #5, paused through a restart, resumed", time.time() - started))

    print()
    print(traffic.account("rollouts through SIGTERM, SIGKILL, a download cut short and a paused restart"))
    for what, seconds in timings:
        print(f"   {what}: {seconds:.1f} s")
    assert traffic.failed() == [], traffic.account("failures")
    assert len(traffic.succeeded("stream")) >= 20 and len(traffic.succeeded("plain")) >= 80
