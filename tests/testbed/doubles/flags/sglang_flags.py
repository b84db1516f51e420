"""Print the command-line flags of SGLang's server, read from its source without running it.

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl && unzip -q /tmp/sgl/sglang-*.whl 'sglang/srt/*' -d /tmp/sgl/x
    python3 sglang_flags.py /tmp/sgl/x > sglang-0.5.23.txt

`ServerArgs.add_cli_args` (sglang/srt/server_args.py) registers one flag per annotated field of
the classes in sglang/srt/arg_groups/fields/ (`A[T, "help"]` or `A[T, Arg(...)]`: `--` + the
field name with `-` for `_`, or Arg's cli_name, plus its aliases; `no_cli=True` fields have
none), then a few by hand with `parser.add_argument("--name", ...)`. Both are read here with
`ast`; nothing of SGLang is imported.
"""

import ast
import sys
from pathlib import Path


def _string_list(node):
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def field_flags(tree):
    flags = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = node.annotation
        if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
                and annotation.value.id in ("A", "Annotated") and isinstance(annotation.slice, ast.Tuple)):
            continue
        meta = annotation.slice.elts[-1]
        name = "--" + node.target.id.replace("_", "-")
        if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
            flags.add(name)
        elif isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
            keywords = {k.arg: k.value for k in meta.keywords}
            if isinstance(keywords.get("no_cli"), ast.Constant) and keywords["no_cli"].value is True:
                continue
            if isinstance(keywords.get("cli_name"), ast.Constant):
                name = keywords["cli_name"].value
            flags.add(name)
            flags.update(_string_list(keywords.get("aliases")))
    return flags


def add_argument_flags(tree):
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("-"))
    return flags


def main(root):
    srt = Path(root) / "sglang" / "srt"
    flags = set()
    for path in sorted((srt / "arg_groups" / "fields").glob("*.py")):
        flags |= field_flags(ast.parse(path.read_text()))
    flags |= add_argument_flags(ast.parse((srt / "server_args.py").read_text()))
    for flag in sorted(flags):
        print(flag)


if __name__ == "__main__":
    main(sys.argv[1])
