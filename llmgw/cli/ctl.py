"""`llmgw ctl`: the operator's commands against a running gateway's admin listener (R-9.1, R-9.4).

Commands call the management API and print its answer; they hold no logic of their own (the
listings are computed once, in llmgw.admin.views, and laid out for the terminal by
llmgw.admin.render). `--json` prints the API's answer as it is.
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
from rich.console import Console
from rich.text import Text

from llmgw.admin import render
from llmgw.admin import text as words
from llmgw.admin.client import AdminClient, AdminError, default_actor
from llmgw.cli.exits import fail

WATCH_INTERVAL = 2.0

ctl = typer.Typer(
    name="ctl",
    help="Look at and steer a running gateway through its admin listener (`llmgw serve` must be running).",
    no_args_is_help=True,
)
model_app = typer.Typer(help="Add or remove models at runtime (models of the inventory file are edited there).",
                        no_args_is_help=True)
ctl.add_typer(model_app, name="model")
alias_app = typer.Typer(help="Stable names clients call, each pointing at a model.", no_args_is_help=True)
ctl.add_typer(alias_app, name="alias")
rollout_app = typer.Typer(help="A model's move to a new revision: watch it, pause, resume, promote a canary, undo.",
                          no_args_is_help=True)
ctl.add_typer(rollout_app, name="rollout")

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
    ca: Path | None = None
    _client: AdminClient | None = None

    def client(self) -> AdminClient:
        if self._client is None:
            state_dir = self.state_dir
            if state_dir is None and self.inventory is not None:
                state_dir = _inventory_state_dir(self.inventory)
            self._client = AdminClient.discover(admin=self.admin, token=self.token,
                                                token_file=str(self.token_file) if self.token_file else None,
                                                state_dir=state_dir, actor=default_actor(),
                                                ca=str(self.ca) if self.ca else None)
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
    ca: Path | None = typer.Option(None, "--ca", envvar="LLMGW_ADMIN_CA", dir_okay=False,
                                   help="CA certificate (PEM) to check an https:// --admin listener's certificate "
                                        "with, when a public authority did not sign it."),
) -> None:
    """Look at and steer a running gateway through its admin listener."""
    ctx.obj = Connection(admin, token, state_dir, inventory, token_file, ca)


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
        extra = [p for p in exc.problems if p != exc.message]
        fail(f"error: {words.printable(exc.message)}", *(f"  {words.printable(str(problem))}" for problem in extra))


def _emit(document: Any, as_json: bool, layout: Callable[[Any], Any]) -> None:
    """Print an API answer: as JSON, or laid out by one of llmgw.admin.render's functions."""
    if as_json:
        typer.echo(json.dumps(document, indent=2))  # JSON escapes control characters itself
        return
    rendered = layout(words.printable_document(document))
    if rendered is not None:
        _console().print(rendered)


# -- status ------------------------------------------------------------------------------------------


@ctl.command()
def status(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The fleet at a glance.

    GPU capacity per class (used / free / unhealthy: an unhealthy GPU is neither), free whole
    nodes per fabric, replica and model counts, models that cannot be placed and why, replicas
    unasked-for longest, and what each fabric holds.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/status"), as_json, render.status)


# -- nodes -------------------------------------------------------------------------------------------


@ctl.command()
def nodes(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Every node: state, GPUs, memory, disks.

    State (unreachable since, stale facts), admin state, fabric, labels, GPUs used / free /
    unhealthy with the reasons, memory, disk free/total per filesystem with shared filers apart.
    `-` is unknown: the node did not report it.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/nodes"), as_json, render.nodes)


# -- models ------------------------------------------------------------------------------------------


@ctl.command()
def models(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The catalog in force.

    State, serving replicas, scaling, routing policy, profile, weights, where each model is declared.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/models"), as_json, render.models)


# -- replicas ----------------------------------------------------------------------------------------

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
            _emit(client.get("/api/replicas"), as_json, render.replicas)
            return
        console = _console()
        if console.is_terminal and not as_json:
            from rich.live import Live

            def rendered() -> Text:
                return render.replicas(words.printable_document(client.get("/api/replicas")))

            with Live(rendered(), console=console, auto_refresh=False) as live:
                try:
                    while True:
                        time.sleep(interval)
                        live.update(rendered(), refresh=True)
                except KeyboardInterrupt:
                    return
        try:
            while True:
                _emit(client.get("/api/replicas"), as_json, render.replicas)
                if not as_json:
                    typer.echo(f"--- {time.strftime('%H:%M:%S')}")
                sys.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return


# -- placement ---------------------------------------------------------------------------------------


@ctl.command("explain-placement")
def explain_placement(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                      as_json: bool = JSON_OPTION) -> None:
    """Why MODEL goes where it goes, or nowhere.

    Every node considered, with its verdict and reasons, and the plan placement would make.
    """
    with _refusals():
        _emit(_client(ctx).get(f"/api/explain/{_quote(model)}"), as_json, render.explanation)


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


# -- node admin --------------------------------------------------------------------------------------


def _node_admin(ctx: typer.Context, node: str, action: str, grace: str | None, as_json: bool) -> None:
    with _refusals():
        body: dict[str, Any] = {"action": action}
        if grace is not None:
            body["grace"] = grace
        _emit(_client(ctx).post(f"/api/nodes/{_quote(node)}/admin", body), as_json, render.node_admin)


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


@model_app.command("add")
def model_add(ctx: typer.Context,
              file: Path = typer.Option(..., "-f", "--file", exists=True, dir_okay=False, readable=True,
                                        help="YAML of one model, as an entry of the inventory's `models:` list."),
              replace: bool = typer.Option(False, "--replace", help="Give a model added at runtime this new "
                                                                    "definition (a changed revision rolls)."),
              as_json: bool = JSON_OPTION) -> None:
    """Add a model at runtime from a YAML file.

    The file holds one entry as in the inventory's `models:` list. It is checked like the
    inventory, and must fit some node of it, before anything is stored; it survives restarts.
    With --replace, a model added at runtime takes the file's definition: scaling, routing,
    limits and fallbacks apply in place, and a change of what its replicas run (weights, engine,
    arguments, environment…) rolls them to the new revision (`ctl rollout status`).
    """
    with _refusals():
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdminError(f"{file} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
        # The file's name rides in the JSON body: an HTTP header cannot carry every name a file can have.
        answer = _client(ctx).post("/api/models", {"yaml": text, "source": file.name, "replace": replace})
        _emit(answer, as_json, render.model_summary("replaced" if replace else "added"))


@model_app.command("remove")
def model_remove(ctx: typer.Context, name: str = typer.Argument(..., help="Model name."),
                 as_json: bool = JSON_OPTION) -> None:
    """Remove a model added at runtime and stop its replicas.

    Models of the inventory file are removed by editing the file.
    """
    with _refusals():
        answer = _client(ctx).call("DELETE", f"/api/models/{_quote(name)}")
        _emit(answer, as_json, render.removed)


@ctl.command()
def scale(ctx: typer.Context,
          model: str = typer.Argument(..., help="Model name (one added with `ctl model add`)."),
          minimum: int = typer.Option(..., "--min", min=0, help="Replicas that always run; 0 makes the model "
                                                                "on demand."),
          maximum: int | None = typer.Option(None, "--max", min=0, help="Load adds replicas up to this many "
                                                                        "(default: max(min, 1), no scaling on load)."),
          as_json: bool = JSON_OPTION) -> None:
    """Change a runtime model's scaling.

    A model runs at least min replicas and at most max; in between, load decides: requests in
    flight per replica against the model's scaling.target (default 2), a replica added once the
    load stayed above it for scaling.up_delay (30s), one removed once it stayed below for
    scaling.down_delay (10m), draining first. Without --max, max is min (1 for an on-demand
    model): the model runs exactly that many. An on-demand model (--min 0) loads one replica
    when asked, more under load up to its max, and stops them after its idle timeout. Only min
    and max change; max < min is refused and the stored definition stays as it was. The answer
    shows the scaling now in force, with the max the catalog filled in.
    """
    with _refusals():
        answer = _client(ctx).post(f"/api/models/{_quote(model)}/scale", {"min": minimum, "max": maximum})
        _emit(answer, as_json, lambda a: render.scaled(a, max_given=maximum is not None))


# -- aliases ------------------------------------------------------------------------------------------


@alias_app.command("list")
def alias_list(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The aliases in force: from the inventory's `aliases:` and those set at runtime."""
    with _refusals():
        _emit(_client(ctx).call("GET", "/api/aliases"), as_json, render.aliases)


@alias_app.command("set")
def alias_set(ctx: typer.Context, name: str = typer.Argument(..., help="The alias clients call."),
              target: str = typer.Argument(..., help="The model it points at."),
              as_json: bool = JSON_OPTION) -> None:
    """Point an alias at a model (made, or moved from the model it pointed at).

    Clients call the alias as a model: requests go to the target, usage is counted under the
    target with the name the client used. A key may use an alias when it may use the alias's
    name or its target. Aliases of the inventory file are changed there.
    """
    with _refusals():
        answer = _client(ctx).call("PUT", f"/api/aliases/{_quote(name)}", body={"target": target})
        _emit(answer, as_json, lambda a: Text(f"alias {a['name']} -> {a['target']}"))


@alias_app.command("rm")
def alias_rm(ctx: typer.Context, name: str = typer.Argument(..., help="The alias."),
             as_json: bool = JSON_OPTION) -> None:
    """Remove an alias set at runtime: clients calling it get 'model not found'."""
    with _refusals():
        answer = _client(ctx).call("DELETE", f"/api/aliases/{_quote(name)}")
        _emit(answer, as_json, lambda a: Text(f"removed alias {a['removed']}"))


# -- rollouts -----------------------------------------------------------------------------------------

CANARY_OPTION = typer.Option(None, "--canary", min=1, max=99,
                             help="Stop at one replica of the target given about this percent of the requests, "
                                  "until `ctl rollout promote`.")


@rollout_app.command("status")
def rollout_status(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                   as_json: bool = JSON_OPTION) -> None:
    """Where the model's rollout stands: its target revision, why it waits, replicas per revision.

    A model rolls when its definition changes what its replicas run (weights, engine, arguments,
    environment, runtime, GPUs…): replicas of the new revision start and each old one leaves once
    a new one serves, within the model's rollout.surge and rollout.unavailable. With no rollout
    under way it shows the revision every replica runs.
    """
    with _refusals():
        _emit(_client(ctx).call("GET", f"/api/models/{_quote(model)}/rollout"), as_json, render.rollout)


def _rollout(ctx: typer.Context, model: str, action: str, as_json: bool, canary: int | None = None) -> None:
    with _refusals():
        body = {} if canary is None else {"canary": canary}
        _emit(_client(ctx).post(f"/api/models/{_quote(model)}/rollout/{action}", body), as_json, render.rollout)


@rollout_app.command("pause")
def rollout_pause(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                  as_json: bool = JSON_OPTION) -> None:
    """Stop the rollout where it is: nothing more starts or stops; every replica keeps serving."""
    _rollout(ctx, model, "pause", as_json)


@rollout_app.command("resume")
def rollout_resume(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                   canary: int | None = CANARY_OPTION, as_json: bool = JSON_OPTION) -> None:
    """Go on with a paused rollout (one paused by a failing replica tries again at once)."""
    _rollout(ctx, model, "resume", as_json, canary)


@rollout_app.command("promote")
def rollout_promote(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                    as_json: bool = JSON_OPTION) -> None:
    """End the canary: the rollout goes on to every replica."""
    _rollout(ctx, model, "promote", as_json)


@rollout_app.command("undo")
def rollout_undo(ctx: typer.Context, model: str = typer.Argument(..., help="Model name."),
                 canary: int | None = CANARY_OPTION, as_json: bool = JSON_OPTION) -> None:
    """Roll back to the previous revision, the same way, also after the rollout ended.

    The model then stays on that revision, and `ctl models` shows it differs from the catalog,
    until the model's definition changes again (a reload of the unchanged file keeps it).
    """
    _rollout(ctx, model, "undo", as_json, canary)


# -- reload ------------------------------------------------------------------------------------------


@ctl.command()
def reload(ctx: typer.Context,
           dry_run: bool = typer.Option(False, "--dry-run", help="Print what would change; change nothing."),
           grace: str | None = typer.Option(None, "--grace", help="How long replicas of a removed node wait for "
                                                                  "their replacements before they stop (default 10m)."),
           force: bool = typer.Option(False, "--force", help="Apply a file that leaves a model's min with no node "
                                                             "that could ever run it."),
           as_json: bool = JSON_OPTION) -> None:
    """Re-read the inventory file `llmgw serve` was started with and apply what changed.

    The differences are printed (what each does): nodes added are connected and used, nodes
    removed are drained and then forgotten, a node's connection settings reconnect it, profiles,
    models and gateway settings change; gateway.listen, gateway.admin and gateway.state_dir need a
    restart and are left as they are. A file with a problem is refused with file, line and field,
    and nothing changes. A file that removes every node able to run a model with a min (its GPU
    class or count, memory, labels, fabric size) is refused naming each such model, unless
    --force; a change that only has to wait for room is not. --dry-run says so too, and exits 1
    where the reload would be refused. SIGHUP to `llmgw serve` does the same, without --force.
    """
    with _refusals():
        body: dict[str, Any] = {"dry_run": dry_run, "force": force}
        if grace is not None:
            body["grace"] = grace
        answer = _client(ctx).post("/api/reload", body)
        _emit(answer, as_json, render.reload)
    if answer.get("refused"):
        fail()  # the answer printed says why


# -- storage and reclaim -----------------------------------------------------------------------------


@ctl.command()
def storage(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Disks per node and the weights each node holds.

    Free/total per filesystem, shared filers apart and counted once.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/storage"), as_json, render.storage)


@ctl.command()
def engines(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Engines llmgw installed per node: environments (runtime: venv) and images (runtime: container).

    What each is, its size and last use, the profiles that want it and the shards running it.
    `llmgw ctl reclaim` lists those no profile wants; --collect removes them.
    """
    with _refusals():
        _emit(_client(ctx).get("/api/engines"), as_json, render.engines)


@ctl.command()
def reclaim(ctx: typer.Context,
            collect: bool = typer.Option(False, "--collect", help="Ask the nodes to delete what is listed."),
            as_json: bool = JSON_OPTION) -> None:
    """List downloaded weights no model wants, and engines no profile wants; --collect asks the nodes to delete them.

    Only what llmgw fetched, built or pulled is ever touched, and each node checks every path
    again before it deletes anything.
    """
    with _refusals():
        client = _client(ctx)
        answer = client.post("/api/reclaim", {"collect": True}) if collect else client.get("/api/reclaim")
        _emit(answer, as_json, render.reclaim)


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


@ctl.command()
def usage(ctx: typer.Context,
          by: str = typer.Option("model", "--by", help="Group by `model` or `key`."),
          since: str = typer.Option("24h", "--since", help="How far back, e.g. 1h, 7d."),
          as_json: bool = JSON_OPTION) -> None:
    """Requests and tokens per model or per API key."""
    if by not in ("model", "key"):
        fail("error: --by must be `model` or `key`")
    with _refusals():
        _emit(_client(ctx).get("/api/usage", by=by, since=since), as_json, render.usage)


FOLLOW_EVERY = 1.0  # seconds between two asks of `requests --follow`
FOLLOW_TIMEOUT = 10.0  # seconds one ask of `requests --follow` waits for the admin listener
FOLLOW_BATCH = 1000  # records one ask of `requests --follow` takes at most (the API's most)


@ctl.command()
def requests(ctx: typer.Context,
             key: str | None = typer.Option(None, "--key", help="Only requests made with this API key (its name)."),
             model: str | None = typer.Option(None, "--model", help="Only requests for this model, or that named it "
                                                                    "(an alias the client called)."),
             status: str | None = typer.Option(None, "--status", metavar="STATUS",
                                               help="Only this status (503) or class of statuses (5xx, 4xx)."),
             slower_than: str | None = typer.Option(None, "--slower-than", metavar="DURATION",
                                                    help="Only requests that took longer, e.g. 30s, 1.5s, 250ms."),
             n: int = typer.Option(50, "-n", min=1, help="How many of the latest (at most 1000)."),
             follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new records as they arrive, "
                                                                      "until interrupted."),
             as_json: bool = JSON_OPTION) -> None:
    """The latest requests the routers recorded, across routers, newest first.

    One record per request (gateway.request_log): when it arrived, its X-Request-Id, the key's
    name, the model (and the alias it was called by), the status and error code, the replica and
    node of the last attempt, attempts and the fallback that served, the time queued, to the
    first byte and in all, tokens in/out (`~`: estimated from what was relayed). `-` is unknown.
    Records reach the control plane with the routers' reports, about a second after the request.
    With --follow the latest N are printed oldest first, then each new record as it comes in
    (--json: a {"requests": [...]} document per line); it ends with an error when the gateway
    stops answering.
    """
    filters = {"key": key, "model": model, "status": status, "slower_than": slower_than}
    with _refusals():
        client = _client(ctx)
        answer = client.get("/api/requests", n=n, **filters)
        if not follow:
            _emit(answer, as_json, render.requests)
            return
        answer["requests"].reverse()  # followed: oldest first, so that new records come below
        headed = _print_requests(answer, as_json, headed=False)
        cursor = answer["cursor"]
        try:
            while True:
                time.sleep(FOLLOW_EVERY)
                # A listener that stopped answering ends the follow with its error, never a silent wait.
                answer = client.call("GET", "/api/requests", query={"after": cursor, "n": FOLLOW_BATCH, **filters},
                                     timeout=FOLLOW_TIMEOUT)
                cursor = answer["cursor"]
                if answer["requests"]:
                    headed = _print_requests(answer, as_json, headed)
        except KeyboardInterrupt:
            return


def _print_requests(answer: dict, as_json: bool, headed: bool) -> bool:
    """One batch of a follow: a JSON document on a line of its own, or rows of the table (its
    header once, over the first rows). Returns whether the header has been printed."""
    if as_json:
        typer.echo(json.dumps(answer))
    elif answer["requests"] or not headed:
        _console().print(render.requests(words.printable_document(answer), header=not headed))
        headed = headed or bool(answer["requests"])
    sys.stdout.flush()
    return headed


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


# -- credentials (R-9.3, R-10.7) -------------------------------------------------------------------

routers_app = typer.Typer(help="Credentials of the routers fed by this control plane: one per router.",
                          no_args_is_help=True)
ctl.add_typer(routers_app, name="routers")
token_app = typer.Typer(help="The admin token.", no_args_is_help=True)
ctl.add_typer(token_app, name="token")
GRACE_OPTION = typer.Option("0s", "--grace", metavar="DURATION",
                            help="How long the credential it replaces stays accepted, e.g. 10m (default: not at all).")


@routers_app.command("add")
def routers_add(ctx: typer.Context, name: str = typer.Argument(..., help="The router's name, e.g. edge1."),
                as_json: bool = JSON_OPTION) -> None:
    """Make a router's credential and print it, this once (the gateway keeps only its hash)."""
    with _refusals():
        _secret(_client(ctx).post("/api/routers", {"name": name}), "credential", as_json,
                lambda answer: render.router_credential_note("added", answer))


@routers_app.command("list")
def routers_list(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """The routers with a credential, revoked ones included."""
    with _refusals():
        _emit(_client(ctx).get("/api/routers"), as_json, render.routers)


@routers_app.command("rotate")
def routers_rotate(ctx: typer.Context, name: str = typer.Argument(..., help="The router's name."),
                   grace: str = GRACE_OPTION, as_json: bool = JSON_OPTION) -> None:
    """Give a router a new credential and print it; the old one works for --grace more."""
    with _refusals():
        _secret(_client(ctx).post(f"/api/routers/{_quote(name)}/rotate", {"grace": grace}), "credential", as_json,
                lambda answer: render.router_credential_note("has a new credential", answer))


@routers_app.command("revoke")
def routers_revoke(ctx: typer.Context, name: str = typer.Argument(..., help="The router's name."),
                   as_json: bool = JSON_OPTION) -> None:
    """Refuse a router's credential: its feed streams end and its reports are refused."""
    with _refusals():
        _emit(_client(ctx).call("DELETE", f"/api/routers/{_quote(name)}"), as_json, render.router_revoked)


@token_app.command("rotate")
def token_rotate(ctx: typer.Context, grace: str = GRACE_OPTION, as_json: bool = JSON_OPTION) -> None:
    """Write a new admin token to the admin-token file and print it; the old one works for --grace more.

    The grace is kept by the running gateway: a restart of `llmgw serve` ends it."""
    with _refusals():
        _secret(_client(ctx).post("/api/token/rotate", {"grace": grace}), "token", as_json, render.token_rotated_note)


def _secret(answer: dict, field: str, as_json: bool, note: Callable[[dict], str]) -> None:
    """A secret shown once: alone on stdout (`> FILE` keeps just it), what to do with it on stderr."""
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
        return
    typer.echo(answer[field])
    typer.echo(words.printable(note(answer)), err=True)
