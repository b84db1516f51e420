"""The helper's JSON-lines loop in-process: framing, refusals, failures that must not kill it."""

import io
import json
import os
import threading

from tests.helper.client import load_helper

helper = load_helper()


class _Pipe:
    """A blocking line source the test feeds, standing in for stdin."""

    def __init__(self):
        self.lines = []
        self.cond = threading.Condition()
        self.closed = False

    def feed(self, obj):
        with self.cond:
            self.lines.append((json.dumps(obj) + "\n").encode())
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def readline(self):
        with self.cond:
            self.cond.wait_for(lambda: self.lines or self.closed, 30)
            return self.lines.pop(0) if self.lines else b""


def _serve(node, requests):
    source = io.BytesIO(b"".join((json.dumps(r) + "\n").encode() for r in requests))
    out = io.BytesIO()
    assert helper.Server(node, source, out).run() == 0
    return [json.loads(line) for line in out.getvalue().decode().splitlines()]


def _answers(lines):
    return {line["id"]: line for line in lines if "ok" in line}


def test_an_unexpected_exception_is_answered_as_internal_and_the_helper_goes_on(tmp_path):
    node = helper.Node(str(tmp_path), helper.__file__, "0" * 64)

    def broken(args, ctx):
        raise ZeroDivisionError("division by zero")

    node.operations["inventory"] = broken
    node.operations["ping"] = lambda args, ctx: {"time": 1.0}
    lines = _serve(node, [{"id": 1, "op": "inventory"}, {"id": 2, "op": "ping"}])
    answers = _answers(lines)
    assert answers[1] == {"id": 1, "ok": False, "error": {"kind": "internal", "message": "ZeroDivisionError: division by zero"}}
    assert answers[2] == {"id": 2, "ok": True, "result": {"time": 1.0}}


def test_hello_comes_first_and_names_the_expected_hash(tmp_path):
    node = helper.Node(str(tmp_path), helper.__file__, "ab" * 32)
    lines = _serve(node, [])
    assert list(lines[0]) == ["hello"]
    hello = lines[0]["hello"]
    assert hello["sha256"] == "ab" * 32 and hello["protocol"] == 1 and hello["pid"] == os.getpid()


def test_events_come_before_the_answer_and_carry_the_id(tmp_path):
    node = helper.Node(str(tmp_path), helper.__file__, "0" * 64)

    def streaming(args, ctx):
        ctx.emit("lines", {"lines": ["a"]})
        ctx.emit("lines", {"lines": ["b"]})
        return {"lines": []}

    node.operations["logs"] = streaming
    lines = _serve(node, [{"id": "f", "op": "logs", "args": {}}])
    assert lines[1:] == [
        {"id": "f", "event": "lines", "data": {"lines": ["a"]}},
        {"id": "f", "event": "lines", "data": {"lines": ["b"]}},
        {"id": "f", "ok": True, "result": {"lines": []}},
    ]


def test_destructive_operations_need_the_verified_serve_mode(tmp_path):
    node = helper.Node(str(tmp_path), helper.__file__)  # one-shot: no expected hash
    for op, args in (("launch", {"shard_id": "x", "argv": ["true"]}),
                     ("reclaim", {"cache_dir": str(tmp_path), "names": ["llmgw-" + "0" * 16], "collect": True})):
        try:
            node.operations[op](args, helper.Context())
        except helper.HelperError as exc:
            assert exc.kind == "bad_args" and "serve --expect-sha256" in exc.message
        else:
            raise AssertionError("%s ran without serve" % op)


def test_cancel_reaches_a_running_request(tmp_path):
    node = helper.Node(str(tmp_path), helper.__file__, "0" * 64)
    started = threading.Event()

    def waits(args, ctx):
        started.set()
        assert ctx.cancelled.wait(30)
        return {"lines": []}

    node.operations["logs"] = waits
    source, out = _Pipe(), io.BytesIO()
    server = helper.Server(node, source, out)
    runner = threading.Thread(target=server.run)
    runner.start()
    source.feed({"id": 7, "op": "logs", "args": {}})
    assert started.wait(30)
    source.feed({"id": 8, "op": "cancel", "args": {"target": "7"}})
    source.feed({"id": 9, "op": "cancel", "args": {"target": 7}})
    source.close()
    runner.join(30)
    answers = _answers([json.loads(line) for line in out.getvalue().decode().splitlines()])
    assert answers[8]["result"] == {"cancelled": False}, "ids are matched with their type"
    assert answers[9]["result"] == {"cancelled": True}
    assert answers[7]["result"] == {"lines": []}
