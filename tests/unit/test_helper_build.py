"""The node helper is developed as modules in remote/helper/ and shipped as the one file
scripts/build-helper concatenates from them (R-1.3): the committed file is the build's output,
byte for byte. test_helper_source.py checks that file (standard library only, Python 3.8)."""

import ast
import runpy
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = runpy.run_path(str(REPO / "scripts" / "build-helper"), run_name="build_helper")
SOURCES = REPO / "remote" / "helper"


def test_the_shipped_helper_is_the_build_of_its_modules():
    built = BUILD["build"]()
    assert built == (REPO / "remote" / "llmgw_helper.py").read_bytes(), (
        "remote/llmgw_helper.py is not the build of remote/helper/: edit the modules, then run ./scripts/build-helper"
    )


def test_the_build_depends_only_on_the_modules(tmp_path):
    copy = tmp_path / "helper"
    shutil.copytree(SOURCES, copy)
    assert BUILD["build"](copy) == BUILD["build"]()


def test_the_helper_is_developed_as_modules_beside_the_shipped_files():
    modules = sorted(path.name for path in SOURCES.glob("*.py"))
    assert len(modules) >= 4, modules
    shipped = sorted(path.name for path in (REPO / "remote").glob("*.py"))
    assert shipped == ["__init__.py", "llmgw_helper.py", "llmgw_vllm_guard.py"]


def test_each_module_begins_where_the_built_file_names_it():
    text = (REPO / "remote" / "llmgw_helper.py").read_text()
    named = [line.split()[2] for line in text.splitlines() if line.startswith("# ---- remote/helper/")]
    assert named == ["remote/helper/%s.py" % name for name in BUILD["MODULES"][1:]]
    assert ast.get_docstring(ast.parse(text)).startswith("llmgw node helper"), "the protocol stays on top"


def _sources(tmp_path, **changes):
    copy = tmp_path / "helper"
    shutil.copytree(SOURCES, copy)
    for name, text in changes.items():
        (copy / (name + ".py")).write_text(text)
    return copy


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        pytest.param({"storage": "import json\n"}, "only protocol.py imports", id="module-level-import"),
        pytest.param({"storage": "def f():\n    from fetch import FetchJob\n"}, "imports a module of the helper",
                     id="import-of-a-module"),
        pytest.param({"extra": "X = 1\n"}, "not listed ['extra']", id="unlisted-module"),
        pytest.param({"storage": "X = 1\n\n"}, "no blank line at either end", id="trailing-blank-line"),
    ],
)
def test_the_build_refuses_what_concatenation_would_break(tmp_path, changes, says):
    with pytest.raises(BUILD["BuildError"]) as caught:
        BUILD["build"](_sources(tmp_path, **changes))
    assert says in str(caught.value)


def test_the_build_refuses_a_missing_module(tmp_path):
    copy = _sources(tmp_path)
    (copy / "reclaim.py").unlink()
    with pytest.raises(BUILD["BuildError"]) as caught:
        BUILD["build"](copy)
    assert "missing ['reclaim']" in str(caught.value)
