"""The node side trusts only what llmgw made: how helper processes start, which directories the
helper accepts, which cache entries count as fetched weights (R-1.3, R-1.6, R-5.2, R-5.5)."""

import json
import subprocess
import sys
import textwrap

from llmgw.fleet.link import helper_argv, helper_code
from tests.helper.client import HelperClient, load_helper, wait_until
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
