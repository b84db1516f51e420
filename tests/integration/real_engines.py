"""Shared parts of the tests that run the real engines on testbed nodes (test_real_*.py).

One testbed and one `llmgw serve` per module, models published on the testbed's weights server
(as an operator's HTTPS URL or Hugging Face repository would be), and the checks every engine
must pass: usage recorded as the engine reported it, the engine's own log through `ctl logs`,
the port free once stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory

# Port probe run inside a node: exit 0 when nothing listens on the port (the bind succeeds).
PORT_FREE = ("import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
             "try:\n    s.bind((sys.argv[1],int(sys.argv[2])))\nexcept OSError:\n    sys.exit(1)\n")


def publish_hf_dir(bed, repo: str, folder: Path) -> str:
    """Every file of a model folder as a repository of the testbed's fake hub; `hf:REPO`."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    bed.weights.add_hf_repo(repo, files)
    return f"hf:{repo}"


def start_gateway(bed, tmp: Path, *, models: list, profiles: dict, gateway: dict | None = None,
                  env: dict | None = None) -> GatewayProcess:
    """`llmgw serve` of the testbed's inventory; `gateway` settings over the scenarios' ones, `env`
    added to its environment (its router workers inherit it)."""
    inventory = write_inventory(bed, tmp / "inventory.yaml", models=models, profiles=profiles, gateway=gateway)
    process = GatewayProcess(inventory, tmp / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint, **(env or {})})
    return process.start()


def new_client(gateway: GatewayProcess, key_name: str) -> tuple[openai.OpenAI, str]:
    """An `openai` client with a new key, once the router knows the key (it refreshes keys from
    SQLite every couple of seconds)."""
    key = gateway.create_key(key_name)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)
    wait_for(lambda: client.models.list() is not None, 30, f"the router to accept key {key_name}")
    return client, key


def replicas(gateway: GatewayProcess, model: str | None = None) -> list[dict]:
    status, answer = gateway.admin("/api/replicas")
    assert status == 200, answer
    return [r for r in answer["replicas"] if not r["retired"] and (model is None or r["model"] == model)]


def serving(gateway: GatewayProcess, model: str) -> list[dict]:
    return [r for r in replicas(gateway, model) if r["serving"]]


def wait_serving(gateway: GatewayProcess, model: str, timeout: float, count: int = 1) -> list[dict]:
    def enough():
        found = serving(gateway, model)
        return found if len(found) >= count else None
    return wait_for(enough, timeout, f"{count} serving replica(s) of {model}\n{gateway.log()[-4000:]}", interval=0.5)


def key_usage(gateway: GatewayProcess, key_name: str) -> dict | None:
    status, answer = gateway.admin("/api/usage?by=key&since=1d")
    assert status == 200, answer
    return next((row for row in answer["rows"] if row["name"] == key_name), None)


def wait_usage(gateway: GatewayProcess, key_name: str, expected: dict, timeout: float = 30) -> dict:
    """The gateway's counters for a key, once they reach what the client saw (they are flushed
    in the background); then they must be exactly that."""
    seen = []

    def reached():
        row = key_usage(gateway, key_name)
        seen[:] = [row]
        return row if row and row["requests"] >= expected["requests"] else None
    try:
        row = wait_for(reached, timeout, f"usage of key {key_name} to reach {expected}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; recorded: {seen[0] if seen else None}") from None
    got = {k: row[k] for k in expected}
    assert got == expected, f"recorded {got}, the engine reported {expected}"
    return row


def engine_log(gateway: GatewayProcess, replica_id: str) -> str:
    result = Ctl(gateway).ok("logs", replica_id, "-n", "400")
    return result.stdout


def port_free(bed, node: str, host: str, port: int) -> bool:
    return bed.run(node, ["/usr/bin/python3", "-c", PORT_FREE, host, str(port)]).returncode == 0


@dataclass
class Counted:
    """Usage the client saw, summed: what the gateway must have recorded for the key."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, usage) -> None:
        assert usage is not None, "the engine reported no usage"
        self.requests += 1
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens or 0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens}


@dataclass
class Load:
    """Client threads sending chat requests (plain and streamed, alternately) until stopped;
    bounded in count and time. Every failure is kept with its reason."""

    base_url: str
    api_key: str
    model: str
    workers: int = 2
    max_requests: int = 2000
    max_seconds: float = 180.0
    pause: float = 0.0  # seconds a worker waits between requests: cores left for an engine loading
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sent: int = 0

    def __enter__(self) -> Load:
        self._deadline = time.monotonic() + self.max_seconds
        for worker in range(self.workers):
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, worker: int) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            with self._lock:
                if self._sent >= self.max_requests:
                    return
                self._sent += 1
            n += 1
            messages = [{"role": "user", "content": f"worker {worker} request {n}"}]
            try:
                if n % 2:
                    reply = client.chat.completions.create(model=self.model, messages=messages, max_tokens=4)
                    assert reply.choices, "no choices"
                else:
                    stream = client.chat.completions.create(model=self.model, messages=messages, max_tokens=8,
                                                            stream=True, stream_options={"include_usage": True})
                    finish = None
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                    assert finish is not None, "stream ended without a finish reason"
            except Exception as exc:  # noqa: BLE001 - every failure is counted with its reason
                with self._lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
            else:
                with self._lock:
                    self.ok += 1
            if self.pause:
                self._stop.wait(self.pause)
        client.close()

    def wait_ok(self, count: int, timeout: float) -> None:
        wait_for(lambda: self.ok >= count, timeout, f"{count} answered requests (failures: {self.failures[:5]})")


def drain_under_load(bed, gateway, model: str, victim: str, spare: str, *, key_name: str,
                     move_timeout: float, after: int = 10) -> Load:
    """Drain `victim` while two clients send requests to `model`, until its replica serves from
    `spare` alone and the victim runs no engine, then `after` more answers; no request may fail
    (R-9.5). Uncordons the victim again; returns the load with its counts."""
    _, key = new_client(gateway, key_name)
    ctl = Ctl(gateway)
    # A pause between requests leaves the replacement loading on `spare` some of the cores: the
    # load goes on all through the move, at a rate a 2-core machine can also start an engine under.
    with Load(gateway.url + "/v1", key, model, workers=2, max_requests=50_000, max_seconds=600,
              pause=0.05) as load:
        load.wait_ok(after, 120)
        done = ctl.run("drain", victim)
        assert done.code == 0, done.stderr

        def moved():
            found = serving(gateway, model)
            return found if [r["shards"][0]["node"] for r in found] == [spare] and not bed.engine_pids(victim) else None
        wait_for(moved, move_timeout, f"the replica to move to {spare}\n{gateway.log()[-3000:]}", interval=0.5)
        load.wait_ok(load.ok + after, 120)
    print(f"{model}: drain under load, {load.ok} requests answered, {len(load.failures)} failed")
    assert load.failures == [], "\n".join(load.failures) + "\n" + gateway.log()[-6000:]
    assert ctl.run("uncordon", victim).code == 0
    return load
