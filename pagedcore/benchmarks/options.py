"""What a benchmark run is asked for: workload size, device, dtype, model size, threads, which benchmarks.

Plain Python (no torch import), so that ``pagedcore --help`` and the command line's parser stay light. The values are
checked here, once, when a :class:`BenchOptions` is made; whether the device and dtype actually work on this machine
is checked when a run starts (:mod:`pagedcore.cli.devices`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pagedcore.cli.devices import DTYPES
from pagedcore.errors import ConfigError
from pagedcore.validation import integer

from .registry import BENCHMARKS

__all__ = [
    "DEVICES",
    "DTYPES",
    "ENGINE_COMPILE",
    "MODEL_SIZES",
    "QUICK_MODEL",
    "BenchOptions",
    "add_arguments",
    "options_from",
]

DEVICES = ("cpu", "cuda", "auto")
ENGINE_COMPILE: dict[str, bool | str] = {"auto": "auto", "eager": False, "inductor": True, "cudagraphs": "cudagraphs"}
"""``--engine-compile``: the benchmarked Engines' ``compile=`` (cudagraphs needs CUDA; hybrid models stay eager)."""

# The Llama shapes of --model-size (random weights; nothing is downloaded).
MODEL_SIZES: dict[str, dict[str, int]] = {
    # the test suite's benchmark model (tests/test_benchmarks.py): a smoke run in seconds
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
    },
    # the benchmark model of the reference figures (docs/benchmarks.md): 57M parameters
    "small": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
    # about 1.1B parameters (Llama-3.2-1B's shapes with a 32k vocabulary): for GPUs
    "1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    },
}
# --quick without --model-size: fewer layers, narrower, smaller vocabulary (the small model's head dim and GQA ratio).
QUICK_MODEL: dict[str, int] = {
    **MODEL_SIZES["small"],
    "vocab_size": 8000,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
}


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark run's settings, checked on creation (a bad value raises :class:`~pagedcore.errors.ConfigError`).

    Args:
        quick: the smaller workloads (and, without ``model_size``, the smaller quick model): a smoke run.
        progress: tqdm progress bars on stderr.
        threads: torch intra-op threads for the run (None: torch's own choice).
        device: ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``) or ``"auto"`` (cuda when available).
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``: the model's and so the KV cache's dtype.
        model_size: a key of :data:`MODEL_SIZES`; None: ``"small"``, or the quick model with ``quick=True``.
        only: the benchmarks to run, in registry order whatever the order given (None: all of them).
        seed: seeds the model's random weights and the workloads.
        engine_compile: how the benchmarked Engines run their decode steps, a key of :data:`ENGINE_COMPILE`
            (``"cudagraphs"`` only on CUDA: checked when the run starts).

    Example:
        >>> options = BenchOptions(quick=True, only=("engine", "prefix"))
        >>> options.names, options.model_size_name, options.model_shape["num_hidden_layers"]
        (('prefix', 'engine'), 'quick', 4)
        >>> BenchOptions(model_size="1b").model_shape["hidden_size"]
        2048
        >>> BenchOptions(threads=0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: threads must be a positive integer, got 0
    """

    quick: bool = False
    progress: bool = True
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    model_size: str | None = None
    only: tuple[str, ...] | None = None
    seed: int = 0
    engine_compile: str = "auto"

    def __post_init__(self) -> None:
        if self.threads is not None:
            integer("threads", self.threads, minimum=1, error=ConfigError, expected="a positive integer")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.engine_compile not in ENGINE_COMPILE:
            raise ConfigError(f"engine compile {self.engine_compile!r} is not one of {', '.join(ENGINE_COMPILE)}")
        if self.model_size is not None and self.model_size not in MODEL_SIZES:
            raise ConfigError(f"model size {self.model_size!r} is not one of {', '.join(MODEL_SIZES)}")
        if self.only is not None:
            unknown = [name for name in self.only if name not in BENCHMARKS]
            if unknown or not self.only:
                raise ConfigError(
                    f"unknown benchmark {', '.join(map(repr, unknown)) or '(none given)'}; "
                    f"choose from {', '.join(BENCHMARKS)}"
                )

    @property
    def names(self) -> tuple[str, ...]:
        """The benchmarks this run runs, in registry (and report) order."""
        return tuple(name for name in BENCHMARKS if self.only is None or name in self.only)

    @property
    def model_size_name(self) -> str:
        """``model_size``, or what it defaults to: ``"small"``, ``"quick"`` for a quick run."""
        if self.model_size is not None:
            return self.model_size
        return "quick" if self.quick else "small"

    @property
    def model_shape(self) -> dict[str, int]:
        """The Llama config fields of the benchmark model."""
        return dict(QUICK_MODEL if self.model_size_name == "quick" else MODEL_SIZES[self.model_size_name])

    @property
    def needs_torch(self) -> bool:
        """Whether any benchmark of the run uses a model (so the device and dtype matter)."""
        return any(BENCHMARKS[name].uses_model for name in self.names)


def add_arguments(parser: argparse.ArgumentParser, *, several: bool = True) -> None:
    """Add the options every benchmark command shares to ``parser`` (``--only`` too when it runs ``several``).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> options = options_from(parser.parse_args(["--quick", "--only", "core,memory", "--dtype", "bfloat16"]))
        >>> options.names, options.dtype, options.device
        (('memory', 'core'), 'bfloat16', 'cpu')
    """
    parser.add_argument("--quick", action="store_true", help="smaller workloads and model: a smoke run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the CPUs this process may use that other work leaves free, stated at start)",
    )
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="where the models run (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model and KV dtype (default: float32)")
    parser.add_argument(
        "--engine-compile",
        default="auto",
        choices=list(ENGINE_COMPILE),
        help="the Engines' decode steps: auto (the Engine's default, eager), eager, inductor (compile=True) or "
        "cudagraphs (CUDA only; hybrid models stay eager)",
    )
    parser.add_argument(
        "--model-size",
        default=None,
        choices=list(MODEL_SIZES),
        help="random Llama: tiny (hidden 64, 2 layers), small (hidden 512, 8 layers; the default), 1b (hidden 2048, "
        "16 layers, about 1.1B parameters); --quick alone uses a smaller quick model",
    )
    if several:
        parser.add_argument(
            "--only",
            default=None,
            metavar="NAMES",
            help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)",
        )


def options_from(args: argparse.Namespace, **fixed: Any) -> BenchOptions:
    """The :class:`BenchOptions` of arguments parsed with :func:`add_arguments` (``fixed`` overrides fields).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser, several=False)
        >>> options_from(parser.parse_args([]), only=("cold",)).names
        ('cold',)
    """
    only = getattr(args, "only", None)
    fields: dict[str, Any] = {
        "quick": args.quick,
        "progress": not args.no_progress,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "engine_compile": getattr(args, "engine_compile", "auto"),
        "model_size": args.model_size,
        "only": None if only is None else tuple(name.strip() for name in only.split(",") if name.strip()),
    }
    return BenchOptions(**{**fields, **fixed})
