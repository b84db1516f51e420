"""The node helper's source as shipped, the file scripts/build-helper makes from remote/helper/: one
file, standard library only, Python 3.8 (R-1.3, R-1.4)."""

import ast
import re
import sys

import pytest

from tests.helper.client import HELPER_PATH

SOURCE = HELPER_PATH.read_text()
TREE = ast.parse(SOURCE)

# Modules in today's standard library that Python 3.8 does not have.
NEWER_THAN_38 = {"zoneinfo", "graphlib", "tomllib", "_tokenize", "wsgiref.types"}

# Attributes and names that appeared after 3.8: the file would parse there and fail at run time.
NEWER_ATTRIBUTES = {
    "removeprefix", "removesuffix", "waitstatus_to_exitcode", "BooleanOptionalAction", "to_thread",
    "randbytes", "bit_count", "file_digest", "pidfd_open", "splice", "cache", "is_relative_to",
    "with_stem", "hardlink_to", "stdlib_module_names", "orig_argv", "TaskGroup",
}
NEWER_KEYWORDS = {"process_group", "cancel_futures", "strict", "encoding_warning"}


def test_parses_as_python_38():
    ast.parse(SOURCE, feature_version=(3, 8))


def test_imports_only_the_standard_library():
    imported = set()
    for node in ast.walk(TREE):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add(node.module)
    assert imported, "the check found the imports"
    for name in imported:
        assert name.split(".")[0] in sys.stdlib_module_names, name
        assert name not in NEWER_THAN_38 and name.split(".")[0] not in NEWER_THAN_38, name
    assert not any(name.split(".")[0] == "llmgw" for name in imported)


def test_no_runtime_annotation_features_newer_than_38():
    # Annotations are evaluated at definition time on 3.8: list[int] and X | Y would fail there.
    for node in ast.walk(TREE):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
            annotations = [a.annotation for a in arguments if a.annotation is not None]
            if node.returns is not None:
                annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        for annotation in annotations:
            for part in ast.walk(annotation):
                assert not isinstance(part, ast.BinOp), "X | Y annotation at line %d" % part.lineno
                if isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name):
                    assert part.value.id not in ("list", "dict", "tuple", "set", "frozenset", "type"), (
                        "builtin generic at line %d" % part.lineno
                    )


def test_no_apis_newer_than_38():
    for node in ast.walk(TREE):
        if isinstance(node, ast.Attribute):
            assert node.attr not in NEWER_ATTRIBUTES, "%s at line %d" % (node.attr, node.lineno)
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                assert keyword.arg not in NEWER_KEYWORDS, "%s= at line %d" % (keyword.arg, node.lineno)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            for side in (node.left, node.right):
                assert not isinstance(side, ast.Dict), "dict | dict at line %d" % node.lineno


@pytest.mark.parametrize(
    "snippet",
    [
        pytest.param("match x:\n    case 1:\n        pass\n", id="match"),
        pytest.param("with (open('a') as a, open('b') as b):\n    pass\n", id="parenthesised-with"),
    ],
)
def test_the_syntax_check_would_catch_newer_syntax(snippet):
    with pytest.raises(SyntaxError):
        ast.parse(snippet, feature_version=(3, 8))


def test_no_expected_hash_constant_in_the_file():
    # A file checking itself against its own text proves nothing.
    assert not re.search(r"\b[0-9a-f]{64}\b", SOURCE)


def test_exit_codes_are_documented_constants():
    assert re.search(r"^EXIT_INTEGRITY = 97$", SOURCE, re.M)
    assert re.search(r"^EXIT_PERMISSIONS = 98$", SOURCE, re.M)
    docstring = ast.get_docstring(TREE)
    for word in ("EXIT_INTEGRITY", "EXIT_PERMISSIONS", '"hello"', '"event"', '"ok"', "unknown_op", "bad_args"):
        assert word in docstring, word


# Each part of the protocol is its own class holding its own state; Node makes them and joins
# their operations in one explicit table.
PARTS = {
    "RootDir": {"fleet_secret"},
    "Inventory": {"inventory"},
    "Storage": {"storage", "holdings"},
    "Fetches": {"fetch", "source_size"},
    "Venvs": set(),  # the environments provision builds, envs lists, launch runs from, reclaim removes
    "Containers": set(),  # the container side of provision, launch, status and stop
    "Engines": {"provision", "envs", "launch", "status", "stop", "forget", "logs"},
    "Reclaim": {"reclaim"},
    "Node": {"ping", "cancel"},
}


def test_each_part_of_the_protocol_is_its_own_class():
    classes = {node.name: node for node in TREE.body if isinstance(node, ast.ClassDef)}
    defined = {}
    for name in PARTS:
        operations = {item.name[3:] for item in classes[name].body
                      if isinstance(item, ast.FunctionDef) and item.name.startswith("op_")}
        defined[name] = operations
    assert defined == PARTS
    node = classes["Node"]
    assert [base.id for base in node.bases] == ["object"], "Node holds its parts, it does not inherit them"
    (init,) = [item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"]
    (table,) = [item.value for item in ast.walk(init) if isinstance(item, ast.Assign)
                and isinstance(item.targets[0], ast.Attribute) and item.targets[0].attr == "operations"]
    listed = {ast.literal_eval(key): value.attr for key, value in zip(table.keys, table.values)}
    assert set(listed) == set().union(*PARTS.values())
    assert all(value == "op_" + key for key, value in listed.items()), "each name maps to its op_ method"
    computed = [item.lineno for item in ast.walk(TREE) if isinstance(item, ast.Call) and isinstance(item.func, ast.Name)
                and item.func.id == "getattr" and not isinstance(item.args[1], ast.Constant)]
    assert not computed, "getattr of a computed name at lines %s: an operation is found in the table" % computed
    assert TREE.body[0].lineno == 2 and ast.get_docstring(TREE).startswith("llmgw node helper"), "the protocol stays on top"
