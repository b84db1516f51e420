"""Fleet metrics for /metrics (R-9.7, R-6.8b), rendered at scrape time from the listings of the published view.

A node's gauge is absent when the node has not reported the value, never 0 (R-2.7): a scrape
that finds no `llmgw_node_memory_bytes{node="gpu3"}` means "unknown", which alerting can tell
apart from "empty". The router's request, latency and token metrics are registered on the same
registry by the router itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.admin.views import Listings
from llmgw.contracts import states
from llmgw.contracts.states import AdminState, LinkState, ShardState

NODE_STATES = tuple(LinkState)
ADMIN_STATES = tuple(AdminState)


class FleetCollector:
    """A prometheus_client collector over the gateway's listings; register it on the gateway's registry."""

    def __init__(self, snapshot: Callable[[], Listings]):
        self._snapshot = snapshot

    def describe(self) -> list:
        return []  # built on collect only: nothing is read from the gateway at registration

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        nodes = snapshot.nodes()
        state = GaugeMetricFamily("llmgw_node_state", "1 for the node's current link state",
                                  labels=["node", "state"])
        admin = GaugeMetricFamily("llmgw_node_admin_state", "1 for the node's admin state (cordoned, draining)",
                                  labels=["node", "state"])
        stale = GaugeMetricFamily("llmgw_node_facts_stale", "1 when what is shown of the node was reported "
                                  "before it became unreachable", labels=["node"])
        gpus = {kind: GaugeMetricFamily(f"llmgw_node_gpus{suffix}", help_text, labels=["node", "gpu_class"])
                for kind, suffix, help_text in (
                    ("total", "", "GPUs the node reports (absent until it reported them)"),
                    ("used", "_used", "Healthy GPUs held by llmgw replicas"),
                    ("free", "_free", "Healthy GPUs no replica holds"),
                    ("unhealthy", "_unhealthy", "GPUs excluded from placement (ECC errors, lost, foreign memory)"))}
        memory = GaugeMetricFamily("llmgw_node_memory_bytes", "Memory the node reports (absent when unknown)",
                                   labels=["node"])
        labels = ["node", "device", "mount_point", "fstype", "shared"]
        disk_free = GaugeMetricFamily("llmgw_node_disk_free_bytes", "Free bytes per filesystem of the node; "
                                      "shared filers carry shared=\"true\" and are mounted by many nodes",
                                      labels=labels)
        disk_total = GaugeMetricFamily("llmgw_node_disk_total_bytes", "Size per filesystem of the node",
                                       labels=labels)
        for node in nodes:
            name = node["name"]
            for value in NODE_STATES:
                state.add_metric([name, value], 1.0 if node["state"] == value else 0.0)
            for value in ADMIN_STATES:
                admin.add_metric([name, value], 1.0 if node["admin"]["state"] == value else 0.0)
            stale.add_metric([name], 1.0 if node["stale"] else 0.0)
            if node["gpus"] is not None:
                gpu_class = node["gpu_class"] or ""
                for kind, family in gpus.items():
                    family.add_metric([name, gpu_class], node["gpus"][kind])
            if node["memory_bytes"] is not None:
                memory.add_metric([name], node["memory_bytes"])
            disk = node["disk"]
            if disk is not None:
                for fs in disk["local"] + disk["shared"]:
                    values = [name, fs["device"], fs["mount_point"] or "", fs["fstype"] or "",
                              "true" if fs["shared"] else "false"]
                    if fs["free_bytes"] is not None:
                        disk_free.add_metric(values, fs["free_bytes"])
                    if fs["total_bytes"] is not None:
                        disk_total.add_metric(values, fs["total_bytes"])
        yield from (state, admin, stale, *gpus.values(), memory, disk_free, disk_total)

        replicas = GaugeMetricFamily("llmgw_replicas", "Replicas by model and state", labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for replica in snapshot.replicas():
            if not replica["retired"]:
                key = (replica["model"], replica["state"])
                counts[key] = counts.get(key, 0) + 1
        models = snapshot.models()
        for model in models:
            if model["static"]:
                continue
            for value in ShardState:
                counts.setdefault((model["name"], value), 0)
        for (model, value), count in sorted(counts.items()):
            replicas.add_metric([model, value], count)
        yield replicas

        wanted = GaugeMetricFamily("llmgw_model_min_replicas", "Replicas the model keeps running (scaling.min)",
                                   labels=["model"])
        unplaceable = GaugeMetricFamily("llmgw_model_unplaceable", "1 when the model has a replica missing "
                                        "that no node can take", labels=["model"])
        desired = GaugeMetricFamily("llmgw_model_desired_replicas", "Replicas the model wants now, between min and "
                                    "max by load (absent until decided)", labels=["model"])
        decisions = CounterMetricFamily("llmgw_model_scale_decisions", "Scaling decisions since the gateway "
                                        "started, by direction", labels=["model", "direction"])
        for model in models:
            wanted.add_metric([model["name"]], model["scaling"]["min"])
            unplaceable.add_metric([model["name"]], 1.0 if model["unplaceable"] else 0.0)
            if model["static"]:
                continue
            if model["desired"] is not None:
                desired.add_metric([model["name"]], model["desired"])
            for direction in ("up", "down"):
                decisions.add_metric([model["name"], direction], model["scale_decisions"][direction])
        yield wanted
        yield unplaceable
        yield desired
        yield decisions

        # LoRA adapters loaded and unloaded at runtime, and loads that failed.
        adapter_families = {kind: CounterMetricFamily(f"llmgw_adapter_{kind}", help_text, labels=["adapter", "model"])
                            for kind, help_text in (
                                ("loads", "LoRA adapter loads on replicas since the gateway started"),
                                ("unloads", "LoRA adapters unloaded from replicas (least recently used) since "
                                            "the gateway started"),
                                ("load_failures", "LoRA adapter loads that failed since the gateway started"))}
        for model in models:
            for adapter in model["adapters"]:
                for kind, family in adapter_families.items():
                    family.add_metric([adapter["name"], model["name"]], adapter[kind])
        yield from adapter_families.values()

        # Revisions and rollouts: live replicas per revision, the revision each
        # model is to run, and 1 for the state its rollout is in.
        by_revision = GaugeMetricFamily("llmgw_model_revision_replicas", "Live replicas of the model per revision "
                                        "they run", labels=["model", "revision", "number"])
        target = GaugeMetricFamily("llmgw_model_revision", "The number of the revision the model's replicas are "
                                   "to run (label: its id)", labels=["model", "revision"])
        rollout = GaugeMetricFamily("llmgw_model_rollout_state", "1 for the state of the model's rollout "
                                    "(none, rolling, paused, canary, done)", labels=["model", "state"])
        for model in models:
            if model["static"] or model["revision"] is None:
                continue
            for entry in model["revisions"]:
                number = entry["number"]
                by_revision.add_metric([model["name"], entry["revision"] or "", "" if number is None else str(number)],
                                       entry["replicas"])
            if model["revision_number"] is not None:
                target.add_metric([model["name"], model["revision"]], model["revision_number"])
            for value in ("none", "rolling", "paused", "canary", "done"):
                rollout.add_metric([model["name"], value], 1.0 if model["rollout"] == value else 0.0)
        yield by_revision
        yield target
        yield rollout

        # A move the transition table does not allow is a bug in its caller, refused and counted
        # (contracts.states): zero is what a healthy control plane shows, so it is always there.
        refused = CounterMetricFamily("llmgw_state_transitions_refused", "State changes the transition table "
                                      "refused, by the kind of state and the move", labels=["kind", "from", "to"])
        for (kind, current, new), count in sorted(states.refused.items()):
            refused.add_metric([kind, current, new], count)
        yield refused
