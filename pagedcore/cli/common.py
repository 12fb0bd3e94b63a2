"""What every command of the ``pagedcore`` command line shares: exit codes, the usage error, the ``--model`` loader.

A leaf module: ``pagedcore.cli`` and the front ends' own commands (``pagedcore.serve.cli``,
``pagedcore.serve.ray``) import it, and it imports none of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "UsageError",
    "first_line",
    "load_model",
    "missing_extra",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def load_model(name: str, dtype: Any, *, trust_remote_code: bool = False, **hub: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a checkpoint folder or hub name, for the subcommands' ``--model``; ``hub`` goes to
    both ``from_pretrained`` calls (``revision``, ``cache_dir``).

    Raises :class:`UsageError` (exit code 2, one line) for a path that holds no model or a checkpoint that cannot
    be loaded.

    Example:
        >>> load_model("./no-such-model", None)
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --model './no-such-model': no such folder
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~"))):
        raise UsageError(f"--model {name!r}: no such folder")
    if path.is_file():
        raise UsageError(f"--model {name!r} is a file: give a model folder (with config.json) or a hub name")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name!r}: the folder holds no model (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **hub)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load model {name!r} (its tokenizer): {first_line(exc)}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code, **hub)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load model {name!r}: {first_line(exc)}") from exc
    return model.eval(), tokenizer


def first_line(exc: BaseException) -> str:
    """An error's message cut to its first line: the command line reports each error in one line.

    Example:
        >>> first_line(OSError("no config.json" + chr(10) + "see the docs")), first_line(ValueError())
        ('no config.json', 'ValueError')
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def missing_extra(command: str, extra: str, modules: tuple[str, ...]) -> bool:
    """Whether one of ``modules`` cannot be imported; if so, say in one line which extra ``command`` needs.

    Example:
        >>> missing_extra("pagedcore serve", "serve", ("json",))
        False
    """
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        print(f"{command}: needs the {extra} extra: pip install 'pagedcore[{extra}]' ({exc})", file=sys.stderr)
        return True
    return False
