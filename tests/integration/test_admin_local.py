"""`llmgw ctl` and the admin listener against a real `llmgw serve` with one local node.

The node is `connection: local` (R-1.7); its model runs the engine test double through a custom
engine template. Covers the token (R-9.3), catalog changes and their refusals (R-8.2–R-8.4),
logs (R-4.8), replicas with a failed one's log tail, usage (R-6.9), /metrics (R-9.7), the
tokenised dashboard URL (R-9.6), and the embedded default (R-9.2).
"""

from __future__ import annotations

import http.cookiejar
import json
import signal
import socket
import sqlite3
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.test_admin_support import (DOUBLES, Serve, free_port, kill_processes_mentioning, read_until,
                                                  wait_for)

ENGINE_WRAPPER = """\
import sys
sys.path.insert(0, {doubles!r})
import engine_double
engine_double.entry_point("vllm", None)
"""


def inventory(tmp: Path) -> dict:
    wrapper = tmp / "engine.py"
    wrapper.write_text(ENGINE_WRAPPER.format(doubles=str(DOUBLES)))
    return {
        "gateway": {"tick": "0.5s"},
        "nodes": [{"name": "local", "connection": "local", "labels": {"role": "test"}}],
        "engines": {"double": {
            "command": [sys.executable, str(wrapper), "serve", "{model}", "--port", "{port}",
                        "--served-model-name", "{name}", "--host", "{host}"],
            "api_key_env": "VLLM_API_KEY"}},
        "profiles": {
            "small": {"engine": "double", "start_timeout": "60s"},
            # The engine double refuses to start, the way an engine out of GPU memory does.
            "refusing": {"engine": "double", "env": {"ENGINE_DOUBLE_REFUSE_START": "CUDA out of memory (double)",
                                                     "ENGINE_DOUBLE_STDERR_LINES": "3"}},
        },
        "models": [{"name": "chat", "profile": "small"},
                   {"name": "broken", "profile": "refusing"}],
    }


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-local")
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(inventory(tmp)))
    serve = Serve(path, tmp / "state")
    try:
        serve.start()
        wait_for(lambda: serve.ctl_json("models")["models"][1]["state"] == "serving", 60, "chat to serve")
        yield serve
        serve.stop()
    finally:
        if serve.process is not None and serve.process.poll() is None:
            serve.process.kill()
        kill_processes_mentioning(str(tmp))


def replica_of(gw: Serve, model: str, serving: bool = True) -> dict:
    for replica in gw.ctl_json("replicas")["replicas"]:
        if replica["model"] == model and (replica["serving"] or not serving):
            return replica
    raise AssertionError(f"no replica of {model}")


# -- the token (R-9.3) -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/status", "/api/nodes", "/api/replicas", "/metrics", "/api/nosuch"])
def test_admin_requests_without_the_token_get_401(gw, path):
    status, body = gw.api(path, token=None)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    status, _ = gw.api(path, token="not-the-token")
    assert status == 401
    status, body = gw.api(path)
    assert status == (404 if path == "/api/nosuch" else 200)


def test_token_file_is_private_and_ctl_refuses_clearly_without_it(gw, tmp_path):
    assert (gw.state_dir / "admin-token").stat().st_mode & 0o777 == 0o600
    wrong = gw.ctl("--token", "wrong", "status")
    assert wrong.exit_code == 1 and wrong.stdout == ""
    assert wrong.stderr.startswith("error: missing or wrong admin token")
    assert len(wrong.stderr.strip().splitlines()) == 1
    elsewhere = Serve(gw.inventory, tmp_path / "nothing")  # never started: no token, no address
    missing = elsewhere.ctl("status")
    assert missing.exit_code == 1 and "no admin token at" in missing.stderr
    unreachable = gw.ctl("--admin", f"127.0.0.1:{free_port()}", "nodes")
    assert unreachable.exit_code == 1 and "cannot reach the admin listener" in unreachable.stderr


def test_admin_listener_is_not_reachable_on_other_addresses(gw):
    host, port = gw.admin_url.removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1"
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with pytest.raises(OSError):
        socket.create_connection((address, int(port)), timeout=2).close()


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


# -- listings -------------------------------------------------------------------------------------


def test_status(gw):
    result = gw.ctl("status")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "GPU capacity: no GPUs reported" in out  # this machine's nvidia-smi is absent: none, known
    assert "nodes: 1 (1 ready; 1 active)" in out
    assert "models: 2 (" in out and "1 serving" in out
    assert "Replicas unasked-for longest" in out
    document = gw.ctl_json("status")
    assert document["nodes"]["total"] == 1 and document["capacity"] == [] and document["gpus_unknown"] == []
    assert document["replicas"]["serving"] >= 1
    chat = next(i for i in document["idle"] if i["model"] == "chat")
    assert chat["last_used"] is None or isinstance(chat["last_used"], float)


def test_nodes(gw):
    result = gw.ctl("nodes")
    assert result.exit_code == 0, result.stderr
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["NODE", "STATE", "ADMIN", "FABRIC", "LABELS", "GPUS", "USED", "FREE", "UNHEALTHY",
                              "MEM", "DISK", "FREE/TOTAL", "SHARED", "FREE/TOTAL"]
    assert row.split()[:9] == ["local", "ready", "active", "-", "role=test", "none", "0", "0", "0"]
    node = gw.ctl_json("nodes")["nodes"][0]
    assert node["name"] == "local" and node["host"] == "local"
    assert isinstance(node["memory_bytes"], int) and node["memory_bytes"] > 0
    assert node["gpus"]["total"] == 0 and node["gpus"]["nvidia_smi"] in ("absent", "ok")
    assert f"{node['memory_bytes'] / 1e9:.1f} GB" in row


def test_models(gw):
    result = gw.ctl("models")
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "serving" in lines["chat"] and "min 1, max 1" in lines["chat"] and "file" in lines["chat"]
    models = {m["name"]: m for m in gw.ctl_json("models")["models"]}
    assert models["chat"]["scaling"] == {"min": 1, "max": 1, "on_demand": False, "idle_timeout": 600.0,
                                         "evictable": False, "evict_idle": None, "scales": False, "target": 2.0,
                                         "up_delay": 30.0, "down_delay": 600.0}
    # Its one replica is what scaling wants, decided without a change: no decision yet.
    assert models["chat"]["desired"] == 1 and models["chat"]["last_scale"] is None
    assert models["chat"]["scale_decisions"] == {"up": 0, "down": 0}
    assert models["chat"]["declared_in"] == "file" and models["chat"]["engine"] == "double"


def test_replicas_show_shards_and_a_failed_ones_log_tail(gw):
    chat = replica_of(gw, "chat")
    out = gw.ctl("replicas").stdout
    assert f"{chat['id']}  chat  serving" in out
    port = chat["shards"][0]["port"]
    assert f"  shard 0 on local (no GPUs) port {port}: serving since " in out

    def failed():
        replicas = gw.ctl_json("replicas")["replicas"]
        return next((r for r in replicas if r["model"] == "broken" and r["state"] == "failed"
                     and r["shards"][0]["log_tail"]), None)
    broken = wait_for(failed, 30, "a failed replica of broken with its log tail")
    shard = broken["shards"][0]
    assert shard["reason"].startswith("engine exited with status")
    assert any("CUDA out of memory (double)" in line for line in shard["log_tail"])
    out = gw.ctl("replicas").stdout
    block = out[out.index(broken["id"]):]
    assert "failed" in block.splitlines()[0]
    assert "    | " in block and "CUDA out of memory (double)" in block
    models = {m["name"]: m for m in gw.ctl_json("models")["models"]}
    assert models["broken"]["failures"] >= 1 and models["broken"]["last_failure"]


def test_replicas_watch_refreshes(gw):
    process = gw.ctl_process("replicas", "--watch", "--interval", "0.2")
    try:
        seen = read_until(process.stdout, lambda text: text.count("--- ") >= 2, 20, "two refreshes")
        assert seen.count("chat  serving") >= 2
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 0


def test_explain_placement(gw):
    result = gw.ctl("explain-placement", "chat")
    assert result.exit_code == 0
    assert result.stdout.startswith("chat: would place on local (no GPUs)")
    assert "plan: would place: local (no GPUs)" in result.stdout
    verdict = gw.ctl_json("explain-placement", "chat")["verdicts"][0]
    assert verdict["node"] == "local" and verdict["fits"]
    missing = gw.ctl("explain-placement", "nosuch")
    assert (missing.exit_code, missing.stderr) == (1, "error: no model named 'nosuch'\n")


# -- logs (R-4.8) ---------------------------------------------------------------------------------


def test_logs(gw):
    chat = replica_of(gw, "chat")
    result = gw.ctl("logs", chat["id"], "-n", "200")
    assert result.exit_code == 0
    assert "vLLM API server version" in result.stdout and "(engine test double)" in result.stdout
    answer = gw.ctl_json("logs", chat["id"], "-n", "2")
    assert answer["replica"] == chat["id"] and answer["shard"] == 0 and len(answer["lines"]) == 2
    wrong_shard = gw.ctl("logs", chat["id"], "--shard", "3")
    assert wrong_shard.exit_code == 1 and "has shards 0-0" in wrong_shard.stderr


def test_logs_follow_streams_new_lines(gw):
    chat = replica_of(gw, "chat")
    process = gw.ctl_process("logs", chat["id"], "-n", "1", "-f")
    try:
        # The engine logs every health probe, so new lines keep coming while it serves.
        read_until(process.stdout, lambda text: text.count("GET /health") >= 3, 30, "followed lines")
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 0


# -- catalog changes (R-8.2–) ----------------------------------------------------------------


def stored_definition(gw: Serve, name: str) -> str | None:
    with sqlite3.connect(f"file:{gw.state_dir / 'state.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT definition FROM models WHERE name = ?", [name]).fetchone()
    return row[0] if row else None


def model_names(gw: Serve) -> list[str]:
    return [m["name"] for m in gw.ctl_json("models")["models"]]


@pytest.mark.parametrize(("text", "message"), [
    pytest.param("name: bad\nprofile: small\nscaling:\n  min: 1\n  max: oops\n",
                 "error: bad.yaml:5: scaling.max: Input should be a valid integer", id="field-path-and-line"),
    pytest.param("name: bad\nprofile: small\nscaling: {min: 3, max: 1}\n",
                 "error: bad.yaml:3: scaling: max (1) must be >= min (3)", id="max-below-min"),
    pytest.param("name: bad\nprofile: nosuch\n", "error: bad.yaml:2: profile: unknown profile 'nosuch'", id="unknown-profile"),
    pytest.param("name: chat\nprofile: small\n", "error: model 'chat' is declared in", id="name-collision"),
    pytest.param("name: bad\nprofile: small\nfallback: nosuch\n", "error: bad.yaml:3: fallback: fallback 'nosuch' is not a model",
                 id="missing-fallback"),
    pytest.param("name: bad\nprofile: small\ncolour: blue\n", "error: bad.yaml:3: colour: unknown field",
                 id="unknown-field"),
])
def test_model_add_refusals_change_nothing(gw, tmp_path, text, message):
    before = model_names(gw)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = gw.ctl("model", "add", "-f", str(path))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith(message), result.stderr
    assert model_names(gw) == before
    assert stored_definition(gw, "bad") is None
    status, body = gw.api("/api/models", method="POST", body={"yaml": text, "source": "bad.yaml"})
    assert status == 400 and body["error"]["message"] == result.stderr.splitlines()[0].removeprefix("error: ")


def test_model_add_scale_remove(gw, tmp_path):
    path = tmp_path / "extra.yaml"
    path.write_text("name: extra\nprofile: small\nscaling:\n  min: 0\n  max: 3\n  idle_timeout: 5m\n")
    added = gw.ctl("model", "add", "-f", str(path))
    assert added.exit_code == 0, added.stderr
    assert added.stdout.strip() == "added extra (profile small; on demand (max 3; 2 in flight per replica), stops after 5m idle)"
    models = {m["name"]: m for m in gw.ctl_json("models")["models"]}
    assert models["extra"]["declared_in"] == "store" and models["extra"]["actor"]
    again = gw.ctl("model", "add", "-f", str(path))
    assert again.exit_code == 1 and "already added at runtime" in again.stderr

    # max < min: refused, and the stored definition is untouched.
    stored = stored_definition(gw, "extra")
    refused = gw.ctl("scale", "extra", "--min", "3", "--max", "1")
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: max (1) must be >= min (3); extra keeps min 0, max 3")
    assert stored_definition(gw, "extra") == stored
    assert {m["name"]: m for m in gw.ctl_json("models")["models"]}["extra"]["scaling"]["max"] == 3

    # The answer shows the scaling in force, with the max the catalog filled in.
    scaled = gw.ctl("scale", "extra", "--min", "2")
    assert scaled.exit_code == 0, scaled.stderr
    assert scaled.stdout.strip() == ("extra: scaling in force: min 2, max 2 (max filled in by the catalog); "
                                     "runs exactly 2 (max = min: no scaling on load)")
    definition = json.loads(stored_definition(gw, "extra"))
    assert definition["scaling"]["min"] == 2 and definition["scaling"]["idle_timeout"] == 300.0
    assert definition["profile"] == "small"  # the rest is written back untouched
    on_demand = gw.ctl_json("scale", "extra", "--min", "0", "--max", "4")
    assert on_demand["scaling"] == {"min": 0, "max": 4, "idle_timeout": 300.0, "on_demand": True, "scales": True,
                                    "target": 2.0}
    shown = gw.ctl("scale", "extra", "--min", "1", "--max", "3")
    assert shown.stdout.strip() == ("extra: scaling in force: min 1, max 3; runs 1 to 3 replicas as load needs "
                                    "(2 in flight per replica)")

    removed = gw.ctl("model", "remove", "extra")
    assert removed.exit_code == 0 and removed.stdout.strip() == "removed extra; its replicas are being stopped"
    assert "extra" not in model_names(gw) and stored_definition(gw, "extra") is None
    assert gw.ctl("model", "remove", "extra").stderr == "error: no model named 'extra'\n"


def test_scale_and_remove_of_a_file_model_are_refused(gw):
    for args in (("scale", "chat", "--min", "2"), ("model", "remove", "chat")):
        result = gw.ctl(*args)
        assert result.exit_code == 1
        assert result.stderr.startswith(f"error: chat is declared in {gw.inventory}; edit it there")
    assert {m["name"]: m for m in gw.ctl_json("models")["models"]}["chat"]["scaling"]["min"] == 1


def test_scale_help_explains_what_min_and_max_mean(gw):
    result = gw.ctl("scale", "--help")
    text = " ".join(result.stdout.split())
    assert "A model runs at least min replicas and at most max; in between, load decides" in text
    assert "Without --max, max is min (1 for an on-demand model): the model runs exactly that many" in text
    assert "loads one replica when asked, more under load up to its max" in text


# -- storage, reclaim, usage, metrics, dashboard ----------------------------------------------------


def test_storage_and_reclaim(gw):
    storage = gw.ctl("storage")
    assert storage.exit_code == 0 and storage.stdout.splitlines()[1].split()[0] == "local"
    node = gw.ctl_json("storage")["nodes"][0]
    assert node["cache_dir"].endswith("/cache") and node["holdings"] is not None
    listed = gw.ctl("reclaim")
    assert listed.stdout.strip() == "nothing to reclaim: every cache entry is wanted by a model of the catalog"
    collected = gw.ctl_json("reclaim", "--collect")
    assert collected["collect"] is True and collected["asked_to_remove"] == 0
    assert gw.ctl("reclaim", "--collect").stdout.startswith("asked to remove 0 cache entries")


def test_usage_and_router_metrics_after_a_request(gw):
    from typer.testing import CliRunner

    from llmgw.cli.main import app

    created = CliRunner().invoke(app, ["keys", "create", "ops-team", "--rpm", "600", "--model-limit",
                                       "chat:tpm=100000", "--state-dir", str(gw.state_dir)])
    assert created.exit_code == 0, created.stderr
    secret = created.stdout.strip()

    def ask():
        request = urllib.request.Request(
            gw.router_url + "/v1/chat/completions", method="POST",
            data=json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hello there"}]}).encode(),
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # the router loads new keys every couple of seconds
                return False
            raise
    wait_for(ask, 30, "a chat completion through the router")

    def counted(by):
        rows = gw.ctl_json("usage", "--by", by, "--since", "1h")["rows"]
        return rows if rows and rows[0]["requests"] >= 1 else None
    rows = wait_for(lambda: counted("model"), 30, "usage to be recorded")
    assert rows[0]["name"] == "chat" and rows[0]["prompt_tokens"] > 0 and rows[0]["completion_tokens"] > 0
    by_key = wait_for(lambda: counted("key"), 10, "usage by key")
    assert by_key[0]["name"] == "ops-team"
    assert {f: by_key[0][f] for f in ("rpm", "tpm", "concurrency", "model_limits")} == {
        "rpm": 600, "tpm": None, "concurrency": None,
        "model_limits": {"chat": {"rpm": None, "tpm": 100000, "concurrency": None}}}  # its limits
    rendered = gw.ctl("usage", "--by", "key")
    assert rendered.stdout.splitlines()[0].split() == ["KEY", "REQUESTS", "PROMPT", "TOKENS", "COMPLETION",
                                                       "TOKENS", "TOTAL", "TOKENS", "ESTIMATED", "UNMETERED",
                                                       "RPM", "TPM", "CONC", "MODEL", "LIMITS"]
    row = rendered.stdout.splitlines()[1].split()
    # None of its tokens estimated, none of its requests unmetered (R-6.9a), then its limits.
    assert row[0] == "ops-team" and row[5:] == ["0", "0", "600", "-", "-", "chat:", "tpm=100000"]
    assert gw.ctl("usage", "--by", "colour").exit_code == 1

    status, metrics = gw.api("/metrics")
    assert status == 200
    assert 'llmgw_router_requests_total{code="2xx",model="chat"}' in metrics
    assert 'llmgw_replicas{model="chat",state="serving"} 1.0' in metrics
    assert 'llmgw_node_memory_bytes{node="local"}' in metrics
    # A used replica is no longer "unknown" in the idle listing.
    chat = wait_for(lambda: next((i for i in gw.ctl_json("status")["idle"] if i["model"] == "chat"
                                  and i["last_used"] is not None), None), 15, "chat's last use to be known")
    assert chat["idle_seconds"] >= 0


def test_dashboard_url_opens_the_dashboard_once(gw):
    printed = gw.ctl("dashboard")
    url = printed.stdout.strip()
    assert url == f"{gw.admin_url}/?token={gw.token}"
    assert gw.ctl_json("dashboard") == {"url": url}
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with browser.open(url, timeout=10) as response:  # 303 to / with the cookie, then the page
        assert response.status == 200 and response.url == gw.admin_url + "/"
        page = response.read().decode()
    assert "<script" not in page and "chat" in page
    with browser.open(gw.admin_url + "/replicas", timeout=10) as response:
        assert "broken" in response.read().decode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(gw.admin_url + "/replicas", timeout=10)
    assert refused.value.code == 401


def test_cordon_drain_uncordon(gw):
    cordoned = gw.ctl("cordon", "local")
    assert cordoned.stdout.strip() == "local: cordoned — nothing new is placed there; its replicas keep serving"
    assert gw.ctl_json("nodes")["nodes"][0]["admin"]["state"] == "cordoned"
    drained = gw.ctl_json("drain", "local", "--grace", "10m")
    assert drained["admin"] == "draining" and drained["grace_until"] is not None
    assert "draining (grace until" in gw.ctl("nodes").stdout
    explained = gw.ctl_json("explain-placement", "chat")["verdicts"][0]
    assert "draining" in explained["reasons"]
    assert gw.ctl("drain", "local", "--grace", "soon").exit_code == 1
    uncordoned = gw.ctl("uncordon", "local")
    assert uncordoned.stdout.strip() == "local: active — placement may use it again"
    assert gw.ctl_json("nodes")["nodes"][0]["admin"]["state"] == "active"
    assert gw.ctl("cordon", "nosuch").stderr == "error: no node named 'nosuch'\n"


def test_sigterm_ends_log_followers_and_exits_cleanly(gw):
    """Runs last against this gateway: it stops it, with a `logs -f` still attached."""
    chat = replica_of(gw, "chat")
    follower = gw.ctl_process("logs", chat["id"], "-f")
    read_until(follower.stdout, lambda text: "GET /health" in text, 30, "the first followed lines")
    gw.stop(timeout=10)  # well inside the 15 s grace: the follow is ended, not waited for
    assert gw.process.returncode == 0
    assert follower.wait(10) == 0
    assert "the log stream ended" in follower.stderr.read().decode()
    assert "shutting down" in gw.log()


# -- the embedded default (R-9.2) -------------------------------------------------------------------


def test_embedded_default_serves_this_machine(tmp_path):
    """`llmgw serve` with no inventory: this machine, router on 8080, admin on loopback 8081."""
    for port in (8080, 8081):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is taken on this machine; the default addresses cannot be tried")
    serve = Serve(Path("unused"), tmp_path / "state")
    import subprocess

    with open(serve.log_path, "ab") as log:
        serve.process = subprocess.Popen([sys.executable, "-m", "llmgw.cli.main", "serve", "--state-dir",
                                          str(serve.state_dir)], stdout=log, stderr=subprocess.STDOUT,
                                         env=serve.env)
    try:
        wait_for(lambda: serve._alive() and (serve.state_dir / "admin-address").exists(), 30, "the admin address")
        assert (serve.state_dir / "admin-address").read_text().strip() == "127.0.0.1:8081"
        # Ready comes with the session; memory with the first inventory, which may follow a tick later.
        node = wait_for(lambda: next((n for n in serve.ctl_json("nodes")["nodes"]
                                      if n["state"] == "ready" and n["memory_bytes"] is not None), None),
                        30, "this machine to be ready and inventoried")
        assert node["name"] == "local" and node["memory_bytes"] > 0
        status = serve.ctl("status")
        assert status.exit_code == 0 and "nodes: 1 (1 ready; 1 active)" in status.stdout
        serve.stop()
        assert serve.process.returncode == 0
    finally:
        if serve.process.poll() is None:
            serve.process.kill()
        kill_processes_mentioning(str(tmp_path))
