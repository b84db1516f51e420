"""The node side trusts only what llmgw made: how helper processes start, which directories the
helper accepts, which cache entries count as fetched weights (R-1.3, R-1.6, R-5.2, R-5.5)."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from llmgw.fleet.link import helper_argv, helper_code
from tests.helper.client import HelperClient, install_helper, load_helper, wait_until
from tests.helper.conftest import Route, keep_fleet_secret
from tests.helper.test_helper_engines import _launch

# Imported on start by any Python that is not isolated and has this directory on PYTHONPATH.
SITECUSTOMIZE = """
    import os, sys
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran-%d" % os.getpid()), "w") as f:
        f.write(" ".join(sys.argv))
"""


def _planted_site(tmp_path, base_env):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    env = dict(base_env, PYTHONPATH=str(site))
    return site, env


def _ran(site):
    return sorted(p.name for p in site.iterdir() if p.name.startswith("ran-"))


def test_the_link_starts_the_helper_isolated(tmp_path, base_env):
    site, env = _planted_site(tmp_path, base_env)
    code = helper_code()
    root = tmp_path / "root"
    argv = helper_argv(sys.executable, str(root / "helper" / code.filename), code, str(root))
    assert argv[1:4] == ["-I", "-c", load_helper().LOADER]
    proc = subprocess.run(argv, input=code.text + b'{"id": 1, "op": "ping"}\n', capture_output=True,
                          env=env, timeout=60, check=False)
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert proc.returncode == 0, proc.stderr
    assert "upload" in lines[0] and "hello" in lines[1] and lines[2]["ok"] is True
    assert _ran(site) == [], "PYTHONPATH of the node reached the helper's interpreter"


def test_the_supervisor_starts_through_the_verifying_loader_isolated(installed, base_env, tmp_path, engines):
    site, env = _planted_site(tmp_path, base_env)
    helper = HelperClient(installed.path, installed.sha, installed.root, env=env)
    try:
        helper.wait_hello()
        result = _launch(helper, "iso", engines.argv("sleep_engine.py"))
    finally:
        helper.kill()
    state = json.loads((installed.root / "shards" / "iso" / "state.json").read_text())
    supervisor = state["supervisor_pid"]
    with open(f"/proc/{supervisor}/cmdline", "rb") as handle:
        cmdline = [part.decode() for part in handle.read().split(b"\0")[:-1]]
    assert cmdline[1:7] == ["-I", "-c", load_helper().LOADER, str(installed.path), installed.sha, "-"]
    assert cmdline[7] == "supervise"
    # The helper itself was started without -I here (so it ran the planted file); the
    # supervisor must not have.
    assert f"ran-{helper.proc.pid}" in _ran(site)
    assert f"ran-{supervisor}" not in _ran(site)
    assert result["pid"]


def test_a_supervisor_refuses_a_helper_file_changed_after_the_start(installed, helper, engines):
    data = installed.path.read_bytes()
    installed.path.write_bytes(data.replace(b'HELPER_VERSION = "', b'HELPER_VERSION = "x', 1))
    answer = helper.request("launch", {"shard_id": "swapped", "argv": engines.argv("sleep_engine.py")}, timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "launch_failed"
    assert '"fatal": "integrity"' in answer["error"]["message"]
    wait_until(lambda: not (installed.root / "shards" / "swapped" / "state.json").exists(), timeout=1)


# --------------------------------------------------------------------------------------------
# The helper root and every directory above it (as OpenSSH's StrictModes judges a home)


def _serve(path, sha, root, stdin=b""):
    return subprocess.run([sys.executable, str(path), "serve", "--expect-sha256", sha, "--root", str(root)],
                          input=stdin, capture_output=True, timeout=30, check=False)


def _installed_under(parent):
    root = parent / "llmgw"
    path, sha = install_helper(root)
    os.chmod(root, 0o700)
    return root, path, sha


def test_a_root_under_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    root, path, sha = _installed_under(shared)
    os.chmod(shared, 0o777)
    result = _serve(path, sha, root)
    assert result.returncode == 98, result.stdout
    fatal = json.loads(result.stdout)
    assert fatal["fatal"] == "permissions" and fatal["path"] == str(shared)
    assert fatal["mode"] == "0777" and "chmod go-w" in fatal["message"]


def test_a_root_under_a_sticky_directory_like_tmp_runs(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    root, path, sha = _installed_under(sticky)
    os.chmod(sticky, 0o1777)
    result = _serve(path, sha, root)
    assert result.returncode == 0, result.stdout
    assert "hello" in json.loads(result.stdout.splitlines()[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")
def test_a_parent_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    root, path, sha = _installed_under(theirs)
    os.chown(theirs, 4242, 4242)
    result = _serve(path, sha, root)
    assert result.returncode == 98
    fatal = json.loads(result.stdout)
    assert fatal["path"] == str(theirs) and fatal["owner"] == 4242 and "uid 4242" in fatal["message"]


@pytest.mark.parametrize("how", ["group-writable-root", "shards-link", "shards-group-writable"])
def test_root_and_shards_must_be_private(tmp_path, how):
    root, path, sha = _installed_under(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if how == "group-writable-root":
        os.chmod(root, 0o770)
        expected = root
    elif how == "shards-link":
        os.symlink(elsewhere, root / "shards")
        expected = root / "shards"
    else:
        (root / "shards").mkdir()
        os.chmod(root / "shards", 0o775)
        expected = root / "shards"
    result = _serve(path, sha, root)
    assert result.returncode == 98, result.stdout
    fatal = json.loads(result.stdout)
    assert fatal["fatal"] == "permissions" and fatal["path"] == str(expected), fatal


def test_state_and_log_files_are_not_followed_through_links(helper, installed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("an engine key\n")
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"shard_id": "p", "pid": 1, "argv": ["x"], "exit_code": 0}))
    shard = installed.root / "shards" / "p"
    shard.mkdir(parents=True)
    os.symlink(planted, shard / "state.json")
    os.symlink(secret, shard / "engine.log")
    assert [s["shard_id"] for s in helper.call("status")["shards"]] == []
    assert helper.call("logs", {"shard_id": "p"}) == {"lines": []}
    linked = installed.root / "shards" / "q"
    os.symlink(tmp_path / "elsewhere-shard", linked)
    (tmp_path / "elsewhere-shard").mkdir()
    (tmp_path / "elsewhere-shard" / "engine.log").write_text("from elsewhere\n")
    assert helper.call("logs", {"shard_id": "q"}) == {"lines": []}


def test_launch_refuses_a_shard_directory_that_is_a_link(helper, installed, tmp_path, engines):
    elsewhere = tmp_path / "elsewhere-launch"
    elsewhere.mkdir(mode=0o700)
    (installed.root / "shards").mkdir(mode=0o700)
    os.symlink(elsewhere, installed.root / "shards" / "lnk")
    answer = helper.request("launch", {"shard_id": "lnk", "argv": engines.argv("sleep_engine.py")}, timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "permissions", answer
    assert "symbolic link" in answer["error"]["message"]
    assert os.listdir(elsewhere) == []


# --------------------------------------------------------------------------------------------
# Cache entries: sealed with the fleet secret, accepted only from this user


NAME = "llmgw-" + "5eed" * 8


def _fetch(server, cache_dir, path="/w.bin", name=NAME, token=None):
    return {"source": {"kind": "https", "urls": [server.url(path)]}, "cache_dir": str(cache_dir), "name": name,
            "token": token}


def _other_helper(tmp_path, label, secret, env):
    root = tmp_path / label
    path, sha = install_helper(root)
    os.chmod(root, 0o700)
    keep_fleet_secret(root, secret)
    client = HelperClient(path, sha, root, env=env)
    client.wait_hello()
    return client


def test_a_fetched_entry_is_sealed_and_accepted_by_another_node_of_the_fleet(
        start_helper, installed, tls_env, https_server, tmp_path):
    https_server.routes["/w.bin"] = Route(os.urandom(64 * 1024))
    filer = tmp_path / "filer"
    first = start_helper(env=tls_env)
    assert first.call("fetch", _fetch(https_server, filer))["bytes"] == 64 * 1024
    marker = json.loads((filer / NAME / ".llmgw-complete").read_text())
    files = load_helper().entry_manifest(str(filer / NAME), os.getuid())[0]
    assert marker["sha256"] == {"w.bin": hashlib.sha256((filer / NAME / "w.bin").read_bytes()).hexdigest()}
    assert marker["seal"] == load_helper().entry_seal(installed.secret, NAME, files, marker["sha256"])
    same_fleet = _other_helper(tmp_path, "node-b", installed.secret, tls_env)
    other_fleet = _other_helper(tmp_path, "node-c", "0" * 64, tls_env)
    try:
        wanted = {"candidates": {"m": [str(filer / NAME)]}}
        assert same_fleet.call("holdings", wanted)["held"] == {"m": {"path": str(filer / NAME), "bytes": 64 * 1024,
                                                                     "file": str(filer / NAME / "w.bin"),
                                                                     "verified": True}}  # no big file
        assert same_fleet.call("fetch", _fetch(https_server, filer))["bytes"] == 64 * 1024
        assert https_server.gets("/w.bin") == 1, "the other node took the entry, it did not fetch again"
        assert other_fleet.call("holdings", wanted)["held"] == {}
    finally:
        same_fleet.kill()
        other_fleet.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting files as another user needs root")
def test_a_directory_planted_on_a_shared_cache_is_never_served_nor_held(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/w.bin"] = Route(b"real weights" * 100)
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / NAME
    planted.mkdir()
    (planted / "model.gguf").write_bytes(b"poisoned weights")
    (planted / ".llmgw-complete").write_text(json.dumps({"name": NAME, "bytes": 16, "files": 1}))
    for path in (planted, planted / "model.gguf", planted / ".llmgw-complete"):
        os.chown(path, 4242, 4242)
    helper = start_helper(env=tls_env)
    assert helper.call("holdings", {"candidates": {"m": [str(planted)]}})["held"] == {}
    answer = helper.request("fetch", _fetch(https_server, shared), timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "cache_dir", answer
    assert "not llmgw's" in answer["error"]["message"] and "uid 4242" in answer["error"]["message"]
    assert https_server.gets("/w.bin") == 0, "refused before downloading anything"
    assert (planted / "model.gguf").read_bytes() == b"poisoned weights", "someone else's files are left alone"
    assert sorted(os.listdir(shared)) == [NAME], "nothing of ours is left behind"
    [listed] = helper.call("reclaim", {"cache_dir": str(shared), "names": None})["entries"]
    assert "uid 4242" in listed["reason"]
    [refused] = helper.call("reclaim", {"cache_dir": str(shared), "names": [NAME], "collect": True})["entries"]
    assert refused["action"] == "refused" and "uid 4242" in refused["reason"]


@pytest.mark.parametrize("old", [pytest.param({"name": NAME, "source": {}, "bytes": 4096, "files": 1}, id="unsealed"),
                                 pytest.param({"format": 2, "name": NAME, "bytes": 4096, "files": 1, "seal": "ab" * 32},
                                              id="sealed-without-hashes")])
def test_an_entry_made_before_content_hashes_is_fetched_again(start_helper, tls_env, https_server, tmp_path, old):
    """Its seal covers no content, and any node of the fleet could have written it: it is not
    held, and the next fetch replaces it with a download checked as it streams (R-5.6)."""
    https_server.routes["/w.bin"] = Route(b"x" * 4096)
    cache = tmp_path / "cache"
    entry = cache / NAME
    entry.mkdir(parents=True)
    (entry / "w.bin").write_bytes(b"y" * 4096)
    (entry / ".llmgw-complete").write_text(json.dumps(old))
    helper = start_helper(env=tls_env)
    assert helper.call("holdings", {"candidates": {"m": [str(entry)]}})["held"] == {}
    assert json.loads((entry / ".llmgw-complete").read_text()) == old, "never sealed as it is"
    assert helper.call("fetch", _fetch(https_server, cache))["bytes"] == 4096
    assert https_server.gets("/w.bin") == 1
    assert (entry / "w.bin").read_bytes() == b"x" * 4096
    assert json.loads((entry / ".llmgw-complete").read_text())["format"] == 3


def test_the_fleet_secret_is_kept_private_in_the_root_and_never_echoed(helper, installed):
    secret = "a1" * 32
    assert helper.call("fleet_secret", {"secret": secret}) == {"stored": True}
    path = installed.root / "fleet.key"
    assert path.read_text().strip() == secret
    assert os.stat(path).st_mode & 0o777 == 0o600
    bad = "not hex " + "b2" * 20
    answer = helper.request("fleet_secret", {"secret": bad})
    assert answer["ok"] is False and answer["error"]["kind"] == "bad_args"
    assert bad not in json.dumps(answer) and path.read_text().strip() == secret
    assert helper.close() == 0
    assert secret not in json.dumps(helper.lines) + "".join(helper.stderr_lines)


# --------------------------------------------------------------------------------------------
# Downloads are bounded and private when fetched with a token


def _modes(top):
    found = {}
    for directory, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, top)] = os.lstat(path).st_mode & 0o777
    found["."] = os.lstat(top).st_mode & 0o777
    return found


def _hub(server, files, sizes=True):
    siblings = [dict({"rfilename": name}, **({"size": len(body)} if sizes else {})) for name, body in files.items()]
    server.routes["/api/models/org/m/revision/main"] = Route(json.dumps({"siblings": siblings}).encode())
    for name, body in files.items():
        server.routes["/org/m/resolve/main/" + name] = Route(body)
    return {"kind": "hf", "repo": "org/m", "revision": "main", "endpoint": server.url("")}


@pytest.mark.parametrize("token", [pytest.param("hf_" + "9" * 20, id="with-token"), pytest.param(None, id="public")])
def test_weights_fetched_with_a_token_are_readable_by_this_user_only(start_helper, tls_env, https_server, tmp_path, token):
    old = os.umask(0o002)  # a permissive umask must not open them either
    try:
        helper = start_helper(env=tls_env)
    finally:
        os.umask(old)
    source = _hub(https_server, {"config.json": b"{}", "weights/model.safetensors": b"w" * 4096})
    cache = tmp_path / "cache"
    helper.call("fetch", {"source": source, "cache_dir": str(cache), "name": NAME, "token": token})
    modes = _modes(cache / NAME)
    dirs, files = (0o700, 0o600) if token else (0o755, 0o644)
    assert modes == {".": dirs, "weights": dirs, "config.json": files, "weights/model.safetensors": files,
                     ".llmgw-complete": files}


def test_a_download_is_stopped_at_its_cap(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/endless.bin"] = Route(b"z" * (3 << 20), length=False)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    args = dict(_fetch(https_server, cache, "/endless.bin"), max_bytes=1 << 20)
    answer = helper.request("fetch", args, timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "too_large", answer
    assert "1048576 bytes allowed (the request's max_bytes)" in answer["error"]["message"]
    assert os.listdir(cache) == []


def test_a_length_beyond_the_cap_is_refused_before_reading(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/big.bin"] = Route(b"z" * (2 << 20))
    helper = start_helper(env=tls_env)
    answer = helper.request("fetch", dict(_fetch(https_server, tmp_path / "cache", "/big.bin"), max_bytes=4096))
    assert answer["error"]["kind"] == "too_large" and "announces 2097152 bytes" in answer["error"]["message"]


def test_a_file_longer_than_the_hub_listing_says_is_refused(start_helper, tls_env, https_server, tmp_path):
    source = _hub(https_server, {"a.bin": b"a" * 100, "b.bin": b"b" * 100})
    https_server.routes["/org/m/resolve/main/b.bin"] = Route(b"b" * 5000, length=False)
    helper = start_helper(env=tls_env)
    answer = helper.request("fetch", {"source": source, "cache_dir": str(tmp_path / "cache"), "name": NAME})
    assert answer["error"]["kind"] == "too_large" and "more than the 100 bytes it announced" in answer["error"]["message"]


def test_a_hub_listing_is_bounded(start_helper, tls_env, https_server, tmp_path):
    many = [{"rfilename": "f%d" % i, "size": 1} for i in range(load_helper().HUB_LISTING_MAX_FILES + 1)]
    https_server.routes["/api/models/org/many/revision/main"] = Route(json.dumps({"siblings": many}).encode())
    helper = start_helper(env=tls_env)
    source = {"kind": "hf", "repo": "org/many", "revision": "main", "endpoint": https_server.url("")}
    answer = helper.request("fetch", {"source": source, "cache_dir": str(tmp_path / "cache"), "name": NAME})
    assert answer["error"]["kind"] == "http" and "more than the 50000 a fetch takes" in answer["error"]["message"]
    assert helper.request("source_size", {"source": source})["error"]["kind"] == "http"


@pytest.mark.parametrize("stall_after", [pytest.param(64 * 1024, id="mid-body"), pytest.param(0, id="after-headers")])
def test_a_download_that_stalls_fails_with_that_reason(start_helper, tls_env, https_server, tmp_path, stall_after):
    https_server.routes["/stuck.bin"] = Route(b"s" * (1 << 20), stall_after=stall_after)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    answer = helper.request("fetch", dict(_fetch(https_server, cache, "/stuck.bin"), stall_timeout=1), timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "stalled", answer
    assert "sent no byte for 1 s" in answer["error"]["message"]
    wait_until(lambda: os.listdir(cache) == [], timeout=10, message="the partial download removed")


def test_a_server_that_never_answers_stalls_too(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/silent.bin"] = Route(b"x", gate=threading.Event())
    helper = start_helper(env=tls_env)
    answer = helper.request("fetch", dict(_fetch(https_server, tmp_path / "cache", "/silent.bin"), stall_timeout=1))
    assert answer["error"]["kind"] == "stalled" and "sent nothing for 1 s" in answer["error"]["message"]


def test_reclaim_on_another_node_leaves_a_running_download_on_a_shared_cache(
        start_helper, installed, tls_env, https_server, tmp_path):
    gate = threading.Event()
    body = os.urandom(128 * 1024)
    https_server.routes["/w.bin"] = Route(body, gate=gate)
    shared = tmp_path / "filer"
    downloading = start_helper(env=tls_env)
    request_id = downloading.send("fetch", _fetch(https_server, shared))
    wait_until(lambda: https_server.gets("/w.bin") == 1, message="the download started")
    [temp] = [n for n in os.listdir(shared) if n.startswith(".tmp-")]
    lease = json.loads((shared / temp / ".llmgw-lease").read_text())
    assert lease["pid"] == downloading.proc.pid
    other = _other_helper(tmp_path, "node-b", installed.secret, tls_env)
    try:
        assert other.call("reclaim", {"cache_dir": str(shared), "names": None})["entries"] == []
        collected = other.call("reclaim", {"cache_dir": str(shared), "names": [temp, NAME], "collect": True})
        assert [e["action"] for e in collected["entries"]] == ["refused", "refused"]
        assert "pid %d" % downloading.proc.pid in collected["entries"][0]["reason"]
    finally:
        other.kill()
    gate.set()
    assert downloading.answer(request_id, timeout=60)["ok"]
    assert (shared / NAME / "w.bin").read_bytes() == body
    assert sorted(os.listdir(shared / NAME)) == [".llmgw-complete", "w.bin"], "the lease goes with the download"


def test_a_marker_keeps_no_signed_url_query(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/signed.bin"] = Route(b"s" * 1000)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    args = _fetch(https_server, cache, "/signed.bin?X-Amz-Signature=s3cr3t")
    assert helper.call("fetch", args)["bytes"] == 1000
    marker = (cache / NAME / ".llmgw-complete").read_text()
    assert "s3cr3t" not in marker and https_server.url("/signed.bin?<redacted>") in marker
