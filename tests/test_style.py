"""Style rules the code keeps: no shipped function over 60 lines (docs/architecture.md, the brief's rules).

A function's length is its ``def`` line to its last line, docstring included (``ast``'s ``lineno`` to
``end_lineno``); nested functions are counted on their own and as part of the function around them. Modules are
every file of the ``pagedcore/`` tree (tests/repo.py).

:data:`LONG_FUNCTIONS` names the functions still over the limit, outside ``pagedcore/benchmarks/`` (which has none):
they are being shrunk. A function leaves the list when it is shrunk (the second test fails until it does); none
joins it.
"""

from __future__ import annotations

import ast

import pytest
from repo import source_modules

MAX_LINES = 60

# module -> qualified names of the functions over MAX_LINES today; to be emptied.
LONG_FUNCTIONS: dict[str, frozenset[str]] = {
    "pagedcore.adapters.transformers.attention": frozenset({"paged_attention_forward"}),
    "pagedcore.adapters.transformers.prefix_caching": frozenset({"enable"}),
    "pagedcore.prefix_trie": frozenset({"PrefixTrie.insert"}),
}


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
    new = {
        f"{module}.{name} ({n} lines)"
        for module, over in LONG.items()
        for name, n in over.items()
        if name not in LONG_FUNCTIONS.get(module, frozenset())
    }
    assert not new, f"functions over {MAX_LINES} lines: {sorted(new)}"


@pytest.mark.parametrize(
    "qualname", sorted(f"{module}:{name}" for module, names in LONG_FUNCTIONS.items() for name in names)
)
def test_every_allowed_long_function_is_still_long(qualname):
    """An allowed function that is now short leaves :data:`LONG_FUNCTIONS`, so the list only shrinks."""
    module, name = qualname.split(":")
    assert name in LONG.get(module, {}), f"{qualname} is {MAX_LINES} lines or fewer now: remove it from LONG_FUNCTIONS"


def test_benchmarks_have_no_long_function():
    assert not any(module.startswith("pagedcore.benchmarks") for module in LONG_FUNCTIONS)
    assert not any(module.startswith("pagedcore.benchmarks") for module in LONG)
