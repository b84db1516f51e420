"""Aliases through the router with the official openai client (R-8.7): an alias is served by its
target, listed with it, allowed to keys on the alias or on the target, counted under the target
with the alias named."""

from __future__ import annotations

import openai
import pytest

from llmgw.catalog import Alias, Catalog
from tests.integration.test_router_support import ENGINES, PROFILES, model, shared_engines, start_router  # noqa: F401


def aliased(target: str = "chat-v2") -> Catalog:
    return Catalog.build(file_models=[model("chat-v2"), model("other")], profiles=PROFILES, engines=ENGINES,
                         aliases=[Alias("chat", target, "file")])


@pytest.fixture
async def gw(shared_engines, start_router):  # noqa: F811
    if not shared_engines.started:
        shared_engines.start("chat-v2")
        shared_engines.start("other")
    v2, other = shared_engines.started[:2]
    return await start_router(aliased(), {"chat-v2": [v2.endpoint()], "other": [other.endpoint()]})


async def test_r8_7_an_alias_is_served_by_its_target_and_counted_under_it(gw):
    async with gw.client() as client:
        answer = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi you"}])
        stream = await client.chat.completions.create(model="chat", stream=True,
                                                      messages=[{"role": "user", "content": "one two three"}])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        direct = await client.chat.completions.create(model="chat-v2", messages=[{"role": "user", "content": "x"}])
    # The engine double answers with the name it was asked by: the target's, not the alias.
    assert answer.choices[0].message.content.startswith("chat-v2 heard 2 words")
    assert text.startswith("chat-v2 heard 3 words") and direct.choices[0].message.content.startswith("chat-v2")
    await gw.feed.report()
    rows = [r for r in await gw.usage_rows() if r["model"] == "chat-v2"]
    assert sorted((r["via"], r["requests"]) for r in rows) == [("", 1), ("chat", 2)]


async def test_r8_7_models_lists_aliases_with_their_target(gw):
    async with gw.client() as client:
        listed = {m.id: m async for m in client.models.list()}
        one = await client.models.retrieve("chat")
    assert set(listed) == {"chat", "chat-v2", "other"}
    assert listed["chat"].model_extra["alias_for"] == "chat-v2" and "alias_for" not in listed["other"].model_extra
    assert one.id == "chat" and one.model_extra["alias_for"] == "chat-v2"


async def test_r8_7_a_key_may_use_an_alias_when_allowed_on_its_name_or_its_target(gw):
    on_target = gw.key("on-target", models=["chat-v2"])
    on_alias = gw.key("on-alias", models=["chat"])
    elsewhere = gw.key("elsewhere", models=["other"])
    ask = [{"role": "user", "content": "hello"}]
    async with gw.client(on_target) as client:  # the target's key reaches it by either name
        assert (await client.chat.completions.create(model="chat", messages=ask)).choices
        assert [m.id async for m in client.models.list()] == ["chat", "chat-v2"]
    async with gw.client(on_alias) as client:  # the alias's key: through the alias only
        assert (await client.chat.completions.create(model="chat", messages=ask)).choices
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="chat-v2", messages=ask)
        assert [m.id async for m in client.models.list()] == ["chat"]
    async with gw.client(elsewhere) as client:  # neither: the alias does not exist for it
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(model="chat", messages=ask)
        assert "does not exist" in str(refused.value)
        assert [m.id async for m in client.models.list()] == ["other"]
