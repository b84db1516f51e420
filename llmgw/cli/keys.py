"""`llmgw keys create|list|revoke`: client API keys (R-6.2).

The commands open the state database directly (the same file `llmgw serve` uses); a running
router picks up a new or revoked key within a couple of seconds, without a restart.
"""

from __future__ import annotations

import datetime
import getpass
import json
from pathlib import Path

import typer

from llmgw.config import ConfigError, Inventory, load_inventory, resolve_state_dir
from llmgw.keys import KeyRefused, create_key, list_keys, revoke_key
from llmgw.store import Store, audit

EXIT_REFUSED = 1
EXIT_CONFIG = 2

keys_app = typer.Typer(
    name="keys",
    no_args_is_help=True,
    help="Client API keys. Every request to the client listener needs one (only / and /healthz "
         "are open), and none exists at first: create the first with `llmgw keys create NAME` "
         "(add --state-dir or -i if `llmgw serve` uses a non-default state directory). The key "
         "is printed once; only its SHA-256 hash is stored.",
)

StateDir = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR",
                        help="State directory of the gateway (default: gateway.state_dir of --inventory, "
                             "else ~/.local/state/llmgw).")
InventoryFile = typer.Option(None, "-i", "--inventory",
                             help="Inventory file whose gateway.state_dir to use.")


def _open_store(state_dir: Path | None, inventory: Path | None) -> Store:
    config = Inventory()
    if inventory is not None:
        try:
            config, _ = load_inventory(inventory)
        except ConfigError as exc:
            for line in exc.lines():
                typer.echo(line, err=True)
            raise typer.Exit(EXIT_CONFIG)
    directory = resolve_state_dir(config, str(state_dir) if state_dir else None)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Store.open(directory / "state.db")


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return "cli"


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


@keys_app.command("create")
def create(
    name: str = typer.Argument(..., help="A name for the key: who or what uses it."),
    models: str | None = typer.Option(None, "--models",
                                      help="Comma-separated models the key may use (default: all)."),
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """Create a key and print its secret. It is shown this once: store it now."""
    wanted = models.split(",") if models is not None else None
    store = _open_store(state_dir, inventory)
    try:
        def write(db):
            key, secret = create_key(db, name, wanted)
            audit(db, _actor(), "key.create", key.name, {"models": sorted(key.models) if key.models else None})
            return key, secret
        key, secret = store.write_sync(write)
    except KeyRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED)
    finally:
        store.close()
    typer.echo(secret)
    scope = ", ".join(sorted(key.models)) if key.models is not None else "all models"
    typer.echo(f"created key {key.name!r} ({scope}); this is the only time the secret is shown.", err=True)


@keys_app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """List keys: name, prefix, models, created, last used (`-` when never), revoked."""
    store = _open_store(state_dir, inventory)
    try:
        keys = store.read_sync(list_keys)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps([{
            "name": k.name, "prefix": k.prefix,
            "models": sorted(k.models) if k.models is not None else None,
            "created_at": k.created_at, "last_used_at": k.last_used_at, "revoked_at": k.revoked_at,
        } for k in keys], indent=2))
        return
    if not keys:
        typer.echo("no keys yet; create one with `llmgw keys create NAME`")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "PREFIX", "MODELS", "CREATED", "LAST USED", "REVOKED"):
        table.add_column(column, no_wrap=column != "MODELS")
    for k in keys:
        table.add_row(k.name, k.prefix + "…", ", ".join(sorted(k.models)) if k.models is not None else "all",
                      _when(k.created_at), _when(k.last_used_at), _when(k.revoked_at))
    Console(width=200).print(table)


@keys_app.command("revoke")
def revoke(
    name: str = typer.Argument(..., help="The key's name, as `llmgw keys list` shows it."),
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """Revoke a key. A running router refuses it within a few seconds; usage history is kept."""
    store = _open_store(state_dir, inventory)
    try:
        def write(db):
            key, newly = revoke_key(db, name)
            if newly:
                audit(db, _actor(), "key.revoke", key.name)
            return key, newly
        key, newly = store.write_sync(write)
    except KeyRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED)
    finally:
        store.close()
    state = "revoked" if newly else "was already revoked"
    typer.echo(f"key {key.name!r} ({key.prefix}…) {state} at {_when(key.revoked_at)}")
