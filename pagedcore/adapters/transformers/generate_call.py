"""One ``enable()``d ``generate`` call's plan: its settings, the mask it runs with, the prefix hit it attaches, the
blocks it reserves and gives back (:mod:`.prefix_caching` runs the calls; :mod:`.seq2seq_calls` those of
encoder-decoder models).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.capacity import Demand, Reservation
from pagedcore.errors import OutOfBlocksError
from pagedcore.kv_pool import PoolMatch

from .cache import PagedCache
from .multimodal import CallItems, usable_length
from .pool import PagedKVPool

# Internal to prefix_caching.py and seq2seq_calls.py (split out of prefix_caching.py for its size): no public API.
__all__: list[str] = []

_call_ids = itertools.count()


@dataclass(frozen=True)
class CallSettings:
    max_new_tokens: int
    expand: int
    beams: int
    use_cache: bool
    # False when the call must compute its whole prompt: attentions or hidden states asked for (they must cover every
    # prompt position), or assisted / prompt-lookup decoding (transformers 5.24 gets them wrong after a pre-filled
    # cache: a DynamicCache holding the first prompt tokens gives other tokens than an empty one).
    reuse: bool
    # Assisted / prompt-lookup decoding: the cache records its past, so sliding-window layers keep their blocks
    # between crops (a window's bound does not hold for such a call).
    records_past: bool
    pad_token_id: Any
    eos_token_id: Any


def keyword_args(call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's positional arguments after the first (the inputs) as the keywords ``generate`` binds them to, so
    the plan reads ``generate(ids, config)``'s config as it reads ``generation_config=config``. Unchanged when they
    cannot be named (a signature with ``*args``, or a name also given as a keyword: ``generate`` raises its own
    TypeError then).

    Example:
        >>> def generate(inputs=None, generation_config=None, logits_processor=None, **kwargs): ...
        >>> keyword_args(generate, ("ids", "config"), {"max_new_tokens": 3})
        (('ids',), {'max_new_tokens': 3, 'generation_config': 'config'})
    """
    if len(args) < 2:
        return args, kwargs
    try:
        params = list(inspect.signature(call).parameters.values())[: len(args)]
    except (TypeError, ValueError):  # no signature to read: the call as it was given
        return args, kwargs
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
    if len(params) < len(args) or any(p.kind not in named or p.name in kwargs for p in params):
        return args, kwargs
    return args[:1], {**kwargs, **{p.name: value for p, value in zip(params[1:], args[1:])}}


_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def draws_dropout(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> bool:
    """Whether a forward of ``model`` draws dropout: a module in training mode with a dropout layer or an attention
    dropout probability (transformers' attention modules keep it as a float) above 0. Such a call's keys are one
    draw's: a prefix cached from them would give a later call other tokens than computing its own prompt does.

    Checked at each call (a submodule's mode, a probability, the modules themselves may change between calls): one
    pass over the module tree that reads each module's ``training`` flag, and looks further only into the modules
    in training mode (their attributes from their ``__dict__``; a class's own attributes of those names by
    ``getattr``, its classes known once). ``modules``: every module of ``model``, known to be its tree now (the
    weights watch's, :meth:`~.weights.WeightsWatch.modules`), read instead of walking the tree.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama(attention_dropout=0.1)
        >>> draws_dropout(model), draws_dropout(model.train()), draws_dropout(tiny_llama().train())
        (False, True, False)
        >>> draws_dropout(model, list(model.modules())), draws_dropout(model.eval(), list(model.modules()))
        (True, False)
    """
    if modules is not None:
        return any(module.training and _module_draws(module) for module in modules)
    stack: list[torch.nn.Module | None] = [model]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:  # None: a submodule slot registered empty
            continue
        seen.add(id(module))
        if module.training and _module_draws(module):
            return True
        stack.extend(module._modules.values())  # noqa: SLF001  (the children, without modules()'s names)
    return False


_DROPOUT_NAMES = ("attention_dropout", "dropout", "attn_dropout")
# Per module class: whether it is a dropout layer, and the dropout names its class gives (a class attribute, a
# property), read from each module by getattr. A plain dict: a lookup per module of each call, classes are few.
_KINDS: dict[type, tuple[bool, tuple[str, ...]]] = {}


def _module_draws(module: torch.nn.Module) -> bool:
    """Whether ``module`` (in training mode) draws dropout itself."""
    cls = type(module)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = (issubclass(cls, _DROPOUTS), tuple(n for n in _DROPOUT_NAMES if hasattr(cls, n)))
    if kind[0]:
        return float(getattr(module, "p", 0.0)) > 0
    own = module.__dict__
    for name in _DROPOUT_NAMES:
        value = own.get(name)
        if isinstance(value, float) and value > 0:
            return True
    for name in kind[1]:
        if name not in own:
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def call_settings(model: Any, kwargs: dict[str, Any], prompt_len: int) -> CallSettings:
    """The call's settings: its keyword arguments over the model's generation config, as ``generate`` reads them."""
    config = kwargs.get("generation_config") or model.generation_config

    def get(name: str, default: Any = None) -> Any:
        if kwargs.get(name) is not None:
            return kwargs[name]
        value = getattr(config, name, None)
        return default if value is None else value

    max_new = get("max_new_tokens")
    if max_new is None:
        max_new = max(int(get("max_length", 20)) - prompt_len, 1)
    beams = int(get("num_beams", 1))
    expand = max(beams, int(get("num_return_sequences", 1)))
    use_cache = bool(get("use_cache", True))
    full_outputs = bool(get("output_attentions", False)) or bool(get("output_hidden_states", False))
    candidates = any(
        get(name) is not None for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
    )
    reuse = not (full_outputs or candidates)
    return CallSettings(
        int(max_new), expand, beams, use_cache, reuse, candidates, get("pad_token_id"), get("eos_token_id")
    )


def call_mask(input_ids: torch.Tensor, mask: Any, settings: CallSettings) -> torch.Tensor:
    """The 2-D mask generate will use (inferred from the pad token like generate does when none is given)."""
    if isinstance(mask, torch.Tensor):
        return mask
    pad = settings.pad_token_id
    eos = settings.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def left_pads(mask: torch.Tensor) -> list[int] | None:
    """Leading zeros per row, or None if some row is not of the form 0...01...1 (no prefix reuse then)."""
    ones = mask.ne(0).long().cpu()
    count = ones.sum(dim=1)
    pads = mask.shape[1] - count
    expected = torch.arange(mask.shape[1])[None, :] >= pads[:, None]
    if not torch.equal(ones.bool(), expected) or bool((count == 0).any()):
        return None
    return [int(p) for p in pads]


def attach_hit(
    cache: PagedCache,
    pool: PagedKVPool,
    rows: list[list[int]],
    pads: list[int],
    ns: Hashable,
    *,
    lookup: bool,
    ids: list[int] | None = None,
    items: CallItems | None = None,
) -> tuple[int, Lookups]:
    """Declare the rows' padding and prompts to the cache and attach the prefix every row can use (the rectangular
    prefix: see :mod:`.prefix_caching`); returns its rectangular length and the lookups, for the caller to
    :meth:`~Lookups.record` once the call's reservation is granted (a refused call counts none). ``lookup=False``
    declares the padding and prompts only. ``ids``: the rows' numbers in the call (the hit events' request ids),
    when the cache holds some of its rows only; ``items``: the call's multimodal items, which a prefix holds all or
    none of."""
    with pool.lock:
        if not lookup:
            cache.attach_prefix([None] * len(rows), pads, 0, rows)
            return 0, Lookups(pool, [], [], ns, [])
        for tokens in rows:
            pool.kv.load_prefix(tokens, ns)  # the tiers below the pool, if any
        matches = [pool.kv.match(tokens, ns) for tokens in rows]
        hits = [min(m.num_tokens, len(tokens) - 1) for m, tokens in zip(matches, rows)]
        length = min(p + h for p, h in zip(pads, hits))
        if items is not None and items.spans:
            spans = [items.spans[i] for i in ids] if ids is not None else items.spans
            length = usable_length(spans, pads, length, items.may_cover)
        cache.attach_prefix(matches, pads, length, rows)
    return length, Lookups(pool, rows, [max(0, length - pad) for pad in pads], ns, matches, ids)


@dataclass(frozen=True)
class Lookups:
    """A call's prefix lookups: ``rows``, the tokens each takes from the cache (``used[r]`` of its ``matches[r]``),
    ``ids`` the rows' numbers in the call (default: their order). Recorded only once the call's reservation is
    granted, so that a refused call leaves the pool's counters and the plugins' hit events as they were."""

    pool: PagedKVPool
    rows: list[list[int]]
    used: list[int]
    ns: Hashable
    matches: Sequence[PoolMatch]
    ids: Sequence[int] | None = None

    def record(self) -> None:
        """Count each row's lookup and the tokens it takes, and tell the plugins which blocks served them."""
        pool, call = self.pool, next(_call_ids)
        ids = self.ids if self.ids is not None else range(len(self.rows))
        for r, tokens, hit, match in zip(ids, self.rows, self.used, self.matches):
            pool.kv.record(len(tokens), hit)
            pool.plugins.emit(
                "pagedcore_prefix_hit",
                request_id=f"generate-{call}/{r}",
                num_query_tokens=len(tokens),
                num_hit_tokens=hit,
                namespace=self.ns,
                block_ids=match.head(hit, pool.block_size),
            )


def reserve_call(
    pool: PagedKVPool,
    held: list[int],
    shape: tuple[int, ...],
    pads: list[int] | None,
    settings: CallSettings,
    copies: list[int] | None,
    kwargs: dict[str, Any],
    snapshots: bool = False,
) -> Reservation:
    """Reserve the call's worst case (under the pool's lock), so it can never run out half-way; else raise
    OutOfBlocksError before generation, ending the call's streamer so that its consumer does not wait for ever.

    ``shape`` is the ``(rows, width)`` of the rows the cache holds, ``pads`` each row's unstored padding (None: the
    mask is not left padding, so every row stores every position); rows already hold ``held`` tokens (a hit, or a
    continued cache), and with ``snapshots`` compute their prompt to snapshot points (recurrent-state layers). Each row
    is a :class:`~pagedcore.capacity.Demand`: ``settings.expand`` copies, each storing the whole row, or with
    ``copies`` the row's prompt computed once and forked into ``copies[r]`` rows (identical rows of the call and
    their ``num_return_sequences``); the pool's :meth:`~pagedcore.kv_pool.KVPool.worst_case` says how many blocks
    they need, and :meth:`~pagedcore.kv_pool.KVPool.reserve` holds them back from every other holder (other calls, an
    Engine) until the call ends. An Engine's running requests keep what they may still need: those blocks cannot be
    reserved.
    """
    batch, width = shape
    pads = pads if pads is not None else [0] * batch
    demands = [
        Demand(
            num_prompt_tokens=width - pad,
            max_new_tokens=settings.max_new_tokens,
            num_held_tokens=held[r] if r < len(held) else 0,
            num_copies=copies[r] if copies is not None else settings.expand,
            share_prompt=copies is not None,
            keeps_window=settings.records_past,
            snapshots=snapshots,
        )
        for r, pad in enumerate(pads)
    ]
    needs = pool.kv.worst_case(*demands)
    try:
        return pool.kv.reserve(needs)
    except OutOfBlocksError as exc:
        streamer = kwargs.get("streamer")
        if streamer is not None:
            streamer.end()
        raise OutOfBlocksError(
            f"this generate call needs up to {exc.requested} blocks of {pool.block_size} tokens but only "
            f"{exc.available} can be had now ({exc}): use a larger pool (enable(model, num_blocks=... / "
            "memory_budget=...)), smaller batches, or release caches returned by earlier calls; calls sharing the "
            "pool (other threads, an Engine's running requests) hold back what they may still need",
            requested=exc.requested,
            available=exc.available,
        ) from exc


def give_back(pool: PagedKVPool, reservation: Reservation | None, cache: PagedCache) -> None:
    """End a call's reservation: what it did not use goes back to the pool (a kept cache holds what it stored)."""
    if reservation is None:
        return
    with pool.lock:
        reservation.release()
        cache.reservation = None


def carries_cache(result: Any, cache: PagedCache) -> bool:
    """Whether ``generate`` returned the cache to the caller (``return_dict_in_generate=True``), also as the
    self-attention half of an ``EncoderDecoderCache``."""
    return isinstance(result, Mapping) and any(
        value is cache or getattr(value, "self_attention_cache", None) is cache for value in result.values()
    )
