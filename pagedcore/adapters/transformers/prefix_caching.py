"""Automatic prefix caching for plain ``model.generate``: one line to enable, one to disable.

``enable(model)`` gives the model a long-lived :class:`PagedKVPool` and wraps its ``generate``. Each call then:

1. looks every row's prompt up in the pool's prefix trie (per namespace) and attaches the longest cached prefix
   to a fresh :class:`PagedCache`, always leaving the last prompt token to compute;
2. runs the original ``generate`` with that cache, which feeds only the uncached part of the prompt;
3. registers the rows' full blocks in the trie; then releases the cache's references, unless the result returns
   the cache (``return_dict_in_generate=True``): the caller then keeps a live cache (see *Kept caches*).

**Batches and left padding.** ``generate`` sees one rectangular cache length for all rows, so the usable prefix is
the shortest one: with ``pad[r]`` left-padding positions and ``hit[r]`` cached tokens in row ``r``, the first
``L = min_r(pad[r] + hit[r])`` positions are taken from the cache (padding positions cost nothing) and each row
computes the rest. The padding is declared to the cache, so it is never stored, also for models whose attention
does not pass ``position_ids`` to the cache (GPT-NeoX, Falcon, Bloom). A row whose mask is not left-padded (right
padding, holes) turns prefix reuse off for the call.

**Kept caches.** A result that carries the cache (``out.cache`` / ``out.past_key_values``) keeps it valid: it holds
its rows' blocks (prompt and generated tokens, rounded up to whole blocks, in every KV group) until the caller calls
``out.cache.release()`` or drops the last reference to it (garbage collection gives the blocks back). Meanwhile
those blocks count as used: they cannot be evicted and the pool has that much less room for other calls. Passing
it back (``generate(..., cache=out.cache)``) continues the conversation, exactly as with ``DynamicCache``; after
each call its full blocks are in the prefix trie, so later calls that do not pass it hit them too. A call whose
result carries no cache (the default, a tensor) releases it before returning. Calls nested in a call (an assistant
model's ``generate`` in assisted decoding, a ``generate`` inside a stopping criterion, logits processor or streamer)
work the same way.

**Namespaces.** ``with namespace("tenant-a"): model.generate(...)`` or ``model.generate(..., pagedcore_namespace=
"tenant-a")``: prompts in different namespaces never share blocks (a prefix hit is measurably faster, so shared
blocks would let one tenant probe another's prompts by timing; see vLLM's CVE-2025-46570). An explicit ``None``
(``pagedcore_namespace=None`` or ``namespace(None)``) is the shared default namespace, also inside
``with namespace("X")`` and for a model enabled with a namespace of its own. Calls nested in a call run in its
namespace. A kept cache registers its blocks only when continued in the namespace it was made in.

**Calls that compute the whole prompt.** A call that asks for ``output_attentions`` or ``output_hidden_states``
takes no prefix hit (and no shared prefill for ``num_return_sequences`` / beams), so those outputs cover every prompt
position exactly as without ``enable``. So does assisted or prompt-lookup decoding, which transformers 5.24 gets
wrong after a pre-filled cache (also a ``DynamicCache``). Their blocks are still registered. Early-exit decoding
(``assistant_early_exit``) drafts with the model itself, its config cut to the first layers for a nested ``generate``:
those draft calls run as stock ``generate``.

**Weights that change.** Every call first has the pool compare the model's weights fingerprint with the last one
(:meth:`PagedKVPool.check_weights`: parameters' identities and version counters, optimizer steps, PEFT adapter
state, module structure; see :mod:`.weights`). After an optimizer step, ``load_state_dict``, a replaced parameter or
an adapter loaded, switched, merged or disabled, the cached prefixes are forgotten, so the call computes its prompt
with the new weights as stock ``generate`` would. A kept cache holds what it computed (continuing it goes on from
those keys and values, as a kept ``DynamicCache`` would), and its blocks are never cached afterwards.

**A converted model.** After ``model.to(dtype or device)`` the cached keys and values belong to the model as it was.
The next call rebuilds the pool (drops its tensors and cached prefixes) when no cache holds blocks, and raises
:class:`~pagedcore.errors.PoolMismatchError` saying what to release otherwise.

**Copies.** ``copy.deepcopy`` / ``copy.copy`` / ``pickle`` / ``torch.save`` of an enabled model give a plain model of
its own weights (:func:`_plain_reduce`); ``enable(copy)`` gives it a pool of its own. ``enable(torch.compile(model))``
enables the module the compiled one wraps.

``num_return_sequences`` / ``num_beams`` > 1: the prompt is computed once for the unexpanded batch, then every row
is forked; the copies share the prompt's blocks (copy-on-write) instead of recomputing and storing it k times.

**Rows that repeat a prompt** (an RL trainer's group: TRL's GRPO puts each prompt ``num_generations`` times in one
call) are forked the same way: the distinct rows compute their prompt once; and a prefix several distinct rows share
(a system prompt) is computed once and hit by all of them (:mod:`.shared_rows`). (A model with recurrent-state layers
computes its rows as :mod:`.state_prefill` says instead.)

**Images, video, audio.** A prompt's prefix key names each multimodal item's placeholders by a digest of its content
(:mod:`.multimodal`): a prompt with another image at the same placeholders reuses only the text before it. A prefix
holds all of a call's items or none of them; when it holds them all the call's content is left out (the cache
holds what it gave) and multimodal-RoPE models (Qwen2-VL) get the whole prompt's ``rope_deltas``.

**Encoder-decoder models** (Whisper, T5, BART): each call gets ``EncoderDecoderCache(PagedCache(model),
DynamicCache())`` (the decoder's self-attention paged, the cross-attention computed once per call beside it); the
prefix of ``decoder_input_ids`` is reused under the same encoder input only (:mod:`.seq2seq_calls`).

The call's settings, its hit and its reservation are :mod:`.generate_call`'s.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch
from torch.utils.hooks import RemovableHandle

from pagedcore.block_keys import namespace_key
from pagedcore.capacity import Reservation
from pagedcore.config import PoolConfig
from pagedcore.engine.context import ContextWindow
from pagedcore.engine.inputs import TOKEN_DTYPES, check_token_tensor
from pagedcore.errors import ConfigError, InvalidRequestError, PoolMismatchError
from pagedcore.validation import as_integer

from . import sleep_mode
from .cache import PagedCache
from .encoder_decoder import is_encoder_decoder
from .generate_call import (
    CallSettings,
    Lookups,
    attach_hit,
    call_mask,
    call_settings,
    carries_cache,
    draws_dropout,
    give_back,
    keyword_args,
    left_pads,
    reserve_call,
)
from .model_inputs import SEQUENCE_INPUTS, model_inputs
from .multimodal import CallItems, call_keys
from .pool import KVStoreSpec, PagedKVPool
from .probe import cache_path
from .seq2seq_calls import run_seq2seq
from .shared_rows import SharedRows, shared_rows, warm_shared_prefixes
from .spec import context_limit, packed_rope_limit, text_config
from .state_prefill import StatePrefill

__all__ = ["disable", "enable", "is_enabled", "namespace", "prefix_pool"]

NAMESPACE_KWARG = "pagedcore_namespace"
_UNSET: Any = object()
_namespace: ContextVar[Any] = ContextVar("pagedcore_namespace", default=_UNSET)


@dataclass
class _Enabled:
    pool: PagedKVPool
    namespace: Hashable
    attention_backend: str | None
    # The instance attributes enable() sets (generate, __reduce_ex__) as they were before it (_ABSENT: none).
    before: dict[str, Any]
    sleep_hook: RemovableHandle | None = None


_ENABLED: weakref.WeakKeyDictionary[Any, _Enabled] = weakref.WeakKeyDictionary()
_ABSENT: Any = object()
_INSTALLED = ("generate", "__reduce_ex__")
# The model whose early-exit call (assistant_early_exit) is running in this context: its draft passes run as stock.
_drafting: ContextVar[Any] = ContextVar("pagedcore_early_exit", default=None)


def enable(
    model: Any,
    *,
    pool: PagedKVPool | None = None,
    config: PoolConfig | None = None,
    num_blocks: int | None = None,
    memory_budget: int | float | str | None = None,
    block_size: int | None = None,
    namespace: Hashable = None,
    attention_backend: str | None = None,
    eviction_policy: str | None = None,
    kv_store: KVStoreSpec | None = None,
    kv_store_bytes: int | float | str | None = None,
    state_slots: int | None = None,
    snapshot_interval: int | None = None,
    sleep_when_training: bool = False,
) -> PagedKVPool:
    """Make plain ``model.generate(...)`` reuse cached prompt prefixes across calls.

    Args:
        model: a transformers causal LM.
        pool: a pool to use (e.g. shared with an Engine); else one is created with ``config`` (a
            :class:`~pagedcore.config.PoolConfig`) or the keyword arguments that build one:
        num_blocks / memory_budget / block_size / eviction_policy / state_slots / snapshot_interval: sizing of a new
            pool (see PagedKVPool; the last two for recurrent-state layers, :mod:`.state_prefill`).
        namespace: default namespace of its calls (override per call or block; ``None``: the shared default one).
        attention_backend: backend for ``attn_implementation="paged"`` (default: the plugins' choice).
        kv_store / kv_store_bytes: tiers below a new pool (a directory, a budget): evicted prefixes outlive restarts.
        sleep_when_training: the pool sleeps at each training forward (:func:`~.sleep_mode.sleep_when_training`).

    Returns the pool (hit rate: ``pool.num_hit_tokens / pool.num_query_tokens``). Kept results, weight updates,
    ``model.to(...)``: the module docstring; a prompt + ``max_new_tokens`` past the context: ``InvalidRequestError``.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters import transformers as pc
        >>> model = tiny_llama()
        >>> pool = pc.enable(model, num_blocks=64, block_size=4)
        >>> prompt = torch.arange(1, 14)[None]
        >>> _ = model.generate(prompt, max_new_tokens=2, do_sample=False)   # cold: computes 13 tokens
        >>> _ = model.generate(prompt, max_new_tokens=2, do_sample=False)   # warm: 12 cached, computes 1
        >>> pool.num_hit_tokens, pool.kv.num_used_blocks    # nothing held after the call
        (12, 0)
        >>> _ = pc.disable(model)
    """
    model = _uncompiled(model)
    if model in _ENABLED:
        raise ConfigError("prefix caching is already enabled on this model; call disable(model) first")
    sizes = {"num_blocks": num_blocks, "memory_budget": memory_budget, "block_size": block_size}
    more = {"eviction_policy": eviction_policy, "kv_store": kv_store, "kv_store_bytes": kv_store_bytes}
    more |= {"state_slots": state_slots, "snapshot_interval": snapshot_interval}
    made = pool is None
    pool = PagedKVPool.resolve(model, pool, PoolConfig.of(config, **sizes, **more))
    state = _enabled_state(model, pool, made, namespace, attention_backend, sleep_when_training)
    model.generate, model.__reduce_ex__ = _wrapped_generate(model, state), _plain_reduce(model, state)
    _ENABLED[model] = state
    return pool


def _enabled_state(
    model: Any, pool: PagedKVPool, made: bool, namespace: Hashable, attention_backend: str | None, sleeps: bool
) -> _Enabled:
    """What :func:`enable` keeps for ``model`` once its pool is made (``made``: by it) or bound: the model's path is
    exact or refused here, not at the first call; a refused model leaves no tiers of a pool made for it open."""
    with pool.closed_on_failure(made):
        cache_path(model, pool, PagedCache, attention_backend, reuse=True)
        state = _Enabled(
            pool, namespace, attention_backend, {name: vars(model).get(name, _ABSENT) for name in _INSTALLED}
        )
        state.sleep_hook = sleep_mode.sleep_when_training(model, pool) if sleeps else None
    return state


def _uncompiled(model: Any) -> Any:
    """The module a ``torch.compile``d model (an ``OptimizedModule``) wraps, whose ``generate`` its own delegates to
    (``compiled.generate`` is the module's: it runs the module's forward, uncompiled); any other model itself."""
    inner = getattr(model, "_orig_mod", None) if isinstance(model, torch.nn.Module) else None
    return _uncompiled(inner) if isinstance(inner, torch.nn.Module) else model


def _wrapped_generate(model: Any, state: _Enabled) -> Callable[..., Any]:
    """The ``generate`` :func:`enable` installs: the model's own (instance or class), run through :func:`_generate`.
    It holds the model weakly, so an enabled model is still garbage collected."""
    own = state.before["generate"]
    had_instance = own is not _ABSENT
    original = own if had_instance else type(model).generate
    model_ref = weakref.ref(model)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        target = model_ref()
        if target is None:
            raise ReferenceError("the model was garbage collected")
        call = original if had_instance else functools.partial(original, target)
        return _generate(target, call, state, args, kwargs)

    return generate


def _plain_reduce(model: Any, state: _Enabled) -> Callable[[SupportsIndex], Any]:
    """The ``__reduce_ex__`` :func:`enable` installs, through which ``copy.copy``, ``copy.deepcopy``, ``pickle`` and
    ``torch.save`` take the model: as the plain model, without what ``enable`` added (its ``generate``, this method,
    the ``sleep_when_training`` hook). A copy is a plain model of its own weights (``enable(copy)`` gives it a pool of
    its own), never one whose ``generate`` runs the original; the pool and its prefixes are not copied."""
    model_ref = weakref.ref(model)

    def __reduce_ex__(protocol: SupportsIndex) -> Any:
        target = model_ref()
        if target is None:
            raise ReferenceError("the model was garbage collected")
        reduce_ex: Any = type(target).__reduce_ex__  # the class's: what copies and pickles of the model use
        reduced = reduce_ex(target, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
            return reduced
        attributes = dict(reduced[2])  # a copy of the model's __dict__ (nn.Module.__getstate__)
        for name, value in state.before.items():
            if value is _ABSENT:
                attributes.pop(name, None)
            else:
                attributes[name] = value
        hook = state.sleep_hook
        for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
            table = attributes.get(hooks)
            if hook is not None and isinstance(table, dict) and hook.id in table:
                table = table.copy()
                del table[hook.id]
                attributes[hooks] = table
        return (reduced[0], reduced[1], attributes, *reduced[3:])

    return __reduce_ex__


def disable(model: Any) -> PagedKVPool:
    """Restore the model's own ``generate``. Returns the pool (its cached prefixes stay until it is dropped).

    Caches returned by earlier calls stay valid and keep their blocks until released or dropped.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> pool = enable(model, num_blocks=16)
        >>> disable(model) is pool, is_enabled(model)
        (True, False)
    """
    model = _uncompiled(model)
    state = _ENABLED.pop(model, None)
    if state is None:
        raise ConfigError("prefix caching is not enabled on this model")
    if state.sleep_hook is not None:
        state.sleep_hook.remove()
    for name, value in state.before.items():
        if value is _ABSENT:
            delattr(model, name)
        else:
            setattr(model, name, value)
    return state.pool


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` is in effect for ``model``.

    Example:
        >>> is_enabled(object())
        False
    """
    return _uncompiled(model) in _ENABLED


def prefix_pool(model: Any) -> PagedKVPool:
    """The pool :func:`enable` gave ``model``.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> pool = enable(model, num_blocks=16)
        >>> prefix_pool(model) is pool
        True
        >>> _ = disable(model)
    """
    state = _ENABLED.get(_uncompiled(model))
    if state is None:
        raise ConfigError("prefix caching is not enabled on this model")
    return state.pool


@contextmanager
def namespace(name: Hashable) -> Iterator[None]:
    """Run ``generate`` calls of enabled models in the block under prefix-cache namespace ``name``.

    A per-call ``pagedcore_namespace=`` overrides it; an explicit ``None`` (here or per call) is the shared default
    namespace, not "unset": ``with namespace(None)`` inside ``with namespace("X")`` shares with calls that never set
    a namespace.

    Example:
        >>> with namespace("tenant-a"):
        ...     pass  # model.generate(...) here only shares prefixes with other "tenant-a" calls
    """
    token = _namespace.set(name)
    try:
        yield
    finally:
        _namespace.reset(token)


# ---------------------------------------------------------------------- the wrapped generate
def _generate(model: Any, call: Callable[..., Any], state: _Enabled, args: tuple[Any, ...], kwargs: dict) -> Any:
    args, kwargs = keyword_args(call, args, kwargs)  # generate(ids, config) planned as generation_config=config
    if _drafting.get() is model:
        # A draft pass of this model's own assistant_early_exit call: transformers runs generate with the config cut
        # to the first layers (its own cache, not this pool's); stock, as without enable.
        return call(*args, **kwargs)
    drafting = _drafting.set(model) if _early_exit(model, kwargs) else None
    try:
        return _namespaced(model, call, state, args, kwargs)
    finally:
        if drafting is not None:
            _drafting.reset(drafting)


def _early_exit(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for early-exit assisted decoding (``assistant_early_exit``, per call or in its config)."""
    if kwargs.get("assistant_early_exit") is not None:
        return True
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "assistant_early_exit", None) is not None


def _namespaced(model: Any, call: Callable[..., Any], state: _Enabled, args: tuple[Any, ...], kwargs: dict) -> Any:
    explicit = NAMESPACE_KWARG in kwargs
    ns = kwargs.pop(NAMESPACE_KWARG, _UNSET)
    if ns is _UNSET:
        ns = _namespace.get()
    if ns is _UNSET:
        ns = state.namespace
    try:
        hash(ns)
    except TypeError:
        raise InvalidRequestError(f"the prefix-cache namespace must be hashable (a str is best), got {ns!r}") from None
    # Calls nested in this one (an assistant model's generate, a generate in a callback) run in its namespace.
    token = _namespace.set(ns) if explicit else None
    try:
        return _run(model, call, state, args, kwargs, ns)
    finally:
        if token is not None:
            _namespace.reset(token)


def _run(
    model: Any, call: Callable[..., Any], state: _Enabled, args: tuple[Any, ...], kwargs: dict, ns: Hashable
) -> Any:
    if _peft_per_call(model, state) or draws_dropout(model):  # dropout: each call's keys are its own draw's
        return call(*args, **kwargs)
    if is_encoder_decoder(model):  # the decoder's self-attention paged, keyed by the encoder input (seq2seq_calls)
        _check_placement(state)
        return run_seq2seq(model, call, state.pool, state.attention_backend, args, kwargs, ns)
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(input_ids, torch.Tensor) or kwargs.get("inputs_embeds") is not None:
        return call(*args, **kwargs)  # inputs_embeds (or no tensor at all: generate's own checks)
    _check_input_ids(model, input_ids)
    settings = call_settings(model, kwargs, input_ids.shape[1])
    mask = call_mask(input_ids, kwargs.get("attention_mask"), settings)
    _check_context(model, mask, settings)
    passed = kwargs.get("cache")
    if passed is None:
        passed = kwargs.get("past_key_values")
    if passed is not None:
        if isinstance(passed, PagedCache) and passed.pool is state.pool:
            _check_placement(state)
            return _continue(model, call, state, passed, args, kwargs, input_ids, mask, settings, ns)
        return call(*args, **kwargs)  # the caller's own cache
    if not settings.use_cache or _rope_changes(model, input_ids.shape[1]):
        return call(*args, **kwargs)
    _check_placement(state)
    return _fresh(model, call, state, args, kwargs, input_ids, mask, settings, ns)


def _rope_changes(model: Any, prompt: int) -> bool:
    """Whether a prompt of ``prompt`` positions crosses where the model's rotary frequencies change with the
    forward's largest position (dynamic, longrope: :func:`~.spec.packed_rope_limit`): stock computes it in one
    forward at the other frequencies, where a hit's keys came from a shorter forward, so the call runs as stock. Its
    decode steps are the same forwards either way."""
    rope = packed_rope_limit(model)
    return rope is not None and prompt > rope[0]


def _peft_per_call(model: Any, state: _Enabled) -> bool:
    """Whether PEFT changes this call's forward in a way its token ids do not show, so that it must run as stock
    ``generate`` (nothing reused, nothing cached): prompt learning (prompt tuning, P-tuning: the
    ``prepare_inputs_for_generation`` PEFT sets on the model for the call puts virtual tokens before the ids) or a
    mixed batch's ``adapter_names`` (PEFT's forward pre-hooks on the LoRA layers, a row's adapter per call)."""
    bound = vars(model).get("prepare_inputs_for_generation")
    config = getattr(getattr(bound, "__self__", None), "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        return True
    with state.pool.lock:
        state.pool.check_weights()  # the tuner layers as they are now
        watch = state.pool.weights
        return watch is not None and watch.tuners_hooked()


def _fresh(
    model: Any,
    call: Callable[..., Any],
    state: _Enabled,
    args: tuple[Any, ...],
    kwargs: dict,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    settings: CallSettings,
    ns: Hashable,
) -> Any:
    """A call without a cache of its own: attach the prefix hit to a new cache, reserve the call's worst case,
    compute what the rows share once, generate, register, release."""
    pads = left_pads(mask)
    pool = state.pool
    cache = PagedCache(model, pool=pool, namespace=ns, attention_backend=state.attention_backend)
    keep = False
    plan = _Plan(None, None, None, 0)
    try:
        keys = call_keys(model, input_ids, kwargs)  # the token ids, multimodal placeholders keyed by their content
        rows = [keys[r][p:] for r, p in enumerate(pads)] if pads is not None and keys is not None else None
        items = CallItems.of(model, input_ids, mask, kwargs, rows)
        if pool.states is not None and any(items.spans):
            rows = None  # a recurrent-state model's multimodal prompt: computed as stock, nothing reused or cached
        plan = _plan(model, state, cache, input_ids, mask, rows, pads, settings, ns, kwargs, items)
        cache.reservation = plan.reservation
        length = plan.length
        if length and pads is not None:
            kwargs = items.after_hit(model, kwargs, pads, length)
        states, share = plan.states, plan.share
        if states is not None and pads is not None and states.active:
            length = states.run(cache, pads, model_inputs(model, kwargs))
            if settings.expand > 1:  # generate expands the batch but never the cache
                cache.batch_repeat_interleave(settings.expand)
        elif share is not None:  # each distinct prompt once, then every row forks from its own (copy-on-write)
            unique = list(share.unique)
            _prefill_once(model, cache, input_ids[unique], mask[unique], length, kwargs)
            cache.batch_select_indices(torch.tensor(share.rows(settings.expand)))
        elif settings.expand > 1:
            cache.batch_repeat_interleave(settings.expand)
        kwargs["cache"] = cache
        result = call(*args, **kwargs)
        if rows is not None and pads is not None:
            _register(cache, result, pads, settings, rows)
        keep = carries_cache(result, cache)
        return result
    finally:
        if plan.states is not None:
            plan.states.release()
        give_back(pool, plan.reservation, cache)
        if not keep:
            cache.release()


@dataclass
class _Plan:
    """What a fresh call computes: the rows' prefill for a model with recurrent-state layers (``states``), or which
    rows compute their prompt once (``share``); its reservation and the rectangular length already attached."""

    states: StatePrefill | None
    share: SharedRows | None
    reservation: Reservation | None
    length: int


def _plan(
    model: Any,
    state: _Enabled,
    cache: PagedCache,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    rows: list[list[int]] | None,
    pads: list[int] | None,
    settings: CallSettings,
    ns: Hashable,
    kwargs: dict[str, Any],
    items: CallItems | None = None,
) -> _Plan:
    """Look the rows up, attach their hit and reserve the call's worst case (in one hold of the pool's lock: no other
    holder takes blocks in between); a prefix several distinct rows share is computed first (:mod:`.shared_rows`)."""
    pool, batch = state.pool, input_ids.shape[0]
    states = None  # a model with recurrent-state layers: its rows computed alone, to snapshot points
    if pool.states is not None and rows is not None and settings.reuse:
        states = StatePrefill(model, pool, ns, state.attention_backend)
        share = SharedRows(tuple(range(batch)), tuple(range(batch))) if settings.expand > 1 else None
    else:
        share = _sharing(model, input_ids, mask, settings, kwargs)
    unique = list(share.unique) if share is not None else list(range(batch))
    own_rows = [rows[r] for r in unique] if rows is not None else None  # the rows the cache holds
    own_pads = [pads[r] for r in unique] if pads is not None else None
    if states is None and own_rows is not None and len(own_rows) > 1 and _mergeable(model, settings, kwargs):
        # A prefix several distinct rows share (a system prompt): computed once here, then they all hit it.
        backend, device, prefill = state.attention_backend, input_ids.device, _prefill_once
        warm_shared_prefixes(model, pool, own_rows, ns, prefill, kwargs, device=device, attention_backend=backend)
    length = 0
    with pool.lock:
        held, lookups = cache.row_tokens(), None
        if states is not None and rows is not None:
            held = states.plan(rows)
            lookups = Lookups(pool, rows, held, ns, [row.match for row in states.rows])
        elif own_rows is not None and own_pads is not None:
            length, lookups = attach_hit(
                cache, pool, own_rows, own_pads, ns, lookup=settings.reuse, ids=unique, items=items
            )
            held = cache.row_tokens()
        copies = [n * settings.expand for n in share.copies()] if share is not None else None
        shape = (len(unique), input_ids.shape[1])
        reservation = reserve_call(pool, held, shape, own_pads, settings, copies, kwargs, states is not None)
        if lookups is not None:  # counted once granted: a refused call leaves the statistics as they were
            lookups.record()
        if states is not None and pads is not None:
            states.attach(reservation, cache, pads)
    return _Plan(states, share, reservation, length)


def _continue(
    model: Any,
    call: Callable[..., Any],
    state: _Enabled,
    cache: PagedCache,
    args: tuple[Any, ...],
    kwargs: dict,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    settings: CallSettings,
    ns: Hashable,
) -> Any:
    """A call given a PagedCache of this pool (one returned by an earlier call): continue it, then register.

    Its blocks are registered only when they hold exactly the rows' tokens: the mask is left padding equal to the
    padding the cache left out, one row per sequence (no beams or expansion), and the call runs in the namespace
    the cache was made in. The caller owns the cache: it is never released here. The call reserves its worst case
    for its own length (one row per sequence), unless the cache holds a reservation of its own, which it draws from.
    """
    pads = left_pads(mask)
    pool = state.pool
    reservation, own = None, cache.reservation  # a cache that holds a reservation of its own draws from that one
    if own is None and settings.expand == 1 and cache.batch_size == input_ids.shape[0]:
        with pool.lock:
            shape = tuple(input_ids.shape)
            reservation = reserve_call(pool, cache.row_tokens(), shape, cache.row_padding(), settings, None, kwargs)
        cache.reservation = reservation
    try:
        result = call(*args, **kwargs)
    finally:
        give_back(pool, reservation, cache)
    keys = call_keys(model, input_ids, kwargs)
    if (
        pads is not None
        and keys is not None
        and pads == cache.row_padding()
        and settings.expand == 1
        and namespace_key(cache.namespace) == namespace_key(ns)  # the trie's identity: ("t", 1) is not ("t", True)
    ):
        _register(cache, result, pads, settings, [row[p:] for row, p in zip(keys, pads)])
    return result


# ---------------------------------------------------------------------- checks (typed errors, nothing changed)
def _check_input_ids(model: Any, input_ids: torch.Tensor) -> None:
    """Typed errors for input the prefix cache (or the model) would otherwise trip over half-way through a call: a
    batch (2-D) of token ids, with the Engine's rules on the ids (:func:`.inputs.check_token_tensor`)."""
    if input_ids.dim() != 2:
        raise InvalidRequestError(f"input_ids must be 2-D (batch, tokens), got shape {tuple(input_ids.shape)}")
    vocab = as_integer(getattr(text_config(model), "vocab_size", None)) or None
    check_token_tensor(
        input_ids, vocab_size=vocab, name="input_ids", dtypes=TOKEN_DTYPES, hint="; pass embeddings as inputs_embeds="
    )


def _check_context(model: Any, mask: torch.Tensor, settings: CallSettings) -> None:
    """Prompt + new tokens must fit the model's context (positions count real tokens: padding takes none); the rule
    is :class:`~pagedcore.engine.context.ContextWindow`'s."""
    window = ContextWindow(context_limit(model))
    if window.limit is None or mask.numel() == 0:
        return
    window.check(int(mask.ne(0).sum(dim=1).max()), settings.max_new_tokens, which="the longest prompt")


def _check_placement(state: _Enabled) -> None:
    """Have the pool notice a weight update (it forgets the old prefixes) or a conversion (it rebuilds when idle),
    and say what holds the pool of a converted model that cannot rebuild yet."""
    pool = state.pool
    with pool.lock:
        pool.check_weights()
        stored = pool.stale_placement
        if stored is None:
            return
        now = pool.weights.placement if pool.weights is not None else None
        dtype, device = now if now is not None else (None, None)
        raise PoolMismatchError(
            f"the model is now {dtype} on {device} but this pool holds keys and values computed as {stored[0]} on "
            f"{stored[1]}, and {pool.kv.num_used_blocks} of its blocks are held "
            "(caches returned by earlier calls with return_dict_in_generate=True, or an Engine's requests). Release "
            "them (out.cache.release()) or drop them; the next call then rebuilds the pool"
        )


def _prefill_once(
    model: Any, cache: PagedCache, input_ids: torch.Tensor, mask: torch.Tensor, start: int, kwargs: dict[str, Any]
) -> None:
    """Compute prompt positions ``start .. T-2`` for the unexpanded batch, so forks share them: the model gets what
    ``generate`` would give it for those positions, through the model's own ``prepare_inputs_for_generation``, with
    every model input the call was given (``token_type_ids`` and the like, sliced to the positions)."""
    end = input_ids.shape[1] - 1
    if end <= start:
        return
    extra = model_inputs(model, kwargs)
    for key in SEQUENCE_INPUTS:
        value = extra.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] == input_ids.shape[1]:
            extra[key] = value[..., :end]
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        extra["position_ids"] = positions[:, :end]
    if "logits_to_keep" in parameters:
        extra.setdefault("logits_to_keep", 1)
    prepared = model.prepare_inputs_for_generation(
        input_ids[:, :end],
        next_sequence_length=end - start,
        cache=cache,
        attention_mask=mask[:, :end],
        is_first_iteration=True,
        use_cache=True,
        **extra,
    )
    with torch.no_grad():
        model(**prepared)


def _register(
    cache: PagedCache, result: Any, pads: list[int], settings: CallSettings, prompts: list[list[int]]
) -> None:
    """Register every row's full blocks in the trie: its prompt's key (``prompts``: the rows' keys after their
    padding, multimodal placeholders named by their content) and the tokens it generated, from the output; only its
    prompt after beam search (whose rows get reordered) or without sequences in the output."""
    sequences = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    tokens: list[list[int]] = []
    for i in range(max(cache.batch_size, 0)):
        source = i // settings.expand
        prompt = prompts[source]
        if settings.beams == 1 and isinstance(sequences, torch.Tensor) and i < sequences.shape[0]:
            tokens.append(prompt + sequences[i, pads[source] + len(prompt) :].tolist())
        else:
            tokens.append(prompt)
    if tokens:
        cache.cache_prefixes(tokens)


def _sharing(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, settings: CallSettings, kwargs: dict[str, Any]
) -> SharedRows | None:
    """Which rows compute their prompt once and fork (None: every row computes its own). Identical rows merge
    (:func:`.shared_rows.shared_rows`) when the call gives the model nothing else per row; ``num_return_sequences``
    and beams fork each row. Not for a call that must compute its whole prompt (``settings.reuse`` off)."""
    if not settings.reuse or input_ids.shape[0] == 0:
        return None
    if _mergeable(model, settings, kwargs):
        share = shared_rows(input_ids, mask)
        if share.num_merged:
            return share
    if settings.expand > 1:
        batch = input_ids.shape[0]
        return SharedRows(tuple(range(batch)), tuple(range(batch)))
    return None


def _mergeable(model: Any, settings: CallSettings, kwargs: dict[str, Any]) -> bool:
    """Whether rows that look alike (ids, mask, a prefix) compute alike: the call reuses prefixes and gives the
    model no other per-row input (``token_type_ids``, images, ...)."""
    return settings.reuse and not any(isinstance(v, torch.Tensor) for v in model_inputs(model, kwargs).values())
