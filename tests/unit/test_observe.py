"""The observe step as a factor matrix: every combination of what a node can say about a shard,
with the judgement it must give (R-4.2–R-4.5, R-4.7).

The expected judgement comes from the small table in `expected()`, written from the
requirements, not from the code under test.
"""

from __future__ import annotations

import copy
import itertools
import time
from types import SimpleNamespace

import pytest

from llmgw.contracts.states import LinkState, ReplicaPhase, ShardState
from llmgw.control import observe
from llmgw.control.observe import UNHEALTHY_PROBES, judge
from llmgw.control.state import Replica, Shard
from llmgw.fleet.facts import NodeFacts, ShardStatus

NOW = 100_000.0
SETTLING = 20.0
START_TIMEOUT = 60.0
KEY = "llmgw-engine-secret"

LINKS = {  # name -> (link state, seconds since it became that), None: the node left the inventory
    "ready": (LinkState.READY, 500.0),
    "unreachable-recent": (LinkState.UNREACHABLE, 5.0),
    "unreachable-past": (LinkState.UNREACHABLE, 100.0),
    "unhealthy-past": (LinkState.UNHEALTHY, 100.0),
    "connecting-past": (LinkState.CONNECTING, 100.0),
    "missing": None,
}
REPORTS = ("none", "older", "newer")  # no shard report at all / last report before the launch / after
IDENTITIES = ("same", "exited", "gone", "other-process", "not-found")
HEALTH = ("200", "failing", "no-http")
TIMEOUTS = ("within", "past")
STATES = (ShardState.STARTING, ShardState.SERVING)
PRIOR_PROBES = (0, UNHEALTHY_PROBES - 1)


def expected(link, report, identity, health, timeout, state, prior):
    """(state, reason, abandon, failed_probes, log_tail), or None for no judgement."""
    if LINKS[link] is None:
        return ShardState.FAILED, "node a is no longer in the inventory", False, None, None
    link_state, age = LINKS[link]
    if link_state == LinkState.CONNECTING:
        return None  # its first attempt has not ended: nothing is known of the node yet
    if link_state != LinkState.READY:
        if age > SETTLING:
            since = time.strftime("%H:%M:%S", time.localtime(NOW - age))
            return ShardState.FAILED, f"node a {link_state} since {since}", True, None, None
        return None
    if report != "newer":
        return None
    failures = {"exited": ("engine exited with status 3", ("token *** refused", "bye")),
                "gone": ("engine is gone (no exit status recorded)", None),
                "other-process": ("a different process now has the engine's id", None),
                "not-found": ("engine not found on the node", None)}
    if identity in failures:
        reason, tail = failures[identity]
        return ShardState.FAILED, reason, False, None, tail
    healthy = health != "failing"
    if state == ShardState.STARTING:
        if healthy:
            return ShardState.SERVING, None, False, None, None
        if timeout == "past":
            return ShardState.FAILED, "did not become ready within 60s (last health: 503)", False, None, None
        return None
    if healthy:
        return (None, None, False, 0, None) if prior else None
    if prior + 1 >= UNHEALTHY_PROBES:
        return ShardState.FAILED, "health check failing: 503", False, prior + 1, None
    return None, None, False, prior + 1, None


def patience(failed_probes=None):
    """The settling window and start timeout of these cases, with the failed probes so far."""
    return observe.Patience(SETTLING, lambda model: START_TIMEOUT, failed_probes or {})


def case(link, report, identity, health, timeout, state):
    launched = NOW - (30.0 if timeout == "within" else 120.0)
    shard = Shard(id="m-1-0", replica_id="m-1", rank=0, node="a", gpus=(0,), port=8000, state=state, pid=41,
                  start_time=4100, serves_http=health != "no-http", launched_at=launched)
    replica = Replica(id="m-1", model="m", api_key=KEY, shards=[shard])
    link_obj = None
    if LINKS[link] is not None:
        link_state, age = LINKS[link]
        link_obj = SimpleNamespace(state=link_state, since=NOW - age, reason=None)
    statuses = None
    if report != "none":
        alive = identity in ("same", "other-process")
        status = ShardStatus(
            shard_id=shard.id, pid=41, start_time=4100 if identity != "other-process" else 9999, argv=("vllm",),
            alive=alive, exit_code=3 if identity == "exited" else None, ended_at=None, started_at=launched,
            port=8000, health_status={"200": 200, "failing": 503, "no-http": None}[health] if alive else None,
            health_error=None, log_tail=(f"token {KEY} refused", "bye") if identity == "exited" else None)
        statuses = {} if identity == "not-found" else {shard.id: status}
    observed = NOW - 1.0 if report == "newer" else launched - 1.0
    facts = NodeFacts(inventory=None, storage=None, holdings={}, shards=statuses, observed_at={"status": observed})
    return replica, shard, link_obj, facts


@pytest.mark.parametrize("link,report,identity,health,timeout,state,prior",
                         list(itertools.product(LINKS, REPORTS, IDENTITIES, HEALTH, TIMEOUTS, STATES, PRIOR_PROBES)),
                         ids=lambda v: str(v))
def test_judgement(link, report, identity, health, timeout, state, prior):
    replica, shard, link_obj, facts = case(link, report, identity, health, timeout, state)
    before = (copy.deepcopy(replica), copy.deepcopy(facts))
    judgement = judge(replica, shard, link_obj, facts, NOW, patience({shard.id: prior}))
    want = expected(link, report, identity, health, timeout, state, prior)
    got = None if judgement is None else (judgement.state, judgement.reason, judgement.abandon,
                                          judgement.failed_probes, judgement.log_tail)
    assert got == want
    if judgement is not None:
        assert (judgement.replica_id, judgement.rank) == ("m-1", 0)
    assert (replica, facts) == before  # the inputs are left as they were


def test_a_shard_not_launched_yet_is_not_judged():
    replica, shard, link, facts = case("ready", "newer", "not-found", "200", "past", ShardState.STARTING)
    shard.pid = shard.launched_at = None
    assert judge(replica, shard, link, facts, NOW, patience()) is None


def test_observe_judges_only_live_shards_of_replicas_not_retiring():
    replica, shard, link, facts = case("ready", "newer", "exited", "200", "within", ShardState.SERVING)
    other, other_shard, _, _ = case("ready", "newer", "exited", "200", "within", ShardState.SERVING)
    other.id = other_shard.replica_id = "m-2"
    other_shard.id = "m-2-0"
    other.set_phase(ReplicaPhase.RETIRING)
    stopping, stopping_shard, _, _ = case("ready", "newer", "exited", "200", "within", ShardState.STOPPING)
    stopping.id = "m-3"
    observed = observe.observe([replica, other, stopping], {"a": link}, {"a": facts}, NOW, patience())
    assert [(j.replica_id, j.state) for j in observed.judgements] == [("m-1", ShardState.FAILED)]


def test_unknown_engines_are_the_live_ones_no_replica_has():
    replica, shard, link, facts = case("ready", "newer", "same", "200", "within", ShardState.SERVING)
    stranger = ShardStatus(shard_id="x-0", pid=5, start_time=50, argv=("x",), alive=True, exit_code=None,
                           ended_at=None, started_at=0.0, port=1, health_status=None, health_error=None, log_tail=None)
    dead = ShardStatus(**{**stranger.__dict__, "shard_id": "y-0", "alive": False})
    facts.shards.update({"x-0": stranger, "y-0": dead})
    silent = NodeFacts(inventory=None, storage=None, holdings=None, shards=None, observed_at={})
    retiring = Replica(id="r-1", model="m", api_key=KEY, phase=ReplicaPhase.RETIRING,
                       shards=[Shard(id="r-1-0", replica_id="r-1", rank=0, node="a", gpus=(1,))])
    facts.shards["r-1-0"] = ShardStatus(**{**stranger.__dict__, "shard_id": "r-1-0"})
    observed = observe.observe([replica, retiring], {"a": link, "b": link}, {"a": facts, "b": silent}, NOW,
                               patience())
    assert observed.unknown_engines == {"a": ["x-0"]}  # a retiring replica's engine is still known
