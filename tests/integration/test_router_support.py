"""Real parts for router tests: engine doubles as local processes, a router on a loopback port.

Imported by the other test_router_* modules; it holds no tests itself. Engines are the testbed's
engine double run as `vllm serve ...` on 127.0.0.1 (no SSH needed to test the router); the router
is the real app on an aiohttp runner, reached with the official `openai` client, fed by a real
FeedPublisher through the in-process LocalFeed (as `llmgw serve` runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import openai
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import EngineConfig, GatewayConfig, ModelConfig, ProfileConfig, ScalingConfig
from llmgw.control.feed import FeedPublisher
from llmgw.control.feed.routing import routed_models
from llmgw.fleet.secret import response_secret
from llmgw.keys import create_key, key_entries
from llmgw.localfeed import LocalFeed
from llmgw.router import Endpoint, Router
from llmgw.store import Store

DOUBLES = Path(__file__).resolve().parents[1] / "testbed" / "doubles"
PROFILES = {"p": ProfileConfig(engine="vllm"), "sglang": ProfileConfig(engine="sglang"),
            "llama": ProfileConfig(engine="llama-server"), "custom": ProfileConfig(engine="custom")}
ENGINES = {"custom": EngineConfig(command=["my-engine", "--port", "{port}"])}
DEADLINE = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_REFUSING: list[socket.socket] = []


def refusing_port() -> int:
    """A port on 127.0.0.1 that refuses connections for the rest of the test process: bound and
    never listening, so that no server of a test running beside this one can take it meanwhile
    (a port only found free may be, and then answers)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _REFUSING.append(s)
    return s.getsockname()[1]


def poll(condition, timeout: float = DEADLINE, what: str = "condition"):
    """Call condition() until it returns something truthy; fail after the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def apoll(condition, timeout: float = DEADLINE, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class EngineDouble:
    """One engine double serving `name` as vLLM (or `mode`: sglang, llama-server) would, on 127.0.0.1:port."""

    name: str
    port: int
    key: str
    log_path: Path
    knobs: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    mode: str = "vllm"
    env: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()  # more of the engine's command line (LoRA adapters: `--lora-modules ...`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self, replica_id: str | None = None, model: str | None = None) -> Endpoint:
        return Endpoint(replica_id=replica_id or f"r-{self.name}-{self.port}", model=model or self.name,
                        url=self.url, api_key=self.key)

    def start(self, healthy: bool = True) -> EngineDouble:
        env = dict(os.environ, PYTHONPATH=str(DOUBLES), HOME=str(self.log_path.parent), **self.env)
        for knob, value in self.knobs.items():
            env["ENGINE_DOUBLE_" + knob.upper()] = str(value)
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.mode == "vllm":
            env["VLLM_API_KEY"] = self.key
            args = ["serve", f"/weights/{self.name}", "--served-model-name", self.name, *where]
        elif self.mode == "llama-server":
            env["LLAMA_API_KEY"] = self.key
            args = ["-m", f"/weights/{self.name}.gguf", "--alias", self.name, *where, "--metrics"]
        else:
            args = ["--model-path", f"/weights/{self.name}", "--served-model-name", self.name, *where,
                    "--api-key", self.key]
        args += self.args
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import engine_double; engine_double.entry_point({self.mode!r}, None)", *args,
             *self.args],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        poll(self.healthy if healthy else self.listening, what=f"engine double {self.name} on port {self.port}")
        return self

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"engine double exited with {self.proc.returncode}: "
                                 + self.log_path.read_text()[-2000:])
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def counters(self) -> dict[str, int]:
        """requests and aborted streams as the double counts them (its /metrics)."""
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
        found = dict(re.findall(r"^engine_double_(\w+)_total (\d+)$", text, re.M))
        return {name: int(value) for name, value in found.items()}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Engines:
    """Starts engine doubles and stops them all at the end."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.started: list[EngineDouble] = []

    def start(self, name: str, port: int | None = None, key: str | None = None, healthy: bool = True,
              mode: str = "vllm", env: dict | None = None, args: tuple[str, ...] = (), **knobs) -> EngineDouble:
        port = port or free_port()
        home = self.directory / f"engine-{name}-{port}"
        home.mkdir(parents=True, exist_ok=True)
        engine = EngineDouble(name=name, port=port, key=key or f"engine-key-{name}-{port}",
                              log_path=home / "engine.log", knobs=knobs, mode=mode, env=env or {}, args=tuple(args))
        self.started.append(engine)
        return engine.start(healthy)

    def close(self) -> None:
        for engine in self.started:
            engine.kill()


@pytest.fixture
def engines(tmp_path):
    pool = Engines(tmp_path)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def shared_engines(tmp_path_factory):
    pool = Engines(tmp_path_factory.mktemp("engines"))
    yield pool
    pool.close()


def model(name: str, *, fallback: str | None = None, on_demand: bool = False, profile: str = "p", **kw) -> ModelConfig:
    scaling = ScalingConfig(min=0, max=1) if on_demand else ScalingConfig()
    return ModelConfig(name=name, profile=profile, fallback=fallback, scaling=scaling, **kw)


def catalog(*models: ModelConfig) -> Catalog:
    return Catalog.build(file_models=list(models), profiles=PROFILES, engines=ENGINES)


def with_adapters(adapters: Mapping[str, tuple[str, str | None]]):
    """A stand-in for the feed's routed_models: the catalog's models, then a LoRA adapter entry
    (R-8.8) per `adapters` item, name -> (its base, the name its vLLM serves it by), made from the
    base's entry as the control plane publishes one. Patched into llmgw.control.feed.publisher."""
    def routed(cat: Catalog):
        models = dict(routed_models(cat))
        for name, (base, served) in adapters.items():
            models[name] = dataclasses.replace(models[base], name=name, served_name=served, fallbacks=(),
                                               adapter_of=base)
        return MappingProxyType(models)
    return routed


@dataclass
class RunningRouter:
    router: Router
    runner: web.AppRunner
    store: Store
    url: str
    secret: str
    registry: CollectorRegistry
    publisher: FeedPublisher
    feed: LocalFeed

    def client(self, secret: str | None = None, **kw) -> openai.AsyncOpenAI:
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=secret or self.secret, **kw)

    def key(self, name: str, models=None) -> str:
        """A new key, published to the running router at once (the periodic reload is tested apart)."""
        _, secret = self.store.write_sync(lambda db: create_key(db, name, models))
        self.reload_keys()
        return secret

    def reload_keys(self) -> None:
        self.publisher.set_keys(self.store.read_sync(key_entries))
        self.feed.pump()

    def set_endpoints(self, table) -> None:
        """What the reconciler pushes, applied to the router before this returns."""
        self.publisher.set_endpoints(table)
        self.feed.pump()

    async def abandon(self, replica_id: str) -> int:
        """The control plane gives a replica up; returns the in-flight count it knew of."""
        await self.feed.report()
        count = self.publisher.abandon(replica_id)
        self.feed.pump()
        return count

    async def take_last_used(self) -> dict[str, float]:
        await self.feed.report()
        return self.publisher.take_last_used()

    def response_id(self, model: str, replica: str, engine_id: str, secret: str | None = None) -> str:
        """The id this router hands out for the engine's `engine_id` made with `secret`'s key (the first key's by default)."""
        key = self.router.keys.authenticate(f"Bearer {secret or self.secret}")
        return self.router.feed.response_ids.seal(model, replica, key.id, engine_id)

    def opened(self, response_id: str) -> tuple[str, str, str] | None:
        """(model, replica, engine id) of an id this router handed out, None when it did not."""
        sealed = self.router.feed.response_ids.open(response_id)
        return None if sealed is None else (sealed.model, sealed.replica_id, sealed.engine_id)

    async def usage_rows(self) -> list[dict]:
        return await self.store.read(lambda db: list(db["usage"].rows))


@pytest.fixture
async def start_router(tmp_path):
    """start_router(catalog, endpoints={...}, gateway=..., on_demand=...)."""
    running: list[RunningRouter] = []

    async def start(cat: Catalog, endpoints=None, *, gateway: GatewayConfig | None = None, on_demand=None,
                    store_path: Path | None = None) -> RunningRouter:
        store = Store.open(store_path or tmp_path / "state.db")
        _, secret = store.write_sync(lambda db: create_key(db, f"test-{len(running)}"))
        registry = CollectorRegistry()
        # one control plane's secret for every router of the test, as every router of a gateway is fed it
        publisher = FeedPublisher(CatalogHolder(cat), store, gateway or GatewayConfig(), note_demand=on_demand,
                                  response_secret=response_secret(tmp_path))
        router = Router(registry=registry)
        if endpoints:
            publisher.set_endpoints(endpoints)
        publisher.mark_ready()
        feed = LocalFeed(publisher, router.feed)
        feed.pump()
        feed.start()
        runner = router.runner()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        handle = RunningRouter(router, runner, store, f"http://127.0.0.1:{port}", secret, registry, publisher, feed)
        running.append(handle)
        return handle

    yield start
    for handle in running:
        await handle.runner.cleanup()
        await handle.feed.close()
        await handle.publisher.close()
        await handle.router.close()
        handle.store.close()


async def raw_request(url: str, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request with the path sent exactly as given (no client-side normalisation)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    response_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        response_headers[name.strip().lower()] = value.strip()
    if response_headers.get("transfer-encoding") == "chunked":
        body_out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body_out += rest[:size]
            rest = rest[size + 2:]
        rest = body_out
    return int(status_line.split()[1]), response_headers, rest


@contextlib.asynccontextmanager
async def scripted_engine(answer, path: str = "/v1/chat/completions", method: str = "POST"):
    """An engine of one route whose answers the test scripts (an aiohttp handler); yields its URL."""
    engine = web.Application()
    engine.router.add_route(method, path, answer)
    runner = web.AppRunner(engine)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
