"""The flags ``vllm serve`` users type, as ``pagedcore serve`` takes them: the ones that apply here are
implemented (their definitions are in :mod:`pagedcore.serve.cli`); the ones that do not are refused at start-up with
one line saying what to use instead (:data:`REFUSED`), exit code 2.

Imported by the command line's parser: argparse only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

__all__ = ["REFUSED", "add_refused", "check_refused", "json_list"]

REFUSED: dict[str, tuple[Callable[[str], object], object, str]] = {
    "--tensor-parallel-size": (
        int,
        1,
        "one engine holds the whole model here; for more engines use --ray --replicas N",
    ),
    "--pipeline-parallel-size": (int, 1, "one engine holds the whole model; for more engines use --ray --replicas N"),
    "--data-parallel-size": (int, 1, "use --ray --replicas N for several engine replicas"),
    "--quantization": (str, None, "load a quantized checkpoint with transformers instead (its config says how)"),
    "--kv-cache-dtype": (str, "auto", "the KV pool holds the model's dtype (--dtype)"),
    "--speculative-config": (str, None, "speculative decoding is not supported"),
    "--enable-lora": (str, None, "LoRA adapters are not supported"),
    "--tokenizer-mode": (str, "auto", "the checkpoint's own (fast) tokenizer is always used"),
    "--load-format": (str, "auto", "checkpoints load with transformers' from_pretrained"),
    "--reasoning-parser": (str, None, "reasoning parsers are not supported"),
}
"""vLLM flags that do not apply here: flag -> (type, the value that asks for nothing, what to use instead)."""


def add_refused(parser: argparse.ArgumentParser) -> None:
    """Add the :data:`REFUSED` flags (hidden from ``--help``) so that :func:`check_refused` can name them.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_refused(parser)
        >>> parser.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size
        2
    """
    for flag, (kind, _, _) in REFUSED.items():
        if kind is str and flag == "--enable-lora":
            parser.add_argument(flag, action="store_const", const="yes", default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)


def check_refused(args: argparse.Namespace, error: type[Exception]) -> None:
    """Raise ``error`` for the first :data:`REFUSED` flag given at a value that asks for something.

    Example:
        >>> check_refused(argparse.Namespace(tensor_parallel_size=2), ValueError)
        Traceback (most recent call last):
        ...
        ValueError: --tensor-parallel-size 2 is not supported: one engine holds the whole model here; for more ...
    """
    for flag, (_, no_op, instead) in REFUSED.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None and value != no_op:
            shown = "" if value == "yes" else f" {value}"
            raise error(f"{flag}{shown} is not supported: {instead}")


def json_list(text: str) -> list[str]:
    """vLLM's list flags (``--allowed-origins '["*"]'``): a JSON list of strings, or one bare string.

    Example:
        >>> json_list('["http://a", "http://b"]'), json_list("*")
        (['http://a', 'http://b'], ['*'])
    """
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value
