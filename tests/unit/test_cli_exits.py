"""`llmgw` commands end on an error in one way (llmgw/cli/exits.py): its exit codes, its printing."""

from __future__ import annotations

import ast
from pathlib import Path

from llmgw.cli.exits import ExitCode

CLI = Path(__file__).resolve().parents[2] / "llmgw" / "cli"


def _exits(tree: ast.AST) -> list[str]:
    """The arguments of every typer.Exit(...) call, as source."""
    return [ast.unparse(node.args[0]) if node.args else "" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("typer.Exit", "Exit")]


def test_only_exits_py_ends_a_command_with_an_exit_code_of_its_choosing():
    found = {path.name: _exits(ast.parse(path.read_text())) for path in sorted(CLI.glob("*.py"))
             if path.name != "exits.py"}
    # `llmgw router` ends with its supervisor's own status, whatever it is.
    assert {name: calls for name, calls in found.items() if calls} == {"router.py": ["code"]}


def test_no_command_defines_exit_codes_of_its_own():
    for path in CLI.glob("*.py"):
        if path.name != "exits.py":
            assert "EXIT_" not in path.read_text(), path.name


def test_the_exit_codes():
    assert {code.name: int(code) for code in ExitCode} == {"FAILED": 1, "BAD_CONFIG": 2}
