"""What the model benchmarks share: the benchmark model, workload helpers, ``generate`` and a forward counter.

- Model: :func:`bench_config` / :func:`bench_model` build a Llama with random weights in one of the
  :data:`~pagedcore.benchmarks.options.MODEL_SIZES` (or the quick model), on any device and dtype;
  :func:`describe_model`, :func:`kv_bytes_per_token`, :func:`cache_tensor_bytes` describe and measure it.
- Workloads: seeded token lists (:func:`random_tokens`), block counts, left-padded batches on the model's device.
- Generation: :func:`generate` / :func:`greedy`, :func:`attn` (the attention implementation for a block), a
  forward hook that counts the positions the model computes (:func:`counting`).

How a benchmark is timed lives in :mod:`~pagedcore.benchmarks.runner`; the peers it runs, in
:mod:`~pagedcore.benchmarks.peers`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from pagedcore.adapters.transformers import ModelKVSpec
from pagedcore.adapters.transformers.hook_ids import transparent_hook

from .options import MODEL_SIZES, QUICK_MODEL
from .steps import forward_edges

__all__ = [
    "bench_config",
    "bench_model",
    "bench_tokenizer",
    "cache_tensor_bytes",
    "describe_model",
    "kv_bytes_per_token",
    "model_from_config",
]

PAD = 0
FIRST_TOKEN = 3  # prompts draw token ids from FIRST_TOKEN .. vocab - 1 (0, 1, 2: pad, bos, eos)
BLOCK_SIZE = 16


# ---------------------------------------------------------------------------------------------------- model
def bench_config(quick: bool = False, size: str | None = None, **overrides: Any) -> LlamaConfig:
    """The benchmark Llama's config: ``size`` of :data:`~pagedcore.benchmarks.options.MODEL_SIZES`, else the small
    model (the smaller quick one with ``quick=True``), with ``overrides`` applied.

    Example:
        >>> config = bench_config(quick=True)
        >>> config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size
        (4, 256, 1, 8000)
        >>> bench_config(num_hidden_layers=2).num_hidden_layers   # the small model with fewer layers
        2
        >>> bench_config(size="1b").hidden_size, bench_config(quick=True, size="tiny").hidden_size
        (2048, 64)
    """
    shape = MODEL_SIZES[size] if size is not None else (QUICK_MODEL if quick else MODEL_SIZES["small"])
    fields = {**shape, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    return LlamaConfig(**{**fields, **overrides})


def bench_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    quick: bool = False,
    size: str | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """The benchmark Llama with random weights (see :func:`bench_config`), on ``device`` in ``dtype``.

    The weights are drawn on the CPU in float32 from ``seed`` and then moved, so every device and dtype gets the same
    model. It comes back in eval mode with ``attn_implementation="sdpa"``; its generation config has no eos token
    (generations run to ``max_new_tokens``) and pad token 0. No weights are downloaded.

    Example:
        >>> model = bench_model(quick=True, num_hidden_layers=1)   # the quick model, cut to one layer
        >>> model.config.hidden_size, model.config.num_hidden_layers, model.training
        (256, 1, False)
        >>> model.generation_config.eos_token_id, model.generation_config.pad_token_id
        ([], 0)
        >>> bench_model(size="tiny", dtype=torch.bfloat16).dtype
        torch.bfloat16
    """
    return model_from_config(bench_config(quick, size, **overrides), seed, dtype, device, attn_implementation)


def bench_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens for the benchmark model, built here (nothing downloaded):
    GPT-2's 256-symbol byte alphabet, then lower-case letter pairs, space-led triples and plain quadruples, so that a
    generated token decodes to one to four characters as a served model's tokenizer's do (decoding is what a step's
    record stage runs per token; there are no merges, so text encodes byte by byte).

    Example:
        >>> tokenizer = bench_tokenizer(1024)
        >>> len(tokenizer), tokenizer.decode([300, 1000])     # a letter pair, then a space-led triple
        (1024, 'bs acq')
    """
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    letters = string.ascii_lowercase
    pieces = itertools.chain(
        ("".join(p) for p in itertools.product(letters, repeat=2)),
        ("\u0120" + "".join(p) for p in itertools.product(letters, repeat=3)),  # Ġ: a leading space
        ("".join(p) for p in itertools.product(letters, repeat=4)),
    )
    for piece in itertools.islice(pieces, max(0, vocab_size - len(vocab))):
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)


def model_from_config(
    config: Any,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A model of ``config`` with random weights drawn on the CPU from ``seed``, moved to ``device`` and ``dtype``,
    in eval mode, generating to ``max_new_tokens`` (no eos token) with pad token 0: the benchmarks' models.

    Example:
        >>> model_from_config(bench_config(size="tiny", vocab_size=256)).config.vocab_size
        256
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = []  # none, not even the tokenizer's: run to max_new_tokens
    model.generation_config.pad_token_id = PAD
    return model


def describe_model(model: PreTrainedModel) -> str:
    """One line: architecture, sizes, parameter count, dtype (and the device when it is not the CPU).

    Example:
        >>> describe_model(bench_model(size="tiny"))  # doctest: +ELLIPSIS
        'Llama with random weights: 2 layers, hidden 64, 2 heads / 1 KV heads (head dim 32), ... float32'
    """
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    params = sum(p.numel() for p in model.parameters())
    where = "" if model.device.type == "cpu" else f" on {model.device}"
    return (
        f"Llama with random weights: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
        f"heads / {c.num_key_value_heads} KV heads (head dim {head_dim}), intermediate {c.intermediate_size}, vocab "
        f"{c.vocab_size}; {params / 1e6:.1f}M parameters, {str(model.dtype).removeprefix('torch.')}{where}"
    )


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one token's keys and values take over all layers, in the model's dtype.

    Example:
        >>> kv_bytes_per_token(bench_model(size="tiny"))   # 2 layers x (K + V) x 1 KV head x 32 x 4 bytes
        512
    """
    return ModelKVSpec.from_model(model).bytes_per_block(1, model.dtype)


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of a transformers cache (``DynamicCache`` / ``StaticCache``) as allocated.

    Example:
        >>> from transformers import DynamicCache
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 0)   # 3 positions, float32
        >>> cache_tensor_bytes(cache)
        192
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------------- workloads
def random_tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    """``count`` token ids drawn from ``FIRST_TOKEN .. vocab - 1`` (never pad, bos or eos)."""
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def left_padded(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of the prompts left-padded to the longest, on ``device``."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


# ---------------------------------------------------------------------------------------------------- generation
def generate(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """``model.generate`` (typed loosely: the stubs see ``nn.Module`` attributes as tensors)."""
    return model.generate(*args, **kwargs)  # type: ignore[operator]


def greedy(model: PreTrainedModel, ids: list[int], new: int, **kwargs: Any) -> list[int]:
    """Greedy ``generate`` of one prompt on the model's device; returns the new tokens."""
    out = generate(model, torch.tensor([ids], device=model.device), max_new_tokens=new, do_sample=False, **kwargs)
    return list(out[0, len(ids) :].tolist())


@contextlib.contextmanager
def attn(model: PreTrainedModel, implementation: str) -> Iterator[None]:
    """Switch the model's attention implementation for the block (restored afterwards)."""
    before = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation != before:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if (getattr(model.config, "_attn_implementation", None) or "sdpa") != before:
            model.set_attn_implementation(before)


class ForwardCounter:
    """Counts the positions the model computes (a forward pre-hook on the module each forward calls first,
    :func:`~pagedcore.benchmarks.steps.forward_edges`; works in any thread that runs the model)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.positions = 0
        self.forwards = 0
        self._handle = forward_edges(model)[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    @transparent_hook  # a counter: not a change of the model (the prefix cache keeps its prefixes)
    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            self.positions += ids.shape[0] * ids.shape[1]
            self.forwards += 1

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


@contextlib.contextmanager
def counting(model: PreTrainedModel) -> Iterator[ForwardCounter]:
    """A :class:`ForwardCounter` on ``model`` for the block."""
    counter = ForwardCounter(model)
    try:
        yield counter
    finally:
        counter.close()
