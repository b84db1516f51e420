"""scripts/test checks the code with ruff before pytest, and a ruff finding fails the run.

The script runs as written, in a copy of the repository's layout whose venv python, engine
builder and `id` are stubs that record how they were called.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PYTHON_STUB = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in
    "-m ruff"*) exit "${RUFF_EXIT:-0}" ;;
    "-m pytest"*) exit "${PYTEST_EXIT:-0}" ;;
esac
exit 0
"""


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "test", tmp_path / "scripts" / "test")
    stubs = {
        ".venv/bin/python": PYTHON_STUB,
        "scripts/engines": "#!/bin/sh\necho engines >> \"$CALLS\"\n",
        "bin/id": "#!/bin/sh\necho 1000\n",  # not root: the script installs nothing through apt
    }
    for name, text in stubs.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    return tmp_path


def run(tree, **env):
    calls = tree / "calls.log"
    environ = dict(os.environ, CALLS=str(calls), PATH=f"{tree / 'bin'}:{os.environ['PATH']}", **env)
    environ.pop("CI", None)
    result = subprocess.run(["bash", str(tree / "scripts" / "test"), "-k", "x"], env=environ,
                            capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    print(result.returncode, lines, result.stderr[-300:])
    return result, lines


def test_ruff_runs_after_the_install_and_before_pytest(tree):
    result, lines = run(tree)
    assert result.returncode == 0
    steps = [line.split()[1] if line.startswith("-m ") else line for line in lines]
    assert steps == ["pip", "ruff", "engines", "compileall", "pytest"]
    assert "-m ruff check ." in lines
    assert "-m compileall -q -j 0 llmgw tests" in lines  # once, for the many llmgw processes the tests start
    # The suite runs on pytest-xdist workers, each file on one; the caller's arguments come last.
    assert "-m pytest -n 3 --dist loadfile --durations=30 -k x" in lines


def test_a_ruff_finding_fails_the_run_and_no_test_starts(tree):
    result, lines = run(tree, RUFF_EXIT="1")
    assert result.returncode != 0
    assert "ruff check found problems" in result.stderr
    assert not [line for line in lines if "pytest" in line]


def test_ruff_is_in_the_test_extras_with_a_bounded_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    (ruff,) = [req for req in project["project"]["optional-dependencies"]["test"] if re.match(r"ruff\b", req)]
    assert re.fullmatch(r"ruff>=[\d.]+,<[\d.]+", ruff)
    assert {"E", "F", "W"} <= set(project["tool"]["ruff"]["lint"]["select"])
