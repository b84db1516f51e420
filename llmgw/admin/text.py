"""Words and figures shared by `llmgw ctl` and the dashboard, so both say the same thing.

Functions of the listing documents (llmgw.admin.views) to short strings: every phrase both print
is made here, and the renderers (llmgw.admin.render for ctl, llmgw.admin.dashboard) only lay them
out. Unknown renders as `-` (R-2.3, R-2.7), through units.format_bytes / format_duration.
"""

from __future__ import annotations

import re
import time
from typing import Any

from llmgw.contracts.states import AdminState, LinkState, ShardState
from llmgw.units import format_bytes, format_duration

UNKNOWN = "-"
BAR_WIDTH = 40
NO_REPLICAS = "no replicas"
NO_REQUESTS = "no requests in this period"
ALL_PLACEABLE = "every model that wants a replica can be placed"

# Escape sequences are removed whole — CSI (`ESC [ ... final`), the string sequences OSC, DCS, SOS,
# PM and APC up to their terminator, and the short ESC ones, in 7- and 8-bit forms — then any
# control character left but newline and tab: the rest of C0, DEL and C1.
_ESCAPES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                      r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|\x1b[ -/]*[0-~]?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: str) -> str:
    """`value` without terminal control sequences: what a node reports (logs, reasons, errors) is
    shown to an operator's terminal, and must not move its cursor, retitle it or rewrite what it shows."""
    if value.isprintable():
        return value
    return _CONTROLS.sub("", _ESCAPES.sub("", value))


def printable_document(document: Any) -> Any:
    """A listing document with every string (keys too) passed through `printable`."""
    if isinstance(document, str):
        return printable(document)
    if isinstance(document, dict):
        return {printable_document(k): printable_document(v) for k, v in document.items()}
    if isinstance(document, list | tuple):
        return [printable_document(v) for v in document]
    return document


def progress_line(done: int, total: int | None) -> str:
    """`downloading 1.2 GB of 4.0 GB (30%)`, or `downloading 1.2 GB so far` without a length.

    A percentage is only ever computed from a length the server sent (R-5.4).
    """
    if total:
        percent = min(100, done * 100 // total)
        return f"downloading {format_bytes(done)} of {format_bytes(total)} ({percent}%)"
    return f"downloading {format_bytes(done)} so far"


def clock(ts: float | None) -> str:
    return UNKNOWN if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


def ago(ts: float | None, now: float) -> str:
    return UNKNOWN if ts is None else f"{format_duration(max(0.0, now - ts))} ago"


def node_state(node: dict, now: float) -> str:
    """`ready`, `unreachable since 12:01:05 (3m); facts from 4m ago`, ..."""
    state = node["state"]
    if state == LinkState.READY:
        return state
    text = state
    if node["since"] is not None:
        text += f" since {clock(node['since'])} ({format_duration(max(0.0, now - node['since']))})"
    if node["state_reason"]:
        text += f": {node['state_reason']}"
    if node["stale"]:
        text += f"; stale facts from {ago(node['observed_at'], now)}"
    return text


def admin_state(node: dict, now: float) -> str:
    admin = node["admin"]
    text = admin["state"]
    if admin["state"] == AdminState.DRAINING and admin["grace_until"] is not None:
        left = admin["grace_until"] - now
        text += f" (grace until {clock(admin['grace_until'])}" + (
            f", {format_duration(left)} left)" if left > 0 else ", over)")
    return text


def gpu_counts(gpus: dict | None) -> tuple[str, str, str]:
    """(used, free, unhealthy) as strings: `-` for all three when the GPUs are unknown."""
    if gpus is None:
        return UNKNOWN, UNKNOWN, UNKNOWN
    return str(gpus["used"]), str(gpus["free"]), str(gpus["unhealthy"])


def gpu_summary(node: dict) -> str:
    gpus = node["gpus"]
    if gpus is None:
        return UNKNOWN
    if not gpus["total"]:
        return "none" if gpus["nvidia_smi"] != "error" else f"nvidia-smi failed: {gpus['nvidia_smi_error']}"
    return f"{gpus['total']} × {node['gpu_class'] or 'unrecognised class'}"


def unhealthy_reasons(gpus: dict | None) -> list[str]:
    """`GPU 3: 2 uncorrected ECC errors` for every unhealthy GPU (R-2.2)."""
    if gpus is None:
        return []
    return [f"GPU {d['index']}: {'; '.join(d['reasons']) or 'unhealthy'}" for d in gpus["devices"]
            if not d["healthy"]]


def filesystem(fs: dict) -> str:
    """`38.2 GB free of 100.0 GB on /data (ext4)`; `-` for a figure the node did not report."""
    where = fs["mount_point"] or fs["device"]
    kind = f" ({fs['fstype']})" if fs["fstype"] else ""
    return f"{format_bytes(fs['free_bytes'])} free of {format_bytes(fs['total_bytes'])} on {where}{kind}"


def low_water(cleanup: dict) -> str:
    """`10% (1.0 GB)`, `20.0 MB`, `off`; then why a due clean-up waits, else the last run's result."""
    if cleanup["mark"] is None:
        return "off"
    threshold = format_bytes(cleanup["threshold_bytes"])
    text = cleanup["mark"] if cleanup["mark"] == threshold else f"{cleanup['mark']} ({threshold})"
    note = cleanup["waiting"] or cleanup["last_result"]
    return f"{text}; {note}" if note else text


def free_of(free: int | None, total: int | None) -> str:
    if free is None and total is None:
        return UNKNOWN
    return f"{format_bytes(free)} / {format_bytes(total)}"


def labels(mapping: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(mapping.items())) or UNKNOWN


def scaling(scaling: dict) -> str:
    """`min 1, max 3; 2 in flight per replica`, `on demand (max 1), stops after 10m idle`: the
    load target is named where load can add replicas (R-6.8a)."""
    on_load = f"; {scaling['target']:g} in flight per replica" if scaling.get("scales") else ""
    if scaling["on_demand"]:
        idle = scaling["idle_timeout"]
        return f"on demand (max {scaling['max']}{on_load})" + (
            f", stops after {format_duration(idle)} idle" if idle is not None else "")
    return f"min {scaling['min']}, max {scaling['max']}{on_load}"


def last_scale(model: dict, now: float) -> str | None:
    """The latest scaling decision and when: `scale 1→3: 7.5 in flight over 30s, target 2 (2m ago)`."""
    decision = model.get("last_scale")
    return None if decision is None else f"{decision['reason']} ({ago(decision['at'], now)})"


def scaling_listed(listed: dict) -> str:
    """The scaling as `ctl models` and the dashboard list it: with `evictable after 10m idle` when
    its idle replicas may be stopped to make room for another model (scaling.evictable, or on demand
    by default), after its idle_timeout where it sets one, else gateway.evict_idle (R-6.8c)."""
    words = scaling(listed)
    if not listed.get("evictable"):
        return words
    after = listed.get("evict_idle")
    return words + (f", evictable after {format_duration(after)} idle" if after is not None else ", evictable")


def what_if(entry: dict) -> str:
    """A rejected node's what-if, `-` when none was found (or the node fits)."""
    return entry.get("what_if") or UNKNOWN


def bar_cells(used: int, free: int, unhealthy: int, width: int = BAR_WIDTH) -> tuple[int, int, int]:
    """Cells of a used/free/unhealthy bar, proportional, each non-zero part at least one cell."""
    total = used + free + unhealthy
    if total == 0:
        return 0, 0, 0
    width = min(width, total)
    parts = [used, free, unhealthy]
    cells = [part * width // total for part in parts]
    for index, part in enumerate(parts):
        if part and not cells[index]:
            cells[index] = 1
    # Give the cells rounding left over (or take the ones borrowed above) by largest remainder.
    remainders = sorted(range(3), key=lambda i: -(parts[i] * width % total))
    while sum(cells) < width:
        for index in remainders:
            if sum(cells) < width and parts[index]:
                cells[index] += 1
    while sum(cells) > width:
        index = max(range(3), key=lambda i: cells[i])
        cells[index] -= 1
    return cells[0], cells[1], cells[2]


def idle_for(entry: dict) -> str:
    """How long a replica has gone unasked-for; `-` when its last use is unknown (R-7.1)."""
    return UNKNOWN if entry["idle_seconds"] is None else format_duration(entry["idle_seconds"])


def replica_adapters(replica: dict) -> str:
    """The LoRA adapters a replica holds (R-8.8), `a, b`; `-` when it holds none or its revision
    is not known; then the loads that failed on it lately, with why."""
    held = ", ".join(replica.get("adapters") or ()) or UNKNOWN
    failed = replica.get("adapter_errors") or ()
    if failed:
        held += "; failed to load " + "; ".join(f"{e['adapter']}: {e['error']}" for e in failed)
    return held


def engine_load(replica: dict) -> str:
    """`queue 3 · running 2 · KV 41%` from the engine's own report; `-` for each figure it did not give."""
    engine = replica.get("engine") or {}

    def figure(name: str) -> str:
        value = engine.get(name)
        return UNKNOWN if value is None else str(value)
    kv = engine.get("kv_cache")
    return (f"queue {figure('waiting')} · running {figure('running')} · "
            f"KV {UNKNOWN if kv is None else f'{kv * 100:.0f}%'}")


def shard_line(shard: dict) -> str:
    """`shard 0 on gpu1 (GPUs 0,1) port 20000: serving since 12:00:01`, with the reason if any."""
    gpus = "GPUs " + ",".join(str(g) for g in shard["gpus"]) if shard["gpus"] else "no GPUs"
    port = f" port {shard['port']}" if shard["port"] else ""
    line = f"shard {shard['rank']} on {shard['node']} ({gpus}){port}: {shard['state']} since {clock(shard['state_since'])}"
    return line + (f": {shard['reason']}" if shard["reason"] else "")


def counts(mapping: dict[str, int]) -> str:
    """`3 ready, 1 unreachable`: the non-zero counts of a by-state mapping; empty when none."""
    return ", ".join(f"{count} {state}" for state, count in mapping.items() if count)


def gpu_class_name(gpu_class: str | None) -> str:
    return gpu_class or "unrecognised"


def fabric_name(fabric: str | None) -> str:
    return fabric or "(no fabric)"


def held_in_fabric(entry: dict) -> str:
    """`chat (shared filer)` or `chat on gpu1, gpu2`: where a fabric holds a model's weights."""
    return entry["model"] + (" (shared filer)" if entry["on_shared"] else f" on {', '.join(entry['nodes'])}")


def filer_free(fs: dict) -> str:
    """`/mnt/filer: 400.0 GB / 1.0 TB`: a shared filer's free and total, counted once (R-2.5)."""
    return f"{fs['mount_point']}: {free_of(fs['free_bytes'], fs['total_bytes'])}"


def declared(model: dict) -> str:
    """`file`, or `store by alice`: where a model is declared, and who added it at runtime."""
    return model["declared_in"] + (f" by {model['actor']}" if model["actor"] else "")


def model_problem(model: dict) -> str | None:
    """Why the model cannot be placed, else its last failure with the wait before the next attempt."""
    problem = model["unplaceable"] or model["last_failure"]
    if problem is not None and model.get("retry_in") is not None:
        problem = f"{problem} (next attempt in {format_duration(model['retry_in'])})"
    return problem


def replica_state(replica: dict) -> str:
    """`serving (draining)`, `failed (retired)`: the state with the marks the state does not say."""
    state = replica["state"] + (" (retired)" if replica["retired"] else "")
    if replica["draining"] and replica["state"] != ShardState.DRAINING:
        state += " (draining)"
    return state


def verdict(entry: dict) -> str:
    return "fits" if entry["fits"] else "rejected"


def usage_caveats(totals: dict) -> str:
    """What in a usage total is estimated or unknown (R-6.9a), as a tail for its summary line."""
    out = ""
    if totals.get("estimated_tokens"):
        out += (f", of which {totals['estimated_tokens']} estimated (streams cut before the engine's usage "
                "arrived, counted from what was relayed)")
    if totals.get("unmetered"):
        out += f"; {totals['unmetered']} requests whose tokens are unknown (not counted)"
    return out


def period_start(report: dict) -> str:
    """Where a usage report's period starts (counters are per hour, so at an hour)."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(report["from"]))


def model_limits(per_model: dict | None) -> str:
    """A key's per-model limits in one cell, only those set: `chat: rpm=5,tpm=900; embed: concurrency=2`."""
    parts = []
    for model, limits in sorted((per_model or {}).items()):
        set_ = ",".join(f"{name}={value}" for name, value in limits.items() if value is not None)
        if set_:
            parts.append(f"{model}: {set_}")
    return "; ".join(parts) or UNKNOWN


def holds(value: bool | None) -> str:
    return UNKNOWN if value is None else "yes" if value else "no"


def plan_line(plan: dict | None) -> str:
    if plan is None:
        return "no plan: nothing fits"
    parts = []
    for shard in plan["shards"]:
        gpus = f"GPUs {','.join(str(g) for g in shard['gpus'])}" if shard["gpus"] else "no GPUs"
        parts.append(f"{shard['node']} ({'leader, ' if shard['leader'] and len(plan['shards']) > 1 else ''}{gpus})")
    fabric = f" on fabric {plan['fabric']}" if plan["fabric"] and len(plan["shards"]) > 1 else ""
    return f"would place{fabric}: " + ", ".join(parts)


def reclaim_summary(answer: dict) -> str:
    entries = [e for n in answer["nodes"] for e in n["entries"]]
    nodes = sum(1 for n in answer["nodes"] if n["entries"])
    size = sum(e.get("bytes") or 0 for e in entries)
    on_nodes = f"on {nodes} node{'s' if nodes != 1 else ''}"
    weights = sum(1 for e in entries if e.get("kind", "weights") == "weights")
    engines = len(entries) - weights
    if answer["collect"]:
        removed = sum(1 for e in entries if e.get("action") == "removed")
        return (f"asked to remove {_entries(answer['asked_to_remove'] - engines, engines)} ({format_bytes(size)}) "
                f"{on_nodes}; the nodes report {removed} removed — each node checks every path again and decides")
    if not entries:
        return "nothing to reclaim: every cache entry is wanted by a model of the catalog"
    wanted_by = " or profile" if engines else ""
    return (f"{_entries(weights, engines)} ({format_bytes(size)}) {on_nodes} "
            f"{'is' if len(entries) == 1 else 'are'} wanted by no model{wanted_by} of the catalog; "
            f"`llmgw ctl reclaim --collect` asks the nodes to remove {'it' if len(entries) == 1 else 'them'}")


def _entries(count: int, engines: int = 0) -> str:
    """`2 cache entries`, `1 cache entry and 1 engine`, `2 engines`."""
    parts = [f"{count} cache {'entry' if count == 1 else 'entries'}"] if count or not engines else []
    if engines:
        parts.append(f"{engines} engine{'s' if engines != 1 else ''}")
    return " and ".join(parts)


def router_snapshot(router: dict) -> str:
    """The snapshot a router routes with: 'version 12 (current)', 'version 9 (behind)', '-'."""
    snapshot = router["snapshot"]
    if snapshot is None:
        return "-"
    if router["current"]:
        return f"version {snapshot['version']} (current)"
    return f"version {snapshot['version']} (behind)"


def router_unapplied(router: dict) -> str:
    """The last Snapshot or Change a router could not apply (R-10.10): 'version 7 at 12:01:05', '-'."""
    unapplied = router.get("unapplied")
    if not unapplied:
        return UNKNOWN
    version = "a message" if unapplied["version"] is None else f"version {unapplied['version']}"
    return f"{version} at {clock(unapplied['at'])}"


def router_unapplied_reason(router: dict) -> str:
    """'could not apply version 7 of epoch EPOCH at 12:01:05: REASON', the reason in the router's words."""
    unapplied = router["unapplied"]
    epoch = "" if unapplied["epoch"] is None else f" of epoch {unapplied['epoch']}"
    version = "a message" if unapplied["version"] is None else f"version {unapplied['version']}"
    return f"could not apply {version}{epoch} at {clock(unapplied['at'])}: {unapplied['reason']}"


def reported_ago(router: dict) -> str:
    if router["reported_ago"] is None:
        return "no report taken"  # every report it sent was refused
    ago = f"{router['reported_ago']:.1f} s ago"
    return ago + ", silent" if router["stale"] else ago


def router_refused(router: dict) -> str:
    """What the control plane refused of a router's reports (R-10.8): '2 reports, 1 row', '-'."""
    refused = router.get("refused")
    if not refused:
        return UNKNOWN
    parts = [f"{n} {what}{'' if n == 1 else 's'}" for what, n in (("report", refused["reports"]),
                                                                   ("row", refused["rows"])) if n]
    return ", ".join(parts) or UNKNOWN


def revision_listed(model: dict) -> str:
    """The model's revision in a listing (R-8.6): `#2`, with its rollout and the replicas per
    revision while several run (`#2 rolling: #2×1 #1×2`), and an undo's hold; `-` when llmgw
    runs nothing for it."""
    number = model.get("revision_number")
    if model.get("revision") is None:
        return "-"
    text = f"#{number}" if number is not None else model["revision"]
    runs = model.get("revisions") or []
    state = model.get("rollout") or "none"
    if state in ("rolling", "paused", "canary"):
        text += f" {state}"
    if len(runs) > 1 or (runs and runs[0]["revision"] != model["revision"]):
        text += ": " + " ".join(f"#{r['number'] if r['number'] is not None else '?'}×{r['replicas']}" for r in runs)
    if model.get("catalog_revision") not in (None, model["revision"]):
        text += " (held by undo; the catalog differs)"
    return text


# -- the request log (R-6.20) ----------------------------------------------------------------------


def moment(ts: float, now: float) -> str:
    """When a request arrived: the clock time, with the date when it was not today."""
    here = time.localtime(ts)
    if time.localtime(now)[:3] == here[:3]:
        return time.strftime("%H:%M:%S", here)
    return time.strftime("%Y-%m-%d %H:%M:%S", here)


def seconds(value: float | None) -> str:
    """A short span as read at a glance: `85ms`, `1.25s`, `75.0s`; `-` when unknown."""
    if value is None:
        return UNKNOWN
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s" if value < 10 else f"{value:.1f}s"


def request_model(record: dict) -> str:
    """The model that was to serve, with the alias the client called it by: `chat-v2 via chat`; a
    name that found no model the key may use: `nope (not found)`."""
    model, asked = record.get("model"), record.get("asked")
    if model is None:
        return f"{asked} (not found)" if asked else UNKNOWN
    return f"{model} via {asked}" if asked else model


def request_status(record: dict) -> str:
    """`200`, or `503 queue_timeout` with the error's code as the client saw it."""
    error = record.get("error")
    return f"{record['status']} {error}" if error else str(record["status"])


def request_where(record: dict) -> str:
    """The replica of the last attempt and its node, `chat-1a2b@gpu03`; `-` for what is not known."""
    replica, node = record.get("replica"), record.get("node")
    if replica is None and node is None:
        return UNKNOWN
    return f"{replica or UNKNOWN}@{node or UNKNOWN}"


def request_attempts(record: dict) -> str:
    """Endpoints tried, and the fallback model that served when one did: `2 → chat-small`."""
    fallback = record.get("fallback")
    return f"{record['attempts']} → {fallback}" if fallback else str(record["attempts"])


def request_tokens(record: dict) -> str:
    """Tokens in/out, `~` before a count estimated from what was relayed (R-6.9a); `-` unknown."""
    mark = "~" if record.get("estimated") else ""

    def count(value: int | None) -> str:
        return UNKNOWN if value is None else f"{mark}{value}"

    prompt, completion = record.get("prompt_tokens"), record.get("completion_tokens")
    if prompt is None and completion is None:
        return UNKNOWN
    return f"{count(prompt)}/{count(completion)}"
