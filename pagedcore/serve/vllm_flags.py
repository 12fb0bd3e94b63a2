"""The flags ``vllm serve`` users type, as ``pagedcore serve`` takes them.

- :func:`add_vllm_flags`: vLLM's flags that mean something here, each implemented (loading, logging, the app's
  defaults; :func:`check_vllm_flags` checks their values), or accepted with no effect where it has no meaning here
  (:data:`NO_OPS`: the start-up log says why, one line per flag given).
- :data:`REFUSED`: flags that do not apply are refused at start-up with one line saying what to use instead, exit
  code 2 (:func:`check_refused`).
- :func:`expand_config`: ``--config FILE.yaml`` (vLLM's): the file's options go before the command line's, which win.

The definitions of the flags both servers share (``--port``, ``--max-model-len``, ...) are in
:mod:`pagedcore.serve.cli`. Imported by the command line's parser: argparse only (PyYAML when ``--config`` is given).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from pagedcore.extras import install_hint

__all__ = [
    "DTYPES",
    "NO_OPS",
    "REFUSED",
    "add_refused",
    "add_vllm_flags",
    "check_refused",
    "check_vllm_flags",
    "expand_config",
    "human_int",
    "json_list",
    "no_op_notes",
]

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
    "--max-cpu-loras": (
        int,
        None,
        "every loaded adapter stays in host memory here; --max-loras bounds those in the model",
    ),
    "--lora-dtype": (str, "auto", "adapters keep the dtype PEFT loads them in (float32 for a half-precision model)"),
    "--fully-sharded-loras": (str, None, "one engine holds the whole model here: nothing is sharded"),
    "--tokenizer-mode": (str, "auto", "the checkpoint's own (fast) tokenizer is always used"),
    "--load-format": (str, "auto", "checkpoints load with transformers' from_pretrained"),
}
"""vLLM flags that do not apply here: flag -> (type, the value that asks for nothing, what to use instead)."""

NO_OPS: dict[str, str] = {
    "--enable-chunked-prefill": "prefills are always chunked here, at --max-num-batched-tokens tokens per step",
    "--swap-space": (
        "preempted requests are recomputed here (their prompt's blocks stay in the prefix cache while the pool has "
        "room): no CPU swap space is reserved"
    ),
    "--enable-tokenizer-info-endpoint": "/tokenizer_info is always served here (behind the API key when there is one)",
    "--enable-prompt-tokens-details": "usage always has prompt_tokens_details.cached_tokens here",
}
"""vLLM flags accepted with no effect, and why: the start-up log prints the reason of each one given."""

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16"}
DTYPES["half"] = "float16"
"""``--dtype``'s values (vLLM's: ``half`` is float16, ``float`` float32) -> the torch dtype's name."""

# Tool-call formats: the ones implemented (pagedcore.serve.tool_calls.TOOL_PARSERS) and vLLM's others, refused by
# name (a format is one parser function: the families this project serves use the implemented ones).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3")
_VLLM_TOOL_CALL_PARSERS = (
    "deepseek_v31", "deepseek_v32", "ernie45", "gigachat3", "glm45", "glm47", "granite", "granite-20b-fc",
    "granite4", "hunyuan_a13b", "internlm", "jamba", "kimi_k2", "llama4_json", "llama4_pythonic", "longcat",
    "minimax", "minimax_m2", "olmo3", "openai", "phi4_mini_json", "qwen3_xml", "seed_oss", "step3", "xlam",
)  # fmt: skip
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "gpt_oss")
_VLLM_REASONING_PARSERS = (
    "deepseek_v3", "ernie45", "glm45", "granite", "holo2", "hunyuan_a13b", "kimi_k2", "minimax_m2",
    "minimax_m2_append_think", "mistral", "olmo3", "seed_oss", "step3",
)  # fmt: skip
_GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
_OTHER_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
_GENERATION_CONFIG = "auto, vllm, or a folder with a generation_config.json"


def human_int(text: str) -> int:
    """vLLM's integers with a unit: ``1k`` is 1000, ``1K`` is 1024 (``m``/``M``, ``g``/``G``, ``t``/``T`` alike);
    decimals only with the decimal units.

    Example:
        >>> human_int("1k"), human_int("1K"), human_int("25.6k"), human_int("4096")
        (1000, 1024, 25600, 4096)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 1k (1000) or 1K (1024), got {text!r}")
    number, unit = match.groups()
    if unit and unit.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(unit) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals go with the decimal units (k, m, g, t) only, got {text!r}")
    return int(number) * (2 ** (10 * "KMGT".index(unit) + 10) if unit else 1)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's flags that are implemented here, or accepted as no-ops (:data:`NO_OPS`), to ``serve``'s parser.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_vllm_flags(parser)
        >>> args = parser.parse_args(["--enforce-eager", "--response-role", "bot", "--swap-space", "4"])
        >>> args.enforce_eager, args.response_role, args.swap_space
        (True, 'bot', 4.0)
    """
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="options from a YAML file (key: value); the command line's win"
    )
    _add_loading_flags(parser)
    _add_app_flags(parser)
    _add_logging_flags(parser)
    group = parser.add_argument_group("vLLM flags with no effect here (the start-up log says why)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--swap-space", type=float, default=None, metavar="GIB")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_const", const=True, default=None)
    group.add_argument("--enable-prompt-tokens-details", action="store_const", const=True, default=None)


def _add_loading_flags(parser: argparse.ArgumentParser) -> None:
    """What is loaded, from where, and how the engine runs it."""
    group = parser.add_argument_group("loading (vLLM's flags)")
    group.add_argument("--tokenizer", default=None, help="the tokenizer's folder or hub name (default: the model's)")
    group.add_argument("--revision", default=None, help="the model's hub revision: a branch, a tag or a commit")
    group.add_argument("--tokenizer-revision", default=None, help="the tokenizer's hub revision")
    group.add_argument("--download-dir", default=None, metavar="DIR", help="the hub cache (default: Hugging Face's)")
    group.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="where requests' default sampling values come from: auto (the model's generation_config.json), vllm "
        "(none: OpenAI's defaults), or a folder holding a generation_config.json",
    )
    group.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="default sampling values over the generation config's, e.g. '{\"temperature\": 0.5}'",
    )
    group.add_argument("--enforce-eager", action="store_true", help="no compiled decode steps (as --no-compile)")
    group.add_argument(
        "--guided-decoding-backend",
        default=None,
        metavar="NAME",
        help="the grammar engine of structured outputs: guidance (llguidance, the only one here) or auto",
    )


def _add_app_flags(parser: argparse.ArgumentParser) -> None:
    """What the HTTP app answers and how."""
    group = parser.add_argument_group("the API (vLLM's flags)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read tool calls from free answers (tool_choice=auto) in the --tool-call-parser format (default: on; "
        "--no-enable-auto-tool-choice refuses tool_choice=auto as vLLM without the flag)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split the reasoning (<think>...</think>, gpt-oss's analysis channel) off the answer as "
        f"reasoning_content: {', '.join(REASONING_PARSERS)}",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="chat template variables for every request (a request's chat_template_kwargs win), e.g. "
        "'{\"enable_thinking\": false}'",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="tokens in logprobs as 'token_id:ID' for every request",
    )
    group.add_argument("--response-role", default="assistant", help="the role of chat answers (default assistant)")
    group.add_argument("--root-path", default=None, help="the path prefix a proxy serves the API under")
    group.add_argument("--disable-fastapi-docs", action="store_true", help="no /openapi.json")
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answers carry X-Request-Id (the client's, or a new one)",
    )


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging (vLLM's flags; INFO lines show with --log-level info)")
    requests = group.add_mutually_exclusive_group()
    requests.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request: its id, prompt size and parameters (at least --log-level info)",
    )
    requests.add_argument("--disable-log-requests", action="store_true", help="do not log requests (the default)")
    group.add_argument(
        "--max-log-len", type=int, default=None, metavar="N", help="logged prompts: at most N characters or ids"
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats lines (throughput, running and waiting requests, KV use, prefix hits; every 10 s "
        "or VLLM_LOG_STATS_INTERVAL seconds)",
    )
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log lines")


def check_vllm_flags(args: argparse.Namespace, error: type[Exception]) -> None:
    """Check the values of the flags :func:`add_vllm_flags` added (raise ``error``, one line, for a bad one).

    Example:
        >>> check_vllm_flags(argparse.Namespace(tool_call_parser="granite"), ValueError)
        Traceback (most recent call last):
        ...
        ValueError: --tool-call-parser granite is not supported here: the formats implemented are hermes, ...
    """
    _check_choice(args, "tool_call_parser", TOOL_CALL_PARSERS, _VLLM_TOOL_CALL_PARSERS, error)
    _check_choice(args, "reasoning_parser", REASONING_PARSERS, _VLLM_REASONING_PARSERS, error)
    backend = getattr(args, "guided_decoding_backend", None)
    if backend is not None and backend not in _GRAMMAR_BACKENDS:
        why = "one grammar engine, llguidance (vLLM's 'guidance'), serves every structured output and tool call"
        known = "vLLM's" if backend in _OTHER_BACKENDS else "an unknown"
        raise error(f"--guided-decoding-backend {backend} ({known} backend) is not supported: {why}")
    if getattr(args, "enable_chunked_prefill", None) is False:
        raise error(
            "--no-enable-chunked-prefill is not supported: prefills are always chunked at --max-num-batched-tokens "
            "(raise it to prefill longer prompts in one step)"
        )
    swap = getattr(args, "swap_space", None)
    if swap is not None and not swap >= 0:
        raise error(f"--swap-space must be a number of GiB >= 0, got {swap}")
    if getattr(args, "max_log_len", None) is not None and args.max_log_len < 0:
        raise error(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if getattr(args, "enforce_eager", False) and getattr(args, "compile", None):
        raise error("--enforce-eager and --compile contradict each other: give one")
    if getattr(args, "cuda_graphs", False) and (
        getattr(args, "enforce_eager", False) or getattr(args, "compile", None)
    ):
        raise error("--cuda-graphs and --enforce-eager / --compile contradict each other: give one")
    root = getattr(args, "root_path", None)
    if root is not None and (not root.startswith("/") or root.endswith("/")):
        raise error(f"--root-path must start with / and not end with one, e.g. /api, got {root!r}")
    if not getattr(args, "response_role", "assistant"):
        raise error("--response-role must not be empty")
    try:
        generation_config_source(getattr(args, "generation_config", "auto"))
    except ValueError as exc:
        raise error(str(exc)) from None


def _check_choice(
    args: argparse.Namespace,
    option: str,
    implemented: Sequence[str],
    vllm: Sequence[str],
    error: type[Exception],
) -> None:
    value = getattr(args, option, None)
    if value is None or value in implemented:
        return
    flag = f"--{option.replace('_', '-')}"
    known = "" if value in vllm else " (no vLLM parser has this name)"
    raise error(f"{flag} {value} is not supported here{known}: the formats implemented are {', '.join(implemented)}")


def no_op_notes(args: argparse.Namespace) -> list[str]:
    """One line per :data:`NO_OPS` flag given, saying why it changes nothing here (the start-up log prints them).

    Example:
        >>> no_op_notes(argparse.Namespace(enable_chunked_prefill=True, swap_space=None))
        ['--enable-chunked-prefill has no effect here: prefills are always chunked here, at ...']
    """
    notes = []
    for flag, why in NO_OPS.items():
        if getattr(args, flag.removeprefix("--").replace("-", "_"), None) is not None:
            notes.append(f"{flag} has no effect here: {why}")
    return notes


def generation_config_source(value: str) -> str:
    """``--generation-config``'s value checked: ``auto``, ``vllm`` or a folder.

    Example:
        >>> generation_config_source("vllm")
        'vllm'
    """
    if value in ("auto", "vllm"):
        return value
    from pathlib import Path

    if not (Path(value).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {value!r}: expected {_GENERATION_CONFIG}")
    return value


_SWITCHES = ("--fully-sharded-loras",)  # REFUSED flags that take no value (vLLM's store_true)
_SHORT = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp", "--data-parallel-size": "-dp",
          "--quantization": "-q"}  # fmt: skip  # vLLM's short forms


def add_refused(parser: argparse.ArgumentParser) -> None:
    """Add the :data:`REFUSED` flags (hidden from ``--help``) so that :func:`check_refused` can name them.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_refused(parser)
        >>> parser.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size
        2
    """
    for flag, (kind, _, _) in REFUSED.items():
        if flag in _SWITCHES:
            parser.add_argument(flag, action="store_const", const="yes", default=None, help=argparse.SUPPRESS)
        else:
            names = (flag, _SHORT[flag]) if flag in _SHORT else (flag,)
            parser.add_argument(*names, type=kind, default=None, help=argparse.SUPPRESS)


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


# --config: how a YAML value becomes command-line words. Flags taking several words, and repeatable flags.
_MANY_WORDS = frozenset({"served-model-name"})
_REPEATED = frozenset({"api-key"})
_NEGATABLE = frozenset({"enable-prefix-caching", "compile", "enable-auto-tool-choice", "enable-chunked-prefill"})


def expand_config(argv: Sequence[str]) -> list[str]:
    """``serve``'s command line with ``--config FILE`` replaced by the YAML file's options, put right after
    ``serve`` (so the command line's own options, which come later, win), as vLLM reads it: ``key: value`` per
    option (``max-model-len`` or ``max_model_len``), ``true`` for a flag (``false``: ``--no-...`` where the flag
    has that form), a list for several values. Raises :class:`ValueError` (one line) for a file it cannot read.

    Example:
        >>> expand_config(["generate", "--config", "x.yaml"])  # only serve reads --config
        ['generate', '--config', 'x.yaml']
    """
    argv = list(argv)
    if not argv or argv[0] != "serve" or not any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    rest: list[str] = []
    files: list[str] = []
    words = iter(argv[1:])
    for word in words:
        if word == "--config":
            files.append(next(words, ""))
        elif word.startswith("--config="):
            files.append(word.split("=", 1)[1])
        else:
            rest.append(word)
    if len(files) != 1 or not files[0]:
        raise ValueError("--config takes one YAML file")
    return ["serve", *_config_words(files[0]), *rest]


def _config_words(path: str) -> list[str]:
    """The command-line words of one YAML config file."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML comes with the serve extra
        raise ValueError(f"--config needs PyYAML: {install_hint('serve')} ({exc})") from None
    try:
        with open(path, encoding="utf-8") as file:
            options = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path!r}: cannot read it: {str(exc).splitlines()[0]}") from None
    if options is None:
        return []
    if not isinstance(options, dict):
        raise ValueError(f"--config {path!r}: expected a mapping of options (key: value), got {type(options).__name__}")
    words: list[str] = []
    for key, value in options.items():
        flag = str(key).replace("_", "-")
        if flag == "config":
            raise ValueError(f"--config {path!r}: a config file cannot name another one")
        if flag in ("model", "model-tag"):
            flag = "model"
        words.extend(_option_words(flag, value))
    return words


def _option_words(flag: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        if value:
            return [f"--{flag}"]
        return [f"--no-{flag}"] if flag in _NEGATABLE else []
    if value is None:
        return []
    if isinstance(value, list) and flag in _MANY_WORDS:
        return [f"--{flag}", *map(str, value)]
    if isinstance(value, list) and flag in _REPEATED:
        return [word for item in value for word in (f"--{flag}", str(item))]
    if isinstance(value, (list, dict)):
        return [f"--{flag}", json.dumps(value)]
    return [f"--{flag}", str(value)]
