"""The helper on the oldest Python it supports, 3.8 (R-1.4): deployed through its loader, then
one request of each part of the protocol (inventory, storage, fetch, processes, reclaim,
environments).
tests/unit/test_helper_source.py checks the source for newer syntax and APIs; this runs it.
Skips, saying so, where no python3.8 is installed."""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helper.client import HELPER_PATH, HelperClient, load_helper, process_running, wait_until
from tests.helper.conftest import Route, free_port
from tests.helper.wheels import probe_wheelhouse


def _python38():
    """A python3.8 that runs (a pyenv shim on PATH may name a version it does not select)."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = sorted(glob.glob(os.path.join(pyenv, "versions", "3.8*", "bin", "python3.8")))
    candidates += [found for found in [shutil.which("python3.8")] if found]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
        if probe.returncode == 0 and probe.stdout.strip() == b"(3, 8)":
            return candidate
    return None


PYTHON38 = _python38()
pytestmark = pytest.mark.skipif(PYTHON38 is None, reason="no python3.8 on PATH or under ~/.pyenv/versions")


def _read_json_line(stream):
    line = stream.readline()
    assert line, "the process closed its output"
    return json.loads(line.decode("utf-8"))


def test_the_loader_deploys_and_starts_the_helper_under_38(tmp_path, base_env):
    text = HELPER_PATH.read_bytes()
    sha = hashlib.sha256(text).hexdigest()
    root = tmp_path / "root"
    path = root / "helper" / ("llmgw_helper-%s.py" % sha)
    argv = load_helper().loader_argv(PYTHON38, str(path), sha, len(text),
                                     ["serve", "--expect-sha256", sha, "--root", str(root)])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=base_env)
    try:
        first = _read_json_line(proc.stdout)
        assert first["upload"] == sha, first
        proc.stdin.write(text)
        proc.stdin.flush()
        hello = _read_json_line(proc.stdout)["hello"]
        print("hello", hello["python"], hello["sha256"][:16])
        assert hello["python"].startswith("3.8."), hello
        assert hello["sha256"] == sha
        assert path.read_bytes() == text, "the copy written is the bytes sent"
        proc.stdin.write(b'{"id": 1, "op": "ping", "args": {}}\n')
        proc.stdin.flush()
        assert _read_json_line(proc.stdout)["ok"] is True
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_each_part_of_the_protocol_runs_under_38(installed, tls_env, https_server, engines, tmp_path):
    body = os.urandom(256 * 1024 + 3)
    https_server.routes["/weights.bin"] = Route(body)
    helper = HelperClient(installed.path, installed.sha, installed.root, env=tls_env, python=PYTHON38)
    try:
        assert helper.wait_hello()["python"].startswith("3.8.")
        inventory = helper.call("inventory", {"images": ["busybox:1"], "venvs": {"v": {
            "kind": "venv", "packages": ["llmgw-probe"], "find_links": [str(tmp_path)], "python": None}}})
        assert inventory["hostname"] and inventory["cpus"] >= 1
        assert inventory["python"]["version"].startswith("3.8.")
        assert set(inventory["containers"]) == {"docker", "podman"}
        assert inventory["venvs"]["v"]["found"] is True and inventory["venvs"]["v"]["version"].startswith("3.8.")

        weights = tmp_path / "models" / "m.gguf"
        weights.parent.mkdir()
        weights.write_bytes(b"w" * 10)
        storage = helper.call("storage", {"dirs": [{"path": str(weights.parent), "shared": False}]})
        assert [fs["dirs"] for fs in storage["filesystems"]] == [[str(weights.parent)]]
        held = helper.call("holdings", {"candidates": {"m": [str(weights)]}})["held"]
        assert held["m"]["bytes"] == 10

        cache = tmp_path / "cache"
        cache.mkdir()
        name = "llmgw-" + "ab" * 16
        fetched = helper.call("fetch", {"source": {"kind": "https", "urls": [https_server.url("/weights.bin")]},
                                        "cache_dir": str(cache), "name": name, "token": None}, timeout=60)
        assert fetched["bytes"] == len(body)
        assert (cache / name / "weights.bin").read_bytes() == body

        launched = helper.call("launch", {"shard_id": "s38", "argv": engines.argv("sleep_engine.py"), "env": {},
                                          "port": None, "host": "127.0.0.1", "health_url": None, "gpus": None},
                               timeout=60)
        shard = wait_until(lambda: next((s for s in helper.call("status")["shards"]
                                         if s["shard_id"] == "s38" and s["alive"]), None), message="s38 alive")
        assert shard["pid"] == launched["pid"]
        wait_until(lambda: helper.call("logs", {"shard_id": "s38", "lines": 10})["lines"], message="the engine's log")
        assert helper.call("stop", {"shard_id": "s38", "grace": 5}, timeout=60)["stopped"] is True
        assert not process_running(launched["pid"])

        entries = helper.call("reclaim", {"cache_dir": str(cache), "names": None})["entries"]
        assert [(e["name"], e["action"]) for e in entries] == [(name, "listed")]

        runtime = {"kind": "venv", "packages": ["llmgw-probe"], "index_url": None,
                   "find_links": [str(probe_wheelhouse(tmp_path / "wheels"))], "python": None, "post_install": []}
        built = helper.call("provision", {"runtime": runtime}, timeout=300)
        assert built["created"] is True and built["python"].startswith("3.8."), built
        port = free_port()
        engine = helper.call("launch", {"shard_id": "venv38", "argv": ["llmgw-probe", str(port)],
                                        "env": {"PATH": "/usr/bin:/bin"}, "runtime": runtime}, timeout=60)
        assert engine["argv"][0] == os.path.join(built["path"], "bin", "llmgw-probe")
        wait_until(lambda: next((s for s in helper.call("status")["shards"] if s["shard_id"] == "venv38"))["alive"],
                   message="venv38 alive")
        assert helper.call("stop", {"shard_id": "venv38", "grace": 5}, timeout=60)["stopped"] is True
        (env,) = helper.call("envs")["envs"]
        assert env["sealed"] is True and env["path"] == built["path"]
    finally:
        helper.kill()
    print("python", PYTHON38, "for", sys.version.split()[0], "tests")
