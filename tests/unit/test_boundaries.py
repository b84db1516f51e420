"""The import graph between llmgw's parts, read from the source (ast), so a crossing cannot creep in.

The control plane and the router meet only in `llmgw.contracts` (the router feed, endpoints,
backoff, views), which imports neither, and the router imports nothing else of llmgw (R-10.6);
the admin renders published views and calls the control plane's service, never the reconciler,
placement or the fleet; `llmgw ctl` speaks to the admin API only. Imports inside
functions count; imports under `if TYPE_CHECKING:` do not (they are never executed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw"

# What the admin may import of the control plane, the fleet and the router when it runs: nothing.
# It is given the control plane's service (AdminDependencies) and reads what both sides share
# (the service's refusals, the state names, the usage hour) from the contracts.
ADMIN_MAY_IMPORT: set[str] = set()
# `llmgw serve`'s wiring, its state directory and the router process it spawns or adopts.
SERVE = ("llmgw.server", "llmgw.state_dir", "llmgw.router_process")
# The parts, and the base modules every part may use: they import none of the parts.
PARTS = ("llmgw.control", "llmgw.fleet", "llmgw.router", "llmgw.admin", "llmgw.cli", "llmgw.localfeed", *SERVE)
BASE = ("llmgw.aio", "llmgw.catalog", "llmgw.config", "llmgw.engines", "llmgw.keys", "llmgw.requestlog",
        "llmgw.routers", "llmgw.revisions", "llmgw.runtimes", "llmgw.store", "llmgw.units", "llmgw.weights")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether `name` (llmgw.x.y) is a module or package of llmgw, not a name inside one."""
    if not name.startswith("llmgw."):
        return False
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str) -> set[str]:
    """Every llmgw module a module imports when it runs (`from llmgw.x import y` counts y too)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
            found.update(names)
            # `from package import module` runs the package's __init__ too, which matters for cycles
            # only through what that __init__ imports: count the package when a name is not a module.
            if not all(_is_module(name) for name in names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "llmgw" or name.startswith("llmgw.")}


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "remote" in path.relative_to(PACKAGE).parts:
            continue  # package data run on nodes (stdlib only), not modules of llmgw
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph[module] = _imports(ast.parse(path.read_text(), str(path)), package)
    return graph


GRAPH = _graph()


def _inside(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _crossings(source: str, *targets: str) -> dict[str, list[str]]:
    crossings = {}
    for module, imported in GRAPH.items():
        if _inside(module, source):
            bad = sorted(name for name in imported if _inside(name, *targets))
            if bad:
                crossings[module] = bad
    return crossings


def test_the_graph_is_read():
    assert "llmgw.control.reconciler" in GRAPH and "llmgw.router.app" in GRAPH
    assert "llmgw.control.plan" in GRAPH["llmgw.control.reconciler"]  # the parser sees imports


def test_control_imports_nothing_from_the_router():
    assert _crossings("llmgw.control", "llmgw.router") == {}


def test_router_imports_nothing_from_control_fleet_or_admin():
    assert _crossings("llmgw.router", "llmgw.control", "llmgw.fleet", "llmgw.admin", *SERVE) == {}


def test_r10_6_router_imports_only_the_router_and_the_contracts():
    # The router feed is its only tie to the control plane: no catalog, configuration, engines or store.
    outside = {f"{module} -> {name}" for module, imported in GRAPH.items() if _inside(module, "llmgw.router")
               for name in imported if not _inside(name, "llmgw.router", "llmgw.contracts")}
    assert outside == set()


@pytest.mark.parametrize("target", ["llmgw.control", "llmgw.fleet", "llmgw.router", "llmgw.admin", "llmgw.cli",
                                    *SERVE])
def test_contracts_import_neither_side(target):
    assert _crossings("llmgw.contracts", target) == {}


def test_admin_reads_views_and_calls_the_service_only():
    imported = {name for module, names in GRAPH.items() if _inside(module, "llmgw.admin") for name in names
                if _inside(name, "llmgw.control", "llmgw.fleet", "llmgw.router") and name in GRAPH}
    assert imported <= ADMIN_MAY_IMPORT, sorted(imported - ADMIN_MAY_IMPORT)


def test_ctl_speaks_to_the_admin_api_only():
    assert _crossings("llmgw.cli.ctl", "llmgw.control", "llmgw.fleet", "llmgw.router", *SERVE) == {}


def test_ctl_holds_commands_and_the_renderers_live_in_the_admin():
    path = PACKAGE / "cli" / "ctl.py"
    tree = ast.parse(path.read_text())
    functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert not {name for name in functions if name.startswith("render_")}
    assert "rich.table" not in GRAPH["llmgw.cli.ctl"] and not any(
        isinstance(node, ast.ImportFrom) and node.module == "rich.table" for node in ast.walk(tree))
    assert "llmgw.admin.render" in GRAPH["llmgw.cli.ctl"]


def test_fleet_imports_nothing_of_the_control_plane_the_router_the_admin_or_the_cli():
    # The fleet is the nodes' side: links, sessions, the helper's protocol; the control plane drives it.
    assert _crossings("llmgw.fleet", *[part for part in PARTS if part != "llmgw.fleet"]) == {}


def test_base_modules_import_none_of_the_parts():
    assert set(BASE) <= set(GRAPH), sorted(set(BASE) - set(GRAPH))
    top_level = {module for module in GRAPH if module.count(".") == 1}
    assert top_level <= {*BASE, *PARTS, "llmgw.contracts", "llmgw.remote"}, "a new top-level module: a base or a part?"
    assert {module: sorted(name for name in GRAPH[module] if _inside(name, *PARTS)) for module in BASE} == \
        {module: [] for module in BASE}


def _cycles() -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    edges = {module: sorted(name for name in imported if name in GRAPH and name != module)
             for module, imported in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert _cycles() == []
