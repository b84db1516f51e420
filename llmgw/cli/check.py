"""`llmgw check -i FILE`: validate an inventory file (R-9.8)."""

from __future__ import annotations

from pathlib import Path

import typer

from llmgw.catalog import Catalog
from llmgw.config import ConfigError, load_inventory

EXIT_CONFIG = 2


def load_checked(path: Path):
    """Inventory, document and catalog from a file; a broken file raises ConfigError."""
    inventory, document = load_inventory(path)
    catalog = Catalog.from_inventory(inventory, document)
    return inventory, document, catalog


def check(
    inventory: Path = typer.Option(..., "-i", "--inventory", help="The inventory file to check."),
) -> None:
    """Validate an inventory file: syntax, fields, profiles, engines, fallbacks, scaling."""
    try:
        inv, _, catalog = load_checked(inventory)
    except ConfigError as exc:
        for line in exc.lines():
            typer.echo(line, err=True)
        raise typer.Exit(EXIT_CONFIG)
    typer.echo(f"{inventory}: valid — {len(inv.nodes)} nodes, {len(inv.profiles)} profiles, "
               f"{len(catalog.models)} models")
