"""Typed node operations (ops.py) and the NodeError classes (errors.py).

The kinds the helper can send are read from its own source; the typed answers are checked
against a real helper (a `connection: local` link, the same protocol as over SSH), and their
refusals of malformed answers against scripted ones.
"""

from __future__ import annotations

import ast
import socket
import sys

import pytest

from llmgw.config import NodeConfig
from llmgw.fleet import errors
from llmgw.fleet.errors import (
    REMOTE_ERRORS,
    BadArguments,
    EngineProgramMissing,
    MalformedAnswer,
    NodeError,
    NodeUnavailable,
    PortInUse,
    RemoteError,
    ShardAlive,
    ShardNotFound,
)
from llmgw.fleet.facts import Inventory, Storage
from llmgw.fleet.link import LocalLink, helper_code
from llmgw.fleet.ops import (
    Fetched,
    FetchProgress,
    FetchRequest,
    FleetSecretRequest,
    ForgetRequest,
    Forgotten,
    HoldingsRequest,
    InventoryRequest,
    LaunchRequest,
    LogsRequest,
    NodeOps,
    Pong,
    ReclaimRequest,
    SourceSizeRequest,
    StatusRequest,
    StopRequest,
    StorageDir,
    StorageRequest,
)
from llmgw.fleet.secret import fleet_secret

# -- every kind the helper can send is mapped ---------------------------------------------------


def _helper_tree() -> ast.Module:
    return ast.parse(helper_code().text)


def _declared_kinds() -> tuple[str, ...]:
    for statement in _helper_tree().body:
        if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == "ERROR_KINDS"):
            return ast.literal_eval(statement.value)
    raise AssertionError("the helper declares no ERROR_KINDS")


def _kinds_sent() -> set[str]:
    """Every kind spelled out where the helper raises or answers an error:
    HelperError("kind", ...) and self._fail(request_id, "kind", ...)."""
    kinds = set()
    for node in ast.walk(_helper_tree()):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        position = {"HelperError": 0, "_fail": 1}.get(name)
        if position is None or len(node.args) <= position:
            continue
        kind = node.args[position]
        if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
            kinds.add(kind.value)
        else:  # re-raised from a caught HelperError: its kind was spelled where it was raised
            assert ast.unparse(kind) in ("job.error.kind", "exc.kind"), ast.unparse(kind)
    return kinds


def test_every_kind_the_helper_sends_is_declared():
    sent = _kinds_sent()
    assert len(sent) > 15, "the scan finds the helper's errors"
    assert sent - set(_declared_kinds()) == set(), "kinds sent but not in ERROR_KINDS"


def test_every_declared_kind_is_mapped_to_its_own_class_and_nothing_else_is():
    declared = _declared_kinds()
    assert len(set(declared)) == len(declared)
    assert set(REMOTE_ERRORS) == set(declared), "the table maps exactly the kinds the helper declares"
    assert len(set(REMOTE_ERRORS.values())) == len(REMOTE_ERRORS), "one class per kind"
    for kind, cls in REMOTE_ERRORS.items():
        assert issubclass(cls, RemoteError) and cls is not RemoteError
        assert cls.KIND == kind


@pytest.mark.parametrize("kind", sorted(REMOTE_ERRORS))
def test_a_node_error_built_from_a_kind_is_that_kinds_class(kind):
    exc = NodeError("n1", "launch", "remote", "it failed", kind=kind)
    assert type(exc) is REMOTE_ERRORS[kind]
    assert (exc.node, exc.op, exc.phase, exc.kind, exc.message) == ("n1", "launch", "remote", kind, "it failed")
    assert str(exc) == "n1: launch: remote: it failed"
    direct = REMOTE_ERRORS[kind]("n1", "launch", "remote", "it failed")
    assert direct.kind == kind


def test_an_unknown_kind_stays_a_remote_error_with_its_kind_and_local_errors_have_none():
    newer = NodeError("n1", "ping", "remote", "new", kind="from_a_newer_helper")
    assert type(newer) is RemoteError and newer.kind == "from_a_newer_helper"
    local = NodeError("n1", "launch", "ports", "no free port")
    assert type(local) is NodeError and local.kind is None
    assert NodeUnavailable("n1", "ping", "not connected", "down").kind is None
    assert "unknown_shard" not in REMOTE_ERRORS  # the helper never sends it


def test_every_error_class_is_a_node_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)
               and v.__module__ == errors.__name__]  # not the root it imports (llmgw.contracts.errors)
    assert all(issubclass(c, NodeError) for c in classes)
    assert set(REMOTE_ERRORS.values()) <= set(classes)


# -- typed requests and answers over a scripted transport ----------------------------------------


class Scripted:
    """A transport that answers each operation from a table and records what it was sent."""

    def __init__(self, answers: dict | None = None, events: list | None = None):
        self.answers = answers or {}
        self.events = events or []
        self.sent: list[tuple[str, dict, float | None]] = []
        self.cancelled = False

    async def call(self, op, args=None, timeout=30.0):
        self.sent.append((op, args, timeout))
        return self.answers[op]

    def stream(self, op, args=None):
        self.sent.append((op, args, None))
        return ScriptedStream(self, self.answers.get(op))


class ScriptedStream:
    def __init__(self, transport: Scripted, result):
        self.transport, self.result, self._done = transport, result, False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if not self._done:
            self.transport.cancelled = True

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for event in self.transport.events:
            yield event
        self._done = True


async def test_requests_send_the_documented_arguments_and_time_bounds():
    transport = Scripted({"launch": {"shard_id": "r-0", "pid": 7, "start_time": 70, "argv": ["e", "--x"]},
                          "stop": {"was_alive": True, "stopped": True}, "forget": {},
                          "source_size": {"bytes": None, "files": 3}})
    ops = NodeOps("n1", transport)
    launched = await ops.launch(LaunchRequest("r-0", ["e", "--x"], env={"KEY": "k"}, port=8000, host="0.0.0.0",
                                              health_url="http://127.0.0.1:8000/health", gpus=(0, 1)))
    assert (launched.pid, launched.start_time, launched.argv, launched.pgid) == (7, 70, ("e", "--x"), None)
    stopped = await ops.stop(StopRequest("r-0", grace=5))
    assert stopped.was_alive and stopped.stopped
    assert await ops.forget(ForgetRequest("r-0")) == Forgotten()
    size = await ops.source_size(SourceSizeRequest({"kind": "https", "urls": ["https://x/a"]}, token="t"))
    assert size.bytes is None and size.files == 3  # unknown stays unknown
    assert transport.sent == [
        ("launch", {"shard_id": "r-0", "argv": ["e", "--x"], "env": {"KEY": "k"}, "files": {}, "file_sha256": {},
                    "port": 8000, "host": "0.0.0.0", "health_url": "http://127.0.0.1:8000/health", "gpus": [0, 1]}, 60.0),
        ("stop", {"shard_id": "r-0", "grace": 5}, 35.0),
        ("forget", {"shard_id": "r-0"}, 30.0),
        ("source_size", {"source": {"kind": "https", "urls": ["https://x/a"]}, "token": "t"}, 60.0),
    ]


def test_a_requests_repr_shows_no_secret():
    shown = " ".join(repr(r) for r in (
        LaunchRequest("r-0", ["e"], env={"API_KEY": "sk-engine-key"}, files={"key.txt": "sk-engine-key"}),
        FetchRequest({"kind": "hf", "repo": "o/m"}, "/c", "llmgw-" + "a" * 32, token="hf_token_value"),
        SourceSizeRequest({"kind": "hf", "repo": "o/m"}, token="hf_token_value"),
        FleetSecretRequest("f" * 64)))
    assert "sk-engine-key" not in shown and "hf_token_value" not in shown and "f" * 64 not in shown
    assert "r-0" in shown and "o/m" in shown


@pytest.mark.parametrize("op,answer,call,field", [
    pytest.param("launch", {"pid": "seven"}, lambda ops: ops.launch(LaunchRequest("r-0", ["e"])), "pid is a string",
                 id="launch-pid-a-string"),
    pytest.param("launch", {"argv": ["e"]}, lambda ops: ops.launch(LaunchRequest("r-0", ["e"])), "pid is missing",
                 id="launch-without-pid"),
    pytest.param("stop", {"was_alive": 1, "stopped": True}, lambda ops: ops.stop(StopRequest("r-0")),
                 "was_alive is an integer", id="stop-flag-an-integer"),
    pytest.param("logs", {"lines": ["a", 2]}, lambda ops: ops.logs(LogsRequest("r-0")), "lines[1] is an integer",
                 id="logs-line-not-a-string"),
    pytest.param("reclaim", {"entries": [{"name": "llmgw-a", "action": None}]},
                 lambda ops: ops.reclaim(ReclaimRequest("/c")), "entries[0].action is missing", id="reclaim-entry"),
    pytest.param("holdings", {"held": {"m": {"path": "/c/llmgw-a", "file": 3}}},
                 lambda ops: ops.holdings(HoldingsRequest({"m": ["/c/llmgw-a"]})), "held['m'].file is an integer",
                 id="holdings-file-not-a-string"),
    pytest.param("status", {"shards": [{"shard_id": "r-0", "pid": "twelve"}]},
                 lambda ops: ops.status(StatusRequest()), "shards[0].pid is a string", id="status"),
    pytest.param("ping", [], lambda ops: ops.ping(), "the answer is a list, not an object", id="ping-a-list"),
])
async def test_a_malformed_answer_is_a_precise_error_naming_the_field(op, answer, call, field):
    with pytest.raises(MalformedAnswer) as info:
        await call(NodeOps("n1", Scripted({op: answer})))
    assert info.value.node == "n1" and info.value.op == op and info.value.phase == "answer"
    assert info.value.message.startswith(f"malformed {op} answer: ") and field in info.value.message


async def test_a_fetch_stream_gives_typed_progress_and_result_and_skips_unknown_events():
    transport = Scripted({"fetch": {"path": "/c/llmgw-a", "bytes": 10, "file": "/c/llmgw-a/m.gguf"}},
                         [("progress", {"bytes": 4, "total": None}), ("from-a-newer-helper", {}),
                          ("progress", {"bytes": 10, "total": 10})])
    stream = NodeOps("n1", transport).fetch(FetchRequest({"kind": "https", "urls": ["https://x/m.gguf"]}, "/c",
                                                         "llmgw-a", max_bytes=100))
    with pytest.raises(RuntimeError, match="not ended"):
        stream.result
    async with stream:
        seen = [event async for event in stream]
    assert seen == [FetchProgress(4, None), FetchProgress(10, 10)]
    assert stream.result == Fetched("/c/llmgw-a", 10, "/c/llmgw-a/m.gguf")
    assert not transport.cancelled
    assert transport.sent[0][1] == {"source": {"kind": "https", "urls": ["https://x/m.gguf"]}, "cache_dir": "/c",
                                    "name": "llmgw-a", "token": None, "max_bytes": 100}


async def test_a_malformed_event_ends_the_stream_and_cancels_it_on_the_node():
    transport = Scripted({"fetch": {"path": "/c/llmgw-a"}}, [("progress", {"bytes": "4"})])
    stream = NodeOps("n1", transport).fetch(FetchRequest({"kind": "https", "urls": ["https://x/a"]}, "/c", "llmgw-a"))
    with pytest.raises(MalformedAnswer, match=r"malformed fetch progress event: bytes is a string"):
        async with stream:
            async for _ in stream:
                pass
    assert transport.cancelled


async def test_a_follow_gives_typed_lines():
    transport = Scripted({"logs": {"lines": []}}, [("lines", {"lines": ["a", "b"]}), ("lines", {"lines": ["c"]})])
    async with NodeOps("n1", transport).follow_logs(LogsRequest("r-0", 5)) as stream:
        seen = [event.lines async for event in stream]
    assert seen == [("a", "b"), ("c",)]
    assert transport.sent == [("logs", {"shard_id": "r-0", "lines": 5, "follow": True}, None)]


# -- the typed answers of a real helper ----------------------------------------------------------


@pytest.fixture
async def link(tmp_path):
    link = LocalLink(NodeConfig(name="local", connection="local"), tmp_path / "node",
                     fleet_secret=fleet_secret(tmp_path / "state"))
    link.start()
    try:
        assert await link.wait_ready(60), link.reason
        yield link
    finally:
        await link.close()


async def test_a_real_helpers_answers_parse_as_the_typed_answers(link, tmp_path):
    ops = link.ops
    assert link.hello is not None and link.hello.sha256 == helper_code().sha256 and link.hello.root
    assert isinstance(await ops.ping(), Pong)
    assert isinstance(await ops.inventory(), Inventory)
    recipe = {"kind": "venv", "packages": ["llmgw-probe"], "index_url": None, "extra_index_urls": [],
              "find_links": [str(tmp_path)], "python": None, "post_install": []}
    engines = await ops.inventory(InventoryRequest(images=["img:1"], venvs={"k": recipe}))
    assert set(engines.containers) == {"docker", "podman"}
    assert engines.venvs["k"].found is True and engines.venvs["k"].built is False and engines.python
    storage = await ops.storage(StorageRequest((StorageDir(str(tmp_path)), StorageDir(str(tmp_path / "none")))))
    assert isinstance(storage, Storage) and storage.missing == (str(tmp_path / "none"),)
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"w" * 10)
    holdings = await ops.holdings(HoldingsRequest({"m": [str(tmp_path / "absent"), str(weights)]}))
    assert holdings.held["m"].path == str(weights) and holdings.held["m"].bytes == 10
    assert holdings.held["m"].file is None  # not a cache entry
    listing = await ops.reclaim(ReclaimRequest(str(tmp_path / "cache")))
    assert listing.entries == ()
    with pytest.raises(BadArguments, match="collect needs the exact list"):
        await ops.reclaim(ReclaimRequest(str(tmp_path / "cache"), collect=True))
    with pytest.raises(ShardNotFound):
        await ops.logs(LogsRequest("no-such-shard"))
    assert await ops.forget(ForgetRequest("no-such-shard")) == Forgotten()


async def test_a_real_helpers_refusals_arrive_as_their_classes(link, tmp_path):
    ops = link.ops
    with pytest.raises(EngineProgramMissing, match="no-such-engine-program"):
        await ops.launch(LaunchRequest("s-missing", ["no-such-engine-program"]))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortInUse) as info:
            await ops.launch(LaunchRequest("s-port", [sys.executable, "-c", "pass"], port=port, host="127.0.0.1"))
        assert info.value.kind == "port_in_use" and str(port) in info.value.message
    launched = await ops.launch(LaunchRequest("s-live", [sys.executable, "-c", "import time; time.sleep(60)"]))
    assert launched.pid > 0 and launched.shard_id == "s-live" and launched.argv[0] == sys.executable
    try:
        status = await ops.status()
        assert status["s-live"].alive and status["s-live"].pid == launched.pid
        with pytest.raises(ShardAlive):
            await ops.forget(ForgetRequest("s-live"))
        with pytest.raises(ShardAlive):
            await ops.launch(LaunchRequest("s-live", [sys.executable, "-c", "pass"]))
    finally:
        stopped = await ops.stop(StopRequest("s-live", grace=2))
    assert stopped.was_alive and stopped.stopped
    assert await ops.forget(ForgetRequest("s-live")) == Forgotten()
    with pytest.raises(ShardNotFound):
        await ops.logs(LogsRequest("s-live"))


async def test_a_link_that_is_not_connected_is_unavailable(tmp_path):
    link = LocalLink(NodeConfig(name="local", connection="local"), tmp_path / "node")
    with pytest.raises(NodeUnavailable) as info:
        await link.ops.ping()
    assert info.value.phase == "not connected" and info.value.op == "ping"
