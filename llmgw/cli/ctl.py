"""`llmgw ctl`: the operator's commands against a running gateway's admin listener (R-9.1, R-9.4).

Commands call the management API and render its answer; they hold no logic of their own (the
listings are computed once, in llmgw.admin.views). `--json` prints the API's answer as it is.
A refusal from the API is one line on stderr and exit code 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmgw.admin import text as words
from llmgw.admin.client import AdminClient, AdminError, default_actor
from llmgw.units import format_bytes, format_duration

EXIT_REFUSED = 1
WATCH_INTERVAL = 2.0

ctl = typer.Typer(
    name="ctl",
    help="Look at and steer a running gateway through its admin listener (`llmgw serve` must be running).",
    no_args_is_help=True,
)
model_app = typer.Typer(help="Add or remove models at runtime (models of the inventory file are edited there).",
                        no_args_is_help=True)
ctl.add_typer(model_app, name="model")

JSON_OPTION = typer.Option(False, "--json", help="Print the API's JSON answer instead of tables.")
TOKEN_FILE_OPTION = typer.Option(None, "--token-file", envvar="LLMGW_ADMIN_TOKEN_FILE", show_envvar=True,
                                 dir_okay=False, help="File holding the admin token (e.g. a copy of the gateway's "
                                                      "admin-token), kept out of the command line.")


@dataclass
class Connection:
    admin: str | None
    token: str | None
    state_dir: Path | None
    inventory: Path | None = None
    token_file: Path | None = None
    _client: AdminClient | None = None

    def client(self) -> AdminClient:
        if self._client is None:
            state_dir = self.state_dir
            if state_dir is None and self.inventory is not None:
                state_dir = _inventory_state_dir(self.inventory)
            self._client = AdminClient.discover(admin=self.admin, token=self.token,
                                                token_file=str(self.token_file) if self.token_file else None,
                                                state_dir=state_dir, actor=default_actor())
        return self._client


def _inventory_state_dir(path: Path) -> Path:
    """The state directory `llmgw serve -i PATH` uses (gateway.state_dir, else the default)."""
    from llmgw.config import ConfigError, load_inventory, resolve_state_dir

    try:
        inventory, _ = load_inventory(path)
    except ConfigError as exc:
        raise AdminError(str(exc).splitlines()[0]) from None
    return resolve_state_dir(inventory)


@ctl.callback()
def connection(
    ctx: typer.Context,
    admin: str | None = typer.Option(None, "--admin", envvar="LLMGW_ADMIN", metavar="URL",
                                     help="TCP admin listener, HOST:PORT or URL, for a gateway on another machine "
                                          "(default: the admin.sock Unix socket of the state directory)."),
    token: str | None = typer.Option(None, "--token", envvar="LLMGW_ADMIN_TOKEN", show_envvar=True,
                                     help="Admin token. Prefer the environment variable or --token-file: a "
                                          "command line is visible to every user of this machine (ps, /proc). "
                                          "Default: the admin-token file of the state directory."),
    token_file: Path | None = TOKEN_FILE_OPTION,
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR",
                                          help="State directory of the running `llmgw serve` "
                                               "(default: gateway.state_dir of --inventory, else "
                                               "~/.local/state/llmgw)."),
    inventory: Path | None = typer.Option(None, "-i", "--inventory",
                                          help="Inventory file of the running `llmgw serve`, for its state "
                                               "directory."),
) -> None:
    """Look at and steer a running gateway through its admin listener."""
    ctx.obj = Connection(admin, token, state_dir, inventory, token_file)


PIPED_WIDTH = 200


def _console() -> Console:
    # Piped into grep or a file, a table wrapped at rich's default 80 columns is unreadable.
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return Console(highlight=False, soft_wrap=False, width=PIPED_WIDTH if piped else None)


def _client(ctx: typer.Context) -> AdminClient:
    return ctx.obj.client()


@contextmanager
def _refusals() -> Iterator[None]:
    """An API refusal or an unreachable listener: one clear line on stderr, exit code 1."""
    try:
        yield
    except AdminError as exc:
        typer.echo(f"error: {words.printable(exc.message)}", err=True)
        extra = [p for p in exc.problems if p != exc.message]
        for problem in extra:
            typer.echo(f"  {words.printable(str(problem))}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None


def _emit(document: Any, as_json: bool, render: Callable[[Any], Any]) -> None:
    if as_json:
        typer.echo(json.dumps(document, indent=2))  # JSON escapes control characters itself
        return
    rendered = render(words.printable_document(document))
    if rendered is not None:
        _console().print(rendered)


def _t(value: Any, style: str | None = None) -> Text:
    """A cell: plain text, never rich markup (node output may contain `[GPU is lost]`).

    Documents reach the renderers through `_emit`, which strips terminal control sequences from
    what nodes report (R-9.4)."""
    return Text(words.UNKNOWN if value is None else str(value), style=style or "")


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


def render_status(status: dict) -> Group:
    parts: list[Any] = []
    capacity = _table("GPU CLASS", "USED/FREE/UNHEALTHY", "USED", "FREE", "UNHEALTHY", "NODES",
                      title="GPU capacity (an unhealthy GPU is neither used nor free)")
    for row in status["capacity"]:
        capacity.add_row(_t(row["gpu_class"] or "unrecognised"), _bar(row["used"], row["free"], row["unhealthy"]),
                         _t(row["used"]), _t(row["free"]), _t(row["unhealthy"]), _t(row["nodes"]))
    parts.append(capacity if status["capacity"] else Text("GPU capacity: no GPUs reported"))
    if status["gpus_unknown"]:
        parts.append(Text("GPUs not reported yet: " + ", ".join(status["gpus_unknown"])))
    whole = status["free_whole_nodes"]
    parts.append(Text("free whole nodes per fabric: " + (
        ", ".join(f"{fabric} {count}" for fabric, count in sorted(whole.items())) or "no node belongs to a fabric")))
    nodes, replicas, models = status["nodes"], status["replicas"], status["models"]
    parts.append(Text(f"nodes: {nodes['total']} ({_counts(nodes['by_state'])}; {_counts(nodes['by_admin'])})"))
    parts.append(Text(f"replicas: {replicas['total']} ({_counts(replicas['by_state']) or 'none'})"
                      + (f"; {replicas['failed_recently']} failed recently" if replicas["failed_recently"] else "")))
    parts.append(Text(f"models: {models['total']} ({_counts(models['by_state']) or 'none'})"))
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
        held = [m["model"] + (" (shared filer)" if m["on_shared"] else f" on {', '.join(m['nodes'])}")
                for m in fabric["models"]]
        filers = [f"{fs['mount_point']}: {words.free_of(fs['free_bytes'], fs['total_bytes'])}"
                  for fs in fabric["shared_filers"]]
        table.add_row(_t(fabric["fabric"] or "(no fabric)"), _t(", ".join(fabric["nodes"])), _lines(held),
                      _lines(filers), _t(format_bytes(fabric["local_free_bytes"])))
    parts += [Text(""), table]
    return Group(*parts)


def _counts(mapping: dict[str, int]) -> str:
    return ", ".join(f"{count} {state}" for state, count in mapping.items() if count)


@ctl.command()
def status(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The fleet at a glance.

    GPU capacity per class (used / free / unhealthy: an unhealthy GPU is neither), free whole
    nodes per fabric, replica and model counts, models that cannot be placed and why, replicas
    unasked-for longest, and what each fabric holds.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/status"), as_json, render_status)


# -- nodes -------------------------------------------------------------------------------------------


def render_nodes(document: dict) -> Table:
    now = time.time()
    table = _table("NODE", "STATE", "ADMIN", "FABRIC", "LABELS", "GPUS", "USED", "FREE", "UNHEALTHY", "MEM",
                   "DISK FREE/TOTAL", "SHARED FREE/TOTAL")
    for node in document["nodes"]:
        used, free, unhealthy = words.gpu_counts(node["gpus"])
        disk = node["disk"]
        local = [words.filesystem(fs) for fs in disk["local"]] if disk else []
        shared = [words.filesystem(fs) for fs in disk["shared"]] if disk else []
        state_style = None if node["state"] == "ready" else "red"
        table.add_row(_t(node["name"], "bold"), _t(words.node_state(node, now), state_style),
                      _t(words.admin_state(node, now), None if node["admin"]["state"] == "active" else "yellow"),
                      _t(node["fabric"]), _t(words.labels(node["labels"])), _t(words.gpu_summary(node)),
                      _t(used), _t(free), _lines([unhealthy, *words.unhealthy_reasons(node["gpus"])]),
                      _t(format_bytes(node["memory_bytes"])), _lines(local), _lines(shared))
    return table


@ctl.command()
def nodes(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Every node: state, GPUs, memory, disks.

    State (unreachable since, stale facts), admin state, fabric, labels, GPUs used / free /
    unhealthy with the reasons, memory, disk free/total per filesystem with shared filers apart.
    `-` is unknown: the node did not report it.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/nodes"), as_json, render_nodes)


# -- models ------------------------------------------------------------------------------------------


def render_models(document: dict) -> Table:
    table = _table("MODEL", "STATE", "SERVING", "SCALING", "ROUTING", "PROFILE", "ENGINE", "WEIGHTS", "FALLBACK",
                   "DECLARED", "PROBLEM")
    for model in document["models"]:
        declared = model["declared_in"] + (f" by {model['actor']}" if model["actor"] else "")
        problem = model["unplaceable"] or model["last_failure"]
        if model["retry_in"] is not None:
            problem = f"{problem} (next attempt in {format_duration(model['retry_in'])})"
        table.add_row(_t(model["name"], "bold"), _t(model["state"]),
                      _t(f"{model['replicas']['serving']}/{model['replicas']['total']}"),
                      _t(words.scaling(model["scaling"])), _t(model.get("routing")), _t(model["profile"]),
                      _t(model["engine"]),
                      _t(model["weights"]), _t(model["fallback"]), _t(declared), _t(problem))
    return table


@ctl.command()
def models(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The catalog in force.

    State, serving replicas, scaling, routing policy, profile, weights, where each model is declared.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/models"), as_json, render_models)


# -- replicas ----------------------------------------------------------------------------------------

LOG_TAIL_SHOWN = 10


def render_replicas(document: dict) -> Text:
    out = Text()
    if not document["replicas"]:
        return Text("no replicas")
    for replica in document["replicas"]:
        state = replica["state"] + (" (retired)" if replica["retired"] else "")
        if replica["draining"] and replica["state"] != "draining":
            state += " (draining)"
        out.append(replica["id"], style="bold")
        out.append(f"  {replica['model']}  ")
        out.append(state, style="green" if replica["serving"] else "red" if replica["state"] == "failed" else "yellow")
        details = []
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


@ctl.command()
def replicas(
    ctx: typer.Context,
    as_json: bool = JSON_OPTION,
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until interrupted."),
    interval: float = typer.Option(WATCH_INTERVAL, "--interval", min=0.2, help="Seconds between refreshes."),
) -> None:
    """Replicas, their shards and states.

    Failed ones show the error and the tail of the engine log; a download in progress shows as a
    line under its replica.
    """
    with _refusals():
        client = _client(ctx)
        if not watch:
            _emit(client.get("/api/replicas"), as_json, render_replicas)
            return
        console = _console()
        if console.is_terminal and not as_json:
            from rich.live import Live

            def rendered() -> Text:
                return render_replicas(words.printable_document(client.get("/api/replicas")))

            with Live(rendered(), console=console, auto_refresh=False) as live:
                try:
                    while True:
                        time.sleep(interval)
                        live.update(rendered(), refresh=True)
                except KeyboardInterrupt:
                    return
        try:
            while True:
                _emit(client.get("/api/replicas"), as_json, render_replicas)
                if not as_json:
                    typer.echo(f"--- {time.strftime('%H:%M:%S')}")
                sys.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return


# -- placement ---------------------------------------------------------------------------------------


def render_explanation(document: dict) -> Group:
    summary = Text(f"{document['model']}: {document['summary']}", style="bold")
    plan = document["plan"]
    parts: list[Any] = [summary, Text("plan: " + words.plan_line(plan))]
    if plan is not None and plan["reasons"]:
        parts.append(Text("why: " + "; ".join(plan["reasons"])))
    table = _table("NODE", "VERDICT", "FREE GPUS", "HOLDS WEIGHTS", "REASONS")
    for verdict in document["verdicts"]:
        table.add_row(_t(verdict["node"], "bold"),
                      _t("fits" if verdict["fits"] else "rejected", "green" if verdict["fits"] else "red"),
                      _t(verdict["free_gpus"]), _t(words.holds(verdict["holds_weights"])),
                      _lines(verdict["reasons"]))
    parts += [Text(""), table]
    return Group(*parts)


@ctl.command("explain-placement")
def explain_placement(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                      as_json: bool = JSON_OPTION) -> None:
    """Why MODEL goes where it goes, or nowhere.

    Every node considered, with its verdict and reasons, and the plan placement would make.
    """
    with _refusals():
        _emit(_client(ctx).get(f"/api/explain/{_quote(model)}"), as_json, render_explanation)


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


# -- node admin --------------------------------------------------------------------------------------


def render_node_admin(answer: dict) -> Text:
    node, state = answer["node"], answer["admin"]
    if state == "cordoned":
        return Text(f"{node}: cordoned — nothing new is placed there; its replicas keep serving")
    if state == "draining":
        line = (f"{node}: draining — its replicas move elsewhere, each stopped once its replacement serves")
        if answer.get("grace_until") is not None:
            left = max(0.0, answer["grace_until"] - time.time())
            line += f"; grace until {words.clock(answer['grace_until'])} ({format_duration(left)})"
        return Text(line)
    return Text(f"{node}: active — placement may use it again")


def _node_admin(ctx: typer.Context, node: str, action: str, grace: str | None, as_json: bool) -> None:
    with _refusals():
        body: dict[str, Any] = {"action": action}
        if grace is not None:
            body["grace"] = grace
        _emit(_client(ctx).post(f"/api/nodes/{_quote(node)}/admin", body), as_json, render_node_admin)


@ctl.command()
def cordon(ctx: typer.Context, node: str = typer.Argument(..., help="Node name."),
           as_json: bool = JSON_OPTION) -> None:
    """Place nothing new on NODE; what runs there keeps serving."""
    _node_admin(ctx, node, "cordon", None, as_json)


@ctl.command()
def uncordon(ctx: typer.Context, node: str = typer.Argument(..., help="Node name."),
             as_json: bool = JSON_OPTION) -> None:
    """Let placement use NODE again (ends a cordon or a drain)."""
    _node_admin(ctx, node, "uncordon", None, as_json)


@ctl.command()
def drain(ctx: typer.Context, node: str = typer.Argument(..., help="Node name."),
          grace: str | None = typer.Option(None, "--grace", help="Stop what is left after this long (e.g. 10m), "
                                                                 "even without a replacement."),
          as_json: bool = JSON_OPTION) -> None:
    """Move NODE's replicas elsewhere without dropping traffic.

    Each replica is stopped once its replacement serves, or when the grace period is over.
    """
    _node_admin(ctx, node, "drain", grace, as_json)


# -- catalog changes ---------------------------------------------------------------------------------


def render_model_summary(verb: str) -> Callable[[dict], Text]:
    def render(answer: dict) -> Text:
        scaling = answer["scaling"]
        return Text(f"{verb} {answer['name']} (profile {answer['profile'] or '-'}; {words.scaling(scaling)})")
    return render


@model_app.command("add")
def model_add(ctx: typer.Context,
              file: Path = typer.Option(..., "-f", "--file", exists=True, dir_okay=False, readable=True,
                                        help="YAML of one model, as an entry of the inventory's `models:` list."),
              as_json: bool = JSON_OPTION) -> None:
    """Add a model at runtime from a YAML file.

    The file holds one entry as in the inventory's `models:` list. It is checked like the
    inventory, and must fit some node of it, before anything is stored; it survives restarts.
    """
    with _refusals():
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdminError(f"{file} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
        # The file's name rides in the JSON body: an HTTP header cannot carry every name a file can have.
        answer = _client(ctx).post("/api/models", {"yaml": text, "source": file.name})
        _emit(answer, as_json, render_model_summary("added"))


@model_app.command("remove")
def model_remove(ctx: typer.Context, name: str = typer.Argument(..., help="Model name."),
                 as_json: bool = JSON_OPTION) -> None:
    """Remove a model added at runtime and stop its replicas.

    Models of the inventory file are removed by editing the file.
    """
    with _refusals():
        answer = _client(ctx).call("DELETE", f"/api/models/{_quote(name)}")
        _emit(answer, as_json, lambda a: Text(f"removed {a['removed']}; its replicas are being stopped"))


@ctl.command()
def scale(ctx: typer.Context,
          model: str = typer.Argument(..., help="Model name (one added with `ctl model add`)."),
          minimum: int = typer.Option(..., "--min", min=0, help="Replicas to run: exactly this many; 0 makes "
                                                                "the model on demand."),
          maximum: int | None = typer.Option(None, "--max", min=0, help="Upper bound (default: the catalog fills "
                                                                        "it in, max(min, 1))."),
          as_json: bool = JSON_OPTION) -> None:
    """Change a runtime model's scaling.

    A model with a minimum runs exactly that many replicas: nothing scales it up under load.
    An on-demand model (--min 0) loads one replica when asked, however high its max, and stops
    it after its idle timeout. Only the scaling block changes; max < min is refused and the
    stored definition stays as it was. The answer shows the scaling now in force, with the max
    the catalog filled in.
    """
    with _refusals():
        answer = _client(ctx).post(f"/api/models/{_quote(model)}/scale", {"min": minimum, "max": maximum})

        def render(answer: dict) -> Text:
            scaling = answer["scaling"]
            line = f"{answer['name']}: scaling in force: min {scaling['min']}, max {scaling['max']}"
            if maximum is None:
                line += " (max filled in by the catalog)"
            if scaling["on_demand"]:
                line += "; on demand: one replica is loaded when asked, however high the max"
            else:
                line += f"; runs exactly {scaling['min']} (nothing scales it up under load)"
            return Text(line)
        _emit(answer, as_json, render)


# -- storage and reclaim -----------------------------------------------------------------------------


def render_storage(document: dict) -> Group:
    table = _table("NODE", "STATE", "CACHE DIR", "LOCAL FREE/TOTAL", "SHARED FREE/TOTAL", "HOLDS")
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
        table.add_row(_t(node["node"], "bold"), _t(state), _t(node["cache_dir"]), _lines(local), _lines(shared), held)
    parts: list[Any] = [table]
    if document["shared_filers"]:
        filers = _table("MOUNT POINT", "TYPE", "FREE/TOTAL", "MOUNTED BY", title="Shared filers (each counted once)")
        for fs in document["shared_filers"]:
            filers.add_row(_t(fs["mount_point"]), _t(fs["fstype"]), _t(words.free_of(fs["free_bytes"], fs["total_bytes"])),
                           _t(", ".join(fs["nodes"])))
        parts += [Text(""), filers]
    return Group(*parts)


@ctl.command()
def storage(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Disks per node and the weights each node holds.

    Free/total per filesystem, shared filers apart and counted once.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/storage"), as_json, render_storage)


def render_reclaim(answer: dict) -> Group:
    table = _table("NODE", "ENTRY", "SIZE", "ACTION", "REASON")
    for node in answer["nodes"]:
        if node["error"]:
            table.add_row(_t(node["node"], "bold"), _t(None), _t(None), _t("error", "red"), _t(node["error"]))
        for entry in node["entries"]:
            table.add_row(_t(node["node"], "bold"), _t(entry.get("path") or entry["name"]),
                          _t(format_bytes(entry.get("bytes"))), _t(entry.get("action") or "listed"),
                          _t(entry.get("reason")))
    parts: list[Any] = []
    if table.row_count:
        parts += [table, Text("")]
    parts.append(Text(words.reclaim_summary(answer)))
    return Group(*parts)


@ctl.command()
def reclaim(ctx: typer.Context,
            collect: bool = typer.Option(False, "--collect", help="Ask the nodes to delete what is listed."),
            as_json: bool = JSON_OPTION) -> None:
    """List downloaded weights no model wants; --collect asks the nodes to delete them.

    Only what llmgw fetched is ever touched, and each node checks every path again before it
    deletes anything.
    """
    with _refusals():
        client = _client(ctx)
        answer = client.post("/api/reclaim", {"collect": True}) if collect else client.get("/api/reclaim")
        _emit(answer, as_json, render_reclaim)


# -- logs and usage ----------------------------------------------------------------------------------


@ctl.command()
def logs(ctx: typer.Context,
         replica: str = typer.Argument(..., help="Replica id (see `llmgw ctl replicas`)."),
         shard: int = typer.Option(0, "--shard", min=0, help="Shard rank (0 is the leader)."),
         lines: int = typer.Option(100, "-n", "--lines", min=0, help="How many of the last lines."),
         follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
         as_json: bool = JSON_OPTION) -> None:
    """An engine's log, read from its node whether the engine is healthy or not."""
    with _refusals():
        client = _client(ctx)
        path = f"/api/replicas/{_quote(replica)}/logs"
        if not follow:
            answer = client.get(path, shard=shard, lines=lines)
            if as_json:
                typer.echo(json.dumps(answer, indent=2))
            else:
                for line in answer["lines"]:
                    typer.echo(words.printable(line))
            return
        try:
            for chunk in client.stream(path, shard=shard, lines=lines, follow=1):
                if as_json:
                    typer.echo(json.dumps(chunk))
                else:
                    for line in chunk["lines"]:
                        typer.echo(words.printable(line))
                sys.stdout.flush()
        except KeyboardInterrupt:
            return
        typer.echo("the log stream ended: the gateway closed it (stopping or restarting?)", err=True)


def render_usage(report: dict) -> Group:
    what = "MODEL" if report["by"] == "model" else "KEY"
    table = _table(what, "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "TOTAL TOKENS")
    for row in report["rows"]:
        table.add_row(_t(row["name"], "bold"), _t(row["requests"]), _t(row["prompt_tokens"]),
                      _t(row["completion_tokens"]), _t(row["total_tokens"]))
    totals = report["totals"]
    start = time.strftime("%Y-%m-%d %H:%M", time.localtime(report["from"]))
    parts: list[Any] = [table] if report["rows"] else [Text("no requests in this period")]
    parts.append(Text(f"since {start} (counted per hour): {totals['requests']} requests, "
                      f"{totals['prompt_tokens']} prompt + {totals['completion_tokens']} completion tokens"))
    return Group(*parts)


@ctl.command()
def usage(ctx: typer.Context,
          by: str = typer.Option("model", "--by", help="Group by `model` or `key`."),
          since: str = typer.Option("24h", "--since", help="How far back, e.g. 1h, 7d."),
          as_json: bool = JSON_OPTION) -> None:
    """Requests and tokens per model or per API key."""
    if by not in ("model", "key"):
        typer.echo("error: --by must be `model` or `key`", err=True)
        raise typer.Exit(EXIT_REFUSED)
    with _refusals():
        _emit(_client(ctx).get("/api/usage", by=by, since=since), as_json, render_usage)


@ctl.command()
def dashboard(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Print the dashboard's address, with the admin token in it.

    Open it in a browser: it trades the token for a cookie. Anyone with this address can read
    the dashboard, so keep it to yourself.
    """
    with _refusals():
        url = _client(ctx).dashboard_url()
        if as_json:
            typer.echo(json.dumps({"url": url}))
        else:
            typer.echo(url)
