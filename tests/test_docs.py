"""Documentation: every public module's docstring examples run, and every public API item has a docstring with a
runnable example."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import pagedcore
import pagedcore.adapters
import pagedcore.benchmarks
import pagedcore.plugins
import pagedcore.serve

pytest.importorskip("fastapi")  # public_items() imports every module, the server's too: the suite runs without them
pytest.importorskip("uvicorn")


def public_modules() -> list[str]:
    names = ["pagedcore", "pagedcore.benchmarks", "pagedcore.serve"]
    for package in (pagedcore, pagedcore.adapters, pagedcore.plugins, pagedcore.benchmarks, pagedcore.serve):
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            names.append(info.name)
    return sorted(set(names))


MODULES = public_modules()


@pytest.mark.parametrize("name", MODULES)
def test_doctests_pass(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"


@pytest.mark.parametrize("name", ["pagedcore.adapters.transformers", "pagedcore.adapters.transformers.testing"])
def test_the_tiny_models_examples_pass_whatever_the_global_random_state(name):
    """The examples that generate with a tiny model of random weights and show the output's length: a greedy eos among
    the new tokens would stop it short. Without their own seed they passed or failed by the random state earlier
    tests left (2 full runs of the docs tests in 15 failed; seeds 16 and 11 failed them here)."""
    import torch

    module = importlib.import_module(name)
    failed = []
    for seed in range(40):
        torch.manual_seed(seed)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=False)
        failed += [seed] if result.failed else []
    assert failed == [], f"{name}'s examples failed after torch.manual_seed({failed})"


def public_items() -> list[tuple[str, object]]:
    items = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                if getattr(obj, "__module__", name) != name:
                    continue  # re-exported: checked where it is defined
                items.append((f"{name}.{attr}", obj))
    return items


ITEMS = public_items()


def has_example(obj: object) -> bool:
    doc = inspect.getdoc(obj) or ""
    return ">>>" in doc


@pytest.mark.parametrize(("qualname", "obj"), ITEMS, ids=[q for q, _ in ITEMS])
def test_public_api_has_a_runnable_example(qualname, obj):
    assert inspect.getdoc(obj), f"{qualname} has no docstring"
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return  # errors are documented by the calls that raise them
    assert has_example(obj), f"{qualname}'s docstring has no runnable example (>>>)"


def test_the_suite_found_the_api():
    assert len(MODULES) > 20 and len(ITEMS) > 40
