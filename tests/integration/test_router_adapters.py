"""LoRA adapters through the router with the official openai client (R-8.8), against engine
doubles holding adapters: vLLM (`--lora-modules`) is asked for an adapter by its served name;
llama-server (`--lora`) by the base's name with every adapter's scale in `lora`, a base request
with them all at 0. An adapter is a model for keys, listed with its base as `parent`, served only
by replicas that hold it, and counted under its own name.

The feed's models are the catalog's plus adapter entries made here (RoutedModel.adapter_of), as
the control plane publishes them; the endpoints name what each replica holds (Endpoint.adapters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import openai
import pytest

from llmgw.admin.usage import usage_report
from llmgw.control.feed import publisher as publisher_module
from tests.integration.test_router_support import (catalog, engines, model, shared_engines,  # noqa: F401
                                                   start_router, with_adapters)

ASK = [{"role": "user", "content": "one two three"}]  # the double counts 3 words
ADAPTERS = {  # name -> (base, the name its vLLM serves it by)
    "bot-v": ("base-v", "bot-v-served"),
    "legal-v": ("base-v", None),
    "bot-l": ("base-l", None),
    "legal-l": ("base-l", None),
    "nowhere": ("base-v", None),  # an adapter of base-v that no replica holds
}


def adapter_files(directory: Path) -> Path:
    """Adapters as the engines find them at start (the double checks them as the real ones do): a
    PEFT folder per vLLM adapter, a file per llama-server one."""
    for name in ("bot", "legal"):
        (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (directory / f"{name}-l.gguf").write_bytes(b"GGUF")
    return directory


@pytest.fixture(scope="module")
def doubles(shared_engines):  # noqa: F811
    """vLLM: `v1` holds bot-v and legal-v, `v2` none (an adapter being rolled out); llama-server:
    `l1` holds legal-l (id 0) and bot-l (id 1), `l2` bot-l alone (id 0). Each notes every body it gets."""
    noted = shared_engines.directory
    files = adapter_files(noted / "adapters")

    def start(name, mode, *args):
        bodies = noted / f"bodies-{len(shared_engines.started)}"
        engine = shared_engines.start(name, mode=mode, args=args, request_bodies=str(bodies))
        engine.bodies, engine.seen = bodies, 0
        return engine

    return {"v1": start("base-v", "vllm", "--enable-lora", "--lora-modules", f"bot-v-served={files / 'bot'}",
                        f"legal-v={files / 'legal'}"),
            "v2": start("base-v", "vllm"),
            "l1": start("base-l", "llama-server", "--lora", f"{files / 'legal-l.gguf'},{files / 'bot-l.gguf'}"),
            "l2": start("base-l", "llama-server", "--lora", str(files / "bot-l.gguf"))}


def received(engine) -> list[dict]:
    """The bodies `engine` got since the last call."""
    lines = engine.bodies.read_text().splitlines() if engine.bodies.exists() else []
    seen, engine.seen = engine.seen, len(lines)
    return [json.loads(line)["body"] for line in lines[seen:]]


def endpoints(d, **held):
    """base -> endpoints, each replica holding what `held` says (by its double's key in `d`)."""
    table = {"base-v": [], "base-l": []}
    for key, engine in d.items():
        table[engine.name].append(dataclasses.replace(engine.endpoint(f"r-{key}"), adapters=held.get(key, ())))
    return table


HELD = {"v1": ("bot-v", "legal-v"), "l1": ("legal-l", "bot-l"), "l2": ("bot-l",)}


@pytest.fixture
async def gw(doubles, start_router, monkeypatch):  # noqa: F811
    for engine in doubles.values():
        received(engine)  # what earlier tests sent is theirs
    monkeypatch.setattr(publisher_module, "routed_models", with_adapters(ADAPTERS))
    return await start_router(catalog(model("base-v"), model("base-l", profile="llama")),
                              endpoints(doubles, **HELD))


async def chat(client, name, **kw):
    answer = await client.chat.completions.create(model=name, messages=ASK, **kw)
    return answer.choices[0].message.content.split()[0]


async def test_r8_8_vllm_is_asked_for_an_adapter_by_its_served_name_on_the_replicas_that_hold_it(gw, doubles):
    async with gw.client() as client:
        answers = [await chat(client, "bot-v") for _ in range(4)]
        stream = await client.chat.completions.create(model="bot-v", messages=ASK, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        base = [await chat(client, "base-v") for _ in range(4)]
    assert answers == ["bot-v-served"] * 4 and streamed.startswith("bot-v-served heard 3 words")
    assert base == ["base-v"] * 4
    v1, v2 = received(doubles["v1"]), received(doubles["v2"])
    assert [b["model"] for b in v1 if b["model"] != "base-v"] == ["bot-v-served"] * 5
    assert [b["model"] for b in v2] == ["base-v"] * 2  # the base is served by every replica, holder or not
    assert not any("lora" in b for b in v1 + v2)


async def test_r8_8_llama_server_gets_the_bases_name_and_every_adapters_scale(gw, doubles):
    clients_lora = {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]}
    async with gw.client() as client:
        adapter = [await chat(client, "bot-l", extra_body=clients_lora) for _ in range(4)]
        legal = await chat(client, "legal-l")
        base = [await chat(client, "base-l", extra_body=clients_lora) for _ in range(4)]
    assert adapter == ["base-l+bot-l"] * 4 and legal == "base-l+legal-l"
    assert base == ["base-l"] * 4  # never the adapters the client's own `lora` asked for
    l1, l2 = received(doubles["l1"]), received(doubles["l2"])
    assert {b["model"] for b in l1 + l2} == {"base-l"}
    off_l1, off_l2 = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}], [{"id": 0, "scale": 0.0}]
    assert [b["lora"] for b in l1] == [[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]] * 2 + \
        [[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]] + [off_l1] * 2
    assert [b["lora"] for b in l2] == [[{"id": 0, "scale": 1.0}]] * 2 + [off_l2] * 2


async def test_r8_8_a_key_reaches_an_adapter_only_when_allowed_on_its_name(gw):
    on_base = gw.key("on-base", models=["base-v"])
    on_adapter = gw.key("on-adapter", models=["bot-v"])
    async with gw.client(on_base) as client:
        with pytest.raises(openai.NotFoundError) as refused:
            await chat(client, "bot-v")
        with pytest.raises(openai.NotFoundError) as unknown:
            await chat(client, "no-such-model")
        assert [m.id async for m in client.models.list()] == ["base-v"]
    assert {**refused.value.body, "request_id": None} == {
        **unknown.value.body, "request_id": None,
        "message": unknown.value.body["message"].replace("no-such-model", "bot-v")}
    async with gw.client(on_adapter) as client:
        assert await chat(client, "bot-v") == "bot-v-served"
        with pytest.raises(openai.NotFoundError):
            await chat(client, "base-v")
        listed = [m async for m in client.models.list()]
        one = await client.models.retrieve("bot-v")
    assert [(m.id, m.model_extra.get("parent")) for m in listed] == [("bot-v", "base-v")]
    assert one.model_extra["parent"] == "base-v" and "root" not in one.model_extra


async def test_r8_8_models_lists_every_adapter_with_its_base_as_parent(gw):
    async with gw.client() as client:
        listed = {m.id: m.model_extra.get("parent") async for m in client.models.list()}
    assert listed == {"base-v": None, "base-l": None, "bot-v": "base-v", "legal-v": "base-v", "bot-l": "base-l",
                      "legal-l": "base-l", "nowhere": "base-v"}


async def test_r8_8_an_adapter_no_replica_holds_is_no_capacity_naming_it_and_its_base(gw, doubles):
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await chat(client, "nowhere")
        gw.set_endpoints(endpoints(doubles, v2=()) | {"base-v": []})
        with pytest.raises(openai.APIStatusError) as no_base:
            await chat(client, "bot-v")
        with pytest.raises(openai.APIStatusError) as base_down:
            await chat(client, "base-v")
    assert refused.value.status_code == 503 and refused.value.body["code"] == "no_capacity"
    assert "'nowhere'" in refused.value.body["message"] and "'base-v'" in refused.value.body["message"]
    assert (no_base.value.status_code, no_base.value.body["code"]) == (503, "no_capacity")
    assert base_down.value.body["code"] == "no_capacity"


async def test_r8_8_a_failed_holder_is_retried_on_another_holder_never_on_a_replica_without_it(gw, doubles):
    table = endpoints(doubles, l2=("bot-l",))
    dead = dataclasses.replace(table["base-l"][1], replica_id="r-dead", url="http://127.0.0.1:9",
                               adapters=("bot-l",))
    gw.set_endpoints({**table, "base-l": [table["base-l"][0], dead, table["base-l"][1]]})  # l1: no adapters listed
    async with gw.client() as client:
        answers = [await chat(client, "bot-l") for _ in range(4)]
    assert answers == ["base-l+bot-l"] * 4
    assert [b["lora"] for b in received(doubles["l2"])] == [[{"id": 0, "scale": 1.0}]] * 4
    assert received(doubles["l1"]) == []


async def test_r8_8_usage_the_request_log_and_metrics_count_an_adapter_under_its_name(gw):
    records = []
    apply = gw.publisher.apply_report

    async def taking(report, *args):
        records.extend(report.requests)
        return await apply(report, *args)
    gw.publisher.apply_report = taking
    async with gw.client() as client:
        await chat(client, "bot-v")
        await chat(client, "bot-l")
        await chat(client, "base-l")
        stream = await client.chat.completions.create(model="bot-l", messages=ASK, stream=True)
        assert [c async for c in stream]
    await gw.feed.report()
    usage = {r["model"]: (r["requests"], r["prompt_tokens"]) for r in await gw.usage_rows()}
    assert usage == {"bot-v": (1, 3), "bot-l": (2, 6), "base-l": (1, 3)}
    by_model = await gw.store.read(lambda db: usage_report(db, "model", 3600))  # `ctl usage --by model`
    assert {r["name"]: r["requests"] for r in by_model["rows"]} == {"bot-v": 1, "bot-l": 2, "base-l": 1}
    assert sorted(r.model for r in records) == ["base-l", "bot-l", "bot-l", "bot-v"]
    assert [r.replica for r in records if r.model == "bot-v"] == ["r-v1"]
    sample = gw.registry.get_sample_value
    assert sample("llmgw_router_requests_total", {"model": "bot-l", "code": "2xx"}) == 2
    assert sample("llmgw_router_tokens_total", {"model": "bot-v", "kind": "prompt"}) == 3
    assert sample("llmgw_router_requests_total", {"model": "base-v", "code": "2xx"}) is None


async def test_r8_8_an_adapter_of_an_on_demand_base_asks_for_the_base_and_waits_for_a_holder(
        engines, start_router, monkeypatch):  # noqa: F811
    asked = []
    holder = {}
    files = adapter_files(engines.directory / "adapters")

    def on_demand(name):  # a stand-in control plane: start the base with the adapter, then push it
        asked.append(name)

        async def start():
            engine = await asyncio.to_thread(engines.start, name, args=(
                "--enable-lora", "--lora-modules", f"bot-v-served={files / 'bot'}"))
            holder["gw"].set_endpoints({name: [dataclasses.replace(engine.endpoint("od-1"), adapters=("bot-v",))]})
        asyncio.get_running_loop().create_task(start())

    monkeypatch.setattr(publisher_module, "routed_models", with_adapters({"bot-v": ("base-v", "bot-v-served")}))
    gw = holder["gw"] = await start_router(catalog(model("base-v", on_demand=True)), on_demand=on_demand)
    async with gw.client() as client:
        assert await chat(client, "bot-v") == "bot-v-served"
    assert asked == ["base-v"]


async def test_r8_8_an_adapter_takes_no_fallback_even_where_its_entry_names_its_bases(
        engines, start_router, monkeypatch):  # noqa: F811
    small = engines.start("small")
    made = with_adapters({"bot-v": ("base-v", "bot-v-served")})

    def keeping_fallbacks(cat):  # the adapter's entry as a copy of its base's, fallbacks included
        models = dict(made(cat))
        models["bot-v"] = dataclasses.replace(models["bot-v"], fallbacks=models["base-v"].fallbacks)
        return models
    monkeypatch.setattr(publisher_module, "routed_models", keeping_fallbacks)
    gw = await start_router(catalog(model("base-v", fallback="small"), model("small")),
                            {"small": [small.endpoint()]})
    assert gw.router.feed.models["bot-v"].fallbacks == ("small",)
    async with gw.client() as client:
        assert await chat(client, "base-v") == "small"  # the base's own fallback serves the base
        with pytest.raises(openai.APIStatusError) as refused:
            await chat(client, "bot-v")
    assert (refused.value.status_code, refused.value.body["code"]) == (503, "no_capacity")
    assert small.counters()["requests"] == 1


async def test_r8_8_a_request_for_an_adapter_no_replica_holds_waits_for_its_load_or_fails_with_why(
        doubles, start_router, monkeypatch):  # noqa: F811
    """An adapter its base's vLLM replicas load on demand (`loadable`): a request that finds no
    holder asks the control plane (the report's demand) and waits; the table that names a holder
    lets it go on there. A load that failed, said on an endpoint, fails the request waiting for it
    with the reason."""
    for engine in doubles.values():
        received(engine)
    asked: list[str] = []
    holder = {}
    made = with_adapters({"legal-v": ("base-v", None), "nowhere": ("base-v", None)})

    def loadable(cat):
        return {name: dataclasses.replace(m, loadable=True) if m.adapter_of else m for name, m in made(cat).items()}

    def on_demand(name):  # a stand-in control plane: v1's engine "loads" legal-v; nowhere's load fails
        asked.append(name)
        if name == "legal-v":
            table = endpoints(doubles, v1=("legal-v",))
        else:
            table = endpoints(doubles, v1=("legal-v",))
            table["base-v"] = [dataclasses.replace(e, adapter_errors=(("nowhere", "LoRA rank 32 is greater than "
                                                                                   "max_lora_rank 8."),))
                               if e.replica_id == "r-v2" else e for e in table["base-v"]]
        asyncio.get_running_loop().call_later(0.3, holder["gw"].publisher.set_endpoints, table)

    monkeypatch.setattr(publisher_module, "routed_models", loadable)
    gw = holder["gw"] = await start_router(catalog(model("base-v"), model("base-l", profile="llama")),
                                           endpoints(doubles), on_demand=on_demand)
    async with gw.client() as client:
        assert await chat(client, "legal-v") == "legal-v"  # waited for the load, then served where it is held
        assert await chat(client, "legal-v") == "legal-v"  # held now: no new demand
        with pytest.raises(openai.APIStatusError) as refused:
            await chat(client, "nowhere")
    assert asked == ["legal-v", "nowhere"]
    assert (refused.value.status_code, refused.value.body["code"]) == (503, "adapter_load_failed")
    assert "LoRA rank 32 is greater than max_lora_rank 8." in refused.value.body["message"]
    assert [b["model"] for b in received(doubles["v1"])] == ["legal-v", "legal-v"]
