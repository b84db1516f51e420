"""A link's supervisor outlives whatever goes wrong while connecting (R-1.1, R-1.3)."""

import asyncio

from llmgw.config import NodeConfig
from llmgw.fleet.link import UNHEALTHY, LocalLink


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
