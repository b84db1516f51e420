"""Engine-reported load (R-6.5): parsed from the engines' own pages, unknown when they do not say.

The fixtures were read from the engines in /opt/llmgw-engines: vLLM 0.32.0 `/metrics` idle after
two chat requests (prefix-cache counters non-zero) and while running twelve completions;
llama-server `/metrics` (`--metrics`) and `/slots` with two slots; llama-server 11434 started with
`-np 3`: `/slots` while one completion ran, and `/props`.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.router.balancer import Balancer
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import MAX_COUNT, EngineLoad, FeedError, Report, from_wire, to_wire
from llmgw.router.engineload import EnginePoller, Malformed, others, parse_metrics, parse_props, parse_slots
from llmgw.router.metrics import RouterMetrics

FIXTURES = Path(__file__).parent / "fixtures" / "engine_load"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_r6_5_vllm_metrics_idle():
    load = parse_metrics(fixture("vllm_metrics.txt"))
    assert load.source == "vllm"
    assert (load.waiting, load.running, load.kv_cache) == (0, 0, 0.0)
    assert (load.prefix_hits, load.prefix_queries) == (384, 862)


def test_r6_5_vllm_metrics_busy():
    load = parse_metrics(fixture("vllm_metrics_busy.txt"))
    assert (load.waiting, load.running) == (0, 12)
    assert 0.0 < load.kv_cache < 0.05


def test_r6_5_llama_server_metrics_say_no_cache_use():
    load = parse_metrics(fixture("llama_server_metrics.txt"))
    assert load.source == "llama-server"
    assert (load.waiting, load.running) == (0, 0)
    assert load.kv_cache is None  # this build exports no KV-cache use: unknown, not 0


def test_r6_5_llama_server_slots_give_no_queue():
    load = parse_slots(fixture("llama_server_slots.json"))
    assert (load.source, load.running, load.waiting, load.kv_cache) == ("llama-server", 0, None, None)
    busy = parse_slots('[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]')
    assert busy.running == 1


def test_r6_17_llama_server_slots_give_its_slot_count():
    assert parse_slots(fixture("llama_server_slots.json")).slots == 2
    busy = parse_slots(fixture("llama_server_slots_busy.json"))
    assert (busy.slots, busy.running, busy.waiting) == (3, 1, None)


def test_r6_17_llama_server_props_give_its_slot_count():
    assert parse_props(fixture("llama_server_props.json")) == 3


def test_r6_17_a_slot_count_is_unknown_where_the_engine_does_not_give_one():
    assert parse_metrics(fixture("llama_server_metrics.txt")).slots is None  # on no llama-server metric
    assert parse_metrics(fixture("vllm_metrics_busy.txt")).slots is None


def test_r6_17_a_slot_count_travels_in_reports_and_is_checked():
    load = EngineLoad(source="llama-server", waiting=0, running=1, at=5.0, slots=3)
    wire = json.loads(json.dumps(to_wire(Report(router="r", seq=1, sent_at=1.0, engine_load={"x": load}))))
    assert from_wire(wire).engine_load["x"] == load
    assert wire["engine_load"]["x"]["slots"] == 3
    del wire["engine_load"]["x"]["slots"]  # a router that does not send it: unknown
    assert from_wire(wire).engine_load["x"].slots is None
    for bad in (0, "3", 2.5):
        wire["engine_load"]["x"]["slots"] = bad
        with pytest.raises(FeedError, match=r"engine_load\['x'\]\.slots"):
            from_wire(wire)


@pytest.mark.parametrize("value", ["+Inf", "1e30", "9007199254740993"])
def test_r10_8_an_engine_count_past_the_maximum_is_clamped(value, caplog):
    text = f"vllm:num_requests_waiting{{model_name=\"m\"}} {value}\nvllm:num_requests_running 1\n"
    load = parse_metrics(text)
    assert load.waiting == MAX_COUNT and load.running == 1
    assert from_wire(json.loads(json.dumps(to_wire(Report(router="r", seq=1, sent_at=1.0,
                                                            engine_load={"x": load}))))).engine_load["x"] == load
    assert parse_props(f'{{"total_slots": {2**70}}}') == MAX_COUNT


@pytest.mark.parametrize("text", [
    pytest.param("not json", id="not-json"),
    pytest.param("[3]", id="not-an-object"),
    pytest.param('{"default_generation_settings": {}}', id="no-total-slots"),
    pytest.param('{"total_slots": 0}', id="zero"),
    pytest.param('{"total_slots": "4"}', id="a-string"),
    pytest.param('{"total_slots": 4.0}', id="a-float"),
])
def test_r6_17_props_without_a_slot_count_are_refused(text):
    with pytest.raises(Malformed):
        parse_props(text)


def test_r6_5_sglang_metrics():
    text = ('# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 7.0\n'
            'sglang:num_running_reqs{model_name="m"} 3.0\nsglang:token_usage{model_name="m"} 0.42\n')
    load = parse_metrics(text)
    assert (load.source, load.waiting, load.running, load.kv_cache) == ("sglang", 7, 3, 0.42)


def test_r6_5_samples_are_summed_over_labels():
    text = ('vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0\n')
    load = parse_metrics(text)
    assert (load.waiting, load.running, load.kv_cache) == (5, None, None)


def test_r6_5_only_the_metric_itself_is_read_not_one_its_name_begins():
    text = ('# HELP vllm:num_requests_waiting Requests waiting\r\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 40.0\r\n'
            'vllm:num_requests_waiting{engine="0"} 2.0\r\n'
            'vllm:num_requests_waiting{engine="1"} 1.0\r\n'
            'vllm:num_requests_running 3\r\n')
    load = parse_metrics(text)
    assert (load.waiting, load.running) == (3, 3)


@pytest.mark.parametrize("text", [
    'vllm:num_requests_waiting{engine="0" 2.0\n',
    "vllm:num_requests_waiting\n",
    "vllm:num_requests_waiting lots\n",
    "vllm:num_requests_waiting NaN\n",
    "vllm:num_requests_waiting -4\n",
])
def test_r6_5_malformed_metrics_are_refused(text):
    with pytest.raises(Malformed):
        parse_metrics(text)


def test_r6_5_a_page_without_engine_metrics_is_unknown():
    assert parse_metrics("# HELP x\nprocess_cpu_seconds_total 3.0\n") is None
    assert parse_metrics("") is None


@pytest.mark.parametrize("text", ["not json", '{"slots": []}', '[{"id": 0}]', '[1, 2]', '[]'])
def test_r6_5_malformed_slots_are_refused(text):
    with pytest.raises(Malformed):
        parse_slots(text)


async def serving(handler) -> tuple[web.AppRunner, str]:
    """An engine answering every GET with `handler` on a port of its own: (runner, url)."""
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def engine(pages: dict[str, tuple[int, str]], seen: list):
    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        status, body = pages.get(request.path, (404, "not found"))
        return web.Response(status=status, text=body)
    return await serving(handler)


async def test_r6_5_poller_reads_with_the_key_and_keeps_unknown_unknown():
    seen: list = []
    vllm, vllm_url = await engine({"/metrics": (200, fixture("vllm_metrics_busy.txt"))}, seen)
    llama, llama_url = await engine({"/metrics": (404, ""), "/slots": (200, fixture("llama_server_slots.json"))},
                                    seen)
    bad, bad_url = await engine({"/metrics": (200, "vllm:num_requests_waiting oops\n")}, seen)
    b = Balancer()
    b.replace({"m": [Endpoint("v", "m", vllm_url, "vkey"), Endpoint("l", "m", llama_url, "lkey"),
                     Endpoint("x", "m", bad_url, "xkey"), Endpoint("gone", "m", "http://127.0.0.1:9", "gkey")]})
    metrics = RouterMetrics(None, b.outstanding_by_model, b.upstreams)
    try:
        async with aiohttp.ClientSession() as session:
            await EnginePoller(b, session).poll_once()
    finally:
        for runner in (vllm, llama, bad):
            await runner.cleanup()
    assert b.engine_load("v").running == 12
    assert b.engine_load("l").running == 0 and b.engine_load("l").waiting is None
    assert b.engine_load("x") is None and b.engine_load("gone") is None
    # The vLLM engine runs 12 requests, none of them this router's: they are load; /slots shows no
    # queue, and an unknown reading adds nothing.
    assert [(up.replica_id, up.queued) for up in b.upstreams()] == [("v", 12), ("l", 0), ("x", 0), ("gone", 0)]
    assert {auth for _, auth in seen} == {"Bearer vkey", "Bearer lkey", "Bearer xkey"}
    exported = {(family.name, tuple(sample.labels.values())): sample.value
                for family in metrics.collect() for sample in family.samples
                if family.name.startswith("llmgw_engine")}
    assert exported[("llmgw_engine_running", ("m", "v"))] == 12
    assert exported[("llmgw_engine_running", ("m", "l"))] == 0
    assert ("llmgw_engine_waiting", ("m", "l")) not in exported  # unknown: no sample, never 0
    assert not any(labels[1] in ("x", "gone") for _, labels in exported)


async def test_r6_5_poller_queue_feeds_the_balancer():
    seen: list = []
    page = 'vllm:num_requests_waiting{engine="0"} 9.0\nvllm:num_requests_running{engine="0"} 4.0\n'
    busy, busy_url = await engine({"/metrics": (200, page)}, seen)
    b = Balancer()
    b.replace({"m": [Endpoint("busy", "m", busy_url, "k"), Endpoint("idle", "m", "http://127.0.0.1:9", "k")]})
    try:
        async with aiohttp.ClientSession() as session:
            await EnginePoller(b, session).poll_once()
    finally:
        await busy.cleanup()
    assert [up.queued for up in b.upstreams()] == [13, 0]  # 4 running + 9 waiting, none of them ours
    assert all(b.acquire("m", 1.0).replica_id == "idle" for _ in range(5))


async def test_r6_5a_the_engine_count_includes_ours_once():
    """The engine counts llmgw's own requests among its running and waiting ones: the load is the
    engine's count (as of the poll), not ours added to it again."""
    seen: list = []
    page = 'vllm:num_requests_waiting{engine="0"} 3.0\nvllm:num_requests_running{engine="0"} 4.0\n'
    busy, busy_url = await engine({"/metrics": (200, page)}, seen)
    b = Balancer()
    b.replace({"m": [Endpoint("busy", "m", busy_url, "k")]})
    ours = [b.acquire("m", 1.0) for _ in range(5)]  # 5 of the engine's 7 are ours
    try:
        async with aiohttp.ClientSession() as session:
            await EnginePoller(b, session).poll_once()
            up = ours[0]
            assert up.outstanding + up.queued == 7  # not 5 + 3 waiting
            for _ in range(3):  # 3 more: not yet in the engine's count as polled
                b.acquire("m", 1.0)
            assert up.outstanding + up.queued == 10
            for request in ours[:5] + [up] * 3:
                b.release(request)
            await EnginePoller(b, session).poll_once()  # the engine still reports 7; none ours now
            assert (up.outstanding, up.queued) == (0, 7)
    finally:
        await busy.cleanup()
    assert others(None, 3) == 0
    assert others(parse_metrics("vllm:num_requests_running 4\n"), 0) == 0  # no queue reported: nothing added
    assert others(parse_metrics("vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"), 5) == 0


LLAMA_501 = ('{"error":{"code":501,"message":"This server does not support slots endpoint. Start it with `--slots`",'
             '"type":"not_supported_error"}}')


async def test_r6_17_poller_reads_a_llama_servers_slot_count_beside_its_metrics():
    """With --metrics (llmgw's template) the queue comes from /metrics and the slot count from
    /slots, else /props; vLLM is asked for /metrics only; an engine that refuses both is not
    asked again; the count stays known while the engine does not answer."""
    seen: list = []
    metrics = (200, fixture("llama_server_metrics.txt"))
    slots, slots_url = await engine({"/metrics": metrics, "/slots": (200, fixture("llama_server_slots_busy.json"))}, seen)
    props, props_url = await engine({"/metrics": metrics, "/slots": (501, LLAMA_501),
                                     "/props": (200, fixture("llama_server_props.json"))}, seen)
    neither, neither_url = await engine({"/metrics": metrics}, seen)
    vllm, vllm_url = await engine({"/metrics": (200, fixture("vllm_metrics_busy.txt"))}, seen)
    b = Balancer()
    b.replace({"m": [Endpoint("s", "m", slots_url, "k"), Endpoint("p", "m", props_url, "k"),
                     Endpoint("n", "m", neither_url, "k"), Endpoint("v", "m", vllm_url, "k")]})
    changes: list[dict] = []
    try:
        async with aiohttp.ClientSession() as session:
            poller = EnginePoller(b, session, on_slots=lambda: changes.append({up.replica_id: up.slots for up in b.upstreams()}))
            assert await poller.poll_once() is True
            first = sorted(seen)
            seen.clear()
            assert await poller.poll_once() is False  # the same counts: no change to tell
            second = sorted(seen)
            await slots.cleanup()  # the engine stops answering: its load is unknown, its slot count kept
            assert await poller.poll_once() is False
    finally:
        for runner in (slots, props, neither, vllm):
            await runner.cleanup()
    print("first poll:", first, "\nsecond poll:", second)
    assert changes == [{"s": 3, "p": 3, "n": None, "v": None}]
    assert (b.engine_load("p").slots, b.engine_load("p").running, b.engine_load("p").waiting) == (3, 0, 0)
    assert b.engine_load("n").slots is None and b.engine_load("v").slots is None
    assert b.engine_load("s") is None and b.endpoints("m")[0].slots == 3
    paths = [path for path, _ in first]
    assert paths.count("/metrics") == 4 and paths.count("/slots") == 3 and paths.count("/props") == 2
    # the second poll asks each for what answered: /slots, /props, nothing beside /metrics, /metrics
    assert sorted(path for path, _ in second) == ["/metrics"] * 4 + ["/props", "/slots"]


async def test_r6_17_poller_reads_slots_alone_from_a_llama_server_without_metrics():
    seen: list = []
    refused = (501, '{"error":{"code":501,"message":"This server does not support metrics endpoint."}}')
    plain, plain_url = await engine({"/metrics": refused, "/slots": (200, fixture("llama_server_slots_busy.json"))}, seen)
    bare, bare_url = await engine({"/metrics": refused, "/slots": (501, LLAMA_501),
                                   "/props": (200, fixture("llama_server_props.json"))}, seen)
    b = Balancer()
    b.replace({"m": [Endpoint("plain", "m", plain_url, "k"), Endpoint("bare", "m", bare_url, "k")]})
    try:
        async with aiohttp.ClientSession() as session:
            await EnginePoller(b, session).poll_once()
    finally:
        await plain.cleanup()
        await bare.cleanup()
    assert (b.engine_load("plain").slots, b.engine_load("plain").running) == (3, 1)
    bare_load = b.engine_load("bare")
    assert (bare_load.source, bare_load.slots, bare_load.running, bare_load.waiting) == ("llama-server", 3, None, None)


async def test_r6_5a_a_request_that_ends_during_the_poll_is_not_left_as_the_engines_queue():
    """The engine counts a request of ours that ends while its /metrics answer is on the way: that
    request is not the engine's own load once it has ended here (else it weighs on the replica, and
    on prefix routing's bound, until the next poll)."""
    b = Balancer()
    ours: list = []

    async def handler(request: web.Request) -> web.Response:
        b.release(ours.pop())  # counted by the engine below, ended here before its answer arrives
        return web.Response(text='vllm:num_requests_waiting{engine="0"} 0.0\nvllm:num_requests_running{engine="0"} 3.0\n')
    runner, url = await serving(handler)
    b.replace({"m": [Endpoint("e", "m", url, "k")]})
    ours.extend(b.acquire("m", 1.0) for _ in range(3))  # the engine's 3 are all ours
    try:
        async with aiohttp.ClientSession() as session:
            await EnginePoller(b, session).poll_once()
    finally:
        await runner.cleanup()
    up = b.endpoints("m")[0]
    assert (up.outstanding, up.queued) == (2, 0)
