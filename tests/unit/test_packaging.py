"""What the wheel ships: every llmgw package, and the node-side files of remote/ as the package
llmgw.remote, read through importlib.resources as the control plane reads them (R-1.3)."""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import tomllib
from pathlib import Path

from llmgw.engines import VLLM_GUARD_FILE, vllm_guard
from llmgw.fleet.link import helper_code

REPO = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_in_the_tree_is_listed():
    # The list is explicit (a search of llmgw/ cannot find remote/): a package missing from it
    # would be missing from the wheel while the editable install still imports it.
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "llmgw").rglob("__init__.py")}
    on_disk.add("llmgw.remote")
    assert set(SETUPTOOLS["packages"]) == on_disk


def test_remote_is_mapped_to_the_package_with_its_two_files():
    assert SETUPTOOLS["package-dir"] == {"llmgw.remote": "remote"}
    assert sorted(SETUPTOOLS["package-data"]["llmgw.remote"]) == ["llmgw_helper.py", "llmgw_vllm_guard.py"]
    shipped = importlib.resources.files("llmgw.remote")
    for name in ("llmgw_helper.py", "llmgw_vllm_guard.py"):
        assert shipped.joinpath(name).read_bytes() == (REPO / "remote" / name).read_bytes(), name
    assert not (REPO / "llmgw" / "remote").exists()


def test_the_control_plane_sends_the_shipped_bytes_and_their_hash():
    helper = importlib.resources.files("llmgw.remote").joinpath("llmgw_helper.py").read_bytes()
    assert helper_code().text == helper
    assert helper_code().sha256 == hashlib.sha256(helper).hexdigest()
    guard = importlib.resources.files("llmgw.remote").joinpath(VLLM_GUARD_FILE).read_bytes()
    assert vllm_guard().text.encode("utf-8") == guard
    assert vllm_guard().sha256 == hashlib.sha256(guard).hexdigest()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_node_files_are_data_never_imported():
    # The package itself runs nothing, and no control-plane module imports a node file: the
    # helper's code runs on a node only, from the bytes the loader hashed.
    init = REPO / "remote" / "__init__.py"
    tree = ast.parse(init.read_text())
    assert [type(statement) for statement in tree.body] == [ast.Expr], "only a docstring"
    for path in sorted((REPO / "llmgw").rglob("*.py")):
        imported = _imports(path)
        assert not {name for name in imported if name.startswith("llmgw.remote.")}, path
        assert not {name for name in imported if "llmgw_helper" in name or "llmgw_vllm_guard" in name}, path
