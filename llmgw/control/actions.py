"""The act step: the tasks that talk to nodes for the reconciler — fetch, launch, stop, log
tails and sizing (R-4.2–R-4.8, R-5.1–R-5.4) — and the replica records as they go: each change of
a replica saved to SQLite as it is made, a replica retired (off the routers first, its engines
stopped once its requests in flight have ended), its record dropped once they are (R-4.1).

Each task is started by the reconciler's pass and runs on its own; what it learns it writes to
the replica it was given (its shards' states through the transition table), to the records it was
given (a failed model's log tail, a stopped replica's record) and to its own `Learned` (sizes,
download rates, provisioning times), and then wakes the reconciler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.catalog import Adapter, Model
from llmgw.config import GatewayConfig, NodeConfig
from llmgw.control import placement
from llmgw.control.routers import Routers
from llmgw.control.state import (ENDED, FAILED, FETCHING, PENDING, RETIRING_PHASE, STARTING, STOPPED, STOPPING, Records,
                                 Replica, Shard, delete_replica, save_replica)
from llmgw.engines import LoRA, ShardVars
from llmgw.fleet.fleet import Fleet
from llmgw.contracts.backoff import backoff_delay
from llmgw.fleet.link import READY
from llmgw.fleet.errors import DiskFull, EngineProgramMissing, IdentityMismatch, NodeError, PortInUse, ShardNotFound
from llmgw.fleet.ops import (FetchRequest, Fetched, ForgetRequest, LaunchRequest, LogsRequest, Provisioned, ProvisionRequest,
                             SourceSizeRequest, StopRequest)
from llmgw.runtimes import runtime_digest, runtime_key, runtime_spec, runtime_words
from llmgw.store import Store
from llmgw.weights import WeightsSource

log = logging.getLogger(__name__)

STOP_GRACE = 10.0
RETIRE_GRACE = 30.0  # a retired replica's requests in flight may finish for this long before its engines stop
PORT_ATTEMPTS = 8
LOG_TAIL_LINES = 50
FETCH_MARGIN = 0.10  # a download may exceed its declared or learned size by 10 %...
FETCH_MARGIN_MIN = 64 * 1024**2  # ...and by at least 64 MiB


@dataclass(eq=False)
class FetchJob:
    """One download of a model's weights onto a node, shared by every shard waiting for it."""

    node: str
    cache_name: str
    watchers: list[Shard] = field(default_factory=list)  # their status carries the progress
    task: asyncio.Task | None = None

    def progress(self, done: int, total: int | None) -> None:
        # Progress rides on the shard status; it is not a state transition.
        for shard in self.watchers:
            shard.progress = (done, total)


@dataclass
class ProvisionJob:
    """One provision of an engine's runtime on a node (an image found or pulled, an environment
    found or built), shared by every shard waiting for it; its last line rides on their status
    (R-4.10, R-4.11)."""

    node: str
    watchers: list[Shard] = field(default_factory=list)
    task: asyncio.Task | None = None
    line: str | None = None

    def progress(self, phase: str, line: str | None) -> None:
        if line:
            self.line = f"{phase}: {line}"[:200]
        for shard in self.watchers:
            shard.activity = self.line or phase


@dataclass(eq=False)
class Learned:
    """What the node tasks learned that outlives them: the size of each source's weights, each
    node's download rate, and how long each runtime took to provision. Absent: not learned yet."""

    sizes: dict[str, int | None] = field(default_factory=dict)  # canonical source -> bytes (None: not said)
    # node -> bytes per second of its latest completed fetch; absent: never measured (unknown, not 0)
    download_rates: dict[str, float] = field(default_factory=dict)
    # Seconds the last build or pull of each runtime took (by runtimes.runtime_digest), on any node.
    provision_seconds: dict[str, float] = field(default_factory=dict)

    def durations(self) -> placement.Durations:
        """What fetches and provisions took lately, for explain-placement's estimate (R-4.12)."""
        return placement.Durations(dict(self.download_rates), dict(self.provision_seconds))

    def with_size(self, model: Model) -> Model:
        """The model as placement sees it: a size learned from the source stands in for disk_gb."""
        size = self.sizes.get(model.source.canonical) if model.source is not None else None
        if size is None or model.config.disk_gb is not None:
            return model
        return dataclasses.replace(model, config=model.config.model_copy(update={"disk_gb": size / 1000**3}))


class Actions:
    """The running node tasks, by what they are for, and how to start each; the replicas' rows."""

    def __init__(self, fleet: Fleet, gateway: GatewayConfig, records: Records, store: Store | None, routers: Routers,
                 wake: Callable[[], None]):
        self.fleet = fleet
        self.gateway = gateway
        # Read for the ports in use; a failed model's log tail is kept in its health, a stopped
        # replica's record goes to the retired.
        self.records = records
        self.store = store
        self.routers = routers  # told the endpoint table when a replica retires; asked its requests in flight
        self.wake = wake
        self.learned = Learned()
        self.launches: dict[str, asyncio.Task] = {}  # replica id ->
        self.stops: dict[str, asyncio.Task] = {}  # replica id ->
        self.fetches: dict[tuple[str, str], FetchJob] = {}  # (node, cache name) ->
        self.provisions: dict[tuple[str, tuple[str, ...]], ProvisionJob] = {}  # (node, runtime key) ->
        self.sizing: dict[str, asyncio.Task] = {}  # canonical source ->

    def tasks(self) -> Iterator[asyncio.Task]:
        yield from self.launches.values()
        yield from self.stops.values()
        yield from (job.task for job in self.fetches.values() if job.task is not None)
        yield from (job.task for job in self.provisions.values() if job.task is not None)
        yield from self.sizing.values()

    # -- the replicas' rows ----------------------------------------------------------------------

    def save(self, replica: Replica) -> None:
        """The replica's row as it is now, written by the store's thread (a copy: the pass and the
        tasks go on changing the replica meanwhile)."""
        if self.store is not None:
            snapshot = Replica(**{**replica.__dict__, "shards": [Shard(**s.__dict__) for s in replica.shards]})
            self.store.submit(lambda db: save_replica(db, snapshot))

    def retire(self, replica: Replica, reason: str, grace: float = RETIRE_GRACE) -> None:
        """Take a replica out of service: off the router first, then its engines stopped once
        its requests in flight have ended, or after `grace` seconds; its record goes once they are."""
        if not replica.set_phase(RETIRING_PHASE):
            return
        replica.reason = replica.reason or reason
        log.info("retiring replica %s of %s: %s", replica.id, replica.model, reason)
        self.cancel_launch(replica.id)
        self.save(replica)
        self.routers.push(self.records.endpoints(self.fleet.nodes))
        self.stops[replica.id] = asyncio.create_task(self._stop_replica(replica, grace), name=f"stop-{replica.id}")

    def _stopped(self, replica: Replica) -> None:
        """A retired replica's engines are all stopped: its record goes, listed a while among the retired."""
        self.records.replicas.pop(replica.id, None)
        self.records.retired.append((time.time(), replica))
        if self.store is not None:
            self.store.submit(lambda db: delete_replica(db, replica.id))
        self.wake()

    # -- starting tasks ------------------------------------------------------------------------

    def launch(self, replica: Replica, model: Model) -> None:
        self.launches[replica.id] = asyncio.create_task(self._launch(replica, model), name=f"launch-{replica.id}")

    def cancel_launch(self, replica_id: str) -> None:
        task = self.launches.pop(replica_id, None)
        if task is not None:
            task.cancel()

    def sized(self, model: Model) -> Model | None:
        """The model with its weights' size filled in from the source when it was not declared;
        None while a node is still asking the source (R-5.1)."""
        source = model.source
        if source is None or not source.fetched or model.config.disk_gb is not None:
            return model
        if source.canonical not in self.learned.sizes:
            return None if self.learn_size(model) else model
        return self.learned.with_size(model)

    def learn_size(self, model: Model) -> bool:
        """Ask a node for the size of the model's weights unless that is under way; False when
        no node is ready to ask."""
        key = model.source.canonical
        if key not in self.sizing:
            if not self.fleet.ready_nodes():
                return False
            self.sizing[key] = asyncio.create_task(self._learn_size(model), name=f"size-{model.name}")
        return True

    # -- sizing (R-5.1) ------------------------------------------------------------------------

    async def _learn_size(self, model: Model) -> None:
        key = model.source.canonical
        size = None
        try:
            for node in self.fleet.ready_nodes()[:2]:
                try:
                    source, token = fetch_source(model.source)
                    size = (await self.fleet.ops(node).source_size(SourceSizeRequest(source, token))).bytes
                    break
                except NodeError as exc:
                    log.info("could not learn the size of %s's weights from %s: %s", model.name, node, exc)
        finally:
            self.learned.sizes[key] = size
            self.sizing.pop(key, None)
            if size is not None:
                log.info("%s's weights are %.2f GB (learned from the source)", model.name, size / 1000**3)
            self.wake()

    # -- launching -----------------------------------------------------------------------------

    async def _launch(self, replica: Replica, model: Model) -> None:
        try:
            leader = replica.leader
            leader_node = self.fleet.nodes[leader.node]
            if len(replica.shards) > 1:
                leader.dist_port = self._free_port(leader.node, exclude=set())
            paths = await asyncio.gather(*(self._weights(replica, shard, model) for shard in replica.shards))
            adapters = await asyncio.gather(*(self._adapters(replica, shard, model) for shard in replica.shards))
            runtimes = await asyncio.gather(*(self._provision(replica, shard, model) for shard in replica.shards))
            await asyncio.gather(*(self._start_shard(replica, shard, model, path, leader_node, runtime, held)
                                   for shard, path, runtime, held in zip(replica.shards, paths, runtimes, adapters)))
        except asyncio.CancelledError:
            raise
        except NodeError as exc:
            self._fail_replica(replica, _node_error_reason(exc))
        except EngineMissing as exc:
            self._fail_replica(replica, str(exc))
        except Exception as exc:  # a bug must fail the replica visibly, not hang it
            log.exception("launching %s failed", replica.id)
            self._fail_replica(replica, f"launch failed: {exc}")
        finally:
            self.launches.pop(replica.id, None)
            self.wake()

    def _fail_replica(self, replica: Replica, reason: str) -> None:
        for shard in replica.shards:
            if shard.state not in ENDED:
                shard.set_state(FAILED, reason)
        self.save(replica)

    async def _weights(self, replica: Replica, shard: Shard, model: Model) -> str:
        """The weights path on the shard's node, fetching them first when needed (R-5.1–R-5.3)."""
        if model.source is None:
            return model.name
        return await self._local(replica, shard, model.source, model.name, model.config.disk_gb)

    async def _adapters(self, replica: Replica, shard: Shard, model: Model) -> tuple[tuple[str, str], ...]:
        """Each adapter the model's revision launches with (R-8.8: every one on llama-server, the
        preloaded ones on vLLM) with its path on the shard's node, fetched as weights are, in launch order."""
        launched = model.launch_adapters
        paths = await asyncio.gather(*(self._local(replica, shard, a.source, a.name, None) for a in launched))
        return tuple((a.name, path) for a, path in zip(launched, paths))

    async def adapter_path(self, replica: Replica, adapter: Adapter) -> str:
        """Where a LoRA adapter is on the node of a serving replica's leader, fetched into its
        cache first (R-8.8) with the replica left serving: it is loaded there while it runs."""
        return await self._local(replica, replica.leader, adapter.source, adapter.name, None, serving=True)

    async def _local(self, replica: Replica, shard: Shard, source: WeightsSource, holder: str,
                     disk_gb: float | None, serving: bool = False) -> str:
        """Where `source` is on the shard's node, fetched into its cache first when it is not
        there: one fetch per node and source however many shards wait for it. `holder` is the
        catalog name the node's holdings list it under (a model, or an adapter). The shard shows
        the fetch (its state and progress) unless it is `serving` already."""
        node = self.fleet.nodes[shard.node]
        paths = self.fleet.paths(node.name)
        candidates = source.candidates([*paths.model_dirs, *paths.shared_dirs], paths.cache_dir)
        held = (self.fleet.facts[shard.node].holdings or {}).get(holder)
        if held is not None and held.path not in candidates:
            # The node was asked about other weights of this model: the revision's before a
            # reload changed them, or the catalog's while an undo holds it on earlier ones.
            held = None
        # An entry held but not yet hashed here goes through fetch, which checks it by hash
        # with progress instead of downloading it again, so the launch need not.
        if held is not None and (held.verified is not False or not source.fetched):
            return _engine_path(source, held.path, held.file)
        if not source.fetched:
            return candidates[0] if candidates else source.path
        if not serving:
            shard.set_state(FETCHING)
            self.save(replica)
        key = (shard.node, source.cache_name)
        job = self.fetches.get(key)
        if job is None:
            job = self.fetches[key] = FetchJob(shard.node, source.cache_name)
            job.task = asyncio.create_task(self._fetch(node, source, holder, disk_gb, job),
                                           name=f"fetch-{shard.node}-{source.cache_name}")
            job.task.add_done_callback(lambda _: self.fetches.pop(key, None))
        if serving:
            fetched = await asyncio.shield(job.task)
            return _engine_path(source, fetched.path, fetched.file)
        job.watchers.append(shard)
        try:
            fetched = await asyncio.shield(job.task)
        finally:
            job.watchers.remove(shard)
        return _engine_path(source, fetched.path, fetched.file)

    def _runtime(self, replica: Replica, shard: Shard, model: Model) -> dict | None:
        """The helper's runtime for this shard: its profile's, with the node's weight directories
        to mount and the replica's label."""
        assert model.profile is not None
        paths = self.fleet.paths(shard.node)
        mounts = [*paths.model_dirs, *paths.shared_dirs, *([paths.cache_dir] if paths.cache_dir else [])]
        return runtime_spec(model.profile, mounts=mounts, labels={"llmgw.replica": replica.id})

    async def _provision(self, replica: Replica, shard: Shard, model: Model) -> dict | None:
        """The shard's runtime, made present on its node first (an image pulled when missing, an
        environment built once per recipe; one provision per node and runtime however many
        shards wait for it; R-4.10, R-4.11)."""
        spec = self._runtime(replica, shard, model)
        if spec is None:
            return None
        key = (shard.node, runtime_key(spec))
        job = self.provisions.get(key)
        if job is None:
            job = self.provisions[key] = ProvisionJob(shard.node)
            job.task = asyncio.create_task(self._run_provision(job, spec, model), name=f"provision-{shard.node}")
            job.task.add_done_callback(lambda _: self.provisions.pop(key, None))
        if shard.state == PENDING:
            shard.set_state(FETCHING)
        shard.activity = job.line or f"checking {runtime_words(spec)}"
        self.save(replica)
        job.watchers.append(shard)
        try:
            await asyncio.shield(job.task)
        finally:
            job.watchers.remove(shard)
            shard.activity = None
        return spec

    async def _run_provision(self, job: ProvisionJob, spec: dict, model: Model) -> Provisioned:
        started = time.monotonic()
        async with self.fleet.ops(job.node).provision(ProvisionRequest(spec)) as stream:
            async for progress in stream:
                job.progress(progress.phase, progress.line)
        result = stream.result
        if result.created or result.pulled:
            self.learned.provision_seconds[runtime_digest(spec)] = time.monotonic() - started
        if result.created:
            size = "-" if result.bytes is None else f"{result.bytes / 1e9:.2f} GB"
            log.info("%s: built the environment %s (%s) for %s in %.1f s", job.node, result.path, size,
                     model.name, time.monotonic() - started)
        if result.pulled:
            log.info("%s: pulled %s (%s) for %s in %.1f s", job.node, result.image, result.image_id, model.name,
                     time.monotonic() - started)
        return result

    async def _fetch(self, node: NodeConfig, source: WeightsSource, holder: str, disk_gb: float | None,
                     job: FetchJob) -> Fetched:
        assert source.fetched
        cache_dir = self.fleet.paths(node.name).cache_dir
        if cache_dir is None:
            raise NodeError(node.name, "fetch", "paths", "the node's cache directory is not known yet")
        helper_source, token = fetch_source(source)
        request = FetchRequest(helper_source, cache_dir, source.cache_name, token=token,
                               max_bytes=fetch_cap(disk_gb, self.learned.sizes.get(source.canonical),
                                                   self.gateway.fetch_limit),
                               stall_timeout=self.gateway.fetch_stall)
        started = time.monotonic()
        written = None
        async with self.fleet.ops(node.name).fetch(request) as stream:
            async for progress in stream:
                job.progress(progress.bytes, progress.total)
                written = progress.bytes
        seconds = time.monotonic() - started
        # Measured only from a fetch that moved bytes: an entry already complete says nothing of the link.
        if written and seconds > 0:
            self.learned.download_rates[node.name] = written / seconds
            log.info("%s: fetched %.2f GB for %s in %.1f s (%.0f MB/s)", node.name, written / 1e9, holder,
                     seconds, written / seconds / 1e6)
        return stream.result

    def _used_ports(self, node: str) -> set[int]:
        ports = set()
        for replica in self.records.replicas.values():
            for shard in replica.shards:
                if shard.node == node and shard.state not in ENDED:
                    ports.update(p for p in (shard.port, shard.dist_port) if p is not None)
        return ports

    def _free_port(self, node: str, exclude: set[int]) -> int:
        low, high = self.fleet.nodes[node].ports
        used = self._used_ports(node) | exclude
        for port in range(low, high + 1):
            if port not in used:
                return port
        raise NodeError(node, "launch", "ports", f"no free port left in {low}-{high}")

    async def _start_shard(self, replica: Replica, shard: Shard, model: Model, weights: str,
                           leader_node: NodeConfig, runtime: dict | None = None,
                           adapters: tuple[tuple[str, str], ...] = ()) -> None:
        node = self.fleet.nodes[shard.node]
        profile = model.profile
        assert profile is not None and model.engine is not None
        local = node.connection == "local"
        tried: set[int] = set()
        for _ in range(PORT_ATTEMPTS):
            port = self._free_port(shard.node, tried)
            shard.port = port
            leader_addr = "127.0.0.1" if leader_node.connection == "local" else (leader_node.host or "127.0.0.1")
            variables = ShardVars(
                model=weights, name=model.config.served_name or model.name,
                host="127.0.0.1" if local else "0.0.0.0", port=port, gpus_per_node=profile.gpus,
                nnodes=profile.nodes, node_rank=shard.rank, leader_addr=leader_addr,
                leader_port=replica.leader.dist_port or 0,
                python=node.python or self.fleet.inventory.ssh.python if not local else "python3")
            # Adapter support on for adapters given now, or loaded later where vLLM runs.
            lora = LoRA(adapters, profile.max_adapters, profile.max_lora_rank) \
                if adapters or model.loads_adapters else None
            spec = model.engine.render(variables, profile.args, profile.env, replica.api_key, lora)
            collector = self.gateway.tracing.otlp_endpoint
            if collector is not None:  # the engine's own spans join the router's traces
                spec = model.engine.traced(spec, collector)
            shard.serves_http = spec.health_path is not None
            shard.argv = spec.argv
            shard.set_state(STARTING)
            self.save(replica)
            request = LaunchRequest(
                shard.id, spec.argv, env=spec.env, files=spec.files, file_sha256=spec.file_sha256,
                port=port if shard.serves_http else None, host=variables.host,
                health_url=f"http://127.0.0.1:{port}{spec.health_path}" if spec.health_path else None,
                gpus=shard.gpus, runtime=runtime)
            try:
                launched = await self.fleet.ops(shard.node).launch(request)
            except PortInUse:
                tried.add(port)
                continue
            except EngineProgramMissing as exc:
                raise EngineMissing(model.engine.missing_reason(shard.node, exc.message)) from exc
            shard.pid, shard.start_time = launched.pid, launched.start_time
            shard.argv = list(launched.argv) or spec.argv
            shard.launched_at = time.time()
            self.save(replica)
            self.wake()
            return
        raise NodeError(shard.node, "launch", "ports", f"ports {sorted(tried)} were all in use")

    # -- stopping ------------------------------------------------------------------------------

    async def _stop_replica(self, replica: Replica, grace: float) -> None:
        try:
            outstanding = self.routers.outstanding
            if outstanding is not None:
                deadline = time.monotonic() + grace
                while outstanding(replica.id) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            await asyncio.gather(*(self._stop_shard(replica, s) for s in replica.shards))
        finally:
            self.stops.pop(replica.id, None)
        self._stopped(replica)

    async def _stop_shard(self, replica: Replica, shard: Shard) -> None:
        failed = shard.state == FAILED
        if shard.state == STOPPED:
            return
        if shard.pid is None and shard.state in (PENDING, FETCHING):
            if not failed:
                shard.set_state(STOPPED)
            return
        if not failed:
            shard.set_state(STOPPING)
            self.save(replica)
        attempt = 0
        while True:
            link = self.fleet.links.get(shard.node)
            if link is None:
                break
            if link.state == READY:
                if failed and shard.log_tail is None:
                    await self._keep_log_tail(replica, shard)
                ops = self.fleet.ops(shard.node)
                try:
                    await ops.stop(StopRequest(shard.id, STOP_GRACE))
                    await ops.forget(ForgetRequest(shard.id))
                    break
                except IdentityMismatch as exc:
                    log.warning("%s: not stopping %s: %s", shard.node, shard.id, exc.message)
                    break
                except ShardNotFound:
                    break
                except NodeError as exc:
                    log.info("%s: stopping %s failed (%s); will retry", shard.node, shard.id, exc)
            # A node that is unreachable now is asked again when it returns: its engines must not
            # outlive the replica (no duplicates after a partition heals).
            await asyncio.sleep(min(backoff_delay(attempt, base=1.0, cap=10.0), 10.0))
            attempt += 1
        if not failed:
            shard.set_state(STOPPED)
        self.save(replica)

    async def _keep_log_tail(self, replica: Replica, shard: Shard) -> None:
        """A shard failed while its engine still ran (e.g. start timeout): read its log before
        stopping it, so the failure carries the tail like an engine that exited (R-4.2, R-4.8)."""
        try:
            answer = await self.fleet.ops(shard.node).logs(LogsRequest(shard.id, LOG_TAIL_LINES))
        except NodeError:
            return
        shard.log_tail = replica.without_key(answer.lines)
        health = self.records.health.get(replica.model)
        if health is not None and health.last_log_tail is None:
            health.last_log_tail = shard.log_tail
        self.save(replica)


def fetch_cap(disk_gb: float | None, learned: int | None, limit: int) -> int:
    """The most bytes one fetch may write: the declared size (disk_gb), else the size learned
    from the source, plus FETCH_MARGIN of it (at least FETCH_MARGIN_MIN, for a source that
    changed a little since); the configured limit when neither is known."""
    size = disk_gb * 1000**3 if disk_gb is not None else learned
    if size is None:
        return limit
    return int(size + max(size * FETCH_MARGIN, FETCH_MARGIN_MIN))


def fetch_source(source) -> tuple[dict, str | None]:
    """The helper's `source` argument and the hub token for it. The token comes from this
    process's environment and travels in the request, never in argv or logs (R-1.6)."""
    helper_source = source.helper_source()
    token = None
    if source.kind == "hf":
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        if os.environ.get("HF_ENDPOINT"):
            helper_source["endpoint"] = os.environ["HF_ENDPOINT"]
    return helper_source, token


def _engine_path(source, path: str, file: str | None) -> str:
    """A single fetched file (a GGUF, say) is handed to the engine as the file the helper says
    it saved, not the entry's directory (the helper's naming rule stays the helper's)."""
    if source.kind == "https" and len(source.urls) == 1 and file is not None:
        return file
    return path


class EngineMissing(LlmgwError):
    """The node lacks the engine's program; the message says which and how to install it."""

    category = Category.NODE


def _node_error_reason(exc: NodeError) -> str:
    if isinstance(exc, DiskFull):
        return f"not enough disk space: {exc.message}"
    return f"{exc.op} on {exc.node} failed ({exc.phase}): {exc.message}"
