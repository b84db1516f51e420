"""Bounds on the shape of the code, read from the source (ast), so that a class does not grow back
into holding everything: the reconciler keeps the pass, the router its listener, the rest lives with the
parts that own it.

How things are counted:
- a class's attributes: the distinct names X assigned as `self.X` (plain, annotated, augmented,
  or inside a tuple target) anywhere in the class, its methods included;
- a class's methods: the functions defined directly in its body (`def` and `async def`, with
  properties, static and class methods; functions nested inside them are not counted);
- a module's imports: every `import` and `from … import` anywhere in it, those under
  `if TYPE_CHECKING:` included, followed through the llmgw modules it imports;
- a function's parameters: all of them but a method's `self` or `cls`, keyword-only ones,
  `*args` and `**kwargs` included (nested functions and lambdas are functions too);
- a module's lines: its lines of text, docstring and comments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw"

RECONCILER_ATTRIBUTES = 15
RECONCILER_METHODS = 15
RECONCILER_LINES = 260
PARAMETERS = 7  # at most, for every function of the control plane and of llmgw.keys


def _class(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse((PACKAGE / module).read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _attributes(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def _methods(cls: ast.ClassDef) -> list[str]:
    return [node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _imports(module: str) -> set[str]:
    """The llmgw modules `module` imports, under TYPE_CHECKING too (a name imported from a module counts as the module)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(".py").exists())
    return {name for name in found if name.startswith("llmgw.")}


def _reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_imports(name) - seen)
    return seen - {module}


def test_the_counts_see_the_code():
    cls = _class("control/reconciler.py", "Reconciler")
    assert {"memory", "nodes", "placing"} <= _attributes(cls) and "step" in _methods(cls)
    assert "llmgw.control.state" in _reachable("llmgw.control.publish")


def test_the_reconciler_keeps_the_pass_and_little_else():
    cls = _class("control/reconciler.py", "Reconciler")
    attributes, methods = _attributes(cls), _methods(cls)
    print(f"Reconciler: {len(attributes)} attributes, {len(methods)} methods")
    assert len(attributes) <= RECONCILER_ATTRIBUTES, sorted(attributes)
    assert len(methods) <= RECONCILER_METHODS, methods


def test_publish_imports_nothing_of_the_reconciler():
    # Not even for a type: a publication is made of what it is given (publish.Sources).
    assert "llmgw.control.reconciler" not in _reachable("llmgw.control.publish")


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    count = len(names) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - 1 if names and names[0] in ("self", "cls") else count


def _functions(path: Path) -> list[tuple[str, int]]:
    """(name:line, parameters) of every function in the module."""
    return [(f"{node.name if not isinstance(node, ast.Lambda) else 'lambda'}:{node.lineno}", _parameters(node))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def test_the_parameter_count_sees_the_code():
    counts = dict(_functions(PACKAGE / "control" / "placement.py"))
    place = next(count for name, count in counts.items() if name.startswith("place:"))
    assert place == 4  # model, nodes, allocated, *, avoid
    assert _parameters(ast.parse("def f(self, a, /, b, *c, d, **e): pass").body[0]) == 5


def test_no_function_of_the_control_plane_or_the_keys_takes_more_than_seven_parameters():
    # More go together as one value (PlanInputs, observe.Patience, placement._Ask, CacheUse, KeySettings).
    paths = [*sorted((PACKAGE / "control").glob("*.py")), PACKAGE / "keys.py"]
    wide = [f"{path.relative_to(PACKAGE.parent)} {name}: {count}" for path in paths
            for name, count in _functions(path) if count > PARAMETERS]
    assert not wide, wide


def test_the_reconciler_module_keeps_the_pass_short():
    lines = len((PACKAGE / "control" / "reconciler.py").read_text().splitlines())
    print(f"control/reconciler.py: {lines} lines")
    assert lines <= RECONCILER_LINES


# -- the router --------------------------------------------------------------------------------------

ROUTER_METHODS = 20
MANY_PARAMETERS = 8  # a function taking this many is carrying a value in pieces
# The four: typer commands, whose options are their parameters (`llmgw router`, `keys create`,
# `keys set`, `ctl requests` with its four filters, count, follow and --json).
FUNCTIONS_WITH_MANY_PARAMETERS = 4
REQUEST_MODULES = ("router/app.py", "router/intake.py", "router/dispatch.py", "router/exchange.py",
                   "router/feedstate.py")
REQUEST_PARAMETERS = 5  # a request travels as one Exchange: no step of it needs more than this


def _functions_in(paths) -> list[tuple[str, int, str, int]]:
    """(module, line, name, parameters) of every function in `paths`, nested ones and methods included."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((str(path.relative_to(PACKAGE)), node.lineno, node.name, _parameters(node)))
    return found


def test_the_router_keeps_the_listener_and_little_else():
    methods = _methods(_class("router/app.py", "Router"))
    print(f"Router: {len(methods)} methods")
    assert len(methods) <= ROUTER_METHODS, methods


def test_few_functions_take_a_value_in_pieces():
    many = [f for f in _functions_in(sorted(PACKAGE.rglob("*.py"))) if f[3] >= MANY_PARAMETERS]
    for module, line, name, count in many:
        print(f"{module}:{line} {name}: {count} parameters")
    assert not [f for f in many if f[0] == "router/app.py"], many
    assert len(many) <= FUNCTIONS_WITH_MANY_PARAMETERS, many


def test_a_request_travels_as_one_value():
    over = [f for f in _functions_in(PACKAGE / module for module in REQUEST_MODULES) if f[3] > REQUEST_PARAMETERS]
    assert not over, over


def test_the_admission_is_a_value_not_a_context_variable():
    # A limited key's admission travels in its request's Exchange; a context variable would be
    # state nobody passes (and copied into every task the request starts).
    for path in sorted((PACKAGE / "router").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert "contextvars" not in {alias.name for alias in node.names}, path
            elif isinstance(node, ast.ImportFrom):
                assert node.module != "contextvars", path
            elif isinstance(node, (ast.Name, ast.Attribute)):
                assert (node.id if isinstance(node, ast.Name) else node.attr) != "ContextVar", path
