"""The helper as a process: start-up checks (R-1.3), the wire protocol (R-1.2), one-shot mode
(R-1.4)."""

import json
import os
import platform
import socket
import subprocess
import sys

import pytest

from tests.helper.client import HELPER_PATH, install_helper, sha256_of, wait_until


def test_hello_is_the_first_line(helper, installed):
    hello = helper.hello
    assert helper.lines[0] == {"hello": hello}
    assert hello["protocol"] == 1
    assert hello["sha256"] == installed.sha
    assert hello["python"] == platform.python_version()
    assert hello["hostname"] == socket.gethostname()
    assert hello["pid"] == helper.proc.pid
    assert isinstance(hello["version"], str) and hello["version"]
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert hello["boot_id"] == handle.read().strip()


def test_ping_answers_with_the_time(helper):
    answer = helper.request("ping")
    assert answer["ok"] is True
    assert isinstance(answer["result"]["time"], float)


@pytest.mark.parametrize(
    "line, kind",
    [
        pytest.param('{"id": "r", "op": "launch-everything", "args": {}}\n', "unknown_op", id="unknown-op"),
        pytest.param('{"id": "r", "op": "storage", "args": {"dirs": "/tmp"}}\n', "bad_args", id="wrong-type"),
        pytest.param('{"id": "r", "op": "logs", "args": {}}\n', "bad_args", id="missing-arg"),
        pytest.param('{"id": "r", "op": "logs", "args": {"shard_id": "../etc"}}\n', "bad_args", id="shard-traversal"),
        pytest.param('{"id": "r", "op": "logs", "args": {"shard_id": ".."}}\n', "bad_args", id="shard-dotdot"),
        pytest.param('{"id": "r", "op": "ping", "args": []}\n', "bad_args", id="args-not-object"),
    ],
)
def test_refusals_name_their_kind(helper, line, kind):
    helper.send_raw(line)
    answer = helper.answer("r")
    assert answer["ok"] is False
    assert answer["error"]["kind"] == kind
    assert answer["error"]["message"]
    assert helper.request("ping")["ok"], "the helper must survive a bad request"


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("this is not json\n", id="not-json"),
        pytest.param("[1, 2]\n", id="not-an-object"),
        pytest.param('{"op": "ping"}\n', id="no-id"),
        pytest.param('{"id": true, "op": "ping"}\n', id="bool-id"),
    ],
)
def test_a_line_that_is_not_a_request_is_answered_with_null_id(helper, line):
    helper.send_raw(line)
    answer = helper.answer(None)
    assert answer["ok"] is False and answer["error"]["kind"] == "bad_request"
    assert helper.request("ping")["ok"]


def test_string_ids_are_echoed(helper):
    helper.send("ping", {}, request_id="abc-1")
    assert helper.answer("abc-1")["ok"]


def test_a_follow_does_not_block_ping_or_status(helper, installed):
    shard_dir = installed.root / "shards" / "quiet"
    shard_dir.mkdir(parents=True)
    (shard_dir / "engine.log").write_text("old line\n")
    follow = helper.send("logs", {"shard_id": "quiet", "lines": 5, "follow": True})
    helper.wait_events(follow, lambda events: events)
    for _ in range(20):
        assert helper.request("ping", timeout=10)["ok"]
    assert helper.request("status", timeout=10)["ok"]
    assert follow not in helper.answers
    assert helper.call("cancel", {"target": follow}) == {"cancelled": True}
    assert helper.answer(follow) == {"id": follow, "ok": True, "result": {"lines": []}}


def test_cancel_of_unknown_request_says_so(helper):
    assert helper.call("cancel", {"target": 12345}) == {"cancelled": False}


def test_eof_ends_the_helper_with_status_0_after_answering(helper):
    request_id = helper.send("inventory")
    assert helper.close() == 0
    assert helper.answers[request_id]["ok"] is True


def test_eof_ends_a_running_follow(helper, installed):
    (installed.root / "shards" / "s1").mkdir(parents=True)
    follow = helper.send("logs", {"shard_id": "s1", "follow": True})
    helper.wait_events(follow, lambda events: events)
    assert helper.close() == 0
    assert helper.answers[follow]["ok"] is True


def test_output_lines_never_interleave(helper):
    ids = [helper.send("status") for _ in range(30)] + [helper.send("ping") for _ in range(30)]
    for request_id in ids:
        assert helper.answer(request_id)["ok"]
    # Every line parsed as one JSON object (the reader would have raised otherwise).
    assert len(helper.lines) == 1 + len(ids)


# --------------------------------------------------------------------------------------------
# Self-verification


def _run_serve(path, sha, root, stdin=b""):
    return subprocess.run(
        [sys.executable, str(path), "serve", "--expect-sha256", sha, "--root", str(root)],
        input=stdin,
        capture_output=True,
        timeout=30,
    )


def test_tampered_copy_exits_97_with_the_fatal_line(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    data = bytearray(path.read_bytes())
    position = data.index(b"HELPER_VERSION = ")
    data[position] = ord("h")  # one byte changed
    path.write_bytes(bytes(data))
    result = _run_serve(path, sha, tmp_path / "root")
    assert result.returncode == 97
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"fatal": "integrity", "expected": sha, "actual": sha256_of(path)}


def test_correct_copy_runs(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    result = _run_serve(path, sha, tmp_path / "root", stdin=b'{"id": "r", "op": "ping"}\n')
    assert result.returncode == 0
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert lines[0]["hello"]["sha256"] == sha
    assert lines[1]["id"] == "r" and lines[1]["ok"] is True


def test_expected_hash_comes_from_the_command_line_only(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    assert sha.encode() not in path.read_bytes()
    wrong = "0" * 64
    result = _run_serve(path, wrong, tmp_path / "root")
    assert result.returncode == 97
    assert json.loads(result.stdout)["expected"] == wrong


def test_directory_open_to_others_exits_98(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    os.chmod(path.parent, 0o755)
    result = _run_serve(path, sha, tmp_path / "root")
    assert result.returncode == 98
    fatal = json.loads(result.stdout)
    assert fatal["fatal"] == "permissions"
    assert fatal["path"] == str(path.parent)
    assert fatal["mode"] == "0755"
    assert fatal["owner"] == os.getuid()
    assert "chmod 700" in fatal["message"]


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_directory_owned_by_someone_else_exits_98(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    os.chown(path.parent, 4242, 4242)
    result = _run_serve(path, sha, tmp_path / "root")
    assert result.returncode == 98
    fatal = json.loads(result.stdout)
    assert fatal["owner"] == 4242 and "uid 4242" in fatal["message"]


def test_integrity_is_checked_before_permissions(tmp_path):
    path, sha = install_helper(tmp_path / "root")
    os.chmod(path.parent, 0o755)
    result = _run_serve(path, "f" * 64, tmp_path / "root")
    assert result.returncode == 97


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["serve"], id="serve-without-hash"),
        pytest.param(["launch"], id="launch-is-not-one-shot"),
        pytest.param(["stop", "x"], id="stop-is-not-one-shot"),
        pytest.param(["fetch"], id="fetch-is-not-one-shot"),
        pytest.param(["reclaim", "/tmp", "--collect"], id="no-collect-one-shot"),
        pytest.param([], id="no-command"),
    ],
)
def test_bad_command_line_exits_2(argv):
    result = subprocess.run([sys.executable, str(HELPER_PATH)] + argv, capture_output=True, timeout=30)
    assert result.returncode == 2, result.stderr


# --------------------------------------------------------------------------------------------
# One-shot mode


def _one_shot(*argv, env=None):
    return subprocess.run(
        [sys.executable, str(HELPER_PATH)] + list(argv), capture_output=True, timeout=60, env=env
    )


def test_help_lists_the_operations():
    result = _one_shot("--help")
    assert result.returncode == 0
    text = result.stdout.decode()
    for op in ("ping", "inventory", "storage", "holdings", "fetch", "launch", "status", "stop", "forget", "logs", "reclaim", "cancel"):
        assert "  %s " % op in text, op
    assert "supervise" not in text


def test_one_shot_inventory_json_matches_the_protocol(helper, tmp_path):
    result = _one_shot("inventory", "--json", "--root", str(tmp_path))
    assert result.returncode == 0
    one_shot = json.loads(result.stdout)
    served = helper.call("inventory")
    assert set(one_shot) == set(served)
    for key in ("hostname", "boot_id", "cpus", "memory_bytes", "nvidia_smi"):
        assert one_shot[key] == served[key]


def test_one_shot_inventory_is_readable(tmp_path):
    result = _one_shot("inventory", "--root", str(tmp_path))
    assert result.returncode == 0
    text = result.stdout.decode()
    assert socket.gethostname() in text and "nvidia-smi:" in text
    with pytest.raises(ValueError):
        json.loads(text)


def test_one_shot_storage_and_holdings(tmp_path):
    (tmp_path / "models" / "m1").mkdir(parents=True)
    (tmp_path / "models" / "m1" / "w.bin").write_bytes(b"x" * 10)
    result = _one_shot("storage", str(tmp_path / "models"), str(tmp_path / "absent"), "--json")
    storage = json.loads(result.stdout)
    assert storage["missing"] == [str(tmp_path / "absent")]
    assert storage["filesystems"][0]["dirs"] == [str(tmp_path / "models")]
    result = _one_shot("holdings", "m1=%s" % (tmp_path / "models" / "m1"), "m2=%s" % (tmp_path / "nope"), "--json")
    assert json.loads(result.stdout)["held"] == {"m1": {"path": str(tmp_path / "models" / "m1"), "bytes": 10}}
    text = _one_shot("holdings", "m1=%s" % (tmp_path / "models" / "m1"), "m2=%s" % (tmp_path / "nope")).stdout.decode()
    assert "m2" in text and "-" in text.split("m2", 1)[1]


def test_one_shot_status_and_logs_read_the_root(tmp_path):
    shard = tmp_path / "shards" / "old"
    shard.mkdir(parents=True)
    (shard / "state.json").write_text(json.dumps({"shard_id": "old", "pid": None, "argv": ["x"], "exit_code": 3}))
    (shard / "engine.log").write_text("first\nsecond\n")
    status = json.loads(_one_shot("status", "--json", "--root", str(tmp_path)).stdout)
    assert status["shards"][0]["exit_code"] == 3 and status["shards"][0]["alive"] is False
    assert status["shards"][0]["log_tail"] == ["first", "second"]
    logs = _one_shot("logs", "old", "-n", "1", "--root", str(tmp_path))
    assert logs.stdout.decode() == "second\n"


def test_one_shot_reclaim_only_lists(tmp_path):
    entry = tmp_path / ("llmgw-" + "a" * 16)
    entry.mkdir()
    (entry / "w").write_bytes(b"12345")
    (entry / ".llmgw-complete").write_text("{}")
    listing = json.loads(_one_shot("reclaim", str(tmp_path), "--json").stdout)
    assert [e["action"] for e in listing["entries"]] == ["listed"]
    assert entry.exists()


def test_one_shot_error_goes_to_stderr_with_status_1(tmp_path):
    result = _one_shot("logs", "nothing-here", "--root", str(tmp_path))
    assert result.returncode == 1
    assert b"not_found" in result.stderr


def test_ping_round_trips_many_times(helper):
    # Fast operations are handled inline; a burst must all come back, in order of sending.
    ids = [helper.send("ping") for _ in range(200)]
    wait_until(lambda: all(i in helper.answers for i in ids), message="200 pings answered")
    answered = [line["id"] for line in helper.lines if "id" in line]
    assert answered == ids
