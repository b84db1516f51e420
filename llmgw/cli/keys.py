"""`llmgw keys create|set|list|revoke`: client API keys (R-6.2) and their limits (R-6.16).

The commands open the state database directly (the same file `llmgw serve` uses); a running
router picks up a new or revoked key within a couple of seconds, without a restart.
"""

from __future__ import annotations

import datetime
import getpass
import json
from pathlib import Path

import typer

from llmgw.cli.exits import bad_config, fail
from llmgw.config import ConfigError, Inventory, load_inventory, resolve_state_dir
from llmgw.contracts.feed import Limits
from llmgw.keys import (MODEL_LIMIT_SYNTAX, ApiKey, KeyRefused, KeySettings, create_key, list_keys, parse_int,
                        parse_limit, parse_model_limit, revoke_key, set_key)
from llmgw.store import Store, audit

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


RpmOption = typer.Option(None, "--rpm", help="Requests per minute the key may make (a whole number, or none).")
TpmOption = typer.Option(None, "--tpm", help="Tokens per minute, prompt and completion together (or none).")
ConcurrencyOption = typer.Option(None, "--concurrency", help="Requests the key may have in flight at once (or none).")
PriorityOption = typer.Option(None, "--priority", help="Priority class when replicas are saturated: higher is "
                                                        "served first (a whole number; default 0).")
WeightOption = typer.Option(None, "--weight", help="Share within its priority class (at least 1; default 1).")
ModelLimitOption = typer.Option(None, "--model-limit", help=f"Limits for one model, on top of the key's: "
                                                            f"{MODEL_LIMIT_SYNTAX}. Repeatable.")


def _limit_flags(rpm: str | None, tpm: str | None, concurrency: str | None, priority: str | None,
                 weight: str | None, model_limit: list[str] | None) -> tuple[dict, dict[str, Limits | None]]:
    """The limit flags given, read (KeyRefused names a bad one): settings and per-model limits."""
    changes: dict = {}
    for flag, name, text in (("--rpm", "rpm", rpm), ("--tpm", "tpm", tpm), ("--concurrency", "concurrency", concurrency)):
        if text is not None:
            changes[name] = parse_limit(text, flag)
    if priority is not None:
        changes["priority"] = parse_int(priority, "--priority")
    if weight is not None:
        changes["weight"] = parse_int(weight, "--weight", 1)
    per_model: dict[str, Limits | None] = {}
    for text in model_limit or ():
        model, limits = parse_model_limit(text)
        if model in per_model:
            raise KeyRefused(f"--model-limit for {model!r} is given twice")
        per_model[model] = limits
    return changes, per_model


def _limits_text(limits: Limits | None) -> str:
    if limits is None:
        return "-"
    return ",".join(f"{name}={'-' if value is None else value}"
                    for name, value in (("rpm", limits.rpm), ("tpm", limits.tpm), ("concurrency", limits.concurrency)))


def _limits_json(limits: Limits | None) -> dict:
    limits = limits or Limits()
    return {"rpm": limits.rpm, "tpm": limits.tpm, "concurrency": limits.concurrency}


def _settings(key: ApiKey) -> dict:
    return {**_limits_json(key.limits), "priority": key.priority, "weight": key.weight,
            "model_limits": {m: _limits_json(lim) for m, lim in sorted(key.model_limits.items())}}


def _open_store(state_dir: Path | None, inventory: Path | None) -> Store:
    config = Inventory()
    if inventory is not None:
        try:
            config, _ = load_inventory(inventory)
        except ConfigError as exc:
            bad_config(exc)
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
    rpm: str | None = RpmOption,
    tpm: str | None = TpmOption,
    concurrency: str | None = ConcurrencyOption,
    priority: str | None = PriorityOption,
    weight: str | None = WeightOption,
    model_limit: list[str] | None = ModelLimitOption,
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """Create a key and print its secret. It is shown this once: store it now. Limits are optional
    (none by default) and can be changed later with `llmgw keys set`."""
    wanted = models.split(",") if models is not None else None
    try:
        changes, per_model = _limit_flags(rpm, tpm, concurrency, priority, weight, model_limit)
    except KeyRefused as exc:
        fail(f"error: {exc}")
    store = _open_store(state_dir, inventory)
    try:
        def write(db):
            settings = KeySettings(limits=Limits(*(changes.get(f) for f in ("rpm", "tpm", "concurrency"))),
                                   priority=changes.get("priority", 0), weight=changes.get("weight", 1),
                                   model_limits=per_model)
            key, secret = create_key(db, name, wanted, settings)
            audit(db, _actor(), "key.create", key.name, {"models": sorted(key.models) if key.models else None,
                                                         **_settings(key)})
            return key, secret
        key, secret = store.write_sync(write)
    except KeyRefused as exc:
        fail(f"error: {exc}")
    finally:
        store.close()
    typer.echo(secret)
    scope = ", ".join(sorted(key.models)) if key.models is not None else "all models"
    typer.echo(f"created key {key.name!r} ({scope}); this is the only time the secret is shown.", err=True)


@keys_app.command("set")
def set_(
    name: str = typer.Argument(..., help="The key's name, as `llmgw keys list` shows it."),
    rpm: str | None = RpmOption,
    tpm: str | None = TpmOption,
    concurrency: str | None = ConcurrencyOption,
    priority: str | None = PriorityOption,
    weight: str | None = WeightOption,
    model_limit: list[str] | None = ModelLimitOption,
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """Change a key's limits; what is not given stays as it was (`--rpm none` clears one). A running
    router applies them within a few seconds."""
    try:
        changes, per_model = _limit_flags(rpm, tpm, concurrency, priority, weight, model_limit)
        if not changes and not per_model:
            raise KeyRefused("nothing to change: give --rpm, --tpm, --concurrency, --priority, --weight "
                             "or --model-limit")
    except KeyRefused as exc:
        fail(f"error: {exc}")
    store = _open_store(state_dir, inventory)
    try:
        def write(db):
            key = set_key(db, name, changes, per_model)
            audit(db, _actor(), "key.set", key.name, _settings(key))
            return key
        key = store.write_sync(write)
    except KeyRefused as exc:
        fail(f"error: {exc}")
    finally:
        store.close()
    per = "; ".join(f"{m}: {_limits_text(lim)}" for m, lim in sorted(key.model_limits.items())) or "-"
    typer.echo(f"key {key.name!r}: {_limits_text(key.limits)}, priority {key.priority}, weight {key.weight}; "
               f"per model: {per}")


@keys_app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    state_dir: Path | None = StateDir,
    inventory: Path | None = InventoryFile,
) -> None:
    """List keys: name, prefix, models, limits (`-` for none), created, last used (`-` when never), revoked."""
    store = _open_store(state_dir, inventory)
    try:
        keys = store.read_sync(list_keys)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps([{
            "name": k.name, "prefix": k.prefix,
            "models": sorted(k.models) if k.models is not None else None,
            **_settings(k),
            "created_at": k.created_at, "last_used_at": k.last_used_at, "revoked_at": k.revoked_at,
        } for k in keys], indent=2))
        return
    if not keys:
        typer.echo("no keys yet; create one with `llmgw keys create NAME`")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "PREFIX", "MODELS", "RPM", "TPM", "CONC", "PRIO", "WEIGHT", "MODEL LIMITS",
                   "CREATED", "LAST USED", "REVOKED"):
        table.add_column(column, no_wrap=column not in ("MODELS", "MODEL LIMITS"))
    for k in keys:
        limits = k.limits or Limits()
        per_model = "; ".join(f"{m}: {_limits_text(lim)}" for m, lim in sorted(k.model_limits.items())) or "-"
        table.add_row(k.name, k.prefix + "…", ", ".join(sorted(k.models)) if k.models is not None else "all",
                      *("-" if v is None else str(v) for v in (limits.rpm, limits.tpm, limits.concurrency)),
                      str(k.priority), str(k.weight), per_model,
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
        fail(f"error: {exc}")
    finally:
        store.close()
    state = "revoked" if newly else "was already revoked"
    typer.echo(f"key {key.name!r} ({key.prefix}…) {state} at {_when(key.revoked_at)}")
