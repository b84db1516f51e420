"""What the operator sees: the JSON of every admin listing, derived from a published ControlView.

This module is the one place where the status, nodes, models, replicas and storage documents
are made, from the control plane's latest published view (llmgw.contracts.views) and the
router's own figures per replica; it never reads the reconciler's or the fleet's records. The
management API returns these documents as they are, `llmgw ctl` renders them, the dashboard
renders them, and /metrics reads them; `status` is a summary of the other listings taken from
the same view, so it cannot disagree with them (R-7.2). Placement explanations are computed by
the control plane (`ControlPlane.explain`); `explanation_json` is their document.

Unknown is `None` (JSON null) everywhere, never 0 (R-2.3, R-2.7): a node that has not reported
its GPUs has `gpus: null`, one that reported none has a count of 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from llmgw.admin.text import progress_line
from llmgw.contracts.views import ControlView, PublishedNode, PublishedReplica
from llmgw.contracts.states import ShardState

if TYPE_CHECKING:
    from llmgw.admin.dependencies import AdminDependencies
    from llmgw.control.placement import Explanation

IDLE_LISTED = 5  # replicas listed as "unasked-for longest" in status
_PROGRESS_ORDER = {state: rank for rank, state in enumerate(ShardState)}


class DataPlane(Protocol):
    """What the listings read of the routers: their figures per replica, as last reported."""

    def reported_in_flight(self, replica_id: str) -> int | None: ...  # None: no router reported lately

    def routers(self) -> list[dict]: ...  # the routers reporting: FeedPublisher.routers

    def engine_load(self, replica_id: str) -> Any: ...  # an object with as_dict(), or None: unknown


def _filesystem(fs) -> dict:
    return {"device": fs.device, "fstype": fs.fstype, "mount_point": fs.mount_point, "shared": fs.shared,
            "total_bytes": fs.total_bytes, "free_bytes": fs.free_bytes, "dirs": list(fs.dirs)}


def _cleanup(cleanup) -> dict:
    """The clean-up at the node's low-water mark: its mark, the last run, the recent removals."""
    return {"mark": cleanup.mark, "threshold_bytes": cleanup.threshold_bytes, "last_run": cleanup.last_run,
            "last_result": cleanup.last_result, "waiting": cleanup.waiting,
            "removed": [{"name": r.name, "path": r.path, "bytes": r.bytes, "last_used": r.last_used,
                         "removed_at": r.removed_at, "mark": r.mark, "threshold_bytes": r.threshold_bytes}
                        for r in cleanup.removed]}


def _sum_known(values: Iterable[int | None]) -> int | None:
    """Sum of the known values; None when none is known (an unknown is not a zero)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _filer_key(fs: dict) -> tuple:
    # A filer is the same bytes wherever it is mounted: counted once per mount point and type,
    # not once per node that mounts it.
    return (fs["fstype"], fs["mount_point"] or fs["device"])


def _scale_decision(decision) -> dict:
    return {"at": decision.at, "from": decision.before, "to": decision.after, "direction": decision.direction,
            "reason": decision.reason}


def listings(admin: AdminDependencies) -> Listings:
    """The listings of the control plane's latest published view, with the routers' figures (the
    feed publisher aggregates what the routers report)."""
    return Listings(admin.control.view(), admin.data_plane)


class Listings:
    """The documents of one published ControlView; every listing of a request comes from it."""

    def __init__(self, view: ControlView, router: DataPlane | None = None, now: float | None = None):
        self.view = view
        self.router = router
        self.now = time.time() if now is None else now
        self.catalog = view.catalog
        self._nodes = {node.name: node for node in view.nodes}
        self._cache: dict[str, Any] = {}

    def _once(self, key: str, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # -- nodes ---------------------------------------------------------------------------------

    def nodes(self) -> list[dict]:
        return self._once("nodes", lambda: [self._node(node) for node in self.view.nodes])

    def _node(self, node: PublishedNode) -> dict:
        inventory = node.inventory
        return {
            "name": node.name,
            "host": node.host,
            "fabric": node.fabric,
            "labels": dict(node.labels),
            "state": node.state,
            "state_reason": node.state_reason,
            "since": node.since,
            # What a node that is not ready last reported is kept, but it is marked stale.
            "stale": node.stale,
            "observed_at": node.observed_at,
            "admin": {"state": node.admin.state, "grace_until": node.admin.grace_until, "actor": node.admin.actor},
            "gpu_class": node.gpu_class,
            "gpus": self._gpus(node),
            "memory_bytes": node.memory_bytes,
            "cpus": inventory.cpus if inventory is not None else None,
            "disk": self._disk(node),
            "replicas": list(node.replicas),
            "unknown_engines": list(node.unknown_engines),
            # Of its latest completed fetch; None until one was measured (unknown, not 0).
            "download_bytes_per_second": node.download_rate,
        }

    @staticmethod
    def _gpus(node: PublishedNode) -> dict | None:
        """Counts and devices; an unhealthy GPU is neither used nor free (R-2.2, R-7.2)."""
        inventory = node.inventory
        if inventory is None:
            return None
        free = set(node.free_gpus or ())
        devices = []
        for gpu in inventory.gpus:
            devices.append({
                "index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "gpu_class": gpu.gpu_class,
                "memory_total_mib": gpu.memory_total_mib, "memory_used_mib": gpu.memory_used_mib,
                "utilization_pct": gpu.utilization_pct, "healthy": gpu.healthy, "reasons": list(gpu.reasons),
                "state": "unhealthy" if not gpu.healthy else "free" if gpu.index in free else "used",
                "replica": node.gpu_holders.get(gpu.index),
            })
        healthy = [d for d in devices if d["healthy"]]
        return {
            "total": len(devices),
            "used": sum(1 for d in healthy if d["index"] in node.allocated),
            "free": len(free),
            "unhealthy": len(devices) - len(healthy),
            "nvidia_smi": inventory.nvidia_smi,
            "nvidia_smi_error": inventory.nvidia_smi_error,
            "devices": devices,
        }

    @staticmethod
    def _disk(node: PublishedNode) -> dict | None:
        """Free/total per filesystem, the node's own disks apart from shared filers (R-2.4, R-2.5)."""
        storage = node.storage
        if storage is None:
            return None
        local = [_filesystem(fs) for fs in storage.local]
        return {
            "local": local,
            "shared": [_filesystem(fs) for fs in storage.shared],
            # Shared filers are never added to a node's own totals.
            "local_free_bytes": _sum_known(fs["free_bytes"] for fs in local),
            "local_total_bytes": _sum_known(fs["total_bytes"] for fs in local),
            "missing": list(storage.missing),
            "stuck": list(storage.stuck),
        }

    # -- replicas ------------------------------------------------------------------------------

    def replicas(self) -> list[dict]:
        return self._once("replicas", lambda: [self._replica(r) for r in (*self.view.replicas, *self.view.retired)])

    def _replica(self, replica: PublishedReplica) -> dict:
        last_used = replica.last_used  # None: unknown, not idle
        router = self.router
        engine = router.engine_load(replica.id) if router is not None else None
        shards = []
        for shard in replica.shards:
            progress = None
            if shard.progress is not None:
                done, total = shard.progress
                progress = {"bytes": done, "total": total, "line": progress_line(done, total)}
            elif shard.activity is not None:
                progress = {"bytes": None, "total": None, "line": shard.activity}
            shards.append({
                "rank": shard.rank, "node": shard.node, "gpus": list(shard.gpus), "port": shard.port,
                "pid": shard.pid,  # the engine process as its node answered the launch; None: not yet
                "state": shard.state, "state_since": shard.state_since, "reason": shard.reason,
                "log_tail": list(shard.log_tail) if shard.log_tail and shard.state == ShardState.FAILED else None,
                "progress": progress,
            })
        return {
            "id": replica.id, "model": replica.model, "state": replica.state, "serving": replica.serving,
            "draining": replica.draining, "retiring": replica.retiring, "retired": replica.retired,
            "replaces": replica.replaces, "reason": replica.reason, "created_at": replica.created_at,
            "serving_since": replica.serving_since, "last_used": last_used,
            "revision": replica.revision, "revision_number": replica.revision_number,  # None: not known
            # The LoRA adapters it holds, its revision's then those loaded since; None:
            # its revision is not known. And the loads that failed on it lately, with why.
            "adapters": list(replica.adapters) if replica.adapters is not None else None,
            "adapter_errors": [{"adapter": name, "error": why} for name, why in replica.adapter_errors],
            "idle_seconds": None if last_used is None else max(0.0, self.now - last_used),
            "nodes": list(replica.nodes), "shards": shards,
            "in_flight": router.reported_in_flight(replica.id) if router is not None else None,
            # The engine's own load as the router last polled it; None: it did not say.
            "engine": engine.as_dict() if engine is not None else None,
        }

    # -- models --------------------------------------------------------------------------------

    def models(self) -> list[dict]:
        return self._once("models", lambda: [self._model(m) for m in sorted(self.catalog.models.values(),
                                                                             key=lambda m: m.name)])

    def _model(self, model) -> dict:
        live = [r for r in self.view.replicas if r.model == model.name and not r.retiring]
        serving = sum(1 for r in live if r.serving)
        known = self.view.models.get(model.name)
        unplaceable = known.unplaceable if known is not None else None
        retry_in = None
        if known is not None and known.next_attempt is not None and known.next_attempt > self.now:
            retry_in = known.next_attempt - self.now
        if model.static:
            state = "static endpoints"
        elif unplaceable is not None:
            state = "cannot be placed"
        elif retry_in is not None and serving < model.min_replicas:
            state = "failing"
        elif serving and serving >= max(model.min_replicas, 1):
            state = ShardState.SERVING
        elif serving:
            state = "partly serving"  # fewer serving replicas than its minimum
        elif not live and model.on_demand:
            state = "idle (on demand)"
        elif live:
            # Not serving yet: say how far the furthest replica got (pending, fetching, starting...).
            state = max((r.state for r in live), key=_PROGRESS_ORDER.get)
        else:
            state = ShardState.PENDING
        profile = model.profile
        return {
            "name": model.name, "state": state, "declared_in": model.declared_in, "actor": model.actor,
            "profile": model.profile_name,
            "engine": profile.engine if profile is not None else None,
            "gpus": profile.gpus if profile is not None else None,
            "nodes": profile.nodes if profile is not None else None,
            "gpu_class": profile.gpu_class if profile is not None else None,
            "weights": str(model.source) if model.source is not None else None,
            # Its LoRA adapters in the catalog, by name: what its replicas hold once they run its revision.
            # `preload`: launched with; else loaded where requests want it on vLLM. loads, unloads and
            # failed loads since the control plane started.
            "adapters": [{"name": a.name, "adapter": str(a.source), "declared_in": a.declared_in, "preload": a.preload,
                          **dict(zip(("loads", "unloads", "load_failures"),
                                     self.view.adapter_counts.get(a.name, (0, 0, 0))))}
                         for a in model.adapters],
            "disk_bytes": model.disk_bytes,
            "scaling": {"min": model.min_replicas, "max": model.max_replicas, "on_demand": model.on_demand,
                        "idle_timeout": model.idle_timeout, "evictable": model.evictable,
                        # unused this long before a replica may be evicted (R-6.8c); None: not evictable or not known
                        "evict_idle": known.evict_idle if known is not None else None, "scales": model.scales,
                        "target": model.config.scaling.target, "up_delay": model.config.scaling.up_delay,
                        "down_delay": model.config.scaling.down_delay},
            # What load-based scaling wants now and its latest decision (R-6.8a, R-6.8b); None: not yet.
            "desired": known.desired if known is not None else None,
            "last_scale": _scale_decision(known.last_scale) if known is not None and known.last_scale else None,
            "scale_decisions": {"up": known.scale_ups if known is not None else 0,
                                "down": known.scale_downs if known is not None else 0},
            "fallback": model.fallback,
            "routing": model.config.routing,
            "static": model.static,
            "replicas": {"total": len(live), "serving": serving},
            # The revision its replicas are to run, the catalog's (they differ while an undo holds
            # the model), how many run which, and where its rollout stands.
            "revision": known.revision if known is not None else None,
            "revision_number": known.revision_number if known is not None else None,
            "catalog_revision": known.catalog_revision if known is not None else None,
            "revisions": _per_revision(live),
            "rollout": known.rollout if known is not None else "none",
            "rollout_waiting": known.rollout_waiting if known is not None else None,
            "unplaceable": unplaceable.summary if unplaceable is not None else None,
            "failures": known.failures if known is not None else 0,
            "last_failure": known.last_failure if known is not None else None,
            "retry_in": retry_in,
        }

    # -- status (R-7.2) ------------------------------------------------------------------------

    def status(self) -> dict:
        nodes, replicas, models = self.nodes(), self.replicas(), self.models()
        capacity: dict[str, dict] = {}
        gpus_unknown = []
        for node in nodes:
            gpus = node["gpus"]
            if gpus is None:
                gpus_unknown.append(node["name"])
                continue
            if not gpus["total"]:
                continue
            row = capacity.setdefault(node["gpu_class"] or "unrecognised",
                                      {"gpu_class": node["gpu_class"], "nodes": 0, "total": 0, "used": 0,
                                       "free": 0, "unhealthy": 0})
            row["nodes"] += 1
            for key in ("total", "used", "free", "unhealthy"):
                row[key] += gpus[key]
        node_states: dict[str, int] = {}
        admin_states: dict[str, int] = {}
        for node in nodes:
            node_states[node["state"]] = node_states.get(node["state"], 0) + 1
            admin = node["admin"]["state"]
            admin_states[admin] = admin_states.get(admin, 0) + 1
        live = [r for r in replicas if not r["retired"]]
        by_state = {state: 0 for state in ShardState if state != ShardState.STOPPED}
        for replica in live:
            by_state[replica["state"]] = by_state.get(replica["state"], 0) + 1
        model_states: dict[str, int] = {}
        for model in models:
            model_states[model["state"]] = model_states.get(model["state"], 0) + 1
        serving = [r for r in live if r["serving"]]
        # Longest unasked-for first; a replica whose last use is unknown is listed after them.
        idle = sorted(serving, key=lambda r: (r["last_used"] is None, r["last_used"] or 0.0, r["id"]))
        return {
            "generated_at": self.now,
            "capacity": sorted(capacity.values(), key=lambda c: (c["gpu_class"] is None, c["gpu_class"] or "")),
            "gpus_unknown": gpus_unknown,
            "free_whole_nodes": dict(self.view.free_whole_nodes),
            "nodes": {"total": len(nodes), "by_state": node_states, "by_admin": admin_states},
            "replicas": {"total": len(live), "serving": len(serving), "by_state": by_state,
                         "failed_recently": sum(1 for r in replicas if r["retired"] and r["state"] == ShardState.FAILED)},
            "models": {"total": len(models), "by_state": model_states},
            "unplaceable": [{"model": m["name"], "reason": m["unplaceable"]} for m in models if m["unplaceable"]],
            "idle": [{"replica": r["id"], "model": r["model"], "nodes": r["nodes"], "last_used": r["last_used"],
                      "idle_seconds": r["idle_seconds"]} for r in idle[:IDLE_LISTED]],
            "fabrics": self.fabrics(),
            # The router processes that report to this control plane; None: not known here.
            "routers": self.router.routers() if self.router is not None else None,
        }

    def fabrics(self) -> list[dict]:
        """What each fabric can serve without a cross-fabric copy; a shared filer counts once (R-7.2)."""
        groups: dict[str | None, list[dict]] = {}
        for node in self.nodes():
            groups.setdefault(node["fabric"], []).append(node)
        out = []
        for fabric, members in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
            holders: dict[str, dict] = {}
            filers: dict[tuple, dict] = {}
            for node in members:
                disk = node["disk"]
                shared = disk["shared"] if disk is not None else []
                for fs in shared:
                    key = _filer_key(fs)
                    filer = filers.setdefault(key, {"fstype": fs["fstype"], "mount_point": fs["mount_point"],
                                                    "total_bytes": fs["total_bytes"], "free_bytes": fs["free_bytes"],
                                                    "nodes": []})
                    filer["nodes"].append(node["name"])
                held = self._nodes[node["name"]].holdings or {}
                for model, where in held.items():
                    if model not in self.catalog.models:
                        continue
                    entry = holders.setdefault(model, {"model": model, "nodes": [], "on_shared": False})
                    entry["nodes"].append(node["name"])
                    if any(_inside(where.path, d) for fs in shared for d in fs["dirs"]):
                        entry["on_shared"] = True
            local_free = _sum_known((n["disk"] or {}).get("local_free_bytes") for n in members)
            out.append({
                "fabric": fabric,
                "nodes": [n["name"] for n in members],
                "models": sorted(holders.values(), key=lambda h: h["model"]),
                "shared_filers": list(filers.values()),
                "local_free_bytes": local_free,
                "shared_free_bytes": _sum_known(f["free_bytes"] for f in filers.values()),
            })
        return out

    # -- storage (R-2.4, R-2.5) ----------------------------------------------------------------

    def storage(self) -> dict:
        nodes = []
        filers: dict[tuple, dict] = {}
        for state, node in zip(self.view.nodes, self.nodes()):
            name = node["name"]
            held = state.holdings
            disk = node["disk"]
            for fs in (disk["shared"] if disk is not None else []):
                filer = filers.setdefault(_filer_key(fs), {"fstype": fs["fstype"], "mount_point": fs["mount_point"],
                                                           "total_bytes": fs["total_bytes"],
                                                           "free_bytes": fs["free_bytes"], "nodes": []})
                filer["nodes"].append(name)
            nodes.append({
                "node": name, "state": node["state"], "stale": node["stale"], "fabric": node["fabric"],
                "cache_dir": state.cache_dir,
                "model_dirs": list(state.model_dirs), "shared_dirs": list(state.shared_dirs),
                "disk": disk,
                "cleanup": _cleanup(state.cleanup),
                "holdings": None if held is None else [
                    {"model": model, "path": where.path, "bytes": where.bytes} for model, where in sorted(held.items())],
            })
        return {"nodes": nodes, "shared_filers": list(filers.values())}


def explanation_json(explanation: Explanation) -> dict:
    """explain-placement's document (R-3.5): every node's verdict and the plan, if any."""
    plan = explanation.plan
    return {
        "model": explanation.model,
        "summary": explanation.summary,
        "placeable": plan is not None,
        "plan": None if plan is None else {
            "fabric": plan.fabric, "reasons": list(plan.reasons),
            "shards": [{"node": s.node, "rank": s.rank, "leader": s.rank == 0, "gpus": list(s.gpus)}
                       for s in plan.shards],
        },
        # what_if: one change that would make a rejected node fit; null when none is found.
        # holds_engine: the image or environment of the profile's runtime; null: unknown,
        # or the node's own program. prepare_seconds: fetching and provisioning before the engine
        # starts on a fitting node, from what they took lately (0: nothing to do); null: not measured.
        "verdicts": [{"node": v.node, "fits": v.fits, "reasons": list(v.reasons), "free_gpus": v.free_gpus,
                      "holds_weights": v.holds_weights, "what_if": v.what_if, "holds_engine": v.holds_engine,
                      "prepare_seconds": v.prepare_seconds}
                     for v in explanation.verdicts],
    }


def _inside(path: str, directory: str) -> bool:
    directory = directory.rstrip("/")
    return path == directory or path.startswith(directory + "/")


def _per_revision(live) -> list[dict]:
    """The model's live replicas counted per revision, the newest revision first."""
    counts: dict[str | None, dict] = {}
    for replica in live:
        entry = counts.setdefault(replica.revision, {"revision": replica.revision, "number": replica.revision_number,
                                                     "replicas": 0, "serving": 0})
        entry["replicas"] += 1
        entry["serving"] += int(replica.serving)
    return sorted(counts.values(), key=lambda e: -(e["number"] or 0))
