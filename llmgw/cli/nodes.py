"""Reaching nodes from the command line: `llmgw helper run` (R-1.8) and the connectivity part of
`llmgw check` (R-9.8). Both go through the same NodeLink code path as `llmgw serve`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from llmgw.cli.exits import ExitCode, bad_config, fail
from llmgw.config import ConfigError, Inventory, NodeConfig
from llmgw.fleet.link import CONNECTING, READY, UNREACHABLE, NodeLink, make_link
from llmgw.fleet.secret import SecretError, fleet_secret
from llmgw.fleet.errors import NodeError, NodeUnavailable
from llmgw.units import format_bytes

helper_app = typer.Typer(help="Run node-helper operations by hand, through the same code path as serve.",
                         no_args_is_help=True)


def _link(inventory: Inventory, node: NodeConfig, state_dir: Path, fleet_secret: str | None = None) -> NodeLink:
    return make_link(node, inventory.ssh, local_root=state_dir / "node" / node.name, fleet_secret=fleet_secret)


def parse_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise typer.BadParameter(f"{text!r}: write --arg key=value")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


async def _run_one(inventory: Inventory, node: NodeConfig, state_dir: Path, op: str, args: dict,
                   timeout: float) -> dict:
    # The fleet secret too, as serve hands it over: a fetch here is sealed like any other.
    link = _link(inventory, node, state_dir, fleet_secret(state_dir))
    link.start()
    try:
        if not await link.wait_ready(timeout):
            raise NodeUnavailable(node.name, op, link.state, link.reason or "not ready in time")
        # Any operation by name, its answer printed as the helper sent it: the untyped call.
        return await link.call(op, args, timeout=None if op in ("fetch", "logs") else 120)
    finally:
        await link.close()


@helper_app.command("run")
def run(
    node: str = typer.Argument(..., help="Node name from the inventory."),
    op: str = typer.Argument(..., help="Helper operation: ping, inventory, storage, holdings, status, logs, reclaim…"),
    arg: list[str] = typer.Option([], "--arg", help="key=value (value parsed as JSON when it is JSON)."),
    inventory_path: Path | None = typer.Option(None, "-i", "--inventory", help="Inventory file (default: embedded)."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="LLMGW_STATE_DIR"),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the node to be reachable."),
) -> None:
    """Run one helper operation on a node and print its JSON answer: the operator's debugging tool."""
    from llmgw.config import load_configuration, resolve_state_dir

    try:
        inventory, _, _ = load_configuration(str(inventory_path) if inventory_path else None)
    except ConfigError as exc:
        bad_config(exc)
    try:
        target = inventory.node(node)
    except KeyError:
        fail(f"no node named {node!r} in the inventory", code=ExitCode.BAD_CONFIG)
    args = dict(parse_arg(a) for a in arg)
    try:
        result = asyncio.run(_run_one(inventory, target, resolve_state_dir(inventory, state_dir and str(state_dir)),
                                      op, args, timeout))
    except (NodeError, SecretError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(result, indent=2))


async def reach_all(inventory: Inventory, state_dir: Path, timeout: float) -> list[dict]:
    """Reach every node once, in parallel (staggered by the link's connect gate)."""
    gate = asyncio.Semaphore(8)

    async def one(node: NodeConfig) -> dict:
        async with gate:
            link = _link(inventory, node, state_dir)
            link.start()
            try:
                ready = await link.wait_ready(timeout)
                if not ready:
                    state = UNREACHABLE if link.state == CONNECTING else link.state
                    return {"node": node.name, "ok": False, "state": state,
                            "problem": link.reason or f"did not answer within {timeout:g}s"}
                facts = await link.ops.inventory(timeout=60)
                return {"node": node.name, "ok": True, "state": READY, "python": link.hello.python if link.hello else None,
                        "gpus": len(facts.gpus), "memory_bytes": facts.memory_bytes, "problem": facts.nvidia_smi_error}
            except NodeError as exc:
                return {"node": node.name, "ok": False, "state": link.state, "problem": str(exc)}
            finally:
                await link.close()

    return list(await asyncio.gather(*(one(n) for n in inventory.nodes)))


def print_reach_table(results: list[dict]) -> None:
    table = Table("node", "state", "python", "GPUs", "memory", "problem")
    for r in results:
        table.add_row(r["node"], r["state"], r.get("python") or "-",
                      str(r["gpus"]) if r.get("gpus") is not None else "-",
                      format_bytes(r.get("memory_bytes")), r.get("problem") or "")
    Console(width=160).print(table)
