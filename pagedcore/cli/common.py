"""What every command of the ``pagedcore`` command line shares: exit codes, the usage error, the ``--model`` loader,
and the checks of ``--model`` and ``--device`` that run before torch and transformers are imported.

A leaf module: ``pagedcore.cli`` and the front ends' own commands (``pagedcore.serve.cli``,
``pagedcore.serve.ray``) import it, and it imports none of them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from pagedcore.errors import ConfigError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "UsageError",
    "check_device",
    "check_model_path",
    "first_line",
    "load_model",
    "missing_extra",
    "torch_build",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def load_model(
    name: str, dtype: Any, *, trust_remote_code: bool = False, tokenizer: bool = True, **hub: Any
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a checkpoint folder or hub name, for the subcommands' ``--model``; ``hub`` goes to
    both ``from_pretrained`` calls (``revision``, ``cache_dir``). ``tokenizer=False``: the model alone (its
    tokenizer is None; the caller loads another, ``serve --tokenizer``).

    Raises :class:`UsageError` (exit code 2, one line) for a path that holds no model or a checkpoint that cannot
    be loaded.

    Example:
        >>> load_model("./no-such-model", None)
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --model './no-such-model': no such folder
    """
    check_model_path(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    own = None
    if tokenizer:
        try:
            own = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **hub)
        except (OSError, ValueError) as exc:
            if Path(name).expanduser().is_dir():
                raise UsageError(
                    f"cannot load the tokenizer in {name!r} ({first_line(exc).rstrip(' :')}): a folder without "
                    "tokenizer files? (serve's --tokenizer PATH names another)"
                ) from exc
            raise UsageError(f"cannot load model {name!r}{_not_here(name)}: {first_line(exc)}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code, **hub)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load model {name!r}{_not_here(name)}: {first_line(exc)}") from exc
    return model.eval(), own


def _not_here(name: str) -> str:
    """What to add to a load error of ``name`` when it is no folder here (it was tried as a hub name)."""
    return "" if Path(name).expanduser().exists() else " (no such folder here; tried as a hub name)"


def check_model_path(name: str) -> None:
    """Refuse a ``--model`` that is a path but no model folder (:class:`UsageError`), without importing anything:
    a name that starts with ``.``, ``~`` or ``/`` and does not exist, a file, a folder without ``config.json``.
    Anything else may be a hub name.

    Example:
        >>> check_model_path("meta-llama/Llama-3.2-1B")   # a hub name: left to transformers
        >>> check_model_path("./no-such-model")
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --model './no-such-model': no such folder
    """
    path = Path(name).expanduser()
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~"))):
        raise UsageError(f"--model {name!r}: no such folder")
    if path.is_file():
        raise UsageError(f"--model {name!r} is a file: give a model folder (with config.json) or a hub name")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name!r}: the folder holds no model (no config.json)")


# The device types torch.device() parses (c10's DeviceType names); "auto" is the commands' own.
_DEVICE_TYPES = [
    "cpu",
    "cuda",
    "ipu",
    "xpu",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "ve",
    "fpga",
    "maia",
    "xla",
    "lazy",
    "vulkan",
    "mps",
    "meta",
    "hpu",
    "mtia",
    "privateuseone",
]


def check_device(name: str) -> None:
    """Refuse a ``--device`` this machine cannot have, before torch is imported (:class:`~pagedcore.errors.ConfigError`,
    as :func:`pagedcore.cli.devices.resolve_device` words it): a name that is no torch device, or CUDA where the
    installed torch was built without it (:func:`torch_build`). What needs torch loaded (a CUDA build on a machine
    without a GPU, an index past the last device) is checked when the device is resolved.

    Example:
        >>> check_device("cpu"), check_device("auto")
        (None, None)
        >>> check_device("gpu0")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: device 'gpu0' is not a torch device (e.g. cpu, cuda, cuda:1)
    """
    if name == "auto":
        return
    match = re.fullmatch(r"([a-z_]+)(?::(\d+))?", name)
    if match is None or match.group(1) not in _DEVICE_TYPES:
        raise ConfigError(f"device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)")
    build = torch_build()
    if match.group(1) == "cuda" and build is not None and build["cuda"] is None and build["hip"] is None:
        raise ConfigError(
            f"device {name!r} is not available on this machine (torch {build['version']}, built without CUDA)"
        )


def torch_build() -> dict[str, Any] | None:
    """The installed torch's ``version``, ``cuda`` and ``hip`` (None where it was built without them), read from its
    ``torch/version.py`` without importing torch; None where torch is not installed.

    Example:
        >>> sorted(torch_build())
        ['cuda', 'hip', 'version']
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    values: dict[str, Any] = {"version": None, "cuda": None, "hip": None}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        name = getattr(target, "id", "")
        name = "version" if name == "__version__" else name
        if name in values:
            try:
                values[name] = ast.literal_eval(value)
            except ValueError:
                pass
    return values


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
        from pagedcore.extras import install_hint

        print(f"{command}: needs the {extra} extra: {install_hint(extra)} ({exc})", file=sys.stderr)
        return True
    return False
