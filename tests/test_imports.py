"""Import structure: no module takes part in an import cycle, not even through a lazy or type-checking import; each
layer imports only the layers above it; the core imports neither the adapters nor torch, transformers or xformers
when it is imported; the engine imports neither transformers nor an adapter nor a front end.

Modules are every file of the ``pagedcore/`` tree, named by their path, which is the name they install under
(``tests/repo.py``; tests/test_packaging.py checks that it matches the wheel). Imports are read with ``ast``: a
module's top level, class bodies and ``if``/``try`` blocks are its import-time imports; function bodies (lazy
imports) and ``if TYPE_CHECKING:`` blocks are read too where a rule says so (the cycle rule reads everything). The
layers (docs/architecture.md): the core is the top-level modules of ``pagedcore/`` less :data:`TENSOR_SIDE` and the
entry script; the engine (``pagedcore.engine``) below it; the adapters and plugins below the engine; the front ends
(:data:`FRONT_ENDS`) at the bottom. Nothing but a front end imports a front end, lazily or not: that rule reads
function bodies too. The core and the engine are also imported for real, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo import ROOT, source_modules

FRONT_ENDS = ("pagedcore.cli", "pagedcore.serve", "pagedcore.benchmarks")
FORBIDDEN_IN_CORE = (
    "torch",
    "transformers",
    "xformers",
    "pagedcore.engine",
    "pagedcore.adapters",
    "pagedcore.plugins",
    *FRONT_ENDS,
)
ENGINE = "pagedcore.engine"
FORBIDDEN_IN_ENGINE = ("transformers", "xformers", "pagedcore.adapters", "pagedcore.plugins", *FRONT_ENDS)
# pagedcore.attention holds the tensor-side interface (PagedAttentionMetadata builds torch tensors): it imports torch
# by design and is reached only from the adapters and plugins, or under TYPE_CHECKING.
TENSOR_SIDE = frozenset({"pagedcore.attention"})
# Importing it runs the command line (python -m pagedcore): checked statically only.
ENTRY_SCRIPTS = frozenset({"pagedcore.__main__"})


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def discover() -> dict[str, Module]:
    return {name: Module(name, path, path.name == "__init__.py") for name, path in source_modules().items()}


MODULES = discover()
SUBPACKAGES = ("pagedcore.engine", "pagedcore.adapters", "pagedcore.plugins", *FRONT_ENDS)
CORE = sorted(
    name
    for name in MODULES
    if not name.startswith(tuple(p + "." for p in SUBPACKAGES))
    and name not in SUBPACKAGES
    and name not in TENSOR_SIDE
    and name not in ENTRY_SCRIPTS
)


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(module: Module, *, lazy: bool = False, type_checking: bool = False) -> list[str]:
    """Absolute names of what ``module`` imports when it is imported (``from X import n`` -> ``X.n`` if a module);
    with ``lazy``, also what its functions import when they run; with ``type_checking``, also what its
    ``if TYPE_CHECKING:`` blocks import (the type checker's graph)."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    found: list[str] = []

    def visit(nodes: list[ast.stmt] | list[ast.excepthandler]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not lazy:
                continue  # runs later, if ever
            if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    found.append(name if name in MODULES else base)
            for field in ("body", "orelse", "finalbody", "handlers"):  # class bodies, if/try/with blocks
                children = getattr(node, field, None)
                if isinstance(children, list) and all(isinstance(c, ast.stmt | ast.excepthandler) for c in children):
                    visit(children)

    visit(tree.body)
    return found


def internal(name: str) -> str | None:
    """The project module an import resolves to (the deepest one that exists), or None for a third-party one."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def packages_run(importer: str, target: str) -> list[str]:
    """``target`` and the packages whose ``__init__`` importing it runs first (Python imports a module's parent
    packages before it), less the importer's own packages (already being imported)."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [p for p in chain if p in MODULES and p != importer and not importer.startswith(p + ".")]


GRAPH: dict[str, list[str]] = {
    name: sorted(
        {
            run
            for imp in import_time_imports(module)
            if (target := internal(imp)) and target != name
            for run in packages_run(name, target)
        }
    )
    for name, module in MODULES.items()
}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_discovery_sees_every_kind_of_module():
    assert {"pagedcore", "pagedcore.block_manager"} <= set(CORE)
    assert not {"pagedcore.cli", "pagedcore.serve.app", "pagedcore.adapters.transformers.cache"} & set(CORE)
    assert {"pagedcore.adapters.transformers.cache", "pagedcore.plugins.torch_backend"} <= set(MODULES)
    assert GRAPH["pagedcore.kv_pool"] == ["pagedcore.attention_kinds", "pagedcore.block_keys",
                                          "pagedcore.block_manager", "pagedcore.capacity",
                                          "pagedcore.errors", "pagedcore.eviction", "pagedcore.namespace_scopes",
                                          "pagedcore.prefix_trie", "pagedcore.state_slots",
                                          "pagedcore.table_rows", "pagedcore.validation"]  # fmt: skip
    assert "pagedcore.kv_pool" not in GRAPH["pagedcore.capacity"]  # only under TYPE_CHECKING
    assert "pagedcore.attention" not in GRAPH["pagedcore.hookspecs"]  # only under TYPE_CHECKING
    assert "pagedcore.adapters.transformers" not in GRAPH["pagedcore.cli"]  # only inside functions
    lazy = import_time_imports(MODULES["pagedcore.cli"], lazy=True)
    assert "pagedcore.adapters.transformers" in {internal(name) for name in lazy}


def test_finding_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def whole_graph() -> dict[str, list[str]]:
    """Every module's imports, import-time, lazy and type-checking alike, resolved through the modules' paths."""
    return {
        name: sorted(
            {
                target
                for imp in import_time_imports(module, lazy=True, type_checking=True)
                if (target := internal(imp)) and target != name
            }
        )
        for name, module in MODULES.items()
    }


def test_no_import_cycle_even_through_lazy_or_type_checking_imports():
    # Issue 27: kv_io <-> pool, sampling <-> logits_processors, capacity <-> kv_pool <-> kv_tiers, serve.cli <->
    # serve.ray.command and benchmarks' options -> registry -> context -> options were cycles of this graph.
    graph = whole_graph()
    assert "pagedcore.kv_tiers" in graph["pagedcore.kv_pool"] or "pagedcore.kv_pool" in graph["pagedcore.kv_tiers"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_engine_imports_no_framework_adapter_or_front_end_even_lazily():
    engine = [name for name in MODULES if name == ENGINE or name.startswith(ENGINE + ".")]
    assert {"pagedcore.engine.engine", "pagedcore.engine.runner", "pagedcore.engine.structured.compiler"} <= set(engine)
    for name in engine:
        imports = import_time_imports(MODULES[name], lazy=True, type_checking=True)
        bad = sorted({imp for imp in imports if _in(imp, FORBIDDEN_IN_ENGINE)})
        assert not bad, f"{name} imports {bad}"


def test_the_engine_imports_for_real_without_transformers_or_front_ends():
    engine = sorted(name for name in MODULES if name == ENGINE or name.startswith(ENGINE + "."))
    code = (
        f"import sys\nfor name in {engine!r}:\n    __import__(name)\n"
        f"bad = {{f for f in {FORBIDDEN_IN_ENGINE!r} for m in sys.modules if m == f or m.startswith(f + '.')}}\n"
        "print(sorted(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_core_reaches_no_adapter_plugin_or_tensor_module_when_imported():
    for start in CORE:
        seen, stack, parents = {start}, [start], {start: ""}
        while stack:
            node = stack.pop()
            for imp in import_time_imports(MODULES[node]):
                bad = next((f for f in FORBIDDEN_IN_CORE if imp == f or imp.startswith(f + ".")), None)
                target = internal(imp)
                if bad or target in TENSOR_SIDE:
                    chain = [node]
                    while parents[chain[-1]]:
                        chain.append(parents[chain[-1]])
                    pytest.fail(f"{' <- '.join(chain)} imports {imp} when imported")
                if target and target not in seen:
                    seen.add(target)
                    parents[target] = node
                    stack.append(target)


@pytest.mark.parametrize("module", CORE)
def test_each_core_module_imports_alone_without_torch_or_the_adapters(module):
    forbidden = (*FORBIDDEN_IN_CORE, *sorted(TENSOR_SIDE))
    code = (
        f"import sys, {module}\n"
        f"bad = {{f for f in {forbidden!r} for m in sys.modules if m == f or m.startswith(f + '.')}}\n"
        "print(sorted(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_only_front_ends_import_front_ends_even_lazily():
    for name, module in MODULES.items():
        if _in(name, FRONT_ENDS) or name in ENTRY_SCRIPTS:
            continue
        bad = sorted({imp for imp in import_time_imports(module, lazy=True) if _in(imp, FRONT_ENDS)})
        assert not bad, f"{name} imports the front end(s) {bad}"


def test_adapters_and_plugins_import_no_front_end_and_plugins_no_adapter():
    for name, module in MODULES.items():
        imports = import_time_imports(module, lazy=True)
        if _in(name, ("pagedcore.plugins",)):
            assert not [i for i in imports if _in(i, ("pagedcore.adapters",))], name


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "pagedcore", "--version"],
        [sys.executable, "-c", "import pagedcore.adapters.transformers, pagedcore.serve, pagedcore.benchmarks"],
        [sys.executable, "-c", "import pagedcore.plugins.xformers.status, pagedcore.cli.common"],
    ],
    ids=["python-m-pagedcore", "import-adapters-serve-benchmarks", "import-plugins"],
)
def test_the_source_root_imports_as_installed(command):
    # Run from the root with no PYTHONPATH: the root's pagedcore/ folder comes first on sys.path and must be the whole
    # package (it shadowed the installed one and lacked its subpackages when they lived beside it).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_old_import_paths_of_the_moved_modules_keep_working():
    """The Engine's modules moved from pagedcore.adapters.transformers to pagedcore.engine (issue 27): users' imports
    of the old paths name the same objects."""
    import importlib

    import pagedcore.engine as engine
    from pagedcore.adapters import transformers as adapter

    assert adapter.SamplingParams is engine.SamplingParams and adapter.RequestOutput is engine.RequestOutput
    assert issubclass(adapter.Engine, engine.Engine)
    for old, new in [
        ("sampling", "pagedcore.engine.sampling"),
        ("outputs", "pagedcore.engine.outputs"),
        ("stopping", "pagedcore.engine.stopping"),
        ("detokenizer", "pagedcore.engine.detokenizer"),
        ("logits_processors", "pagedcore.engine.logits_processors"),
        ("structured.spec", "pagedcore.engine.structured.spec"),
        ("engine", "pagedcore.adapters.transformers.model_engine"),
    ]:
        assert importlib.import_module(f"pagedcore.adapters.transformers.{old}") is importlib.import_module(new), old
    from pagedcore.adapters.transformers.engine import Engine
    from pagedcore.adapters.transformers.structured import GrammarCompiler, StructuredLogitsProcessor

    assert Engine is adapter.Engine and GrammarCompiler.__module__ == "pagedcore.engine.structured.compiler"
    assert StructuredLogitsProcessor.__module__ == "pagedcore.adapters.transformers.structured.processor"
