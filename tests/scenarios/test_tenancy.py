"""Tenancy with two router workers on the testbed: fair queueing and a rate limit (R-6.16, R-6.17).

A real `llmgw serve --workers 2`, one testbed node, one replica of an SGLang engine double whose
answers take a fixed time (streamed tokens TOKEN_DELAY apart), and a profile that lets the replica
take CONCURRENCY requests at once, so a handful of streams saturate it. The clients are the
official `openai` client with `max_retries=0`, each on one connection of its own; a connection's
worker is the router id its `/healthz` names to a request with the key, asked on the same connection
before and after.

How the two workers share the replica: each has its own fair queue, and each holds its part of the
model's places and of their headroom (`router_share`: divided among the routers
of the last leases), so the replica is never given more than CONCURRENCY plus its headroom (one
place, for a key below its share: the quiet one) at once, which the engine's own peak shows. Fairness
is therefore per worker: each worker serves the requests it holds by priority class and then
weighted-fair between keys. The scenario gives each worker the same mix of noisy and quiet
connections, so on each the quiet key's request goes ahead of that worker's noisy backlog.

A key's rate limit is split by the control plane among the workers (leases by demand), so the two
together admit about the limit, not twice it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import httpx2
import openai
import pytest

from llmgw.admin.client import AdminClient
from llmgw.contracts.feed import Snapshot, from_wire
from llmgw.router.fairqueue import replica_places
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

NODE = "node1"
MODEL = "chat"
WORKERS = 2
CONCURRENCY = 2  # what the replica accepts at once: one place per worker
TOKEN_DELAY = 0.15  # seconds between streamed tokens: a stream of STREAM_TOKENS lasts about 1.2 s
STREAM_TOKENS = 8
NOISY_PER_WORKER = 10  # the noisy key sends 10x the quiet key's requests, all at once
QUIET_PER_WORKER = 1
RPM = 30
HELLO = [{"role": "user", "content": "hi"}]


@dataclass
class Connection:
    """One client connection: an openai client on an HTTP client that holds a single connection."""

    http: httpx2.AsyncClient
    client: openai.AsyncOpenAI
    worker: str
    answered: list = field(default_factory=list)


class Gateway:
    def __init__(self, bed, process: GatewayProcess):
        self.bed, self.process = bed, process
        self.admin = AdminClient.discover(state_dir=process.state_dir)

    @property
    def url(self) -> str:
        return self.process.url

    def replica(self) -> dict:
        return next(r for r in self.admin.get("/api/replicas")["replicas"] if r["serving"] and r["model"] == MODEL)

    def engine_metrics(self) -> dict[str, float]:
        """The engine double's own /metrics (SGLang leaves it open), name -> value."""
        shard = self.replica()["shards"][0]
        address = self.bed[shard["node"]].address
        with urllib.request.urlopen(f"http://{address}:{shard['port']}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {line.split()[0].split("{")[0]: float(line.split()[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def snapshot(self) -> Snapshot | None:
        """The routers' last-known-good snapshot, as the workers last wrote it."""
        try:
            return from_wire(json.loads((self.process.router_dir / "snapshot.json").read_bytes()))
        except (OSError, ValueError):
            return None

    def workers(self) -> list[int]:
        return [worker["pid"] for worker in self.process.router_status()["workers"]]

    async def connect(self, key: str) -> Connection:
        # One connection, kept open between requests (httpx's default would close it after 5 s
        # idle, and a new one may land on the other worker).
        http = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1,
                                                       keepalive_expiry=600), timeout=60)
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, http_client=http)
        return Connection(http, client, await worker_of(http, self.url, key))

    async def connections(self, key: str, per_worker: int) -> list[Connection]:
        """`per_worker` connections on each worker: the kernel spreads new connections over the
        workers' sockets, so connect until each has its count and close the rest."""
        kept: dict[str, list[Connection]] = {}
        for _ in range(per_worker * WORKERS * 10):
            connection = await self.connect(key)
            mine = kept.setdefault(connection.worker, [])
            if len(mine) < per_worker:
                mine.append(connection)
            else:
                await connection.http.aclose()
            if len(kept) == WORKERS and all(len(c) == per_worker for c in kept.values()):
                return [c for group in kept.values() for c in group]
        raise AssertionError(f"connections did not reach both workers: {({w: len(c) for w, c in kept.items()})}")


async def worker_of(http: httpx2.AsyncClient, url: str, key: str) -> str:
    """The router id of the worker that holds this client's connection. It is named to a key the
    worker knows only: a new key reaches it with the feed's next change, so ask until then."""
    deadline = time.monotonic() + 30
    while True:
        response = await http.get(url + "/healthz", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        if "router_id" in response.json():
            return response.json()["router_id"]
        assert time.monotonic() < deadline, f"the key did not reach the worker: {response.text}"
        await asyncio.sleep(0.05)


async def close(connections: list[Connection], url: str) -> None:
    """Each connection still on its worker (so what it was answered is that worker's), then closed."""
    moved = []
    for connection in connections:
        now = await worker_of(connection.http, url, connection.client.api_key)
        if now != connection.worker:
            moved.append((connection.worker, now))
        await connection.http.aclose()
    assert moved == [], f"connections changed worker between requests: {moved}"


async def key_in_force(connections: list[Connection]) -> None:
    """Each worker knows the key (the feed brings a new one within a couple of seconds)."""
    for connection in {c.worker: c for c in connections}.values():
        deadline = time.monotonic() + 30
        while True:
            try:
                await connection.client.models.list()
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, f"the key did not reach worker {connection.worker}"
                await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def gateway(testbed_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenancy")
    bed = testbed_factory([NodeSpec.gpu_node(NODE, 1, mem_gb=64, cache_mb=32, tmp_mb=32)])
    try:
        bed.set_engine_knobs(NODE, token_delay=TOKEN_DELAY, start_delay=0.5)
        profiles = {"sg-1": {"engine": "sglang", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "20s",
                             "concurrency": CONCURRENCY}}
        models = [{"name": MODEL, "profile": "sg-1", "scaling": {"min": 1}}]
        inventory = write_inventory(bed, tmp / "inventory.yaml", models=models, profiles=profiles)
        process = GatewayProcess(inventory, tmp / "state", workers=WORKERS)
        process.start()
        try:
            gw = Gateway(bed, process)
            wait_for(lambda: gw.replica(), 60, f"{MODEL} to serve\n{process.log()[-3000:]}", interval=0.2)
            # Both workers heard by the control plane: the split names them both, and each holds
            # its part of the replica's places.
            wait_for(lambda: (lambda s: s is not None and len(s.leases) == WORKERS)(gw.snapshot()), 30,
                     "the control plane's split to name both workers")
            yield gw
        finally:
            process.stop()
    finally:
        bed.close()


async def stream(connection: Connection, who: str, order: list[str]) -> None:
    answer = await connection.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=STREAM_TOKENS,
                                                             stream=True)
    async for _ in answer:
        pass
    order.append(who)


def test_the_quiet_key_is_answered_ahead_of_the_noisy_backlog_on_both_workers(gateway):
    noisy_key = gateway.process.create_key("noisy")
    quiet_key = gateway.process.create_key("quiet")

    async def run():
        noisy = await gateway.connections(noisy_key, NOISY_PER_WORKER)
        quiet = await gateway.connections(quiet_key, QUIET_PER_WORKER)
        await key_in_force(noisy)
        await key_in_force(quiet)
        before = gateway.engine_metrics()
        order: list[str] = []
        started = time.monotonic()
        noisy_tasks = [asyncio.create_task(stream(c, "noisy", order)) for c in noisy]
        # Once two noisy answers are done (or one failed), the backlog has waited a whole service
        # time on both workers.
        backlog = asyncio.Event()

        def answered(task: asyncio.Task) -> None:
            if task.exception() is not None or order.count("noisy") >= 2:
                backlog.set()
        for task in noisy_tasks:
            task.add_done_callback(answered)
        await asyncio.wait_for(backlog.wait(), 60)
        assert [t.exception() for t in noisy_tasks if t.done() and t.exception()] == []
        # What counts is how many noisy answers were done when each quiet request left its client:
        # on a loaded machine the tasks below may start a while after the backlog was seen, and the
        # noisy answers done meanwhile are not the fair queue's to order.
        sent_at: list[int] = []

        async def sending(request) -> None:
            sent_at.append(len(order))
        for connection in quiet:
            connection.http.event_hooks["request"].append(sending)
        quiet_tasks = [asyncio.create_task(stream(c, "quiet", order)) for c in quiet]
        results = await asyncio.gather(*noisy_tasks, *quiet_tasks, return_exceptions=True)
        quiet_sent = max(sent_at)
        elapsed = time.monotonic() - started
        await close(noisy + quiet, gateway.url)
        return before, order, quiet_sent, results, elapsed, {c.worker for c in noisy + quiet}

    before, order, quiet_sent, results, elapsed, workers = asyncio.run(run())
    after = gateway.engine_metrics()
    noisy_count, quiet_count = NOISY_PER_WORKER * WORKERS, QUIET_PER_WORKER * WORKERS
    refused = [r for r in results if isinstance(r, BaseException)]
    last_quiet = max(i for i, who in enumerate(order) if who == "quiet")
    noisy_before = order[:last_quiet].count("noisy")
    print(f"\n{noisy_count} noisy and {quiet_count} quiet streams over workers {sorted(workers)} in {elapsed:.2f} s; "
          f"quiet sent after {quiet_sent} noisy answers; noisy answers before the quiet key's last: {noisy_before} "
          f"(first come first served: {noisy_count}); order {''.join(w[0] for w in order)}; engine: "
          f"{after['engine_double_requests_total'] - before['engine_double_requests_total']:.0f} requests, "
          f"at most {after['engine_double_streams_peak']:.0f} at once (concurrency {CONCURRENCY})")
    # Nothing was refused: the excess waited (a refusal would have to be a 429, or a 503 queue_timeout).
    assert [(getattr(r, "status_code", None), getattr(r, "body", None)) for r in refused] == []
    assert order.count("noisy") == noisy_count and order.count("quiet") == quiet_count
    # Two workers together never gave the replica more than its places and their headroom (each
    # worker alone would give it both: 2 x 3).
    places, headroom = replica_places(CONCURRENCY, None)
    assert after["engine_double_streams_peak"] <= places + headroom
    # First come, first served would answer every noisy request before the quiet ones, which came
    # after the whole backlog. Fair queueing on each worker gives each quiet request the next place
    # there: after the noisy ones answered or running when it came, and at most one more per worker.
    assert noisy_before <= quiet_sent + CONCURRENCY + WORKERS, order


def test_a_rate_limit_holds_across_both_workers(gateway):
    created = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "keys", "create", "limited", "--rpm", str(RPM),
                              "--state-dir", str(gateway.process.state_dir)],
                             capture_output=True, text=True, env=gateway.process.env, timeout=60)
    assert created.returncode == 0, created.stderr
    secret = next(word for word in created.stdout.split() if word.startswith("sk-"))
    sent_at_most = 2 * RPM  # twice the limit, as fast as the connections go, well within the minute

    async def hammer(connection: Connection, sent: list[int]) -> None:
        while sent[0] < sent_at_most:
            sent[0] += 1
            try:
                raw = await connection.client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=HELLO, max_tokens=1)
                connection.answered.append((raw.status_code, raw.headers))
            except openai.APIStatusError as exc:
                connection.answered.append((exc.status_code, exc.response.headers, exc.body))

    def shares() -> dict[str, float]:
        snapshot = gateway.snapshot()
        key_id = next((k.id for k in snapshot.keys if k.name == "limited"), None) if snapshot else None
        return {router: per_key[key_id].share for router, per_key in snapshot.leases.items()
                if key_id in per_key} if key_id else {}

    async def run():
        connections = await gateway.connections(secret, 4)
        await key_in_force(connections)  # listing models spends nothing of the limit
        # The control plane's split of the key among the workers is out (until then each holds
        # 1/2 of it by default, the same here).
        wait_for(lambda: len(shares()) == WORKERS, 30, "the key's leases for both workers")
        sent = [0]
        started = time.monotonic()
        await asyncio.gather(*(hammer(c, sent) for c in connections))
        elapsed = time.monotonic() - started
        await close(connections, gateway.url)
        return connections, elapsed

    connections, elapsed = asyncio.run(run())
    answers = [a for c in connections for a in c.answered]
    admitted = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    per_worker = {}
    for c in connections:
        counts = per_worker.setdefault(c.worker, {"admitted": 0, "refused": 0})
        counts["admitted"] += sum(1 for a in c.answered if a[0] == 200)
        counts["refused"] += sum(1 for a in c.answered if a[0] == 429)
    print(f"\nrpm {RPM}, {len(answers)} requests in {elapsed:.2f} s over {len(connections)} connections: admitted "
          f"{len(admitted)} (the limit's pace adds {RPM * elapsed / 60:.1f} in that time), refused {len(refused)}; "
          f"per worker {per_worker}; the key's shares now {shares()}")
    assert len(answers) == sent_at_most
    assert [a[0] for a in answers if a[0] not in (200, 429)] == []  # nothing but answers and 429s
    assert abs(len(admitted) - RPM) <= 0.1 * RPM  # two workers together: the limit, not twice it
    assert len(per_worker) == WORKERS and all(c["admitted"] and c["refused"] for c in per_worker.values())
    for status, headers, body in refused:
        assert body["code"] == "rate_limit_exceeded" and "requests per minute" in body["message"]
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-limit-requests"] == str(RPM)
        assert int(headers["x-ratelimit-remaining-requests"]) >= 0  # this worker's share, scaled to the key
        assert headers["x-ratelimit-reset-requests"]
    for status, headers in admitted:
        assert headers["x-ratelimit-limit-requests"] == str(RPM)
        assert 0 <= int(headers["x-ratelimit-remaining-requests"]) < RPM
