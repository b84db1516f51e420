"""What the router tells clients about engines: never where they are (R-6.1, R-6.6).

An engine's address (host:port) is the fleet's inside; aiohttp's and asyncio's error texts name
it, so the router's messages must not pass them on. Replica ids are enough to look it up.
"""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest

from llmgw.router import Endpoint
from tests.integration.test_router_support import (  # noqa: F401
    catalog,
    free_port,
    model,
    start_router,
)

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def hanging_up():
    """A port that accepts connections and closes them at once, before any answer."""
    async def close(reader, writer):
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("stream", [pytest.param(False, id="plain"), pytest.param(True, id="stream")])
async def test_client_errors_do_not_carry_engine_addresses(start_router, hanging_up, stream, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="llmgw.router")
    refused = free_port()
    endpoints = [Endpoint(replica_id="r-refused", model="m", url=f"http://127.0.0.1:{refused}", api_key="k"),
                 Endpoint(replica_id="r-hangs-up", model="m", url=f"http://127.0.0.1:{hanging_up}", api_key="k")]
    gw = await start_router(catalog(model("m")), {"m": endpoints})
    async with gw.client() as client:
        for _ in range(2):  # each endpoint is the last one tried once
            with pytest.raises(openai.APIStatusError) as failed:
                await client.chat.completions.create(model="m", messages=HELLO, stream=stream)
            message = failed.value.message
            print(message)
            assert failed.value.status_code == 502 and "after 2 attempts" in message
            assert "127.0.0.1" not in message and str(refused) not in message and str(hanging_up) not in message
            assert "r-refused" in message or "r-hangs-up" in message
    # The operator still has the address, in the gateway's log.
    assert f"127.0.0.1:{refused}" in caplog.text
