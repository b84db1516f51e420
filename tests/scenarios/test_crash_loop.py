"""Engine crash loop: an engine that dies on start is retried with a growing backoff, never in a
busy loop, and the operator sees why (R-4.1, R-4.2, R-4.8).

An engine double refuses to start (it prints an engine-like error and exits 1) for one model,
while another model on the same node serves traffic. Every launch of the crashing model is a
new replica; failed ones stay listed by `llmgw ctl replicas` with their reason and log tail, so
the listing itself counts the launches.
"""

from __future__ import annotations

import math
import os
import re
import time

import openai
import pytest

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

WINDOW = 60.0  # seconds of crash loop counted, from the first launch
BACKOFF_BASE = 2.0  # llmgw.control.state.FAILURE_BACKOFF_BASE: the k-th failure waits 2**(k-1)..2**k s
REFUSAL = "RuntimeError: CUDA error: out of memory (engine double refusing to start)"


def _launch_bounds(window: float) -> tuple[int, int]:
    """How many launches a window starting at a launch can hold.

    At most: the gaps are at least 1, 2, 4, ... s (the low end of each jittered step), so N
    launches need 2**(N-1) - 1 s. At least: even with 15 s of detection per failure on top of
    the high end of each step (2, 4, 8 s), four launches fit in a minute.
    """
    most = 1 + int(math.log2(window / (BACKOFF_BASE / 2) + 1))
    return 4, most


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("cpu1", gpus=None, mem_gb=32)])
    yield tb
    tb.close()


def test_engine_crash_loop_backs_off_and_says_why(bed, tmp_path):
    bed.set_engine_knobs("cpu1", by_model={"crashy": {"refuse_start": REFUSAL, "stderr_lines": 2}})
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": "60s"}}
    models = [{"name": "crashy", "profile": "cpu", "scaling": {"min": 1}},
              {"name": "steady", "profile": "cpu", "scaling": {"min": 1}}]
    inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=models, profiles=profiles)
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    try:
        ctl = Ctl(gateway)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.create_key("crash-loop"),
                               max_retries=0)

        def crashy_launches() -> dict[str, dict]:
            return {r["id"]: r for r in ctl.json("replicas")["replicas"] if r["model"] == "crashy"}

        first = wait_for(lambda: crashy_launches(), 60, f"a first launch of crashy\n{gateway.log()[-2000:]}")
        started = min(r["created_at"] for r in first.values())
        wait_for(lambda: client.chat.completions.create(model="steady", messages=[{"role": "user", "content": "hi"}]),
                 60, "steady to serve")
        cpu_before, clock_before = _cpu_seconds(gateway.proc.pid), time.monotonic()

        # Traffic to the healthy model for the whole window; the listing is read as we go.
        sent = ok = 0
        failures: list[str] = []
        seen: dict[str, dict] = {}
        next_look = 0.0
        while time.time() < started + WINDOW + 1.0:
            sent += 1
            try:
                reply = client.chat.completions.create(model="steady", messages=[{"role": "user", "content": "hi"}])
                ok += reply.choices[0].message.content.startswith("steady")
            except openai.APIError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            if time.monotonic() >= next_look:
                seen.update(crashy_launches())
                next_look = time.monotonic() + 2.0
            time.sleep(0.25)  # a client's pace, not a wait for a condition
        seen.update(crashy_launches())
        cpu_used = _cpu_seconds(gateway.proc.pid) - cpu_before
        elapsed = time.monotonic() - clock_before

        launches = sorted(r["created_at"] for r in seen.values() if r["created_at"] <= started + WINDOW)
        gaps = [b - a for a, b in zip(launches, launches[1:])]
        failed = [r for r in seen.values() if r["state"] == "failed"]
        text = ctl.ok("replicas").stdout

        def crashy_failing() -> dict | None:
            listed = {m["name"]: m for m in ctl.json("models")["models"]}
            return listed if listed["crashy"]["state"] == "failing" else None

        # Between launches crashy is `failing` (waiting out its backoff), while one runs it is
        # `starting`: wait for the state rather than read whichever a moment shows.
        models = wait_for(crashy_failing, 120, f"crashy to be listed as failing\n{gateway.log()[-2000:]}",
                          interval=0.2)
        # Read after the last listing: a launch placed in between is in the log and not yet listed.
        placed_in_log = set(re.findall(r"placing crashy as (\S+) on ", gateway.log()))
        least, most = _launch_bounds(WINDOW)

        print(f"\ncrash loop over {WINDOW:.0f}s: {len(launches)} launches of crashy (expected {least}..{most} "
              f"from the 2 s doubling backoff); gaps {', '.join(f'{g:.1f}s' for g in gaps)}")
        print(f"crashy: {models['crashy']['failures']} failures recorded, state {models['crashy']['state']!r}, "
              f"last failure {models['crashy']['last_failure']!r}")
        print(f"steady: {sent} requests sent, {ok} succeeded, {len(failures)} failed"
              + (f" ({failures[:3]})" if failures else ""))
        print(f"gateway CPU during the loop: {cpu_used:.1f}s in {elapsed:.0f}s")
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("crashy-") and "failed" in line), 0)
        end = next((i for i in range(start, len(lines)) if REFUSAL in lines[i]), start + 2)
        print("llmgw ctl replicas, one failed launch (2 header lines, then the end of its log tail):")
        print("\n".join(lines[start:start + 2] + lines[max(start + 2, end - 2):end + 2]))

        # No busy loop, and the backoff grows: each gap at least the low end of its step.
        assert least <= len(launches) <= most, gaps
        for k, gap in enumerate(gaps, start=1):
            assert gap >= BACKOFF_BASE ** (k - 1) * 0.99, f"gap {k} was {gap:.2f}s, backoff promises >= {2 ** (k - 1)}s"
        assert gaps[-1] > gaps[0]
        # Every launch was logged, and at most the one placed after the last listing is not listed.
        assert set(seen) <= placed_in_log, set(seen) - placed_in_log
        assert len(placed_in_log - set(seen)) <= 1, placed_in_log - set(seen)
        # Every launch failed with the reason and the engine's own last words.
        assert len(failed) >= len(launches) - 1
        for replica in failed:
            shard = replica["shards"][0]
            assert shard["reason"] == "engine exited with status 1", shard
            assert any(REFUSAL in line for line in shard["log_tail"]), shard["log_tail"]
        assert models["crashy"]["failures"] >= len(launches) - 1
        assert models["crashy"]["state"] == "failing"
        assert "engine exited with status 1" in models["crashy"]["last_failure"]
        assert "engine exited with status 1" in text and f"| {REFUSAL}" in text
        # The healthy model on the same node never noticed.
        assert failures == [] and ok == sent
        # A loop that retried at once would keep a core busy; backing off leaves it nearly idle.
        assert cpu_used < 0.5 * elapsed, f"{cpu_used:.1f}s of CPU in {elapsed:.0f}s"
    finally:
        gateway.stop()
