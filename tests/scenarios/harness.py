"""A small fleet for the fault scenarios: testbed nodes, a real `llmgw serve`, and ways to look at both.

Three nodes with one H100 each, so that every node holds at most one replica of the model and a
replacement always lands on a node of its own. The gateway runs with the short timings a test
can afford (`tick: 1s`, `settling_window: 5s`; the testbed's SSH keepalive is 1s × 3). Engine
doubles take `START_DELAY` seconds to load and stream one token every `TOKEN_DELAY` seconds, so
that a replacement is visibly not yet serving for a while and streams are long enough to be
caught in the middle.

What the scenarios observe comes from three independent places: the admin API (`ctl replicas
--json` answers the same document), the processes on the nodes (pids, start times and ports of the
engine doubles, read from /proc on the host), and what the clients saw (`traffic.Traffic`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.admin.client import AdminClient
from llmgw.units import parse_duration
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import SCENARIO_GATEWAY, Ctl, CtlResult, write_inventory
from tests.testbed import NodeSpec

MODEL = "chat"
NODES = ("node1", "node2", "node3")
START_TIMEOUT = 20.0  # the profile's start_timeout: a double starts in well under a second
SETTLING_WINDOW = parse_duration(SCENARIO_GATEWAY["settling_window"])
TICK = parse_duration(SCENARIO_GATEWAY["tick"])
KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 1.0, 3  # what the testbed's inventory sets for SSH
TOKEN_DELAY = 0.1  # seconds between streamed tokens in the engine doubles
START_DELAY = 1.5  # seconds an engine double takes to load, as a real engine takes a while
STREAM_TOKENS = 25  # a stream lasts about 2.5 s
PLAIN_TOKENS = 4


def specs() -> list[NodeSpec]:
    return [NodeSpec.gpu_node(name, 1, mem_gb=64, cache_mb=32, tmp_mb=32) for name in NODES]


@contextmanager
def running_fleet(testbed_factory, tmp: Path, **kwargs) -> Iterator[Fleet]:
    """A fresh testbed and gateway for one scenario, both gone afterwards."""
    bed = testbed_factory(specs())
    fleet = Fleet(bed, tmp, **kwargs)
    try:
        fleet.start()
        yield fleet
    finally:
        try:
            fleet.stop()
        finally:
            bed.close()


@dataclass(frozen=True)
class Engine:
    """An engine double process on a node, identified as R-4.4 does: pid plus start time."""

    node: str
    pid: int
    start_time: int
    port: int | None


class Fleet:
    """The testbed, the gateway process and the admin client, for one scenario."""

    def __init__(self, bed, tmp: Path, *, replicas: int = 2):
        self.bed = bed
        self.tmp = tmp
        self.replicas_wanted = replicas
        for node in NODES:
            bed.set_engine_knobs(node, token_delay=TOKEN_DELAY, start_delay=START_DELAY)
        bed.weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 256 << 10})
        self.inventory = self._write_inventory(tmp / "inventory.yaml")
        self.gateway = GatewayProcess(self.inventory, tmp / "state", env={"HF_ENDPOINT": bed.weights.hf_endpoint})
        self._admin: AdminClient | None = None
        self.key: str | None = None

    def _write_inventory(self, path: Path) -> Path:
        profiles = {"h100-1": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb",
                               "start_timeout": f"{START_TIMEOUT:.0f}s"}}
        models = [{"name": MODEL, "profile": "h100-1", "weights": "hf:org/tiny", "disk_gb": 0.001,
                   "scaling": {"min": self.replicas_wanted}}]
        ssh = self.bed.inventory()["ssh"]
        assert parse_duration(ssh["keepalive_interval"]) == KEEPALIVE_INTERVAL
        assert ssh["keepalive_count"] == KEEPALIVE_COUNT
        return write_inventory(self.bed, path, models=models, profiles=profiles)

    # -- the gateway -----------------------------------------------------------------------------

    def start(self) -> Fleet:
        self.gateway.start()
        self._admin = None
        if self.key is None:
            self.key = self.gateway.create_key("scenario")
            # The router workers learn a new key with the feed's next change: traffic waits for it.
            wait_for(self._key_accepted, 30, "the scenario's key to reach the router")
        return self

    def _key_accepted(self) -> bool:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url + "/models", headers={"Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                return False
            raise

    def stop(self) -> None:
        self.gateway.stop()

    @property
    def url(self) -> str:
        return self.gateway.url + "/v1"

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient.discover(state_dir=self.gateway.state_dir)
        return self._admin

    def ctl(self, *args: str) -> CtlResult:
        """`llmgw ctl ARGS` — the operator's command line against the running gateway."""
        return Ctl(self.gateway).run(*args)

    def ctl_json(self, *args: str) -> dict:
        return Ctl(self.gateway).json(*args)

    def log_tail(self, chars: int = 4000) -> str:
        return self.gateway.log()[-chars:]

    # -- what the admin API says -----------------------------------------------------------------

    def replicas(self) -> list[dict]:
        """Live replicas (retired ones, kept for their error, left out)."""
        return [r for r in self.admin.get("/api/replicas")["replicas"] if not r["retired"]]

    def serving(self) -> list[dict]:
        return [r for r in self.replicas() if r["serving"] and r["model"] == MODEL]

    def wait_serving(self, count: int, timeout: float, what: str = "") -> list[dict]:
        def enough():
            serving = self.serving()
            return serving if len(serving) >= count else None
        return wait_for(enough, timeout, f"{count} serving replicas of {MODEL}{what}\n{self.log_tail()}",
                        interval=0.2)

    # -- what runs on the nodes ------------------------------------------------------------------

    def engines(self, nodes=NODES) -> dict[str, list[Engine]]:
        return {node: engines_of(self.bed, node) for node in nodes}

    def engine_of(self, replica: dict) -> Engine | None:
        """The engine process serving a replica (its leader shard's node and port)."""
        shard = replica["shards"][0]
        return next((e for e in engines_of(self.bed, shard["node"]) if e.port == shard["port"]), None)

    def engine_count(self) -> int:
        return sum(len(engines) for engines in self.engines().values())


def engines_of(bed, node: str) -> list[Engine]:
    found = []
    for pid in bed.engine_pids(node):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue  # gone between the listing and the read
        # Field 22 (start time in clock ticks since boot) counts after the parenthesised comm.
        start_time = int(stat.rsplit(")", 1)[1].split()[19])
        port = None
        if "--port" in argv and argv.index("--port") + 1 < len(argv):
            port = int(argv[argv.index("--port") + 1])
        found.append(Engine(node, pid, start_time, port))
    return found


@dataclass
class Sample:
    at: float
    replicas: list[dict]
    engines: dict[str, list[Engine]]


@dataclass
class Watcher:
    """Samples the admin API and the nodes' engine processes in a thread, for timelines.

    The engines are read before the API in each sample, so "engine gone" in a sample is never
    newer than the replica states beside it.
    """

    fleet: Fleet
    interval: float = 0.1
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watcher:
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.time()
            try:
                engines = self.fleet.engines()
                replicas = self.fleet.replicas()
            except Exception as exc:  # the admin listener may be restarting: note it and go on
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                self.samples.append(Sample(at, replicas, engines))
            self._stop.wait(self.interval)
