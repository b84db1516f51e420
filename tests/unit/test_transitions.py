"""The state enums and the one transition table (R-4.2, R-9.4, R-9.5)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from llmgw.contracts import states
from llmgw.contracts.states import TRANSITIONS, AdminState, LinkState, ReplicaPhase, ShardState, transition
from llmgw.control.state import Replica, Shard
from llmgw.fleet import link


@pytest.fixture(autouse=True)
def fresh_count():
    states.refused.clear()
    yield
    states.refused.clear()


def test_the_values_are_the_strings_stored_shown_and_labelled():
    assert [s.value for s in ShardState] == ["pending", "fetching", "starting", "serving", "draining", "stopping",
                                             "stopped", "failed"]
    assert [s.value for s in LinkState] == ["connecting", "ready", "unreachable", "unhealthy"]
    assert [s.value for s in AdminState] == ["active", "cordoned", "draining"]
    assert [s.value for s in ReplicaPhase] == ["active", "draining", "retiring"]
    assert ShardState.SERVING == "serving" and json.dumps({"s": ShardState.SERVING}) == '{"s": "serving"}'
    assert f"{LinkState.READY}" == "ready"
    assert (link.CONNECTING, link.READY, link.UNREACHABLE, link.UNHEALTHY) == tuple(LinkState)


@pytest.mark.parametrize("kind", [LinkState, AdminState, ShardState, ReplicaPhase])
def test_every_state_has_its_row_and_moves_only_within_its_kind(kind):
    table = TRANSITIONS[kind]
    assert set(table) == set(kind)
    assert all(type(target) is kind for targets in table.values() for target in targets)


def test_the_shard_lifecycle_is_allowed_and_ended_shards_stay_ended():
    path = [ShardState.PENDING, ShardState.FETCHING, ShardState.STARTING, ShardState.SERVING, ShardState.STOPPING,
            ShardState.STOPPED]
    assert all(states.allowed(a, b) for a, b in itertools.pairwise(path))
    for ended, other in itertools.product((ShardState.STOPPED, ShardState.FAILED), ShardState):
        assert states.allowed(ended, other) == (other == ended)


def test_every_admin_move_is_allowed():
    assert all(states.allowed(a, b) for a, b in itertools.product(AdminState, AdminState))


def test_a_refused_move_is_logged_counted_and_not_made(caplog):
    shard = Shard(id="m-1-0", replica_id="m-1", rank=0, node="a", gpus=(0,), state=ShardState.FAILED, reason="boom")
    with caplog.at_level(logging.ERROR, logger="llmgw.contracts.states"):
        assert shard.set_state(ShardState.SERVING) is False
    assert (shard.state, shard.reason) == (ShardState.FAILED, "boom")
    assert states.refused == {("ShardState", "failed", "serving"): 1}
    assert "refused: shard m-1-0 cannot go from failed to serving" in caplog.text


def test_a_move_within_a_state_is_not_a_transition():
    shard = Shard(id="m-1-0", replica_id="m-1", rank=0, node="a", gpus=(0,), state=ShardState.FAILED, reason="boom")
    assert shard.set_state(ShardState.FAILED, "engine exited with status 1") is True
    assert shard.reason == "engine exited with status 1" and not states.refused


def test_a_retiring_replica_is_never_brought_back():
    replica = Replica(id="m-1", model="m", api_key="k", shards=[])
    assert replica.set_phase(ReplicaPhase.DRAINING) and replica.draining and not replica.retiring
    assert replica.set_phase(ReplicaPhase.RETIRING) and replica.retiring and not replica.draining
    assert replica.set_phase(ReplicaPhase.ACTIVE) is False and replica.retiring
    assert states.refused == {("ReplicaPhase", "retiring", "active"): 1}


def test_a_value_of_no_known_state_allows_no_move():
    assert transition("exploded", ShardState.FAILED, "shard x") is False
    assert states.refused == {("ShardState", "exploded", "failed"): 1}
