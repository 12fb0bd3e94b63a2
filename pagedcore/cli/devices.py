"""Turn ``--device`` and ``--dtype`` into a torch device and dtype that work here, or a one-line ``ConfigError``.

A leaf module the commands share (``pagedcore generate``, ``pagedcore bench``): its functions import torch when they
run, so the parsers that read :data:`DTYPES` stay light. Checked before anything is built, so that ``--device
cuda`` on a machine without CUDA, or a dtype the device cannot compute in, fails at once with the reason instead of
a traceback minutes into a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "describe_device", "resolve_device", "resolve_dtype"]

DTYPES = ("float32", "float16", "bfloat16")
"""What ``--dtype`` takes."""


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` means (``"auto"``: cuda when available, else cpu), checked to be usable here.

    Raises:
        ConfigError: not a device name, or a device this machine does not have (e.g. cuda without CUDA).

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("auto").type in ("cpu", "cuda")
        True
        >>> resolve_device("gpu0")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: device 'gpu0' is not a torch device (e.g. cpu, cuda, cuda:1)
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        build = f"torch {torch.__version__}" + (", built without CUDA" if torch.version.cuda is None else "")
        raise ConfigError(f"device {name!r} is not available on this machine ({build})")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {name!r} does not exist: this machine has {count} {device.type} device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype ``name`` (``"float32"``, ``"float16"``, ``"bfloat16"``), checked to compute on ``device``.

    The check runs a tiny matmul, softmax and scaled-dot-product attention in that dtype on the device.

    Raises:
        ConfigError: not one of those dtypes, or the device cannot compute in it.

    Example:
        >>> import torch
        >>> resolve_dtype("float32", torch.device("cpu"))
        torch.float32
        >>> resolve_dtype("int8", torch.device("cpu"))
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: dtype 'int8' is not one of float32, float16, bfloat16
    """
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    dtype: torch.dtype = getattr(torch, name)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype bfloat16 is not supported on {device} ({torch.cuda.get_device_name(device)})")
    try:
        x = torch.ones(1, 2, 4, 8, device=device, dtype=dtype)  # (batch, heads, positions, head_dim)
        y = torch.softmax(x @ x.transpose(-1, -2), dim=-1)
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
        float(y.sum())
    except (RuntimeError, NotImplementedError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"dtype {name} does not compute on {device}: {reason}") from None
    return dtype


def describe_device(device: torch.device) -> str:
    """One line: the device, and for a GPU its name, memory and CUDA version.

    Example:
        >>> import torch
        >>> describe_device(torch.device("cpu"))
        'cpu'
    """
    import torch

    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
