"""The routing policy and engine loads, as ctl and the dashboard show them (R-6.5, R-9.4)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient
from typer.testing import CliRunner

from llmgw.catalog import Catalog
from llmgw.cli.main import app
from llmgw.config import ModelConfig
from llmgw.router.engineload import EngineLoad
from tests.unit.admin_gateway import PROFILES, TOKEN, make_gateway, served_admin


@pytest.fixture
async def admin(tmp_path):
    gateway = make_gateway(tmp_path)
    models = [ModelConfig(name="chat", profile="one", routing="prefix"),
              ModelConfig(name="big", profile="pair")]
    gateway.holder.swap(Catalog.build(file_models=models, profiles=PROFILES))
    gateway.publish()
    gateway.publisher.in_flight["chat-1"] = 3
    gateway.publisher.loads["chat-1"] = EngineLoad(source="vllm", waiting=4, running=2, kv_cache=0.41)
    gateway.publisher.loads["chat-0"] = EngineLoad(source="llama-server", running=1)  # no queue, no KV
    async with served_admin(gateway) as client:
        yield client


async def ctl(client: TestClient, *args: str) -> str:
    runner = CliRunner(env={"COLUMNS": "400", "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None,
                            "LLMGW_STATE_DIR": None})
    address = f"{client.server.host}:{client.server.port}"
    result = await asyncio.to_thread(runner.invoke, app, ["ctl", "--admin", address, "--token", TOKEN, *args])
    assert result.exit_code == 0, result.output
    return result.stdout


async def test_r6_5_ctl_models_shows_each_policy(admin):
    out = await ctl(admin, "models")
    assert "ROUTING" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ("chat", "big")}
    assert " prefix " in lines["chat"] and " least-outstanding " in lines["big"]
    document = json.loads(await ctl(admin, "models", "--json"))
    assert {m["name"]: m["routing"] for m in document["models"]} == {"chat": "prefix", "big": "least-outstanding"}


async def test_r6_5_ctl_replicas_shows_engine_load_and_unknowns(admin):
    out = await ctl(admin, "replicas")
    chat1 = next(line for line in out.splitlines() if line.startswith("chat-1"))
    chat0 = next(line for line in out.splitlines() if line.startswith("chat-0"))
    assert "in flight 3" in chat1 and "engine queue 4 · running 2 · KV 41%" in chat1
    assert "in flight 0" in chat0 and "engine queue - · running 1 · KV -" in chat0
    document = json.loads(await ctl(admin, "replicas", "--json"))
    fetched = next(r for r in document["replicas"] if r["id"] == "fetched-1")
    assert fetched["engine"] is None  # never polled: null, not zeros


async def test_r6_5_dashboard_shows_engine_load(admin):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    page = await (await admin.get("/replicas", headers=headers)).text()
    assert "engine load" in page and "queue 4 · running 2 · KV 41%" in page and "queue - · running 1 · KV -" in page
    models = await (await admin.get("/models", headers=headers)).text()
    assert "prefix" in models and "least-outstanding" in models
