"""Style rules the code keeps: no shipped function over 60 lines and no module over 800 (docs/architecture.md, the
brief's rules).

A function's length is its ``def`` line to its last line, docstring included (``ast``'s ``lineno`` to
``end_lineno``); nested functions are counted on their own and as part of the function around them. Modules are
every file of the ``pagedcore/`` tree (tests/repo.py).

There is no allowlist: the last two long functions (``prefix_caching.enable``, ``PrefixTrie.insert``) were split.
"""

from __future__ import annotations

import ast

from repo import source_modules

MAX_LINES = 60
MAX_MODULE_LINES = 800


def function_lengths(source: str) -> dict[str, int]:
    """Lines of every function and method of ``source``, by qualified name (``Class.method``, ``outer.inner``)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def long_functions() -> dict[str, dict[str, int]]:
    """The functions over :data:`MAX_LINES`, by module."""
    found: dict[str, dict[str, int]] = {}
    for module, path in source_modules().items():
        over = {name: n for name, n in function_lengths(path.read_text()).items() if n > MAX_LINES}
        if over:
            found[module] = over
    return found


LONG = long_functions()


def test_the_lengths_are_read():
    lengths = function_lengths("class A:\n    def m(self):\n        x = 1\n        return x\n")
    assert lengths == {"A.m": 3}
    assert function_lengths("def f():\n    def g():\n        pass\n    return g\n") == {"f": 4, "f.g": 2}
    modules = source_modules()
    assert "pagedcore.benchmarks.runner" in modules and len(modules) > 50


def test_no_function_over_the_limit():
    over = {f"{module}.{name} ({n} lines)" for module, names in LONG.items() for name, n in names.items()}
    assert not over, f"functions over {MAX_LINES} lines: {sorted(over)}"


def test_a_long_function_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    assert function_lengths(f"def f():\n{body}") == {"f": MAX_LINES + 1}


def test_no_module_over_the_limit():
    # Issue 27: the Engine's module had grown to 1,123 lines.
    over = {
        f"{module} ({n} lines)"
        for module, path in source_modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {sorted(over)}"
