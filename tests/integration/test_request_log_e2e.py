"""Following a request through the whole system (R-6.20): a real `llmgw serve` on a testbed node
whose engine doubles serve two models, its own router worker and a second router (`llmgw router`,
fed over the admin listener with a credential of its own); requests sent to each router with the
official `openai` client and raw HTTP, then read back with `llmgw ctl requests` as an operator
does: --json, the filters, -n, --follow and the table.

One gateway for the module: the requests are sent once (`traffic`), and each test reads what the
control plane made of them.
"""

from __future__ import annotations

import json
import secrets
import signal
import statistics
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai
import pytest

from llmgw.router.supervisor import running_supervisor
from tests.integration.gateway import GatewayProcess, free_port, stop_router_supervisor, wait_for
from tests.integration.test_request_log import GUARD, Lines, ctl, ctl_argv, listed
from tests.scenarios.operating import write_inventory
from tests.testbed import NodeSpec

pytestmark = pytest.mark.testbed

NODE = "gpu1"
MODELS = ("chat", "other")
HELLO = [{"role": "user", "content": "one two three"}]  # the double counts 3 prompt tokens
CHAT = "/v1/chat/completions"
ROUTE = "POST " + CHAT
ID = "X-Request-Id"
UNUSABLE_ID = "not usable here"  # spaces: the router makes an id of its own and keeps this one aside
WRONG_KEY = "sk-llmgw-" + "0" * 40  # shaped like a key, known to no one


@dataclass
class System:
    gateway: GatewayProcess
    routers: dict[str, str]  # "serve" (serve's own worker) / "edge" (`llmgw router`) -> its base URL
    keys: dict[str, str]  # key name -> the key
    replicas: dict[str, tuple[str, str]] = field(default_factory=dict)  # model -> (replica id, node)

    def client(self, router: str, key: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.routers[router] + "/v1", api_key=self.keys[key], max_retries=0)


def raw_post(url: str, secret: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """POST `body` as JSON with urllib (no client library between): (status, headers, JSON answer)."""
    request = urllib.request.Request(url + CHAT, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=GUARD) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def serves(system: System, router: str, key: str, model: str) -> bool:
    reply = system.client(router, key).chat.completions.create(model=model, messages=HELLO)
    return bool(reply.choices[0].message.content)


@pytest.fixture(scope="module")
def system(testbed_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reqlog-e2e")
    bed = testbed_factory([NodeSpec.gpu_node(NODE, 2, mem_gb=64, cache_mb=32, tmp_mb=32)])
    gateway = edge = None
    edge_dir = tmp / "edge"
    try:
        bed.weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 256 << 10})
        profiles = {"h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "60s"}}
        models = [{"name": name, "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.001,
                   "scaling": {"min": 1}} for name in MODELS]
        inventory = write_inventory(bed, tmp / "inventory.yaml", models=models, profiles=profiles)
        gateway = GatewayProcess(inventory, tmp / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint}, workers=1)
        gateway.start()

        # The second router: a credential of its own, fed over the admin listener.
        added = ctl(gateway, "routers", "add", "edge1")
        assert added.returncode == 0, added.stderr
        credential = tmp / "edge1.credential"
        credential.write_text(added.stdout.strip() + "\n")
        credential.chmod(0o600)
        port = free_port()
        edge = subprocess.Popen([sys.executable, "-m", "llmgw.cli.main", "router", "--control",
                                 f"http://127.0.0.1:{gateway.admin_port}", "--credential-file", str(credential),
                                 "--listen", f"127.0.0.1:{port}", "--state-dir", str(edge_dir)],
                                stdout=open(tmp / "edge.log", "ab"), stderr=subprocess.STDOUT, env=gateway.env)

        system = System(gateway, {"serve": gateway.url, "edge": f"http://127.0.0.1:{port}"},
                        {name: gateway.create_key(name) for name in ("alice", "bob")})
        for router in system.routers:
            for model in MODELS:
                wait_for(lambda: serves(system, router, "alice", model) and serves(system, router, "bob", model),
                         120, f"{model} served through the {router} router with both keys\n{gateway.log()[-3000:]}",
                         interval=0.5)
        # What the cleanup stops: the `llmgw router` started above, found as the supervisor of its state directory.
        assert running_supervisor(edge_dir) == edge.pid
        for replica in gateway.admin("/api/replicas")[1]["replicas"]:
            if not replica["retired"]:
                system.replicas[replica["model"]] = (replica["id"], replica["shards"][0]["node"])
        assert set(system.replicas) == set(MODELS), system.replicas
        yield system
    finally:
        try:
            if edge is not None:
                try:  # SIGTERM to the supervisor (the process started above), which is to stop its workers too
                    stop_router_supervisor(edge_dir, log=lambda: (tmp / "edge.log").read_text(errors="replace"))
                finally:
                    if edge.poll() is None:  # it never took its state directory
                        edge.kill()
                    edge.wait()
        finally:
            try:
                if gateway is not None:
                    gateway.stop()
            finally:
                bed.close()


@dataclass(frozen=True)
class Sent:
    """One request as its client saw it."""

    router: str
    kind: str
    id: str  # the answer's X-Request-Id
    status: int
    key: str | None = None  # the key's name
    model: str | None = None
    usage: tuple[int, int] | None = None  # the tokens in and out the client was told
    client_request_id: str | None = None


def send_each_kind(system: System, router: str) -> list[Sent]:
    client = system.client(router)
    sent = []

    plain = client.chat.completions.with_raw_response.create(model="chat", messages=HELLO)
    usage = plain.parse().usage
    sent.append(Sent(router, "plain", plain.headers[ID], 200, "alice", "chat",
                     (usage.prompt_tokens, usage.completion_tokens)))

    stream = client.chat.completions.with_raw_response.create(model="chat", messages=HELLO, stream=True,
                                                              stream_options={"include_usage": True})
    chunks = list(stream.parse())
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1  # streamed, not one answer
    usage = chunks[-1].usage
    sent.append(Sent(router, "stream", stream.headers[ID], 200, "alice", "chat",
                     (usage.prompt_tokens, usage.completion_tokens)))

    own = f"e2e-{router}-{secrets.token_hex(4)}"
    answer = client.chat.completions.with_raw_response.create(model="chat", messages=HELLO, extra_headers={ID: own})
    assert answer.headers[ID] == own  # a usable id of the client's is the request's
    usage = answer.parse().usage
    sent.append(Sent(router, "own-id", own, 200, "alice", "chat", (usage.prompt_tokens, usage.completion_tokens)))

    status, headers, body = raw_post(system.routers[router], system.keys["alice"],
                                     {"model": "chat", "messages": HELLO}, {ID: UNUSABLE_ID})
    assert status == 200 and headers[ID] != UNUSABLE_ID and headers[ID]
    sent.append(Sent(router, "unusable-id", headers[ID], 200, "alice", "chat",
                     (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]), UNUSABLE_ID))

    status, headers, body = raw_post(system.routers[router], WRONG_KEY, {"model": "chat", "messages": HELLO})
    assert status == 401 and body["error"]["request_id"] == headers[ID]
    sent.append(Sent(router, "401", headers[ID], 401))

    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    sent.append(Sent(router, "404", refused.value.response.headers[ID], 404, "alice"))

    other = system.client(router, "bob").chat.completions.with_raw_response.create(model="other", messages=HELLO)
    usage = other.parse().usage
    sent.append(Sent(router, "bob-other", other.headers[ID], 200, "bob", "other",
                     (usage.prompt_tokens, usage.completion_tokens)))
    return sent


@pytest.fixture(scope="module")
def traffic(system) -> list[Sent]:
    """Each kind of request sent to each router, once the control plane has all their records."""
    sent = [s for router in system.routers for s in send_each_kind(system, router)]
    assert len({s.id for s in sent}) == len(sent)  # one id each
    wanted = {s.id for s in sent}
    wait_for(lambda: wanted <= {r["id"] for r in listed(system.gateway, "-n", "1000")}, GUARD,
             "every request's record in `ctl requests --json`", interval=0.5)
    return sent


def test_r6_20_each_request_to_each_router_is_recorded_once_with_what_happened(system, traffic):
    done = ctl(system.gateway, "requests", "--json", "-n", "1000")
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)["requests"]
    by_id = {}
    for record in records:
        assert record["id"] not in by_id, record  # once, though reports may be sent again
        by_id[record["id"]] = record

    routers = {s.router: {by_id[t.id]["router"] for t in traffic if t.router == s.router} for s in traffic}
    assert len(routers["serve"]) == len(routers["edge"]) == 1  # one router process each
    (serve_router,), (edge_router,) = routers["serve"], routers["edge"]
    assert serve_router.startswith("local/") and edge_router.startswith("edge1/")

    for sent in traffic:
        record = by_id[sent.id]
        what = f"{sent.router} {sent.kind}: {record}"
        assert record["router"] == {"serve": serve_router, "edge": edge_router}[sent.router], what
        assert (record["route"], record["status"], record["key"]) == (ROUTE, sent.status, sent.key), what
        assert record["client"] == "127.0.0.1" and record["client_request_id"] == sent.client_request_id, what
        # Only a name that found no model is kept as asked; none of these calls an alias.
        assert record["asked"] == ("no-such-model" if sent.status == 404 else None), what
        assert record["fallback"] is None and record["queued"] is None, what
        if sent.status == 200:
            replica, node = system.replicas[sent.model]
            assert node == NODE
            assert (record["model"], record["replica"], record["node"], record["attempts"], record["error"]) == \
                (sent.model, replica, NODE, 1, None), what
            assert (record["prompt_tokens"], record["completion_tokens"], record["estimated"]) == \
                (*sent.usage, False), what
            assert record["stream"] == (sent.kind == "stream"), what
            assert 0 < record["ttfb"] <= record["duration"], what
        else:
            error = {401: "invalid_api_key", 404: "model_not_found"}[sent.status]
            assert (record["error"], record["replica"], record["node"], record["attempts"]) == \
                (error, None, None, 0), what
            assert record["prompt_tokens"] is None and record["completion_tokens"] is None, what
            assert record["duration"] > 0 and not record["stream"], what
    assert by_id[next(s.id for s in traffic if s.kind == "401")]["model"] is None  # no key: nothing more was read

    shown = ctl(system.gateway, "requests", "-n", "1000")
    assert shown.returncode == 0, shown.stderr
    for secret in (*system.keys.values(), WRONG_KEY):
        assert secret not in done.stdout and secret not in shown.stdout  # the key's name, never the key


def test_r6_20_filters_narrow_and_n_limits(system, traffic):
    everything = listed(system.gateway, "-n", "1000")
    ours = {s.id for s in traffic}

    def only(*args: str, keep) -> list[str]:
        """The ids ctl lists with `args`, checked against the records of the whole listing that `keep` keeps."""
        found = [r["id"] for r in listed(system.gateway, "-n", "1000", *args)]
        assert found == [r["id"] for r in everything if keep(r)], args
        assert found and len(found) < len(everything), args  # narrowed, to something
        return found

    bob = only("--key", "bob", keep=lambda r: r["key"] == "bob")
    assert {s.id for s in traffic if s.key == "bob"} <= set(bob)
    assert not {s.id for s in traffic if s.key == "alice"} & set(bob)

    other = only("--model", "other", keep=lambda r: "other" in (r["model"], r["asked"]))
    assert {s.id for s in traffic if s.model == "other"} <= set(other)

    refused = only("--status", "4xx", keep=lambda r: 400 <= r["status"] < 500)
    assert {s.id for s in traffic if s.status in (401, 404)} <= set(refused)
    assert not {s.id for s in traffic if s.status == 200} & set(refused)
    assert only("--status", "401", keep=lambda r: r["status"] == 401)

    # A threshold from the records themselves: the median of our requests' durations, as ctl reads it.
    median = statistics.median_low(r["duration"] for r in everything if r["id"] in ours)
    text = f"{median:.6f}s"
    threshold = float(text[:-1])
    slower = only("--slower-than", text, keep=lambda r: r["duration"] > threshold)
    assert set(slower) & ours and (ours - set(slower))
    only("--slower-than", text, "--key", "alice", keep=lambda r: r["duration"] > threshold and r["key"] == "alice")

    assert [r["id"] for r in listed(system.gateway, "-n", "3")] == [r["id"] for r in everything[:3]]
    alices = [r["id"] for r in everything if r["key"] == "alice"]
    assert [r["id"] for r in listed(system.gateway, "--key", "alice", "-n", "2")] == alices[:2]
    assert len(listed(system.gateway)) == min(50, len(everything))  # 50 unless told


def test_r6_20_the_table_shows_dash_for_what_is_unknown(system, traffic):
    shown = ctl(system.gateway, "requests", "-n", "1000")
    assert shown.returncode == 0, shown.stderr
    print(shown.stdout)
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:3] == ["TIME", "ID", "KEY"]
    for sent in traffic:
        # From the ID on (TIME is a date and a clock on another day): ID KEY MODEL STATUS (and its
        # error code) REPLICA@NODE ATTEMPTS QUEUE TTFB DURATION TOKENS
        row = next(row_from(line, sent.id) for line in lines[1:] if sent.id in line.split())
        if sent.kind == "401":
            assert row[1:7] == ["-", "-", "401", "invalid_api_key", "-", "0"], row
            assert row[7] == "-" and row[-1] == "-", row  # never queued, no tokens
        elif sent.kind == "404":
            # The name asked, which found no model, in words: `no-such-model (not found)`.
            assert row[1:9] == ["alice", "no-such-model", "(not", "found)", "404", "model_not_found", "-", "0"], row
            assert row[9] == "-" and row[-1] == "-", row
        else:
            replica, node = system.replicas[sent.model]
            assert row[1:6] == [sent.key, sent.model, "200", f"{replica}@{node}", "1"], row
            assert row[6] == "-" and row[-1] == "%d/%d" % sent.usage, row  # never queued; counted, not estimated


def row_from(line: str, rid: str) -> list[str]:
    """A row of the table, as words, from its ID on."""
    words = line.split()
    return words[words.index(rid):]


def test_r6_20_follow_prints_a_new_request_from_either_router_and_ends_on_sigint(system, traffic):
    env = {**system.gateway.env, "COLUMNS": "250"}
    documents = Lines(ctl_argv(system.gateway, "requests", "--follow", "--json", "--key", "alice", "-n", "1"), env)
    table = Lines(ctl_argv(system.gateway, "requests", "--follow", "--model", "chat", "-n", "1"), env)
    try:
        first = json.loads(documents.until(lambda line: line.startswith("{"), "with the latest record"))
        assert len(first["requests"]) == 1 and first["requests"][0]["key"] == "alice"
        table.until(lambda line: line.startswith("TIME"), "with the table's header")

        # Filtered out of both: bob's, sent before the others to the router that reports them first.
        filtered = f"e2e-follow-bob-{secrets.token_hex(4)}"
        system.client("serve", "bob").chat.completions.create(model="other", messages=HELLO,
                                                              extra_headers={ID: filtered})
        new = {router: f"e2e-follow-{router}-{secrets.token_hex(4)}" for router in system.routers}
        for router, rid in new.items():
            answer = system.client(router).chat.completions.with_raw_response.create(
                model="chat", messages=HELLO, extra_headers={ID: rid})
            assert answer.headers[ID] == rid
        followed = {}
        while set(new.values()) - set(followed):
            document = json.loads(documents.until(lambda line: line.startswith("{"), "with the new records"))
            followed.update((r["id"], r) for r in document["requests"])
        for router, rid in new.items():
            record = followed[rid]
            assert (record["key"], record["model"], record["status"], record["node"]) == ("alice", "chat", 200, NODE)
            assert record["router"].startswith({"serve": "local/", "edge": "edge1/"}[router])
        for rid in new.values():  # in the order the control plane took them in, which is either
            if not any(rid in line.split() for line in table.seen):
                table.until(lambda line, rid=rid: rid in line.split(), f"with the row of {rid}")
            row = next(row_from(line, rid) for line in table.seen if rid in line.split())
            assert row[:4] == [rid, "alice", "chat", "200"], row

        for follower in (documents, table):
            follower.proc.send_signal(signal.SIGINT)  # an operator's Ctrl-C ends a follow quietly
            code, said = follower.end()
            assert code == 0, said
        assert filtered not in followed and not any(filtered in line for line in table.seen)
        assert not any(secret in line for secret in system.keys.values() for line in documents.seen + table.seen)
    finally:
        documents.kill()
        table.kill()

