"""What the real engines do with LoRA adapters of the tiny model (docs/architecture.md, "LoRA
adapters: what the engines do"): vLLM's CPU build with `--enable-lora` and runtime loading, and
llama-server with `--lora` files chosen per request. Each engine is launched as llmgw launches it
(built-in template, node helper, the replica's key) and started once per module, except the vLLM
that must refuse its launch; the last vLLM test ends its engine. The vLLM's port is also checked
to serve nothing without the key (R-4.6; test_engine_ports.py checks llama-server's).

The adapters come from tests/testbed/make_models.py: lora-a and lora-b of rank 8, lora-big of
rank 32, with random weights strong enough that a greedy answer differs from the base model's.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from tests.integration.gateway import wait_for
from tests.real_engines.engines import CHAT, EXTRA_ROUTES, bin_dir, launch_engine, probe_all, stop_engine
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # CPU vLLM starts on a busy machine

PROMPT = "hello there"
# lora-a and lora-b (rank 8) fit, lora-big (rank 32) does not.
MAX_LORA_RANK = 8
VLLM_LORA_ARGS = ["--max-model-len", "1024", "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
                  "--max-loras", "1", "--max-cpu-loras", "2"]
VLLM_LORA_ENV = {**real.VLLM_TEST_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@pytest.fixture(scope="module")
def made():
    return real.models()


def _launched(engine: str, tmp_path_factory, model: str, args: list[str], env=None, what: str = ""):
    root = tmp_path_factory.mktemp("node") / "llmgw"
    root.mkdir()
    began = time.monotonic()
    launched = launch_engine(root, engine, bin_dir(engine), model, args=args, env=env)
    print(f"\n{engine} {what}: healthy in {time.monotonic() - began:.1f} s")
    return launched, root


def _json(engine, method: str, path: str, body: dict | None = None) -> tuple[int, dict | list | str]:
    """The engine's answer with the replica's key: JSON where it is JSON, else its text."""
    status, data = engine.request(method, path, body, engine.key)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


# --- vLLM ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, made):
    """lora-a given at launch, runtime loading on, one adapter per batch, two kept in memory."""
    launched, root = _launched("vllm", tmp_path_factory, str(made["chat"]),
                               [*VLLM_LORA_ARGS, "--lora-modules", f"lora-a={made['lora-a']}"],
                               env=VLLM_LORA_ENV, what="--enable-lora")
    yield launched
    stop_engine(launched, root)


def vllm_answer(engine, model: str) -> list[int]:
    """The greedy answer's token ids for `model` (the base or an adapter's name)."""
    status, body = _json(engine, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    assert body["model"] == model
    return body["choices"][0]["token_ids"]


def vllm_models(engine) -> dict[str, dict]:
    status, body = _json(engine, "GET", "/v1/models")
    assert status == 200, body
    return {card["id"]: card for card in body["data"]}


def load(engine, name: str, path) -> tuple[int, dict | str]:
    return _json(engine, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(engine, name: str) -> tuple[int, dict | str]:
    return _json(engine, "POST", "/v1/unload_lora_adapter", {"lora_name": name})


def test_vllm_serves_no_route_without_the_key(vllm):
    """R-4.6 on this module's vLLM, as the template launches it with adapters: every route of its
    OpenAPI document (the runtime adapter routes among them) refuses a request without the key."""
    status, data = vllm.request("GET", "/openapi.json", key=vllm.key)
    assert status == 200, data[:200]
    document = json.loads(data)
    routes = [(method.upper(), path) for path, methods in document["paths"].items() for method in methods]
    assert ("POST", "/invocations") in routes and ("POST", "/v1/chat/completions") in routes
    seen, served = probe_all(vllm, routes + EXTRA_ROUTES, open_routes={("GET", "/health")})
    print(f"\nvLLM: {len(set(routes))} routes from its OpenAPI document, {len(seen)} requests without the key "
          f"or with a wrong one; statuses {sorted({s for *_, s in seen})}")
    assert served == [], served
    assert vllm.request("GET", "/health")[0] == 200
    # The key still opens what llmgw uses, and what vLLM alone left open is now behind it too.
    assert vllm.request("POST", "/v1/chat/completions", body=CHAT, key=vllm.key)[0] == 200
    assert vllm.request("POST", "/invocations", body=CHAT, key=vllm.key)[0] == 200
    assert vllm.request("POST", "/tokenize", body={"model": "tiny", "prompt": "hello"}, key=vllm.key)[0] == 200
    assert vllm.key not in " ".join(vllm.argv), "the key is never in argv (R-1.6)"


def test_vllm_lists_a_launch_adapter_under_its_base_and_serves_it_by_name(vllm, made):
    cards = vllm_models(vllm)
    assert sorted(cards) == ["lora-a", "tiny"]
    assert (cards["lora-a"]["parent"], cards["lora-a"]["root"]) == ("tiny", str(made["lora-a"]))
    assert cards["tiny"]["parent"] is None
    base, adapted = vllm_answer(vllm, "tiny"), vllm_answer(vllm, "lora-a")
    print("greedy token ids: base", base, "lora-a", adapted)
    assert adapted != base
    assert vllm_answer(vllm, "lora-a") == adapted  # greedy: the adapter's answer, every time
    status, chat = _json(vllm, "POST", "/v1/chat/completions", {
        "model": "lora-a", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
    assert (status, chat["model"]) == (200, "lora-a"), chat


def test_vllm_loads_serves_and_unloads_an_adapter_at_runtime(vllm, made):
    base, launch_adapter = vllm_answer(vllm, "tiny"), vllm_answer(vllm, "lora-a")
    # The routes are behind the replica's key, like every route but /health (llmgw's guard).
    status, _ = vllm.request("POST", "/v1/load_lora_adapter", {"lora_name": "lora-b", "lora_path": str(made["lora-b"])})
    assert status == 401
    began = time.monotonic()
    assert load(vllm, "lora-b", made["lora-b"]) == (200, "Success: LoRA adapter 'lora-b' added successfully.")
    print(f"\nruntime load of lora-b: {1000 * (time.monotonic() - began):.0f} ms")
    try:
        card = vllm_models(vllm)["lora-b"]
        assert (card["parent"], card["root"]) == ("tiny", str(made["lora-b"]))
        answer = vllm_answer(vllm, "lora-b")
        assert answer not in (base, launch_adapter)
    finally:
        assert unload(vllm, "lora-b") == (200, "Success: LoRA adapter 'lora-b' removed successfully.")
    assert "lora-b" not in vllm_models(vllm)
    assert _json(vllm, "POST", "/v1/completions", {"model": "lora-b", "prompt": PROMPT, "max_tokens": 2}) == (404, {
        "error": {"message": "The model `lora-b` does not exist. Valid aliases: tiny.", "type": "NotFoundError",
                  "param": "model", "code": 404}})
    # An unload removes the launch adapter too.
    assert unload(vllm, "lora-a")[0] == 200
    assert sorted(vllm_models(vllm)) == ["tiny"]
    assert load(vllm, "lora-a", made["lora-a"])[0] == 200
    assert vllm_answer(vllm, "lora-a") == launch_adapter


def test_vllm_serves_more_adapters_than_it_keeps_evicting_the_least_recently_used(vllm, made):
    """Past --max-cpu-loras (2) a load is not refused: vLLM drops the adapter used least recently
    from memory and reads it from its path again when a request names it; past --max-loras (1)
    requests for other adapters wait for the batch."""
    expected = {"tiny": vllm_answer(vllm, "tiny"), "lora-a": vllm_answer(vllm, "lora-a")}
    names = {"lora-b": made["lora-b"], "lora-b-again": made["lora-b"]}
    for name, path in names.items():
        assert load(vllm, name, path)[0] == 200
    try:
        assert sorted(vllm_models(vllm)) == ["lora-a", "lora-b", "lora-b-again", "tiny"]
        expected["lora-b"] = expected["lora-b-again"] = vllm_answer(vllm, "lora-b")
        assert expected["lora-b"] != expected["lora-a"]
        # Three adapters in turn through two places in memory: each answer needs a reload.
        for name in ["lora-a", "lora-b-again", "lora-b", "lora-a", "lora-b-again", "lora-a"]:
            assert vllm_answer(vllm, name) == expected[name], name

        answers: dict[str, list[int]] = {}

        def ask(name: str) -> None:
            answers[name] = vllm_answer(vllm, name)
        threads = [threading.Thread(target=ask, args=(name,)) for name in ("lora-a", "lora-b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert answers == {name: expected[name] for name in ("lora-a", "lora-b")}
    finally:
        for name in names:
            unload(vllm, name)


NOT_FOUND_PATH = "/nonexistent/llmgw-lora"  # outside the folders vLLM hides in its messages


@pytest.mark.parametrize("route, body, status, error", [
    pytest.param("/v1/load_lora_adapter", {"lora_name": "lora-big", "lora_path": "lora-big"}, 500, {
        "message": "Call to add_lora method failed: Worker failed with error 'LoRA rank 32 is greater than "
                   "max_lora_rank 8.', please check the stack trace above for the root cause",
        "type": "InternalServerError", "param": None, "code": 500}, id="rank-above-max-lora-rank"),
    # vLLM writes <path> for any path under /home, /usr, /opt, /var, /tmp, /root, /lib, /mnt, /srv.
    pytest.param("/v1/load_lora_adapter", {"lora_name": "model", "lora_path": "chat"}, 404, {
        "message": "Loading lora model failed: No adapter found for <path>",
        "type": "NotFoundError", "param": None, "code": 404}, id="a-model-not-an-adapter"),
    pytest.param("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": NOT_FOUND_PATH}, 404, {
        "message": f"Loading lora gone failed: No adapter found for {NOT_FOUND_PATH}",
        "type": "NotFoundError", "param": None, "code": 404}, id="no-such-path"),
    pytest.param("/v1/load_lora_adapter", {"lora_name": "lora-a", "lora_path": "lora-a"}, 400, {
        "message": "The lora adapter 'lora-a' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.",
        "type": "InvalidUserInput", "param": None, "code": 400}, id="name-taken"),
    pytest.param("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "lora-b"}, 400, {
        "message": "The lora adapter 'tiny' conflicts with a served base model.",
        "type": "InvalidUserInput", "param": None, "code": 400}, id="the-base-models-name"),
    pytest.param("/v1/unload_lora_adapter", {"lora_name": "lora-z"}, 404, {
        "message": "The lora adapter 'lora-z' cannot be found.",
        "type": "NotFoundError", "param": None, "code": 404}, id="unload-unknown"),
    pytest.param("/v1/completions", {"model": "lora-z", "prompt": PROMPT, "max_tokens": 2}, 404, {
        "message": "The model `lora-z` does not exist. Valid aliases: tiny.",
        "type": "NotFoundError", "param": "model", "code": 404}, id="request-names-unknown-adapter"),
])
def test_vllm_refusals(vllm, made, route, body, status, error):
    if "lora_path" in body and body["lora_path"] in made:
        body = {**body, "lora_path": str(made[body["lora_path"]])}
    before = sorted(vllm_models(vllm))
    assert _json(vllm, "POST", route, body) == (status, {"error": error})
    assert sorted(vllm_models(vllm)) == before
    assert vllm_answer(vllm, "lora-a")  # the engine serves on


def test_vllm_ends_when_an_evicted_adapters_files_are_gone(vllm, made, tmp_path):
    """Last of the vLLM tests: it ends the module's engine. An adapter vLLM dropped from memory
    is read again from its path at its next request; when that fails, the whole engine exits."""
    doomed = tmp_path / "doomed"
    shutil.copytree(made["lora-b"], doomed)
    assert load(vllm, "doomed", doomed)[0] == 200
    assert load(vllm, "lora-b", made["lora-b"])[0] == 200
    vllm_answer(vllm, "doomed")
    vllm_answer(vllm, "lora-a")
    vllm_answer(vllm, "lora-b")  # two others since: doomed is out of the two places in memory
    shutil.rmtree(doomed)
    assert _json(vllm, "POST", "/v1/completions", {"model": "doomed", "prompt": PROMPT, "max_tokens": 2}) == (500, {
        "error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                  "type": "InternalServerError", "param": None, "code": 500}})

    def ended():  # the supervisor records the status just after the process is gone
        shard = next(s for s in vllm.helper.call("status", {"probe": False})["shards"] if s["shard_id"] == vllm.shard_id)
        return shard if not shard["alive"] and shard["exit_code"] is not None else None
    shard = wait_for(ended, 60, "the engine to exit")
    assert shard["exit_code"] == 0  # its API server shuts down in order once its engine is dead
    assert "Worker failed with error 'Loading lora doomed failed: No adapter found for" in vllm.log()


# --- llama-server --------------------------------------------------------------------------------


def _lora_files(made) -> str:
    return ",".join(str(made[name]) for name in ("lora-a-gguf", "lora-b-gguf", "lora-big-gguf"))


def _require_lora_ggufs() -> None:
    reason = real.lora_gguf_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, made):
    """ids 0, 1, 2 = lora-a, lora-b, lora-big; one slot, no prompt cache in host memory."""
    _require_lora_ggufs()
    launched, root = _launched("llama-server", tmp_path_factory, str(made["gguf"]),
                               ["-c", "2048", "--parallel", "1", "--cache-ram", "0",
                                "--lora", _lora_files(made), "--lora-init-without-apply"], what="--lora a,b,big")
    yield launched
    stop_engine(launched, root)


@pytest.fixture(scope="module")
def llama_prompt_cache(tmp_path_factory, made):
    """The same with llama-server's prompt cache in host memory (--cache-ram, on by default)."""
    _require_lora_ggufs()
    launched, root = _launched("llama-server", tmp_path_factory, str(made["gguf"]),
                               ["-c", "2048", "--parallel", "1", "--lora", _lora_files(made)],
                               what="--lora a,b,big with its prompt cache")
    yield launched
    stop_engine(launched, root)


NO_LORA = object()  # a request without the `lora` field


def llama_answer(engine, lora=NO_LORA, prompt: str = PROMPT) -> tuple[str, int]:
    """The greedy answer's text and how many prompt tokens came from the engine's cache."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if lora is not NO_LORA:
        body["lora"] = lora
    status, answer = _json(engine, "POST", "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def only(adapter: int | None) -> list[dict]:
    """A `lora` list applying one adapter at scale 1 (None: none); unlisted ids get scale 0."""
    return [{"id": 0, "scale": 0.0}] if adapter is None else [{"id": adapter, "scale": 1.0}]


ALL = [{"id": n, "scale": 1.0} for n in range(3)]


def test_llama_server_lists_its_adapters_by_id_at_scale_1(llama, made):
    status, adapters = _json(llama, "GET", "/lora-adapters")
    assert status == 200, adapters
    # --lora-init-without-apply leaves every scale at 1.0: it only skips applying them at start.
    assert [(a["id"], a["path"], a["scale"]) for a in adapters] == [
        (0, str(made["lora-a-gguf"]), 1.0), (1, str(made["lora-b-gguf"]), 1.0), (2, str(made["lora-big-gguf"]), 1.0)]


def test_llama_server_applies_the_adapters_a_request_lists(llama):
    base = llama_answer(llama, only(None))[0]
    answers = {n: llama_answer(llama, only(n))[0] for n in range(3)}
    print("\ngreedy answers: base", repr(base), "adapters", answers)
    assert len({base, *answers.values()}) == 4  # each adapter answers its own way
    assert llama_answer(llama, only(0))[0] == answers[0]
    # Without `lora`, or with an empty list, a request gets the global scales: every adapter at
    # 1.0 here. (Asked right after the same adapters, so the slot's cache is theirs.)
    together = llama_answer(llama, ALL)[0]
    assert together not in (base, *answers.values())
    assert llama_answer(llama)[0] == together
    assert llama_answer(llama, [])[0] == together
    status, chat = _json(llama, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "lora": only(1)})
    assert status == 200, chat


@pytest.mark.parametrize("lora", [
    pytest.param([{"id": 3, "scale": 1.0}], id="id-past-the-last"),
    pytest.param([{"id": -1, "scale": 1.0}], id="negative-id"),
    pytest.param([{"id": "lora-a", "scale": 1.0}], id="id-not-a-number"),
    pytest.param([{"id": 0}], id="no-scale"),
])
def test_llama_server_ignores_an_unknown_adapter_id(llama, lora):
    """No error: entries naming no adapter are dropped and every adapter not listed gets scale 0,
    so the answer is the base model's (a missing scale is 0)."""
    base = llama_answer(llama, only(None))[0]
    assert llama_answer(llama, lora)[0] == base


def test_llama_server_refuses_a_lora_field_that_is_not_a_list(llama):
    assert _json(llama, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "lora": {"id": 0, "scale": 1}}) == (
        400, {"error": {"code": 400, "type": "invalid_request_error",
                        "message": "Field 'lora': Error: 'lora' must be an array of objects with 'id' and 'scale' fields"}})


# Two prompts through one slot: the second's base answer again after it ran under lora-b.
STALE_SEQUENCE = [("first", None), ("first", 0), ("second", None), ("second", 1), ("first", None), ("second", None)]
PROMPTS = {"first": "the model server answers the question of the user with one two three",
           "second": "a request to the gateway is a stream of tokens"}


def _run_sequence(engine) -> list[tuple[str, int]]:
    return [llama_answer(engine, only(adapter), PROMPTS[prompt]) for prompt, adapter in STALE_SEQUENCE]


def test_llama_servers_prompt_cache_serves_a_prompt_computed_under_another_adapter(llama_prompt_cache):
    """llama-server's prompt cache in host memory keeps a prompt's state without the adapters it
    was computed under, and hands it to a slot running other adapters: the second prompt's base
    answer changes once it ran under lora-b."""
    answers = _run_sequence(llama_prompt_cache)
    print("\nanswers (text, cached prompt tokens):", answers)
    (base_text, _), (again_text, again_cached) = answers[2], answers[5]
    assert again_cached > 0 and again_text != base_text


def test_llama_server_without_its_prompt_cache_answers_each_adapter_set_the_same(llama):
    answers = _run_sequence(llama)
    assert answers[5][0] == answers[2][0]
    assert answers[4][0] == answers[0][0]
