"""What `llmgw ctl` prints: rich tables and lines built from the admin API's documents.

One function per document (`status`, `nodes`, `models`, `replicas`, ...). The phrases are made in
llmgw.admin.text, which the dashboard uses too, so both say the same thing; here they are only
laid out for a terminal. Every cell is plain text, never rich markup. The documents reach these
functions with terminal control sequences already removed (`text.printable_document`, R-9.4).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from llmgw.admin import text as words
from llmgw.contracts.states import AdminState, LinkState, ShardState
from llmgw.units import format_bytes, format_duration

LOG_TAIL_SHOWN = 10

def _t(value: Any, style: str | None = None) -> Text:
    """A cell: plain text, never rich markup (node output may contain `[GPU is lost]`).

    Documents reach the renderers through `_emit`, which strips terminal control sequences from
    what nodes report (R-9.4)."""
    return Text(words.UNKNOWN if value is None else str(value), style=style or "")


def _or_unknown(value: Any) -> Any:
    return words.UNKNOWN if value is None else value


def _table(*headers: str, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", header_style="bold", box=None,
                  pad_edge=False, padding=(0, 2, 0, 0))
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def _lines(values) -> Text:
    values = list(values)
    return Text("\n".join(values)) if values else _t(None)


# -- status ------------------------------------------------------------------------------------------


def _bar(used: int, free: int, unhealthy: int) -> Text:
    cells = words.bar_cells(used, free, unhealthy)
    bar = Text()
    bar.append("█" * cells[0], style="blue")
    bar.append("░" * cells[1], style="green")
    bar.append("✗" * cells[2], style="red")
    return bar


def status(status: dict) -> Group:
    parts: list[Any] = []
    capacity = _table("GPU CLASS", "USED/FREE/UNHEALTHY", "USED", "FREE", "UNHEALTHY", "NODES",
                      title="GPU capacity (an unhealthy GPU is neither used nor free)")
    for row in status["capacity"]:
        capacity.add_row(_t(words.gpu_class_name(row["gpu_class"])), _bar(row["used"], row["free"], row["unhealthy"]),
                         _t(row["used"]), _t(row["free"]), _t(row["unhealthy"]), _t(row["nodes"]))
    parts.append(capacity if status["capacity"] else Text("GPU capacity: no GPUs reported"))
    if status["gpus_unknown"]:
        parts.append(Text("GPUs not reported yet: " + ", ".join(status["gpus_unknown"])))
    whole = status["free_whole_nodes"]
    parts.append(Text("free whole nodes per fabric: " + (
        ", ".join(f"{fabric} {count}" for fabric, count in sorted(whole.items())) or "no node belongs to a fabric")))
    nodes, replicas, models = status["nodes"], status["replicas"], status["models"]
    parts.append(Text(f"nodes: {nodes['total']} ({words.counts(nodes['by_state'])}; {words.counts(nodes['by_admin'])})"))
    parts.append(Text(f"replicas: {replicas['total']} ({words.counts(replicas['by_state']) or 'none'})"
                      + (f"; {replicas['failed_recently']} failed recently" if replicas["failed_recently"] else "")))
    parts.append(Text(f"models: {models['total']} ({words.counts(models['by_state']) or 'none'})"))
    routers = status.get("routers")
    if routers:
        table = _table("ROUTER", "SNAPSHOT", "NOT APPLIED", "LAST REPORT", "IN FLIGHT", "REFUSED",
                       title="Routers reporting to this control plane")
        for entry in routers:
            table.add_row(_t(entry["router"]), _t(words.router_snapshot(entry)), _t(words.router_unapplied(entry)),
                          _t(words.reported_ago(entry)), _t(entry["in_flight"]), _t(words.router_refused(entry)))
        parts += [Text(""), table]
        for entry in routers:
            if entry.get("unapplied"):
                parts.append(Text(f"{entry['router']}: {words.router_unapplied_reason(entry)}"))
            if entry.get("refused"):
                parts.append(Text(f"{entry['router']}: last refusal: {entry['refused']['last']}"))
    elif routers is not None:
        parts.append(Text("routers: none has reported yet"))
    if status["unplaceable"]:
        table = _table("MODEL", "WHY IT CANNOT BE PLACED", title="Models that cannot be placed")
        for entry in status["unplaceable"]:
            table.add_row(_t(entry["model"]), _t(entry["reason"]))
        parts += [Text(""), table]
    if status["idle"]:
        table = _table("REPLICA", "MODEL", "NODES", "UNASKED-FOR", title="Replicas unasked-for longest")
        for entry in status["idle"]:
            table.add_row(_t(entry["replica"]), _t(entry["model"]), _t(", ".join(entry["nodes"])),
                          _t(words.idle_for(entry)))
        parts += [Text(""), table]
    table = _table("FABRIC", "NODES", "MODELS HELD (NO CROSS-FABRIC COPY)", "SHARED FILERS (COUNTED ONCE)",
                   "LOCAL FREE", title="What each fabric holds")
    for fabric in status["fabrics"]:
        held = [words.held_in_fabric(m) for m in fabric["models"]]
        filers = [words.filer_free(fs) for fs in fabric["shared_filers"]]
        table.add_row(_t(words.fabric_name(fabric["fabric"])), _t(", ".join(fabric["nodes"])), _lines(held),
                      _lines(filers), _t(format_bytes(fabric["local_free_bytes"])))
    parts += [Text(""), table]
    return Group(*parts)


def nodes(document: dict) -> Table:
    now = time.time()
    table = _table("NODE", "STATE", "ADMIN", "FABRIC", "LABELS", "GPUS", "USED", "FREE", "UNHEALTHY", "MEM",
                   "DISK FREE/TOTAL", "SHARED FREE/TOTAL")
    for node in document["nodes"]:
        used, free, unhealthy = words.gpu_counts(node["gpus"])
        disk = node["disk"]
        local = [words.filesystem(fs) for fs in disk["local"]] if disk else []
        shared = [words.filesystem(fs) for fs in disk["shared"]] if disk else []
        state_style = None if node["state"] == LinkState.READY else "red"
        table.add_row(_t(node["name"], "bold"), _t(words.node_state(node, now), state_style),
                      _t(words.admin_state(node, now), None if node["admin"]["state"] == AdminState.ACTIVE else "yellow"),
                      _t(node["fabric"]), _t(words.labels(node["labels"])), _t(words.gpu_summary(node)),
                      _t(used), _t(free), _lines([unhealthy, *words.unhealthy_reasons(node["gpus"])]),
                      _t(format_bytes(node["memory_bytes"])), _lines(local), _lines(shared))
    return table


def models(document: dict) -> Table:
    table = _table("MODEL", "STATE", "SERVING", "REVISION", "SCALING", "LAST SCALED", "ROUTING", "PROFILE", "ENGINE",
                   "WEIGHTS", "FALLBACK", "DECLARED", "PROBLEM")
    now = time.time()
    for model in document["models"]:
        declared, problem = words.declared(model), words.model_problem(model)
        table.add_row(_t(model["name"], "bold"), _t(model["state"]),
                      _t(f"{model['replicas']['serving']}/{model['replicas']['total']}"),
                      _t(words.revision_listed(model)), _t(words.scaling_listed(model["scaling"])), _t(words.last_scale(model, now)),
                      _t(model.get("routing")), _t(model["profile"]),
                      _t(model["engine"]),
                      _t(_weights_listed(model)), _t(model["fallback"]), _t(declared), _t(problem))
    return table


def _weights_listed(model: dict) -> str | None:
    """The weights, then the LoRA adapters the model's replicas hold (R-8.8), by name."""
    adapters = [a["name"] for a in model.get("adapters") or ()]
    if not adapters:
        return model["weights"]
    return f"{model['weights'] or '-'} + adapters {', '.join(adapters)}"


def replicas(document: dict) -> Text:
    out = Text()
    if not document["replicas"]:
        return Text(words.NO_REPLICAS)
    for replica in document["replicas"]:
        state = words.replica_state(replica)
        out.append(replica["id"], style="bold")
        out.append(f"  {replica['model']}  ")
        out.append(state, style="green" if replica["serving"] else "red" if replica["state"] == ShardState.FAILED else "yellow")
        details = [f"revision #{replica['revision_number']}" if replica.get("revision_number") is not None
                   else f"revision {replica.get('revision') or '-'}", f"adapters {words.replica_adapters(replica)}"]
        if replica["serving_since"] is not None:
            details.append(f"serving since {words.clock(replica['serving_since'])}")
        if replica["serving"]:
            details.append(f"unasked-for {words.idle_for(replica)}")
            in_flight = replica.get("in_flight")
            details.append(f"in flight {'-' if in_flight is None else in_flight}")
            details.append(f"engine {words.engine_load(replica)}")
        if replica["reason"]:
            details.append(replica["reason"])
        out.append("  " + " · ".join(details) + "\n")
        for shard in replica["shards"]:
            out.append(f"  {words.shard_line(shard)}\n")
            if shard["progress"] is not None:
                # Progress is a line under the replica, not a column.
                out.append(f"    {shard['progress']['line']}\n", style="cyan")
            for log_line in (shard["log_tail"] or [])[-LOG_TAIL_SHOWN:]:
                out.append(f"    | {log_line}\n", style="dim")
    out.rstrip()
    return out


def explanation(document: dict) -> Group:
    summary = Text(f"{document['model']}: {document['summary']}", style="bold")
    plan = document["plan"]
    parts: list[Any] = [summary, Text("plan: " + words.plan_line(plan))]
    if plan is not None and plan["reasons"]:
        parts.append(Text("why: " + "; ".join(plan["reasons"])))
    table = _table("NODE", "VERDICT", "FREE GPUS", "HOLDS WEIGHTS", "REASONS", "WHAT IF")
    for verdict in document["verdicts"]:
        table.add_row(_t(verdict["node"], "bold"),
                      _t(words.verdict(verdict), "green" if verdict["fits"] else "red"),
                      _t(verdict["free_gpus"]), _t(words.holds(verdict["holds_weights"])),
                      _lines(verdict["reasons"]), _t(words.what_if(verdict)))
    parts += [Text(""), table]
    return Group(*parts)


def node_admin(answer: dict) -> Text:
    node, state = answer["node"], answer["admin"]
    if state == AdminState.CORDONED:
        return Text(f"{node}: cordoned — nothing new is placed there; its replicas keep serving")
    if state == AdminState.DRAINING:
        line = (f"{node}: draining — its replicas move elsewhere, each stopped once its replacement serves")
        if answer.get("grace_until") is not None:
            left = max(0.0, answer["grace_until"] - time.time())
            line += f"; grace until {words.clock(answer['grace_until'])} ({format_duration(left)})"
        return Text(line)
    return Text(f"{node}: active — placement may use it again")


def model_summary(verb: str) -> Callable[[dict], Text]:
    def render(answer: dict) -> Text:
        if answer.get("base") is not None:  # an adapter: served by its base's replicas
            return Text(f"{verb} {answer['name']} (adapter {answer['adapter']} of {answer['base']}, which rolls to "
                        "hold it)")
        scaling = answer["scaling"]
        return Text(f"{verb} {answer['name']} (profile {answer['profile'] or '-'}; {words.scaling(scaling)})")
    return render


def storage(document: dict) -> Group:
    table = _table("NODE", "STATE", "CACHE DIR", "LOCAL FREE/TOTAL", "SHARED FREE/TOTAL", "HOLDS", "LOW WATER")
    removals = _table("NODE", "REMOVED", "ENTRY", "SIZE", "LAST USED", "MARK",
                      title="Removed by the clean-up at the low-water mark (newest first)")
    for node in document["nodes"]:
        disk = node["disk"]
        local = [words.filesystem(fs) for fs in disk["local"]] if disk else []
        shared = [words.filesystem(fs) for fs in disk["shared"]] if disk else []
        if disk:
            local += [f"not there: {path}" for path in disk["missing"]] + [f"stuck: {path}" for path in disk["stuck"]]
        holds = None if node["holdings"] is None else [
            f"{h['model']} ({format_bytes(h['bytes'])}) {h['path']}" for h in node["holdings"]]
        state = node["state"] + (" (stale)" if node["stale"] else "")
        held = _t(None) if holds is None else _lines(holds) if holds else _t("none")
        cleanup = node["cleanup"]
        table.add_row(_t(node["node"], "bold"), _t(state), _t(node["cache_dir"]), _lines(local), _lines(shared), held,
                      _t(words.low_water(cleanup)))
        for removal in cleanup["removed"]:
            removals.add_row(_t(node["node"], "bold"), _t(words.clock(removal["removed_at"])),
                             _t(removal["path"] or removal["name"]), _t(format_bytes(removal["bytes"])),
                             _t(words.clock(removal["last_used"])),
                             _t(words.low_water({**removal, "waiting": None, "last_result": None})))
    parts: list[Any] = [table]
    if removals.row_count:
        parts += [Text(""), removals]
    if document["shared_filers"]:
        filers = _table("MOUNT POINT", "TYPE", "FREE/TOTAL", "MOUNTED BY", title="Shared filers (each counted once)")
        for fs in document["shared_filers"]:
            filers.add_row(_t(fs["mount_point"]), _t(fs["fstype"]), _t(words.free_of(fs["free_bytes"], fs["total_bytes"])),
                           _t(", ".join(fs["nodes"])))
        parts += [Text(""), filers]
    return Group(*parts)


def engines(document: dict) -> Group:
    table = _table("NODE", "KIND", "ENGINE", "VERSION", "SIZE", "LAST USED", "STATE", "WANTED BY", "USED BY")
    notes = []
    for node in document["nodes"]:
        if node["error"]:
            table.add_row(_t(node["node"], "bold"), _t(None), _t(None), _t(None), _t(None), _t(None),
                          _t(f"error: {node['error']}", "red"), _t(None), _t(None))
            continue
        for row in node["engines"]:
            engine = row["what"] or row["name"]
            if row["kind"] == "image" and row["pulled"] is not None:
                engine += " (pulled by llmgw)" if row["pulled"] else " (was on the node)"
            table.add_row(_t(node["node"], "bold"), _t(row["kind"]), _t(engine), _t(row["version"]),
                          _t(format_bytes(row["bytes"])), _t(words.clock(row["last_used"])), _t(row["state"]),
                          _t(", ".join(row["wanted_by"]) or "no profile"), _t(", ".join(row["used_by"]) or None))
        notes += [f"{node['node']}: cannot tell what profile {profile} would install: {why}"
                  for profile, why in node["unknown"].items()]
    if not table.row_count:
        return Group(Text("no engine installed by llmgw on any node"), *(Text(n) for n in notes))
    return Group(table, *(Text(n) for n in notes))


def reclaim(answer: dict) -> Group:
    table = _table("NODE", "ENTRY", "SIZE", "ACTION", "REASON")
    for node in answer["nodes"]:
        if node["error"]:
            table.add_row(_t(node["node"], "bold"), _t(None), _t(None), _t("error", "red"), _t(node["error"]))
        for entry in node["entries"]:
            kind = {"venv": "environment ", "image": "image "}.get(entry.get("kind", "weights"), "")
            table.add_row(_t(node["node"], "bold"), _t(kind + (entry.get("path") or entry["name"])),
                          _t(format_bytes(entry.get("bytes"))), _t(entry.get("action") or "listed"),
                          _t(entry.get("reason")))
    parts: list[Any] = []
    if table.row_count:
        parts += [table, Text("")]
    parts.append(Text(words.reclaim_summary(answer)))
    return Group(*parts)


def usage(report: dict) -> Group:
    by_key = report["by"] == "key"
    limits = ("RPM", "TPM", "CONC", "MODEL LIMITS") if by_key else ()
    table = _table("KEY" if by_key else "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "TOTAL TOKENS",
                   "ESTIMATED", "UNMETERED", *limits, *(() if by_key else ("VIA ALIAS",)))
    for row in report["rows"]:
        cells = [_t(row["name"], "bold"), _t(row["requests"]), _t(row["prompt_tokens"]),
                 _t(row["completion_tokens"]), _t(row["total_tokens"]), _t(row.get("estimated_tokens")),
                 _t(row.get("unmetered"))]
        if by_key:  # the key's limits beside what it used
            cells += [_t(row.get(name)) for name in ("rpm", "tpm", "concurrency")]
            cells.append(_t(words.model_limits(row.get("model_limits"))))
        else:  # requests the model served under an alias's name
            via = row.get("via") or {}
            cells.append(_t(", ".join(f"{alias}: {count}" for alias, count in via.items()) or "-"))
        table.add_row(*cells)
    totals = report["totals"]
    start = words.period_start(report)
    parts: list[Any] = [table] if report["rows"] else [Text(words.NO_REQUESTS)]
    parts.append(Text(f"since {start} (counted per hour): {totals['requests']} requests, "
                      f"{_or_unknown(totals['prompt_tokens'])} prompt + {_or_unknown(totals['completion_tokens'])} "
                      "completion tokens"
                      + words.usage_caveats(totals)))
    return Group(*parts)



def removed(answer: dict) -> Text:
    return Text(f"removed {answer['removed']}; its replicas are being stopped")


def scaled(answer: dict, max_given: bool) -> Text:
    """The scaling now in force, and what it means for the model's replicas."""
    scaling = answer["scaling"]
    line = f"{answer['name']}: scaling in force: min {scaling['min']}, max {scaling['max']}"
    if not max_given:
        line += " (max filled in by the catalog)"
    on_load = f"{scaling['target']:g} in flight per replica" if scaling.get("scales") else None
    if scaling["on_demand"]:
        line += "; on demand: one replica is loaded when asked" + (
            f", more under load up to {scaling['max']} ({on_load})" if on_load else ", and no more (max 1)")
    elif on_load:
        line += f"; runs {scaling['min']} to {scaling['max']} replicas as load needs ({on_load})"
    else:
        line += f"; runs exactly {scaling['min']} (max = min: no scaling on load)"
    return Text(line)


def aliases(answer: dict) -> Table | Text:
    if not answer["aliases"]:
        return Text("no aliases (the inventory's `aliases:`, or `llmgw ctl alias set NAME MODEL`)")
    table = _table("ALIAS", "MODEL", "DECLARED")
    for alias in answer["aliases"]:
        declared = "inventory" if alias["declared_in"] == "file" else f"runtime ({alias['actor'] or '-'})"
        table.add_row(_t(alias["name"], "bold"), _t(alias["target"]), _t(declared))
    return table


def _revision(label: dict | None) -> str:
    if label is None:
        return "-"
    number = label.get("number")
    return f"#{number} {label['id']}" if number is not None else label["id"]


def rollout(answer: dict) -> Group:
    """A model's rollout: where it stands, why it waits, and its replicas per revision (R-4.13)."""
    state = answer["state"]
    target = _revision(answer["target"])
    head = {"none": f"{answer['model']}: revision {target}; no rollout has run",
            "done": f"{answer['model']}: revision {target}; the rollout from {_revision(answer['previous'])} is done",
            "rolling": f"{answer['model']}: rolling from {_revision(answer['previous'])} to {target}",
            "paused": f"{answer['model']}: rollout to {target} PAUSED",
            "canary": f"{answer['model']}: canary of {target}: about {answer['canary']} % of requests"}[state]
    lines = [Text(head, style="bold")]
    if answer.get("held"):
        lines.append(Text(f"held by an undo: the catalog defines revision {_revision(answer['catalog'])}; "
                          "a change of the model's definition ends the hold", style="yellow"))
    if answer.get("paused"):
        lines.append(Text(f"paused: {answer['paused']}  (ctl rollout resume, or undo)", style="red"))
    elif answer.get("waiting"):
        lines.append(Text(answer["waiting"]))
    for change in answer.get("changes") or ():
        lines.append(Text(f"  changes {change}", style="dim"))
    lines.append(Text(f"surge {answer['surge']}, unavailable {answer['unavailable']}"
                      + (f", canary {answer['canary']} %" + (" (promoted)" if answer.get("promoted") else "")
                         if answer.get("canary") is not None else "")))
    answers = {(a["revision"] or {}).get("id"): a for a in answer.get("answers") or ()}
    table = _table("REVISION", "REPLICAS", "SERVING", "ANSWERED", "ERRORS")
    shown = set()
    for entry in answer["revisions"]:
        mark = " (target)" if entry["revision"] == answer["target"] else ""
        counted = answers.get((entry["revision"] or {}).get("id"))
        shown.add((entry["revision"] or {}).get("id"))
        table.add_row(_revision(entry["revision"]) + mark, str(entry["replicas"]), str(entry["serving"]),
                      str(_or_unknown(counted["total"] if counted else None)),
                      str(_or_unknown(counted["errors"] if counted else None)))
    for rid, counted in answers.items():  # a revision whose replicas have all stopped
        if rid not in shown:
            table.add_row(_revision(counted["revision"]), "0", "0", str(counted["total"]), str(counted["errors"]))
    lines.append(table)
    return Group(*lines)


def reload(answer: dict) -> Group:
    """The differences a reload found, and whether they were applied (R-10.5)."""
    changes = answer.get("changes") or []
    count = f"{len(changes)} change{'' if len(changes) == 1 else 's'}"
    if answer.get("dry_run"):
        head = f"{answer.get('source')}: {count} (dry run: nothing applied)"
    elif answer.get("applied"):
        head = f"{answer.get('source')}: {count} applied" if changes else f"{answer.get('source')}: nothing changed"
    else:
        head = f"{answer.get('source')}: not applied"
    parts: list[Any] = [Text(head)]
    if changes:
        table = _table("WHAT", "NAME", "CHANGE", "EFFECT")
        for line in changes:
            table.add_row(_t(line["section"]), _t(line["name"]), _t(line["change"]), _t(line["effect"]))
        parts.append(table)
    restart = answer.get("restart_needed") or []
    if restart:
        parts.append(Text(f"needs a restart of llmgw serve (left as they are): {', '.join(restart)}"))
    for entry in answer.get("unplaceable") or []:
        when = "" if entry["made_by_reload"] else " (already so before this reload)"
        parts.append(Text(f"no node of the new inventory could ever run {entry['model']} (min {entry['min']}){when}: "
                          f"{entry['reason']}"))
    if answer.get("refused"):
        parts.append(Text(f"refused: {answer['refused']}"))
    return Group(*parts)


# -- credentials (R-9.3, R-10.7) -----------------------------------------------------------------


def routers(document: dict) -> Table:
    table = _table("ROUTER", "CREDENTIAL", "STATE", "CREATED", "ROTATED", "PREVIOUS ACCEPTED UNTIL")
    for entry in document["routers"]:
        table.add_row(_t(entry["name"]), _t(entry["prefix"] + "…"), _t(entry["state"]),
                      _t(words.clock(entry["created_at"])),
                      _t(None if entry["rotated_at"] is None else words.clock(entry["rotated_at"])),
                      _t(None if entry["previous_until"] is None else words.clock(entry["previous_until"])))
    return table


def router_credential_note(verb: str, answer: dict) -> str:
    """What `routers add` and `routers rotate` say beside the credential (which goes alone to stdout)."""
    router = answer["router"]
    line = f"router {router['name']} {verb}"
    if router.get("previous_until") is not None:
        line += f"; its previous credential is accepted until {words.clock(router['previous_until'])}"
    return (line + ". This is the only time the credential is shown: put it in a 0600 file on the router's host "
            "for --credential-file FILE (a running router reads that file again by itself).")


def router_revoked(answer: dict) -> Text:
    name = answer["router"]["name"]
    if answer["revoked"]:
        return Text(f"router {name} revoked: its feed streams are ended and its reports refused")
    return Text(f"router {name} was already revoked")


def token_rotated_note(answer: dict) -> str:
    """What `token rotate` says beside the new token (which goes alone to stdout)."""
    where = f" to {answer['file']}" if answer.get("file") else ""
    line = f"new admin token written{where}"
    if answer.get("previous_until") is not None:
        return line + f"; the previous one is accepted until {words.clock(answer['previous_until'])}"
    return line + "; the previous one is refused from now on"


# -- the request log (R-6.20) ----------------------------------------------------------------------

# Columns of `ctl requests`, each at least this wide so that the batches `--follow` prints line up.
REQUEST_COLUMNS = (("TIME", 8), ("ID", 24), ("KEY", 10), ("MODEL", 16), ("STATUS", 6), ("REPLICA@NODE", 20),
                   ("ATTEMPTS", 8), ("QUEUE", 6), ("TTFB", 6), ("DURATION", 8), ("TOKENS IN/OUT", 13))
NO_RECORDS = "no requests recorded that match (gateway.request_log; records arrive with the routers' reports)"


def requests(document: dict, *, header: bool = True, now: float | None = None) -> Table | Text:
    """Request records as the API lists them, in its order; `header`: False for the later
    batches of a follow. Estimated token counts are marked `~`, unknown values are `-`."""
    records = document["requests"]
    if not records and header:
        return Text(NO_RECORDS)
    now = time.time() if now is None else now
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), show_header=header, header_style="bold")
    for name, width in REQUEST_COLUMNS:
        table.add_column(name, min_width=width, overflow="fold")
    for r in records:
        table.add_row(_t(words.moment(r["at"], now)), _t(r["id"]), _t(r.get("key")), _t(words.request_model(r)),
                      _t(words.request_status(r), "red" if r["status"] >= 500 else None),
                      _t(words.request_where(r)), _t(words.request_attempts(r)), _t(words.seconds(r.get("queued"))),
                      _t(words.seconds(r.get("ttfb"))), _t(words.seconds(r["duration"])), _t(words.request_tokens(r)))
    return table
