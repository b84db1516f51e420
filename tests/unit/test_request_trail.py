"""A request's trail and the router's request log (R-6.20): the id chosen, the trail made a
record, the records kept, bounded, merged in the spool and written to a file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from types import SimpleNamespace

import pytest

from llmgw.contracts.feed import (GatewaySettings, Report, RequestRecord, request_record_from_wire,
                                  request_record_to_wire)
from llmgw.router import requestlog
from llmgw.router.requestlog import RequestLog, RequestLogFile
from llmgw.router.spool import Spool, merge_reports
from llmgw.router.trail import CLIENT_CLOSED, CLIENT_CLOSED_STATUS, Trail, new_request_id, request_id_of, to_record
from tests.unit.test_feed_wire import Control, FakeRouter, clients, place, until  # noqa: F401

GATEWAY = GatewaySettings(max_body=1, request_timeout=1.0, on_demand_wait=1.0)


def poll(condition, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("sent,usable", [
    pytest.param("abc", True, id="letters"),
    pytest.param("A-z_0.9:x", True, id="every-allowed-kind"),
    pytest.param("x" * 128, True, id="128-characters"),
    pytest.param("x" * 129, False, id="129-characters"),
    pytest.param("", False, id="empty"),
    pytest.param("a b", False, id="a-space"),
    pytest.param("a/b", False, id="a-slash"),
    pytest.param("é", False, id="not-ascii"),
    pytest.param("a\udcff", False, id="not-utf8"),
])
def test_r6_20_a_clients_id_is_used_only_when_it_is_1_to_128_allowed_characters(sent, usable):
    chosen, kept = request_id_of(sent)
    if usable:
        assert (chosen, kept) == (sent, None)
    else:
        assert chosen != sent and kept is not None and len(kept) <= 128
        kept.encode("utf-8")  # fit for JSON and the log: a byte that was not UTF-8 is replaced
        assert kept == sent[:128] or "\udcff" in sent


def test_r6_20_router_made_ids_are_usable_and_never_repeat():
    made = [request_id_of(None)[0] for _ in range(1000)] + [new_request_id()]
    assert len(set(made)) == len(made)
    assert all(request_id_of(i) == (i, None) for i in made)  # a client may send one back as it is


def test_r6_20_a_forked_child_makes_ids_of_its_own():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    ours = new_request_id()
    assert child.rsplit("-", 1)[0] != ours.rsplit("-", 1)[0]


def _upstream(replica: str, node: str | None = None):
    return SimpleNamespace(replica_id=replica, node=node)


def test_r6_20_the_trail_of_a_retried_stream_becomes_its_record():
    trail = Trail("req-1", None, at=1000.0, started=50.0)
    trail.key, trail.model, trail.asked = "team-a", "chat-v2", "chat"
    trail.queue_start(50.1)
    trail.queue_end(50.3)
    trail.queue_start(50.4)  # an on-demand wait after the place
    trail.queue_end(50.5)
    assert trail.attempt_start(_upstream("chat-v2-r0", "gpu01")) is None
    trail.attempt_end(502, "upstream_unavailable")
    trail.attempt_start(_upstream("small-r1", "gpu02"))
    trail.fallback = "small"
    trail.first_byte(50.75)
    trail.tokens(12, 34, True)
    trail.stream_end(51.0, "upstream_interrupted")
    trail.attempt_end(200)
    trail.finish(51.5, 200, None)
    record = to_record(trail, "POST /v1/chat/completions", "10.0.0.9")
    assert type(record) is RequestRecord
    assert dataclasses.asdict(record) == {
        "at": 1000.0, "id": "req-1", "route": "POST /v1/chat/completions", "status": 200, "duration": 1.5,
        "key": "team-a", "model": "chat-v2", "asked": "chat", "replica": "small-r1", "node": "gpu02",
        "error": "upstream_interrupted", "attempts": 2, "fallback": "small", "queued": pytest.approx(0.3),
        "ttfb": 0.75, "prompt_tokens": 12, "completion_tokens": 34, "estimated": True, "stream": True,
        "client": "10.0.0.9", "client_request_id": None}
    back = request_record_from_wire(json.loads(json.dumps(request_record_to_wire(record))), "record")
    assert back == record  # the record made without its __init__ is a record like any other
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.status = 500


def test_r6_20_a_refusal_before_any_engine_leaves_unknown_as_none():
    trail = Trail("req-2", "not usable!", at=5.0, started=1.0)
    trail.finish(1.25, 401, "invalid_api_key")
    record = to_record(trail, "POST /v1/chat/completions", None)
    assert (record.status, record.error, record.ttfb, record.duration) == (401, "invalid_api_key", 0.25, 0.25)
    assert record.key is record.model is record.replica is record.node is record.queued is None
    assert record.prompt_tokens is record.completion_tokens is None and record.attempts == 0
    assert record.client_request_id == "not usable!" and not record.stream


def test_r6_20_a_client_that_left_before_its_answer_has_no_first_byte():
    trail = Trail("req-3", None, at=5.0, started=1.0)
    trail.finish(3.0, CLIENT_CLOSED_STATUS, CLIENT_CLOSED)
    assert (trail.status, trail.error, trail.ttfb) == (499, "client_closed", None)


def test_r6_20_every_hook_tells_the_span():
    told = []

    class Span:
        def __getattr__(self, hook):
            return lambda *args: told.append(hook) or ({"traceparent": "t"} if hook == "attempt_start" else None)

    trail = Trail("req-4", None, at=5.0, started=1.0)
    trail.span = Span()
    trail.queue_start(1.0)
    trail.queue_end(1.1)
    assert trail.attempt_start(_upstream("r")) == {"traceparent": "t"}
    trail.first_byte(1.2)
    trail.stream_end(1.3)
    trail.attempt_end(200)
    trail.finish(1.4, 200, None)
    assert told == ["queue_start", "queue_end", "attempt_start", "first_byte", "stream_end", "attempt_end", "finish"]


# -- the records kept --------------------------------------------------------------------------------


def _record(n: int) -> RequestRecord:
    return RequestRecord(at=float(n), id=f"req-{n}", route="POST /v1/chat/completions", status=200, duration=0.5)


def test_r6_20_records_wait_for_a_report_bounded_oldest_dropped(monkeypatch, caplog):
    monkeypatch.setattr(requestlog, "RECORDS_KEPT", 3)
    log = RequestLog()
    log._records = type(log._records)(maxlen=3)
    for n in range(5):
        log.keep(_record(n))
    assert [r.id for r in log.take()] == ["req-2", "req-3", "req-4"] and log.take() == ()
    assert log.dropped == 2
    assert len([r for r in caplog.records if "oldest are dropped" in r.getMessage()]) == 1  # once per spell


@pytest.mark.parametrize("settings,kept", [
    pytest.param({}, 200, id="every-one"),
    pytest.param({"request_log_sample": 0.0}, 0, id="sample-0"),
    pytest.param({"request_log": False}, 0, id="off"),
])
def test_r6_20_the_share_kept(settings, kept):
    log = RequestLog()
    log.configure(dataclasses.replace(GATEWAY, **settings))
    assert sum(log.keeps() for _ in range(200)) == kept


def test_r6_20_a_sample_keeps_about_its_share():
    log = RequestLog()
    log.configure(dataclasses.replace(GATEWAY, request_log_sample=0.25))
    share = sum(log.keeps() for _ in range(20000)) / 20000
    assert 0.2 < share < 0.3


def test_r6_20_a_merged_report_keeps_the_newest_records(monkeypatch):
    monkeypatch.setattr("llmgw.router.spool.REQUESTS_PER_REPORT", 4)
    older = Report(router="r", seq=1, sent_at=1.0, requests=tuple(map(_record, range(3))))
    newer = Report(router="r", seq=2, sent_at=2.0, requests=tuple(map(_record, range(3, 6))))
    assert [r.id for r in merge_reports(older, newer).requests] == ["req-2", "req-3", "req-4", "req-5"]


def test_r6_20_a_spool_that_cannot_send_writes_each_record_once_and_stays_bounded(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("llmgw.router.spool.REQUESTS_PER_REPORT", 50)
    spool = Spool(tmp_path, "r-0")
    for period in range(10):  # the control plane away: every report merged into the first
        spool.add({"requests": tuple(_record(period * 20 + n) for n in range(20))}, 1.0 + period)
    assert len(spool.pending) == 1
    kept = [r.id for r in spool.pending[0].report.requests]
    assert kept == [f"req-{n}" for n in range(150, 200)]
    assert spool.records_dropped == 150
    assert len([r for r in caplog.records if "the oldest are dropped" in r.getMessage()]) == 1
    text = spool.path.read_text()
    assert text.count('"id":"req-') == 200  # appended once each, not once per merge
    again = Spool(tmp_path, "r-0")
    again.load()
    assert [r.id for r in again.pending[0].report.requests] == kept
    assert again.pending[0].report.usage == spool.pending[0].report.usage
    body = json.loads(spool.pending[0].encoded())
    assert [r["id"] for r in body["requests"]] == kept  # what is sent: the merged report whole


def test_r6_20_a_report_sent_whole_is_spooled_as_the_same_bytes(tmp_path):
    spool = Spool(tmp_path, "r-0")
    report = spool.add({"requests": (_record(1),)}, 1.0)
    line = spool.path.read_bytes().splitlines()[-1]
    assert spool.pending[0].encoded() == line and json.loads(line)["requests"][0]["id"] == "req-1"
    assert report.requests == (_record(1),)


# -- the file ----------------------------------------------------------------------------------------


def test_r6_20_the_file_gets_each_record_as_a_json_line_and_follows_a_rotation(tmp_path):
    path = tmp_path / "requests.jsonl"
    writer = RequestLogFile(str(path))
    try:
        writer.put(_record(1))
        poll(lambda: path.exists() and path.read_text().count("\n") == 1, what="the first line")
        path.rename(tmp_path / "requests.jsonl.1")  # logrotate
        writer.put(_record(2))
        poll(lambda: path.exists() and path.read_text().count("\n") == 1, what="a new file at the path")
    finally:
        writer.close(wait=True)
    assert request_record_from_wire(json.loads(path.read_text()), "line") == _record(2)
    assert json.loads((tmp_path / "requests.jsonl.1").read_text())["id"] == "req-1"


def test_r6_20_a_file_that_cannot_be_opened_drops_its_records_and_says_so_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    writer = RequestLogFile(str(tmp_path / "missing" / "requests.jsonl"))
    try:
        for n in range(3):
            writer.put(_record(n))
            poll(lambda: writer.dropped == n + 1, what="the record dropped")
    finally:
        writer.close(wait=True)
    warned = [r.getMessage() for r in caplog.records if "request log" in r.getMessage()]
    assert len(warned) == 1 and "cannot open it: No such file or directory" in warned[0]


def test_r6_20_a_new_path_takes_over_and_turning_it_off_ends_the_writer(tmp_path):
    log = RequestLog()
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    log.configure(dataclasses.replace(GATEWAY, request_log_path=str(first)))
    log.keep(_record(1))
    writer = log._file
    log.configure(dataclasses.replace(GATEWAY, request_log_path=str(second)))
    log.keep(_record(2))
    log.configure(dataclasses.replace(GATEWAY, request_log_path=str(second), request_log=False))
    assert log._file is None
    writer._thread.join(5)
    poll(lambda: first.exists() and second.exists() and second.read_text().count("\n") == 1, what="both files")
    assert json.loads(first.read_text())["id"] == "req-1" and json.loads(second.read_text())["id"] == "req-2"


# -- over the router feed ----------------------------------------------------------------------------


class RecordingRouter(FakeRouter):
    """A router whose reports carry the request-log records it was given since the last one."""

    def __init__(self):
        super().__init__()
        self.records: list[RequestRecord] = []

    def report_fields(self) -> dict:
        taken, self.records = tuple(self.records), []
        return {**super().report_fields(), "requests": taken}


async def test_r6_20_records_made_while_the_control_plane_is_away_reach_it_once(place, clients):  # noqa: F811
    control = Control(place)
    router = RecordingRouter()
    client = await clients(router, control.address, place / "router")
    for period in range(3):
        router.records.extend(_record(period * 10 + n) for n in range(10))
        await asyncio.sleep(0.06)  # a report period passes between them: merged in the spool
    await until(lambda: not router.records, "the records spooled")
    await control.start()
    try:
        await until(lambda: client.unacked == 0 and control.publisher.counted, "the spooled report delivered")
        router.records.append(_record(99))
        await until(lambda: any(r.requests and r.requests[-1].id == "req-99" for r in control.publisher.counted.values()),
                    "a report made after the outage")
    finally:
        await control.stop()
    ids = [r.id for report in control.publisher.counted.values() for r in report.requests]
    assert sorted(ids) == sorted([f"req-{n}" for n in range(30)] + ["req-99"])  # each once, none lost
