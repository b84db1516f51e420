"""Engines through the helper: launch detached, identity, stop, status, logs (R-1.6, R-4.4,
R-4.6-R-4.8)."""

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helper.client import process_running, wait_until
from tests.helper.conftest import free_port


def _launch(helper, shard_id, argv, **extra):
    args = {"shard_id": shard_id, "argv": argv, "env": {}, "port": None, "host": "127.0.0.1", "health_url": None, "gpus": None}
    args.update(extra)
    return helper.call("launch", args, timeout=60)


def _shard(helper, shard_id, **args):
    shards = helper.call("status", args)["shards"]
    return next(s for s in shards if s["shard_id"] == shard_id)


def _read_proc(pid, name):
    with open("/proc/%d/%s" % (pid, name), "rb") as handle:
        return handle.read()


def _stat_fields(pid):
    text = _read_proc(pid, "stat").decode()
    return text[text.rfind(")") + 2 :].split()


def test_launch_answers_with_the_recorded_identity(helper, installed, engines):
    argv = engines.argv("sleep_engine.py")
    result = _launch(helper, "s1", argv)
    assert result["shard_id"] == "s1"
    assert result["argv"] == argv
    assert result["log_path"] == str(installed.root / "shards" / "s1" / "engine.log")
    fields = _stat_fields(result["pid"])
    assert int(fields[19]) == result["start_time"]  # field 22 of /proc/PID/stat
    assert int(fields[2]) == result["pgid"]
    assert result["pgid"] != os.getpgid(0), "the engine must not be in the helper's process group"
    assert int(fields[3]) == result["pgid"], "new session: its id is the supervisor's pid"
    state = json.loads((installed.root / "shards" / "s1" / "state.json").read_text())
    assert state["pid"] == result["pid"] and state["start_time"] == result["start_time"]
    assert state["argv"] == argv and state["exit_code"] is None
    assert isinstance(result["started_at"], float)


def test_engine_survives_the_helper_and_a_new_helper_recognises_it(start_helper, engines):
    first = start_helper()
    result = _launch(first, "keep", engines.argv("sleep_engine.py"))
    assert first.close() == 0
    assert process_running(result["pid"])
    second = start_helper()
    shard = _shard(second, "keep")
    assert shard["alive"] is True
    assert shard["pid"] == result["pid"] and shard["start_time"] == result["start_time"]
    assert shard["exit_code"] is None and shard["log_tail"] is None


def test_identity_mismatch_refuses_to_stop_and_signals_nothing(helper, installed, engines):
    result = _launch(helper, "other", engines.argv("sleep_engine.py"))
    state_path = installed.root / "shards" / "other" / "state.json"
    state = json.loads(state_path.read_text())
    state["start_time"] += 1  # as if the pid had been reused by another process
    state_path.write_text(json.dumps(state))
    assert _shard(helper, "other")["alive"] is False
    answer = helper.request("stop", {"shard_id": "other", "grace": 1})
    assert answer["ok"] is False and answer["error"]["kind"] == "identity"
    assert "nothing was signalled" in answer["error"]["message"]
    assert process_running(result["pid"])


def test_argv_mismatch_is_not_alive(helper, installed, engines):
    result = _launch(helper, "argv", engines.argv("sleep_engine.py"))
    state_path = installed.root / "shards" / "argv" / "state.json"
    state = json.loads(state_path.read_text())
    state["argv"] = state["cmdline"] = ["something", "else"]
    state["supervisor_pid"] = None
    state_path.write_text(json.dumps(state))
    assert _shard(helper, "argv")["alive"] is False
    assert helper.request("stop", {"shard_id": "argv"})["error"]["kind"] == "identity"
    assert process_running(result["pid"])


def test_stop_kills_the_whole_process_group(helper, engines, tmp_path):
    pid_file = tmp_path / "worker.pid"
    result = _launch(helper, "family", engines.argv("family_engine.py", pid_file))
    worker = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), message="worker pid"))
    assert process_running(worker)
    answer = helper.call("stop", {"shard_id": "family", "grace": 5}, timeout=60)
    assert answer == {"was_alive": True, "stopped": True}
    assert not process_running(result["pid"])
    assert not process_running(worker)
    shard = wait_until(lambda: (lambda s: s if s["exit_code"] is not None else None)(_shard(helper, "family")),
                       message="exit recorded")
    assert shard["alive"] is False
    assert shard["exit_code"] == -15  # negative signal number: TERM
    assert isinstance(shard["ended_at"], float)


def test_stop_of_an_exited_engine_is_not_an_error(helper, engines):
    _launch(helper, "done", engines.argv("exit_engine.py", 0))
    wait_until(lambda: _shard(helper, "done")["exit_code"] is not None, message="exit recorded")
    assert helper.call("stop", {"shard_id": "done"}) == {"was_alive": False, "stopped": True}


def test_stop_of_an_unknown_shard_is_not_found(helper):
    assert helper.request("stop", {"shard_id": "ghost"})["error"]["kind"] == "not_found"


def test_status_reports_exit_code_and_log_tail(helper, engines):
    _launch(helper, "failing", engines.argv("exit_engine.py", 3))
    shard = wait_until(lambda: (lambda s: s if s["exit_code"] is not None else None)(_shard(helper, "failing")),
                       message="exit recorded")
    assert shard["alive"] is False
    assert shard["exit_code"] == 3
    assert isinstance(shard["ended_at"], float) and shard["ended_at"] >= shard["started_at"]
    assert "fatal: CUDA out of memory" in shard["log_tail"]
    assert shard["health"] is None


def test_supervisor_killed_without_exit_info_leaves_exit_code_null(helper, installed, engines):
    result = _launch(helper, "orphan", engines.argv("sleep_engine.py"))
    log = installed.root / "shards" / "orphan" / "engine.log"
    wait_until(lambda: b"engine up" in log.read_bytes(), message="engine up")
    os.killpg(result["pgid"], 9)
    wait_until(lambda: not process_running(result["pid"]), message="engine gone")
    shard = _shard(helper, "orphan")
    assert shard["alive"] is False
    assert shard["exit_code"] is None
    assert shard["log_tail"] == ["engine up"]


def test_logs_follow_streams_new_lines_until_cancelled(helper, installed, engines):
    _launch(helper, "chatty", engines.argv("sleep_engine.py"))
    log = installed.root / "shards" / "chatty" / "engine.log"
    wait_until(lambda: b"engine up" in log.read_bytes(), message="first line")
    assert helper.call("logs", {"shard_id": "chatty", "lines": 10}) == {"lines": ["engine up"]}
    follow = helper.send("logs", {"shard_id": "chatty", "lines": 1, "follow": True})
    events = helper.wait_events(follow, lambda events: events)
    assert events[0] == ("lines", {"lines": ["engine up"]})
    with open(log, "a") as handle:
        handle.write("request 1 served\nrequest 2 ser")
    events = helper.wait_events(follow, lambda events: len(events) >= 2)
    assert events[1] == ("lines", {"lines": ["request 1 served"]})
    with open(log, "a") as handle:
        handle.write("ved\n")
    events = helper.wait_events(follow, lambda events: len(events) >= 3)
    assert events[2] == ("lines", {"lines": ["request 2 served"]})
    assert helper.call("cancel", {"target": follow}) == {"cancelled": True}
    assert helper.answer(follow)["result"] == {"lines": []}


def test_logs_of_an_unknown_shard(helper):
    assert helper.request("logs", {"shard_id": "nope"})["error"]["kind"] == "not_found"


@pytest.mark.parametrize("listen_host", [pytest.param("127.0.0.1", id="loopback"), pytest.param("0.0.0.0", id="any")])
@pytest.mark.parametrize("launch_host", [pytest.param("127.0.0.1", id="on-loopback"), pytest.param("0.0.0.0", id="on-any")])
def test_port_in_use_is_refused(helper, installed, engines, listen_host, launch_host):
    with socket.socket() as listener:
        listener.bind((listen_host, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        answer = helper.request(
            "launch", {"shard_id": "p", "argv": engines.argv("sleep_engine.py"), "port": port, "host": launch_host}
        )
    assert answer["ok"] is False and answer["error"]["kind"] == "port_in_use"
    assert str(port) in answer["error"]["message"]
    assert not (installed.root / "shards" / "p" / "state.json").exists()


def test_secrets_reach_the_engine_environment_only(helper, engines, tmp_path):
    secret = "sk-llmgw-%s" % os.urandom(8).hex()
    result = _launch(helper, "secret", engines.argv("sleep_engine.py"),
                     env={"VLLM_API_KEY": secret}, gpus=[0, 2])
    engine_env = _read_proc(result["pid"], "environ").split(b"\0")
    assert ("VLLM_API_KEY=%s" % secret).encode() in engine_env
    assert b"CUDA_VISIBLE_DEVICES=0,2" in engine_env
    supervisor = result["pgid"]
    assert process_running(supervisor) and supervisor != result["pid"]
    for pid in (result["pid"], supervisor):
        assert secret.encode() not in _read_proc(pid, "cmdline")
    assert secret.encode() not in _read_proc(supervisor, "environ")
    state_text = (tmp_path / "llmgw" / "shards" / "secret" / "state.json").read_text()
    assert secret not in state_text


def test_no_gpus_means_an_empty_device_list(helper, engines):
    result = _launch(helper, "cpu", engines.argv("sleep_engine.py"), gpus=[])
    assert b"CUDA_VISIBLE_DEVICES=" in _read_proc(result["pid"], "environ").split(b"\0")


def test_files_and_shard_dir_placeholder(helper, installed, engines):
    result = _launch(helper, "cfg", engines.argv("sleep_engine.py") + ["--config", "{shard_dir}/secrets.yaml"],
                     files={"secrets.yaml": "api-key: k\n"})
    shard_dir = installed.root / "shards" / "cfg"
    assert result["argv"][-1] == str(shard_dir / "secrets.yaml")
    assert (shard_dir / "secrets.yaml").read_text() == "api-key: k\n"
    assert (shard_dir / "secrets.yaml").stat().st_mode & 0o077 == 0
    assert _shard(helper, "cfg")["alive"] is True


def test_launch_of_a_missing_program_fails_with_the_reason(helper, installed):
    answer = helper.request("launch", {"shard_id": "bad", "argv": ["/nonexistent/engine-binary"]})
    assert answer["ok"] is False and answer["error"]["kind"] == "engine_missing"
    assert answer["error"]["message"] == "/nonexistent/engine-binary is not an executable file on this node"
    assert not (installed.root / "shards" / "bad").exists(), "nothing is started or recorded"


def test_the_engine_program_is_looked_up_on_the_launch_path(helper, engines, tmp_path):
    bin_dir = tmp_path / "engine-bin"
    bin_dir.mkdir()
    program = bin_dir / "fake-engine"
    program.write_text(f"#!/bin/sh\nexec {sys.executable} {engines.dir / 'sleep_engine.py'}\n")
    program.chmod(0o755)
    answer = helper.request("launch", {"shard_id": "nopath", "argv": ["fake-engine"], "env": {"PATH": "/usr/bin:/bin"}})
    assert answer["ok"] is False and answer["error"]["kind"] == "engine_missing"
    assert answer["error"]["message"] == "fake-engine is not on PATH=/usr/bin:/bin on this node"
    result = _launch(helper, "onpath", ["fake-engine"], env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert _shard(helper, "onpath")["alive"] is True and result["pid"]


def test_a_live_shard_is_not_launched_twice(helper, engines):
    first = _launch(helper, "twice", engines.argv("sleep_engine.py"))
    answer = helper.request("launch", {"shard_id": "twice", "argv": engines.argv("sleep_engine.py")})
    assert answer["error"]["kind"] == "alive"
    assert process_running(first["pid"])


def test_forget_refuses_a_live_shard_and_removes_a_stopped_one(helper, installed, engines):
    _launch(helper, "gone-soon", engines.argv("sleep_engine.py"))
    assert helper.request("forget", {"shard_id": "gone-soon"})["error"]["kind"] == "alive"
    helper.call("stop", {"shard_id": "gone-soon", "grace": 5}, timeout=60)
    assert helper.call("forget", {"shard_id": "gone-soon"}) == {}
    assert not (installed.root / "shards" / "gone-soon").exists()
    assert all(s["shard_id"] != "gone-soon" for s in helper.call("status")["shards"])


def test_probe_reports_the_health_status(helper, engines):
    port = free_port()
    _launch(helper, "web", engines.argv("listen_engine.py", port), port=port, host="0.0.0.0",
            health_url="http://127.0.0.1:%d/health" % port)
    shard = wait_until(
        lambda: (lambda s: s if s["health"]["status"] == 200 else None)(_shard(helper, "web", probe=True, timeout=2)),
        message="health 200",
    )
    assert shard["alive"] is True and shard["health"]["error"] is None
    assert _shard(helper, "web")["health"] is None, "no probe unless asked"


def test_probe_of_a_port_that_never_answers_times_out(helper, engines, installed):
    port = free_port()
    _launch(helper, "hung", engines.argv("hang_engine.py", port), health_url="http://127.0.0.1:%d/health" % port)
    log = installed.root / "shards" / "hung" / "engine.log"
    wait_until(lambda: b"never answering" in log.read_bytes(), message="engine bound")
    shard = _shard(helper, "hung", probe=True, timeout=0.3)
    assert shard["alive"] is True
    assert shard["health"]["status"] is None
    assert shard["health"]["error"]


def test_probe_of_a_closed_port_reports_the_error(helper, engines):
    port = free_port()
    _launch(helper, "closed", engines.argv("sleep_engine.py"), health_url="http://127.0.0.1:%d/health" % port)
    health = _shard(helper, "closed", probe=True, timeout=1)["health"]
    assert health["status"] is None and "refused" in health["error"].lower()


def test_a_squatter_on_the_engine_port_does_not_make_it_healthy(helper, engines):
    # Another process binds the port before the engine does and answers 200 on /health: the
    # probe must not count it as the engine's health.
    port = free_port()
    _launch(helper, "late", engines.argv("sleep_engine.py"), port=port, host="127.0.0.1",
            health_url=f"http://127.0.0.1:{port}/health")
    squatter = subprocess.Popen(engines.argv("listen_engine.py", port), stdout=subprocess.PIPE)
    try:
        assert squatter.stdout.readline().startswith(b"engine listening")
        health = _shard(helper, "late", probe=True, timeout=2)["health"]
        assert health["status"] is None, health
        assert "held by a process that is not this engine" in health["error"]
    finally:
        squatter.kill()
        squatter.wait()


def test_the_listener_of_an_engine_worker_counts_as_the_engine(helper, engines):
    # vLLM's API server may be a child of the launched process: same group, so its socket counts.
    port = free_port()
    script = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, {str(engines.dir / 'listen_engine.py')!r}, {str(port)!r}])\n"
              "time.sleep(3600)\n")
    _launch(helper, "parent", [sys.executable, "-c", script], port=port, host="0.0.0.0",
            health_url=f"http://127.0.0.1:{port}/health")
    def healthy():
        shard = _shard(helper, "parent", probe=True, timeout=2)
        return shard if shard["health"]["status"] == 200 else None

    assert wait_until(healthy, message="health 200 from the engine's worker")["health"]["error"] is None


def test_api_keys_an_engine_prints_are_scrubbed_from_every_log_answer(helper, installed, engines, tmp_path):
    # SGLang prints its server arguments at start, api_key included.
    key = "sk-" + os.urandom(8).hex()
    script = tmp_path / "chatty_engine.py"
    script.write_text(
        "import sys, time\n"
        f"print(\"server_args=ServerArgs(model_path='/m', api_key='{key}', admin_api_key=None, port=30000)\", flush=True)\n"
        f"print('launch: sglang --api-key {key} --port 30000', flush=True)\n"
        "if sys.argv[1] == 'exit':\n    sys.exit(1)\n"
        "time.sleep(3600)\n")
    _launch(helper, "talks", [sys.executable, str(script), "stay"])
    log = installed.root / "shards" / "talks" / "engine.log"
    wait_until(lambda: b"--api-key" in log.read_bytes(), message="the engine's arguments in its log")
    assert key.encode() in log.read_bytes(), "the file on the node is the engine's own"
    expected = ["server_args=ServerArgs(model_path='/m', api_key='***', admin_api_key=None, port=30000)",
                "launch: sglang --api-key *** --port 30000"]
    assert helper.call("logs", {"shard_id": "talks", "lines": 10}) == {"lines": expected}
    follow = helper.send("logs", {"shard_id": "talks", "lines": 10, "follow": True})
    assert helper.wait_events(follow, lambda events: events) == [("lines", {"lines": expected})]
    with open(log, "a") as handle:
        handle.write(f"again api_key='{key}'\n")
    events = helper.wait_events(follow, lambda events: len(events) >= 2)
    assert events == [("lines", {"lines": expected}), ("lines", {"lines": ["again api_key='***'"]})]
    helper.call("cancel", {"target": follow})
    _launch(helper, "dies", [sys.executable, str(script), "exit"])
    wait_until(lambda: _shard(helper, "dies")["exit_code"] is not None, message="exit recorded")
    shard = _shard(helper, "dies")
    assert shard["log_tail"][:2] == expected
    assert key not in json.dumps(shard)


def test_shipped_files_are_checked_by_hash_and_found_through_the_env(helper, installed, engines):
    text = "GUARD = 'llmgw'\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    answer = helper.request("launch", {"shard_id": "tampered", "argv": engines.argv("sleep_engine.py"),
                                       "files": {"guard.py": text}, "file_sha256": {"guard.py": "0" * 64}})
    assert answer["ok"] is False and answer["error"]["kind"] == "integrity"
    assert f"guard.py in the shard directory has SHA-256 {digest}, not {'0' * 64}" in answer["error"]["message"]
    assert not (installed.root / "shards" / "tampered" / "state.json").exists(), "nothing was started"
    result = _launch(helper, "shipped", engines.argv("sleep_engine.py"), files={"guard.py": text},
                     file_sha256={"guard.py": digest}, env={"PYTHONPATH": "{shard_dir}:/elsewhere"})
    shard_dir = installed.root / "shards" / "shipped"
    assert f"PYTHONPATH={shard_dir}:/elsewhere".encode() in _read_proc(result["pid"], "environ").split(b"\0")
