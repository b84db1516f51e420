"""Restarts under traffic with zero failed requests (R-10.4, R-10.3, R-4.5, R-4.4).

Two replicas on three single-GPU nodes, steady traffic (plain and streaming) from the official
`openai` client with `max_retries=0` and no retry of our own: every request must succeed the
first time.

- `llmgw serve` gets SIGTERM and is started again: the router workers, processes of their own,
  serve throughout, and the new serve adopts them. No engine restarts.
- The router workers are restarted one by one (`llmgw router restart`, an upgrade): streams in
  flight finish on the old workers, new connections go to the new ones.
- `llmgw serve` is killed with SIGKILL and left down for 60 s: the workers serve the existing
  replicas with their last snapshot; when it returns, what the clients were answered is counted
  once in `ctl usage` (nothing lost, nothing twice) and no replica is duplicated.
- `llmgw serve` gets SIGINT (Ctrl-C in a terminal): the router stops too and the client port is
  free when serve has exited; the engines keep running and the next serve adopts them.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from llmgw.router.supervisor import running_supervisor
from tests.integration.gateway import wait_for
from tests.scenarios.harness import MODEL, PLAIN_TOKENS, START_TIMEOUT, STREAM_TOKENS, running_fleet
from tests.scenarios.traffic import Traffic

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

DOWN_FOR = 60.0  # seconds the control plane stays killed


@pytest.fixture(scope="module")
def fleet(testbed_factory, tmp_path_factory):
    with running_fleet(testbed_factory, tmp_path_factory.mktemp("restart")) as fleet:
        fleet.wait_serving(2, START_TIMEOUT * 3)
        wait_until_accepted(fleet, fleet.key)
        yield fleet


def wait_until_accepted(fleet, key: str) -> None:
    """One answered request with `key`: a new key reaches the routers with the feed's next change."""
    probe = openai.OpenAI(base_url=fleet.url, api_key=key, max_retries=0)

    def accepted() -> bool:
        try:
            probe.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=PLAIN_TOKENS)
            return True
        except openai.AuthenticationError:
            return False
    wait_for(accepted, 30, "the key to reach the router")


def _through_both_replicas(traffic: Traffic, fleet) -> None:
    pids = {e.pid for engines in fleet.engines().values() for e in engines}
    traffic.wait_for(lambda t: {o.engine_pid for o in t.succeeded("stream")} >= pids
                     and len(t.succeeded("plain")) >= 10, 30, "traffic through both replicas")


def _streams_mid_answer(traffic: Traffic) -> list:
    traffic.wait_for(lambda t: [o for o in t.snapshot()[1] if o.kind == "stream" and 1 <= o.tokens <= STREAM_TOKENS // 2],
                     30, "a stream in the middle of its answer")
    return [o for o in traffic.snapshot()[1] if o.kind == "stream" and o.first_token is not None]


def _serving_again(fleet, before: list[dict]) -> list[dict]:
    """The replicas listed as serving once the restarted control plane lists the ones it adopted:
    it probes them first, so a listing read at one moment right after the start may not show them
    yet. A replica started in their place would never match: the wait then fails, naming them."""
    wanted = sorted(r["id"] for r in before)
    try:
        return wait_for(lambda: (lambda s: s if sorted(r["id"] for r in s) == wanted else None)(fleet.serving()),
                        60, f"the adopted replicas {wanted} listed as serving", interval=0.2)
    except AssertionError:
        return fleet.serving()  # the assertion that follows says what is listed instead


def _traffic_after(traffic: Traffic, since: float) -> None:
    traffic.wait_for(lambda t: sum(1 for o in t.succeeded("stream") if o.started > since) >= 4
                     and sum(1 for o in t.succeeded("plain") if o.started > since) >= 20,
                     60, "traffic after the restart")


def _workers(fleet) -> list[int]:
    return [worker["pid"] for worker in fleet.gateway.router_status()["workers"]]


def test_control_plane_restart_fails_no_request_and_restarts_no_engine(fleet):
    before = fleet.serving()
    engines_before = fleet.engines()
    assert sum(len(e) for e in engines_before.values()) == 2
    supervisor, workers = running_supervisor(fleet.gateway.router_dir), _workers(fleet)
    with Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=2, plain_tokens=PLAIN_TOKENS,
                 stream_tokens=STREAM_TOKENS) as traffic:
        _through_both_replicas(traffic, fleet)
        streaming_at_term = _streams_mid_answer(traffic)
        term_at = time.time()
        assert fleet.gateway.stop_serve() == 0, fleet.log_tail()  # SIGTERM to the control plane only
        exited_at = time.time()
        fleet.start()
        ready_at = time.time()
        _traffic_after(traffic, ready_at)
    after = _serving_again(fleet, before)
    engines_after = fleet.engines()
    outcomes = traffic.outcomes
    print()
    print(traffic.account("SIGTERM and restart of llmgw serve under traffic"))
    print(f"   control plane away {ready_at - term_at:.1f}s (old process exited after {exited_at - term_at:.1f}s); "
          f"streams mid-answer at the SIGTERM: {len(streaming_at_term)}; router supervisor {supervisor} "
          f"workers {workers} -> {running_supervisor(fleet.gateway.router_dir)} {_workers(fleet)}")
    assert engines_after == engines_before, fleet.log_tail(20000)  # same processes (pid and start time), same ports
    assert sorted(r["id"] for r in after) == sorted(r["id"] for r in before)
    assert len(outcomes) >= 40
    assert traffic.failed() == [], traffic.account("failures")
    assert [o for o in outcomes if o.attempts] == []  # nothing was retried: there was no window
    assert streaming_at_term and all(o.ok and not o.attempts for o in streaming_at_term)  # finished by the workers
    # The router was never restarted: the new serve adopted it.
    assert running_supervisor(fleet.gateway.router_dir) == supervisor and _workers(fleet) == workers
    assert f"adopting the running router supervisor: pid {supervisor}" in fleet.gateway.log()
    assert "the router workers keep serving" in fleet.gateway.log()  # serve said which stop it was


def test_router_workers_restarted_one_by_one_fail_no_request(fleet):
    workers = _workers(fleet)
    with Traffic(fleet.url, fleet.key, MODEL, plain=2, streams=2, plain_tokens=PLAIN_TOKENS,
                 stream_tokens=STREAM_TOKENS) as traffic:
        _through_both_replicas(traffic, fleet)
        streaming = _streams_mid_answer(traffic)
        restarted_at = time.time()
        restart = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "router", "restart", "--state-dir",
                                  str(fleet.gateway.router_dir)], capture_output=True, text=True, timeout=300)
        done_at = time.time()
        _traffic_after(traffic, done_at)
    print()
    print(traffic.account("router workers restarted one by one under traffic"))
    print(f"   restart took {done_at - restarted_at:.1f}s; workers {workers} -> {_workers(fleet)}; "
          f"streams mid-answer at the restart: {len(streaming)}")
    assert restart.returncode == 0, restart.stderr + fleet.gateway.router_log()[-3000:]
    assert not set(_workers(fleet)) & set(workers)  # every worker replaced
    assert traffic.failed() == [], traffic.account("failures")
    assert streaming and all(o.ok for o in streaming)  # streams in flight finished on the old workers


@pytest.mark.slow
def test_control_plane_killed_and_down_a_minute_fails_no_request_and_counts_usage_once(fleet):
    key = fleet.gateway.create_key("downtime")
    engines_before, before = fleet.engines(), fleet.serving()
    wait_until_accepted(fleet, key)  # that one answer is counted too

    def usage() -> dict:
        rows = fleet.ctl_json("usage", "--by", "key", "--since", "2h")["rows"]
        return next((row for row in rows if row["name"] == "downtime"),
                    {"requests": 0, "completion_tokens": 0})

    with Traffic(fleet.url, key, MODEL, plain=2, streams=2, plain_tokens=PLAIN_TOKENS, stream_tokens=STREAM_TOKENS,
                 max_seconds=DOWN_FOR + 120) as traffic:
        traffic.wait_for(lambda t: len(t.succeeded()) >= 10, 60, "traffic")
        fleet.gateway.kill()
        killed_at = time.time()
        answered_before_kill = len(traffic.succeeded())
        traffic.wait_for(lambda t: time.time() - killed_at >= DOWN_FOR, DOWN_FOR + 10, "the control plane's minute away")
        answered_while_down = len(traffic.succeeded()) - answered_before_kill
        fleet.start()
        back_at = time.time()
        _traffic_after(traffic, back_at)
    outcomes = traffic.outcomes
    counted = {"requests": len(outcomes) + 1, "completion_tokens": sum(o.tokens for o in outcomes) + PLAIN_TOKENS}
    try:
        recorded = wait_for(lambda: (lambda u: u if u["requests"] >= counted["requests"] else None)(usage()), 30,
                            f"usage of {counted['requests']} requests to be recorded")
    except AssertionError:
        recorded = usage()  # short of it: the assertion below says by how much
    print()
    print(traffic.account(f"llmgw serve killed and down {DOWN_FOR:.0f}s under traffic"))
    print(f"   answered while the control plane was down: {answered_while_down}; "
          f"clients counted {counted}; ctl usage says requests {recorded['requests']}, "
          f"completion tokens {recorded['completion_tokens']}")
    assert traffic.failed() == [], traffic.account("failures")
    assert answered_while_down >= 20
    assert {k: recorded[k] for k in counted} == counted  # every answer counted, none twice
    assert fleet.engines() == engines_before  # no replica duplicated or restarted after the return
    assert sorted(r["id"] for r in _serving_again(fleet, before)) == sorted(r["id"] for r in before)
    assert {k: usage()[k] for k in counted} == counted  # still: nothing was delivered twice meanwhile


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections in TIME_WAIT hold no port
        try:
            sock.bind(("127.0.0.1", port))  # no SO_REUSEPORT: fails while a router's listening socket holds it
        except OSError:
            return False
        return True


def test_r10_4_sigint_stops_the_router_too_and_leaves_the_engines_running(fleet):
    engines_before, before = fleet.engines(), fleet.serving()
    assert sum(len(e) for e in engines_before.values()) == 2
    supervisor, workers = running_supervisor(fleet.gateway.router_dir), _workers(fleet)
    log_from = len(fleet.gateway.log())
    fleet.gateway.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends serve (the router has a session of its own)
    assert fleet.gateway.proc.wait(120) == 0, fleet.log_tail()
    said = fleet.gateway.log()[log_from:]
    print(said[-2000:])
    # serve waited for its router: once serve is gone, so is the router, and the port is free.
    assert running_supervisor(fleet.gateway.router_dir) is None, fleet.gateway.router_log()[-3000:]
    assert [pid for pid in (supervisor, *workers) if _alive(pid)] == []
    assert _port_free(fleet.gateway.port)
    assert "interrupted (SIGINT)" in said and f"router stopped (pid {supervisor})" in said
    assert fleet.engines() == engines_before  # same engine processes, still running
    assert all(_alive(e.pid) for engines in engines_before.values() for e in engines)

    fleet.start()  # a new router; the engines are adopted, not started again
    assert running_supervisor(fleet.gateway.router_dir) not in (None, supervisor)
    after = fleet.wait_serving(2, START_TIMEOUT * 3, " after the restart")
    assert sorted(r["id"] for r in after) == sorted(r["id"] for r in before)
    assert fleet.engines() == engines_before
