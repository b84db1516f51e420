"""Rollouts under load (R-4.13, R-8.6): a changed model converges without failing a request.

Two replicas of a model on three single-GPU nodes (one spare for the surge), the official openai
client sending plain requests and streams throughout. The operator:
1. changes the model's engine arguments and reloads: every replica is replaced, one at a time,
   each old engine stopped only after a new one served;
2. undoes it: back to the first revision the same way, held there (`ctl models` says the catalog
   differs), and a reload of the unchanged file keeps the hold;
3. reloads a definition whose engine refuses its arguments: the rollout pauses with the reason and
   the old replicas keep serving; undo keeps the model on what serves.
Not one request may fail in all of it.
"""

from __future__ import annotations

import time

import pytest
import yaml

from tests.integration.gateway import wait_for
from tests.scenarios.harness import MODEL, PLAIN_TOKENS, START_TIMEOUT, STREAM_TOKENS, Watcher, running_fleet
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

WAIT = START_TIMEOUT * 4


@pytest.fixture
def fleet(testbed_factory, tmp_path):
    with running_fleet(testbed_factory, tmp_path) as fleet:
        yield fleet


def set_args(fleet, args: list[str]) -> None:
    doc = yaml.safe_load(fleet.inventory.read_text())
    doc["profiles"]["h100-1"]["args"] = args
    fleet.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    done = fleet.ctl("reload")
    assert done.code == 0, done.stdout + done.stderr


def rollout(fleet) -> dict:
    return fleet.ctl_json("rollout", "status", MODEL)


def live(fleet) -> list[dict]:
    return [r for r in fleet.replicas() if not r["retired"] and not r["retiring"]]


def all_on(fleet, revision: str, count: int = 2):
    replicas = live(fleet)
    if len(replicas) == count and all(r["serving"] and r["revision"] == revision for r in replicas):
        return replicas
    return None


def stopped_after_replacement(fleet, watcher: Watcher, old_pids: dict[int, str], new_ids: set[str]) -> None:
    """Each old engine stops (once its requests have ended), and was last seen alive no earlier
    than the first sample showing a replica of the new revision serving."""
    def gone():
        alive = {e.pid for engines in fleet.engines().values() for e in engines}
        return not (alive & old_pids.keys())
    wait_for(gone, WAIT, f"the old engines {old_pids} to stop")
    time.sleep(watcher.interval * 3)  # a sample taken after they stopped
    first_new_serving = None
    seen: set[int] = set()
    for sample in watcher.samples:
        if first_new_serving is None and any(r["id"] in new_ids and r["serving"] for r in sample.replicas):
            first_new_serving = sample.at
        alive = {e.pid for engines in sample.engines.values() for e in engines}
        seen |= alive & old_pids.keys()
        for pid in list(old_pids):
            if pid in seen and pid not in alive:
                assert first_new_serving is not None, (
                    f"old engine pid {pid} ({old_pids[pid]}) was gone at {sample.at:.2f}, before any replica of "
                    "the new revision was seen serving")
                del old_pids[pid]
    assert not old_pids, f"old engines still running: {old_pids}"


def test_r4_13_rollout_undo_and_a_failing_revision_fail_no_request(fleet):
    first = fleet.wait_serving(2, WAIT)
    r1 = first[0]["revision"]
    assert r1 and {r["revision"] for r in first} == {r1} and first[0]["revision_number"] == 1
    status = rollout(fleet)
    assert status["state"] == "none" and status["target"]["id"] == r1

    traffic = Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=3,
                      plain_tokens=PLAIN_TOKENS, stream_tokens=STREAM_TOKENS)
    timings = []
    with traffic, Watcher(fleet) as watcher:
        traffic.wait_for(lambda t: len(t.succeeded("plain")) >= 10 and len(t.succeeded("stream")) >= 3, 30,
                         "traffic before the change")

        # 1. A new revision rolls.
        old = {e.pid: e.node for e in (fleet.engine_of(r) for r in first) if e is not None}
        started = time.time()
        set_args(fleet, ["--max-model-len", "2048"])
        r2 = wait_for(lambda: rollout(fleet)["target"]["id"] if rollout(fleet)["target"]["id"] != r1 else None,
                      WAIT, "the new revision")
        second = wait_for(lambda: all_on(fleet, r2), WAIT, f"every replica on {r2}\n{fleet.log_tail()}", interval=0.3)
        timings.append(("roll #1 -> #2", time.time() - started))
        stopped_after_replacement(fleet, watcher, dict(old), {r["id"] for r in second})
        status = wait_for(lambda: (s := rollout(fleet))["state"] == "done" and s, 10, "the rollout done")
        assert status["previous"]["id"] == r1 and status["target"]["number"] == 2
        models = fleet.ctl_json("models")["models"]
        assert models[0]["revision"] == r2 and models[0]["revisions"] == [
            {"revision": r2, "number": 2, "replicas": 2, "serving": 2}]
        traffic.wait_for(lambda t: any(o.started > started and o.ended > time.time() - 1 for o in t.succeeded()), 30,
                         "traffic on the new revision")

        # 2. Undo: back to #1 the same way, held while the file says #2.
        old = {e.pid: e.node for e in (fleet.engine_of(r) for r in second) if e is not None}
        started = time.time()
        undone = fleet.ctl("rollout", "undo", MODEL)
        assert undone.code == 0, undone.stderr
        third = wait_for(lambda: all_on(fleet, r1), WAIT, f"every replica back on {r1}\n{fleet.log_tail()}",
                         interval=0.3)
        timings.append(("undo #2 -> #1", time.time() - started))
        stopped_after_replacement(fleet, watcher, dict(old), {r["id"] for r in third})
        status = rollout(fleet)
        assert status["held"] and status["target"]["id"] == r1 and status["catalog"]["id"] == r2
        assert "held by undo" in fleet.ctl("models").stdout
        assert fleet.ctl("reload").code == 0  # the unchanged file keeps the hold
        time.sleep(3)
        assert all_on(fleet, r1) and rollout(fleet)["held"]

        # 3. A revision whose engine refuses its arguments pauses; the old replicas serve on.
        set_args(fleet, ["--no-such-flag"])
        paused = wait_for(lambda: (s := rollout(fleet))["state"] == "paused" and s, WAIT,
                          f"the rollout to pause\n{fleet.log_tail()}")
        assert "failed" in paused["paused"] and "unrecognized arguments" in paused["paused"], paused
        r3 = paused["target"]["id"]
        assert r3 not in (r1, r2) and paused["target"]["number"] == 3
        text = fleet.ctl("rollout", "status", MODEL).stdout
        assert "PAUSED" in text and "--no-such-flag" not in text.split("paused:")[0]
        assert all_on(fleet, r1)
        traffic.wait_for(lambda t: sum(1 for o in t.succeeded() if o.started > paused["started_at"]) >= 10, 30,
                         "traffic while paused")
        undone = fleet.ctl("rollout", "undo", MODEL)
        assert undone.code == 0, undone.stderr
        status = wait_for(lambda: (s := rollout(fleet))["state"] == "done" and s, 20, "the undo of the paused rollout")
        assert status["target"]["id"] == r1 and status["held"] and status["catalog"]["id"] == r3
        assert all_on(fleet, r1)

    print()
    print(traffic.account("rollout, undo, a failing revision"))
    for what, seconds in timings:
        print(f"   {what}: {seconds:.1f} s")
    assert traffic.failed() == [], traffic.account("failures")
    assert len(traffic.succeeded("stream")) >= 10 and len(traffic.succeeded("plain")) >= 40


def test_r4_13_a_canary_takes_its_share_of_conversations_until_promoted(fleet):
    """rollout.canary: 25 — one replica of the new revision beside the two old ones, given about a
    quarter of 200 conversations, each conversation on one revision throughout; promoted, it rolls on."""
    import concurrent.futures

    import openai

    from tests.scenarios.traffic import engine_pid

    first = fleet.wait_serving(2, WAIT)
    r1 = first[0]["revision"]
    doc = yaml.safe_load(fleet.inventory.read_text())
    doc["models"][0]["rollout"] = {"canary": 25}
    fleet.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    set_args(fleet, ["--max-model-len", "4096"])
    status = wait_for(lambda: (s := rollout(fleet))["state"] == "canary" and s["waiting"]
                      and "promote" in s["waiting"] and s, WAIT, f"the canary serving\n{fleet.log_tail()}")
    r2 = status["target"]["id"]
    live_now = live(fleet)
    assert sorted(r["revision"] == r2 for r in live_now) == [False, False, True]  # all the old ones stay
    revision_of = {e.pid: r["revision"] for r in live_now if (e := fleet.engine_of(r)) is not None}

    client = openai.OpenAI(base_url=fleet.url, api_key=fleet.key, max_retries=0)

    def conversation(i: int) -> list[str]:
        messages = [{"role": "user", "content": f"conversation {i}: tell me about the number {i * 7919}"}]
        seen = []
        for turn in range(2):
            answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            seen.append(revision_of.get(engine_pid(answer.id)))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
        return seen

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(conversation, range(200)))
    assert all(len(set(seen)) == 1 and seen[0] in (r1, r2) for seen in runs), runs
    share = sum(seen[0] == r2 for seen in runs) / len(runs)
    print(f"\n   canary 25 %: {share:.1%} of 200 conversations on revision {r2}")
    assert 0.15 <= share <= 0.35

    # The two revisions' answers side by side, as the routers reported them.
    status = wait_for(lambda: (s := rollout(fleet)).get("answers") and sum(a["total"] for a in s["answers"]) >= 400
                      and s, 30, "the routers' counts per revision")
    answers = {a["revision"]["id"]: a for a in status["answers"]}
    assert answers[r2]["errors"] == 0 and answers[r1]["errors"] == 0
    assert answers[r2]["total"] == sum(2 for seen in runs if seen[0] == r2)
    assert "ANSWERED" in fleet.ctl("rollout", "status", MODEL).stdout

    promoted = fleet.ctl("rollout", "promote", MODEL)
    assert promoted.code == 0, promoted.stderr
    wait_for(lambda: all_on(fleet, r2), WAIT, f"every replica on {r2} once promoted\n{fleet.log_tail()}", interval=0.3)
