"""A link's supervisor outlives whatever goes wrong while connecting (R-1.1, R-1.3)."""

import asyncio
import logging

import pytest

from llmgw.config import NodeConfig
from llmgw.contracts import states
from llmgw.fleet.link import CONNECTING, READY, UNHEALTHY, UNREACHABLE, LocalLink


@pytest.fixture(autouse=True)
def no_refused_transitions():
    states.refused.clear()
    yield
    assert not states.refused, f"moves the transition table refused: {dict(states.refused)}"


def test_a_link_state_change_goes_through_the_transition_table(tmp_path, caplog):
    link = LocalLink(NodeConfig(name="n1", connection="local"), tmp_path / "node")
    assert link.state == CONNECTING
    link._set_state(UNREACHABLE, "connect failed")
    link._set_state(READY)
    with caplog.at_level(logging.ERROR, logger="llmgw.contracts.states"):
        link._set_state(CONNECTING)  # only the state before a link's first answer
    assert link.state == READY and link.reason is None
    assert "refused: node n1's link cannot go from ready to connecting" in caplog.text
    assert states.refused.pop(("LinkState", "ready", "connecting")) == 1


async def test_an_unexpected_error_while_connecting_makes_the_node_unhealthy_and_is_retried(tmp_path):
    link = LocalLink(NodeConfig(name="odd", connection="local"), tmp_path / "node")
    attempts = []

    async def broken_open():
        attempts.append(1)
        raise ValueError("an answer nobody foresaw")

    link._open = broken_open
    link.start()
    try:
        for _ in range(200):
            if link.state == UNHEALTHY:
                break
            await asyncio.sleep(0.01)
        assert link.state == UNHEALTHY
        assert "ValueError: an answer nobody foresaw" in link.reason
        assert link._task is not None and not link._task.done(), "the supervisor task is still alive"
        link.reconnect_now()  # skip the backoff: the supervisor tries again
        for _ in range(200):
            if len(attempts) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(attempts) >= 2
    finally:
        await link.close()
