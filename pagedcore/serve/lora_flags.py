"""``pagedcore serve``'s LoRA flags, vLLM's: ``--enable-lora``, ``--lora-modules``, ``--max-loras``,
``--max-lora-rank``; the adapters the flags name are loaded at start-up (a bad one exits 2 naming it).

``--lora-modules`` takes vLLM's two forms, several per flag: ``name=path``, or a JSON object
``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name``, when given, must be a name the server
serves its model under: it is the adapter's ``parent`` in ``/v1/models``). Adapters load from local folders that
``PeftModel.save_pretrained`` wrote (safetensors).

Imported by the command line's parser: argparse only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LoraModule",
    "add_lora_flags",
    "check_lora_flags",
    "load_lora_modules",
    "lora_module",
    "parents",
    "runtime_lora_updating",
]

DEFAULT_MAX_LORAS = 1  # vLLM's
DEFAULT_MAX_LORA_RANK = 16  # vLLM's


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry.

    Example:
        >>> lora_module("sql=/adapters/sql")
        LoraModule(name='sql', path='/adapters/sql', base_model_name=None)
    """

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoraModule:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON object.

    Example:
        >>> lora_module('{"name": "sql", "path": "/a", "base_model_name": "base"}').base_model_name
        'base'
        >>> lora_module("sql")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected name=path or {"name": ..., "path": ...}, got 'sql'
    """
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        fields = set(value) if isinstance(value, dict) else set()
        name, path, base = (value.get(key) if isinstance(value, dict) else None for key in _JSON_FIELDS)
        if fields - set(_JSON_FIELDS) or not _text(name) or not _text(path) or not (base is None or _text(base)):
            raise argparse.ArgumentTypeError(f"expected {{{', '.join(map(repr, _JSON_FIELDS))}}} strings, got {text}")
        return LoraModule(str(name), str(path), None if base is None else str(base))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f'expected name=path or {{"name": ..., "path": ...}}, got {text!r}')
    return LoraModule(name.strip(), path.strip())


_JSON_FIELDS = ("name", "path", "base_model_name")


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """Add the LoRA flags to ``serve``'s parser.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_lora_flags(parser)
        >>> args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
        >>> [m.name for m in args.lora_modules], args.max_loras, args.max_lora_rank
        (['a', 'b'], 2, None)
    """
    group = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters: a request's model= names one")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help='adapters loaded at start-up: name=path, or {"name": ..., "path": ..., "base_model_name": ...}',
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help=f"the most adapters in the model at once; more wait in host memory (default {DEFAULT_MAX_LORAS})",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        metavar="R",
        help=f"adapters of a higher rank are refused (default {DEFAULT_MAX_LORA_RANK})",
    )


def check_lora_flags(args: argparse.Namespace, error: type[Exception], served: Sequence[str] = ()) -> None:
    """Raise ``error`` (one line) for LoRA flags that cannot be served (``served``: the names the model is served
    under); fill in the defaults when LoRA is on.

    Example:
        >>> check_lora_flags(argparse.Namespace(enable_lora=False, lora_modules=None, max_loras=2), ValueError)
        Traceback (most recent call last):
        ...
        ValueError: --max-loras needs --enable-lora (vLLM's rule: LoRA is off without it)
    """
    given = [flag for flag in ("lora_modules", "max_loras", "max_lora_rank") if getattr(args, flag, None) is not None]
    if not getattr(args, "enable_lora", False):
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise error(f"{flag} needs --enable-lora (vLLM's rule: LoRA is off without it)")
        return
    for flag, default in (("max_loras", DEFAULT_MAX_LORAS), ("max_lora_rank", DEFAULT_MAX_LORA_RANK)):
        value = getattr(args, flag, None)
        if value is None:
            setattr(args, flag, default)
        elif value < 1:
            raise error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    modules = getattr(args, "lora_modules", None) or []
    names = [module.name for module in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise error(f"--lora-modules names {', '.join(repeated)} more than once")
    for module in modules:
        if module.name in served:
            raise error(f"--lora-modules {module.name}: the model is served under that name already")
        if module.base_model_name is not None and module.base_model_name not in served:
            raise error(f"--lora-modules {module.name}: base_model_name {module.base_model_name!r} is not served here")


def load_lora_modules(engine: Any, modules: Sequence[LoraModule] | None, error: type[Exception]) -> list[str]:
    """Load the ``--lora-modules`` adapters into ``engine``; returns their names (the start-up line shows them).

    Raises ``error`` naming the module for one that cannot be loaded.

    Example:
        >>> load_lora_modules(None, [], ValueError)
        []
    """
    loaded = []
    for module in modules or []:
        try:
            engine.loras.load(module.name, module.path)
        except Exception as exc:  # the adapter's files or kind: a usage error naming it
            raise error(f"--lora-modules {module.name}={module.path}: {exc}") from exc
        loaded.append(module.name)
    return loaded


def parents(modules: Sequence[LoraModule] | None) -> dict[str, str]:
    """Adapter name -> the served name ``/v1/models`` shows as its parent (``base_model_name``, when given).

    Example:
        >>> parents([LoraModule("a", "/x", "base"), LoraModule("b", "/y")])
        {'a': 'base'}
    """
    return {m.name: m.base_model_name for m in modules or [] if m.base_model_name is not None}


def runtime_lora_updating() -> bool:
    """Whether ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served: vLLM's switch, the
    environment variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to ``true`` or ``1`` (loading reads files on the
    server's disk, so it is off unless the operator turns it on).

    Example:
        >>> import os
        >>> os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None) and None
        >>> runtime_lora_updating()
        False
    """
    import os

    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
