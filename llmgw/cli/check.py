"""`llmgw check -i FILE`: validate an inventory file (R-9.8)."""

from __future__ import annotations

from pathlib import Path

import typer

from llmgw.catalog import Catalog
from llmgw.cli.exits import bad_config, fail
from llmgw.config import ConfigError, load_inventory


def load_checked(path: Path):
    """Inventory, document and catalog from a file; a broken file raises ConfigError."""
    inventory, document = load_inventory(path)
    catalog = Catalog.from_inventory(inventory, document)
    return inventory, document, catalog


def check(
    inventory: Path = typer.Option(..., "-i", "--inventory", help="The inventory file to check."),
    connect: bool = typer.Option(True, "--connect/--no-connect",
                                 help="Also reach every node once, like `ansible -m ping`."),
    timeout: float = typer.Option(20.0, "--timeout", help="Seconds to wait for each node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR"),
) -> None:
    """Validate an inventory file, then reach every node once and print what is wrong per node.

    The file check covers syntax, fields, profiles, engines, fallbacks and scaling. Exit code 2:
    the file is invalid; 1: a node could not be reached.
    """
    try:
        inv, _, catalog = load_checked(inventory)
    except ConfigError as exc:
        bad_config(exc)
    typer.echo(f"{inventory}: valid — {len(inv.nodes)} nodes, {len(inv.profiles)} profiles, "
               f"{len(catalog.models)} models" + (f", {len(catalog.adapters)} adapters" if catalog.adapters else ""))
    if not connect or not inv.nodes:
        return
    import asyncio

    from llmgw.cli.nodes import print_reach_table, reach_all
    from llmgw.config import resolve_state_dir

    results = asyncio.run(reach_all(inv, resolve_state_dir(inv, state_dir and str(state_dir)), timeout))
    print_reach_table(results)
    if not all(r["ok"] for r in results):
        fail()  # the table says which
