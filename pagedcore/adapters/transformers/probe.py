"""No silent wrong output, by construction: a one-time probe of a model's paged path when an Engine, a
:class:`~pagedcore.adapters.transformers.PagedCache` or ``enable()`` is set up on it.

The paged path is exact only if every layer's attention receives the forward's context and attends over the keys
and values its layer computed. A model can break that in its own code, silently: a decoder layer that calls its
attention without the model's keyword arguments (StableLM, Nemotron: the Engine's context never reaches the
attention), a layer that changes its keys or values after ``cache.update`` returned them (JetMoE tiles its KV
heads, DiffLlama splits its values: the pool holds what ``update`` was given, not what the attention uses), a layer
that reads another layer's keys without storing its own (unless the model's description says it shares them: Gemma 3n
and Gemma 4's KV-shared layers), a model that attends in its own code (Falcon, Bloom).
So before the first real forward, a probe runs a few short forwards of the model through the path, on a private
pool, and the same forwards with a ``DynamicCache`` (the reference: the model's own output), and checks two things:

- **instrumentation** (:class:`ProbeTrace`): every layer whose cache returned only its new keys (the attention must
  read the pool) had its attention receive the context, with exactly the tensors ``update`` returned (an MLA layer's
  attention gets them expanded by its ``expand_kv``, which :func:`~.layer_attention.verify_latent` checks); and every KV
  group's sliding window is one the model keeps (its mask builder or attention calls ask for it: Moshi's config
  names a window its attention never applies, which no path nor a reused prefix can match);
- **the output**: the logits of every probed position equal the reference's, within a float tolerance of the dtype
  (:func:`tolerance`). The Engine's reference is one forward over each whole sequence, what ``generate`` computes.

The first path that passes is used; if none does, construction raises
:class:`~pagedcore.errors.UnsupportedModelError` naming why each failed. The Engine tries its packed paged path, then
the compatible one (:mod:`.padded_step`: left-padded rows, the model's own attention); a ``PagedCache`` whose model
attends with ``attn_implementation="paged"`` tries paged reads, then gathered keys (the layers return their keys
from the blocks, as without paged attention); any other ``PagedCache`` checks its gathered keys. A model nobody
tested is thereby exact or refused. The probe's forwards run on a pool of their own (its blocks and, for a model with
recurrent-state layers, its state slots), so the holder's pool is never touched.

The Engine is not probed for a model with recurrent-state layers: its scheduler refuses them (it gives sequences no
state slots yet) right after, with its reason. A ``PagedCache`` and ``enable()`` of such a model are probed like
any other. Each verdict is kept per model (weakly) and per setting (path kind, attention
implementation, block size, backend, dtype, device), so only the first construction pays: five or six forwards of
at most ``block_size + 4`` tokens, in eager mode (measured in ``docs/families.md``: ``examples/probe_cost.py``).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from pagedcore.block_tables import BlockTables
from pagedcore.engine.engine import Engine
from pagedcore.engine.runner import ForwardBatch
from pagedcore.engine.sampling import SamplingParams
from pagedcore.errors import UnsupportedModelError
from pagedcore.scheduler import ScheduledSequence
from pagedcore.sequence import SequenceState

from .attention import ATTN_IMPLEMENTATION, PROBE_TRACE
from .encoder_decoder import is_encoder_decoder
from .pool import PagedKVPool
from .spec import ModelKVSpec, context_limit, text_config

__all__ = ["PathCheck", "ProbeTrace", "Verdict", "cache_path", "engine_path", "forced", "tolerance", "verdicts"]

logger = logging.getLogger(__name__)

PAGED, PADDED, GATHERED = "paged", "padded", "gathered"
_FORCED: ContextVar[str | None] = ContextVar("pagedcore_probe_path", default=None)
_VERDICTS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Verdict]] = weakref.WeakKeyDictionary()
_PROBING = threading.RLock()
_PROBE_SLOTS = 8  # state slots of a probe's private pool (two rows, and the copies a forward hands out)


@dataclass
class ProbeTrace:
    """What one probe forward's layers did (set on the :class:`~.attention.ForwardContext`; only a probe sets one).
    ``shared``: each KV-shared layer's source layer (it stores nothing and reads its source's keys); ``latent``: MLA
    layers (their attention gets the keys ``update`` returned expanded by their ``expand_kv``).

    Example:
        >>> trace, k, v = ProbeTrace(), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
        >>> trace.stored(0, k, v, returns_new=True, injected=False)
        >>> trace.read(0, k.repeat(1, 2, 1, 1), v)   # the layer tiled its keys after update (JetMoE)
        >>> trace.stored(1, k, v, returns_new=True, injected=True)   # and layer 1's attention never saw the context
        >>> for problem in trace.problems():
        ...     print(problem)
        layer 0 attends over other keys or values than its cache returned
        layer 1's attention never received the context
    """

    shared: dict[int, int] = field(default_factory=dict)
    latent: set[int] = field(default_factory=set)
    returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stores: set[int] = field(default_factory=set)
    injected: set[int] = field(default_factory=set)
    reads: set[int] = field(default_factory=set)
    altered: set[int] = field(default_factory=set)
    windows: set[int] = field(default_factory=set)  # windows the model asked masks or attention calls to keep

    @classmethod
    def of(cls, spec: ModelKVSpec) -> ProbeTrace:
        """A trace for a model of ``spec`` (its KV-shared and MLA layers)."""
        shared = {i: layer.kv_source for i, layer in enumerate(spec.layers) if layer.kv_source is not None}
        return cls(shared, {i for i, layer in enumerate(spec.layers) if layer.latent is not None})

    def stored(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, *, returns_new: bool, injected: bool = False
    ) -> None:
        """The cache's ``update`` of ``layer`` returned ``keys, values``; ``returns_new``: those are only the new
        tokens' (the attention must read the pool through the context); ``injected``: the context reached the
        layer's keyword arguments only through ``update``'s."""
        self.stores.add(layer)
        if returns_new:
            self.returned[layer] = (keys, values)
        if injected:
            self.injected.add(layer)

    def read(self, layer: int, keys: torch.Tensor, values: torch.Tensor, sliding_window: int | None = None) -> None:
        """``layer``'s attention received the context, with ``keys`` and ``values`` (and ``sliding_window``)."""
        self.reads.add(layer)
        self.masked(sliding_window)
        returned = self.returned.get(layer)
        same = returned is None or (_same(keys, returned[0]) and _same(values, returned[1]))
        if not same and layer not in self.latent:
            self.altered.add(layer)

    def masked(self, window: int | None) -> None:
        """The model built a mask (or called attention) keeping the last ``window`` tokens (None: no window)."""
        if window is not None:
            self.windows.add(int(window))

    def unkept(self, windows: dict[int, int | None]) -> list[int]:
        """The windows of ``windows`` (layer -> its KV group's window) the model never keeps: no sliding mask of that
        size, no attention call given it. Such layers attend past the window in the model's own code (Moshi's
        config names one its attention never applies), so a cache that drops keys out of it gives other output."""
        return sorted({w for layer, w in windows.items() if w is not None and layer in self.reads} - self.windows)

    def problems(self, windows: dict[int, int | None] | None = None) -> list[str]:
        """Why the paged path would not be exact (empty: nothing found); ``windows``: each layer's KV-group window."""
        out = [f"its layers with a {w}-token window attend past it" for w in self.unkept(windows or {})]
        out += [f"layer {i} attends over other keys or values than its cache returned" for i in sorted(self.altered)]
        unstored = [i for i in sorted(self.reads) if self.shared.get(i, i) not in self.stores]
        out += [f"layer {i} reads the pool without storing its own keys" for i in unstored]
        missing = sorted(set(self.returned) - self.reads)
        out += [f"layer {i}'s attention never received the context" for i in missing]
        return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


@dataclass(frozen=True)
class PathCheck:
    """One path's probe: ``exact``, or ``reason`` why not; ``error``: the largest logit difference to the reference
    relative to the reference's largest logit (nan when the path raised or was not run); ``injected``: some layer
    received the context only through ``update``'s keyword arguments (the Engine's compiled decode, which hands the
    context at the top only, is then not used); ``window``: the model attends past a window its cache layers keep
    (no path is exact then, nor any reuse of a prefix).

    Example:
        >>> PathCheck("padded", True, error=3e-7).exact
        True
    """

    path: str
    exact: bool
    reason: str = ""
    error: float = float("nan")
    injected: bool = False
    window: bool = False


@dataclass(frozen=True)
class Verdict:
    """The probes of one model for one kind of holder (``"engine"`` or ``"cache"``): the path chosen (None: none
    is exact) and every path tried, in order; ``seconds`` the probe took (the reference's forwards included).

    Example:
        >>> v = Verdict("engine", None, (PathCheck("paged", False, "layer 0's attention never received the context"),
        ...     PathCheck("padded", False, "logits differ")), 0.01, "StableLmForCausalLM")
        >>> v.refusal().split(" (")[1]
        "paged path: layer 0's attention never received the context; padded path: logits differ)"
    """

    kind: str
    path: str | None
    checks: tuple[PathCheck, ...]
    seconds: float
    model: str
    reuse: str = ""  # why a cached prefix would change the model's output ("" when it would not)

    def check(self, path: str) -> PathCheck | None:
        """The probe of ``path``, if it ran."""
        return next((c for c in self.checks if c.path == path), None)

    @property
    def injected(self) -> bool:
        """Whether the chosen path's probe saw a layer get the context only through ``update``'s keyword
        arguments (or the path was not the packed one): the Engine's compiled decode is then not used."""
        chosen = self.check(self.path) if self.path is not None else None
        return self.path != PAGED or (chosen is not None and chosen.injected)

    def refusal(self) -> str:
        """The message of the :class:`UnsupportedModelError` raised for a verdict with no exact path."""
        where = "in the Engine" if self.kind == "engine" else "with a PagedCache"
        why = "; ".join(f"{c.path} path: {c.reason}" for c in self.checks if not c.exact)
        return f"{self.model}: pagedcore cannot serve this model exactly {where} ({why})"


def tolerance(dtype: torch.dtype) -> float:
    """The largest logit difference a probe accepts, relative to the reference's largest logit: float noise of
    ``dtype`` between attention kernels, far below what a lost context or altered keys do (differences of order 1).

    Example:
        >>> tolerance(torch.float32), tolerance(torch.bfloat16)
        (0.0001, 0.05)
    """
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


@contextmanager
def forced(path: str) -> Iterator[None]:
    """While probing: caches and runners made inside take ``path`` without probing (the probe's own).

    Example:
        >>> with forced("gathered"):
        ...     _FORCED.get()
        'gathered'
    """
    token = _FORCED.set(path)
    try:
        yield
    finally:
        _FORCED.reset(token)


# ---------------------------------------------------------------------- the verdicts
def cache_path(
    model: Any, pool: PagedKVPool, cache_type: type, attention_backend: str | None = None, *, reuse: bool = False
) -> str:
    """The path a ``cache_type`` (:class:`~pagedcore.adapters.transformers.PagedCache`) on ``model`` takes:
    ``"paged"`` (the model attends with ``attn_implementation="paged"`` and reads the pool) or ``"gathered"`` (the
    layers return their keys from the blocks). Probed once per model and setting; raises
    :class:`UnsupportedModelError` when neither is exact, and with ``reuse`` (``enable()``) when a cached prefix would
    change the model's output.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedCache, PagedKVPool
        >>> model = tiny_llama()
        >>> cache_path(model, PagedKVPool(model, num_blocks=8, block_size=4), PagedCache)   # sdpa: keys gathered
        'gathered'
        >>> model.set_attn_implementation("paged")
        >>> cache_path(model, PagedKVPool(model, num_blocks=8, block_size=4), PagedCache)
        'paged'
    """
    chosen = _FORCED.get()
    if chosen is not None:
        return chosen
    verdict = _verdict(
        model, pool, attention_backend, "cache", lambda: _probe_cache(model, pool, attention_backend, cache_type)
    )
    if verdict.path is None:
        raise UnsupportedModelError(verdict.refusal())
    if reuse and verdict.reuse:
        raise UnsupportedModelError(
            f"{verdict.model}: a cached prefix would change this model's output ({verdict.reuse}), so enable() "
            "cannot reuse its prefixes; a PagedCache serves it as generate does"
        )
    return verdict.path


def engine_path(model: Any, pool: PagedKVPool, runner_type: type, attention_backend: str | None = None) -> Verdict:
    """The path of an Engine's runner (``runner_type``, e.g. :class:`~.runner.TransformersRunner`) on ``model``:
    ``verdict.path`` is ``"paged"`` (the packed forward, ``attn_implementation="paged"``) or ``"padded"``
    (:class:`~.padded_step.PaddedStep`), probed once per model and setting by running ``runner_type`` itself on a
    private pool. Leaves the model's attention set for that path (``"paged"``, or the implementation it had).
    Raises :class:`UnsupportedModelError` when no path is exact.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> from pagedcore.adapters.transformers.runner import TransformersRunner
        >>> model = tiny_llama()
        >>> verdict = engine_path(model, PagedKVPool(model, num_blocks=8, block_size=4), TransformersRunner)
        >>> verdict.path, model.config._attn_implementation, verdict.check("paged").error < tolerance(torch.float32)
        ('paged', 'paged', True)
    """
    if is_encoder_decoder(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model: the Engine takes decoder prompts only, with no "
            "encoder input per request; use model.generate with enable(model), or with "
            "EncoderDecoderCache(PagedCache(model), DynamicCache())"
        )
    name = type(model).__name__
    chosen = _FORCED.get()
    if chosen is not None:  # the probe's own runner
        verdict = Verdict("engine", chosen or PAGED, (), 0.0, name)
    else:
        original = getattr(text_config(model), "_attn_implementation", None)
        probe = _probe_state_engine if pool.states is not None else _probe_engine
        verdict = _verdict(
            model, pool, attention_backend, "engine", lambda: probe(model, pool, runner_type, attention_backend)
        )
        if verdict.path != PAGED:
            _restore(model, original)
        if verdict.path is None:
            raise UnsupportedModelError(verdict.refusal())
        paged = verdict.check(PAGED)
        if verdict.path != PAGED and paged is not None:
            logger.warning(
                "pagedcore: the Engine runs %s on its compatible path (left-padded rows over the model's own "
                "attention: exact, slower than the packed paged path, which is not exact for it: %s)",
                name,
                paged.reason,
            )
    if verdict.path == PAGED:
        _use_paged_attention(model)
    return verdict


def _use_paged_attention(model: Any) -> None:
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if getattr(text_config(model), "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        # transformers leaves such a model as it was (with a warning): its attention would read only the step's
        # own keys from the Engine's cache, the cached ones never, and answer wrongly without an error.
        raise UnsupportedModelError(
            f"{type(model).__name__} does not attend through transformers' AttentionInterface, so the Engine's "
            "paged attention cannot serve it (PagedCache and enable() run a model's own attention where their "
            "probe finds it exact; else stock generate)"
        )


def _restore(model: Any, original: str | None) -> None:
    """Give ``model`` back the attention implementation ``original`` (when it has another now)."""
    if original is not None and getattr(text_config(model), "_attn_implementation", None) != original:
        model.set_attn_implementation(original)


def verdicts(model: Any) -> list[Verdict]:
    """The verdicts probed for ``model`` so far (one per kind of holder and setting), oldest first.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> model = tiny_llama()
        >>> Engine(model, num_blocks=16, block_size=4).close()
        >>> [(v.kind, v.path) for v in verdicts(model)]
        [('engine', 'paged')]
    """
    return list(_VERDICTS.get(model, {}).values())


def _verdict(model: Any, pool: PagedKVPool, backend: str | None, kind: str, probe: Callable[[], Verdict]) -> Verdict:
    config = text_config(model)
    weight = model.get_input_embeddings().weight
    key = (kind, getattr(config, "_attn_implementation", None), pool.block_size, backend, weight.dtype, weight.device)
    with _PROBING:  # one probe at a time: two threads setting up the same model probe it once
        known = _VERDICTS.setdefault(model, {})
        verdict = known.get(key)
        if verdict is None:
            # The backend the paged path will ask for, asked now (of the plugins, not through the pool, whose lookups
            # are its forwards'): a name nobody offers, or a plugin that fails, is refused when the Engine or cache
            # is built (PluginError), not at its first forward (the probe would take it for a path that is not exact).
            pool.plugins.attention_backend(weight.device.type, weight.dtype, backend)
            # Eager even for a torch.compile'd forward: the probe's shapes would each compile a graph (seconds, and
            # graphs the model's own steps never use); the verdict is about the model's code, the same either way.
            # In eval mode: the verdict is about the model's code, and dropout's draws would differ between the
            # probe's two forwards (a model in train() was refused, and the refusal kept after .eval()).
            modes = [(module, module.training) for module in model.modules()]
            model.eval()
            try:
                with torch.compiler.set_stance("force_eager"):
                    verdict = known[key] = probe()
            finally:
                for module, training in modes:
                    module.training = training
    return verdict


# ---------------------------------------------------------------------- inputs and the reference
def _tokens(model: Any, count: int, seed: int) -> list[int]:
    """``count`` ordinary token ids of the model's vocabulary (no special or placeholder token: an image token
    without its image would make a multimodal model raise)."""
    config = text_config(model)
    vocab = int(getattr(config, "vocab_size", 0) or model.get_input_embeddings().weight.shape[0])
    special: set[int] = set()
    for holder in {id(c): c for c in (config, getattr(model, "config", config))}.values():
        for name, value in vars(holder).items():
            if name.endswith(("token_id", "token_ids", "token_index")):
                special.update(
                    v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)
                )
    allowed = [t for t in range(min(vocab, 4096)) if t not in special and t > 2] or list(range(vocab))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(allowed), (count,), generator=generator).tolist()
    return [allowed[i] for i in picks]


def _lengths(model: Any, pool: PagedKVPool) -> tuple[int, int]:
    """The probe's long and short sequence: across a block boundary, within the model's context."""
    longest = pool.block_size + 3
    limit = context_limit(model)
    if limit is not None:
        longest = max(2, min(longest, limit - 4))
    return longest, max(2, min(5, longest - 2))


def _forward_kwargs(model: Any) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    scale = float(want.abs().max().clamp_min(1.0))
    return float((got.float().to(want.device) - want).abs().max()) / scale


def _compare(
    path: str, got: torch.Tensor, want: torch.Tensor, pool: PagedKVPool, trace: ProbeTrace | None
) -> PathCheck:
    windows = {i: pool.kv.groups[g].sliding_window for i, g in enumerate(pool.spec.layer_groups) if g is not None}
    problems = trace.problems(windows) if trace is not None else []
    injected = bool(trace.injected) if trace is not None else False
    error = _error(got, want) if got.shape == want.shape else float("inf")
    if problems:
        window = trace is not None and bool(trace.unkept(windows))
        return PathCheck(path, False, "; ".join(problems[:3]), error, injected, window)
    if not error <= tolerance(pool.dtype):
        return PathCheck(path, False, f"its logits differ from the model's own by {error:.2g} (relative)", error)
    return PathCheck(path, True, "", error, injected)


def _failed(path: str, exc: BaseException) -> PathCheck:
    return PathCheck(path, False, f"the probe forward raised {type(exc).__name__}: {str(exc)[:300]}")


def _device(model: Any) -> torch.device:
    return model.get_input_embeddings().weight.device


def _private_pool(model: Any, pool: PagedKVPool, lengths: list[int]) -> PagedKVPool:
    """A pool like ``pool`` (block size, layout, dtype, plugins) with room for sequences of ``lengths`` tokens (and
    state slots for them, for a model with recurrent-state layers): the probe's forwards never touch ``pool``."""
    bs = pool.block_size
    blocks = sum(-(-n // bs) for n in lengths)
    return PagedKVPool(
        model,
        num_blocks=blocks,
        block_size=bs,
        kv_layout=pool.config.kv_layout,
        state_slots=_PROBE_SLOTS if pool.states is not None else None,
        dtype=pool.dtype,
        plugins=pool.plugins,
    )


@contextmanager
def _tracing(trace: ProbeTrace | None) -> Iterator[None]:
    token = PROBE_TRACE.set(trace)
    try:
        yield
    finally:
        PROBE_TRACE.reset(token)


# ---------------------------------------------------------------------- the Engine's probe
@dataclass(frozen=True)
class _Schedule:
    """Two sequences and three packed steps: a prefill chunk ending inside a block beside a whole short prompt,
    the rest of the chunk beside a decode, then two decodes."""

    prompts: list[list[int]]
    steps: list[list[tuple[int, int, int]]]  # per step, (sequence, first position, end)

    @classmethod
    def of(cls, model: Any, pool: PagedKVPool) -> _Schedule:
        long, short = _lengths(model, pool)
        chunk = max(1, min(pool.block_size + 1, long - 1))
        steps = [
            [(0, 0, chunk), (1, 0, short)],
            [(0, chunk, long), (1, short, short + 1)],
            [(0, long, long + 1), (1, short + 1, short + 2)],
        ]
        return cls([_tokens(model, long + 1, 1), _tokens(model, short + 2, 2)], steps)

    def batches(self, pool: PagedKVPool) -> Iterator[ForwardBatch]:
        """The steps as the Engine hands them to its runner, over blocks of ``pool`` (every position's logits
        kept); the blocks are given back at the end."""
        seqs = [SequenceState(f"probe-{i}", prompt, max_new_tokens=1) for i, prompt in enumerate(self.prompts)]
        for seq in seqs:
            seq.blocks = BlockTables(pool.kv)
        try:
            for step in self.steps:
                scheduled = []
                for i, start, end in step:
                    blocks = seqs[i].blocks
                    assert blocks is not None
                    blocks.append(end - start)
                    scheduled.append(ScheduledSequence(seqs[i], start, end - start, False, 0))
                count = sum(end - start for _, start, end in step)
                yield ForwardBatch(scheduled, [], list(range(count)), count, False)
        finally:
            for seq in seqs:
                if seq.blocks is not None:
                    seq.blocks.release()


def _engine_reference(model: Any, schedule: _Schedule) -> torch.Tensor:
    """Every scheduled position's logits as ``generate`` computes them for a sequence alone: one forward over all
    its tokens (what its prefill gives; its decode steps agree), in the packed order of the steps. Not the steps'
    own chunks through a ``DynamicCache``: a model whose chunked forwards differ from one forward would then be
    checked against its own fault."""
    device = _device(model)
    with torch.inference_mode():
        whole = [model(input_ids=torch.tensor([ids], device=device)).logits[0].float() for ids in schedule.prompts]
    return torch.cat([whole[seq][start:end] for step in schedule.steps for seq, start, end in step])


def _probe_engine(model: Any, pool: PagedKVPool, runner_type: type, backend: str | None) -> Verdict:
    started = time.perf_counter()
    schedule = _Schedule.of(model, pool)
    original = getattr(text_config(model), "_attn_implementation", None)
    try:
        want = _engine_reference(model, schedule)
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__}: pagedcore could not check this model (its own forward raised "
            f"{type(exc).__name__}: {exc})"
        ) from exc
    checks = [_check_engine(model, pool, runner_type, backend, schedule, want, PAGED)]
    _restore(model, original)
    if not checks[0].exact and not checks[0].window:  # a window the model does not keep: padded rows drop it too
        checks.append(_check_engine(model, pool, runner_type, backend, schedule, want, PADDED))
    path = next((c.path for c in checks if c.exact), None)
    return Verdict("engine", path, tuple(checks), time.perf_counter() - started, type(model).__name__)


def _probe_state_engine(model: Any, pool: PagedKVPool, runner_type: type, backend: str | None) -> Verdict:
    """A model with recurrent-state layers: a real Engine on a private pool runs two prompts greedily with chunked
    prefill (chunks of two blocks and more ending inside a block, cut at a snapshot at every block, so pieces of
    several tokens continue a state), each step's logits against one forward over the sequence's tokens so far (what
    ``generate`` computes). Its only path is the packed one (state steps). A family whose state layers drop the state
    in a scan of several tokens and that ``state_spec`` does not know as such is refused here, not served wrongly."""
    started = time.perf_counter()
    bs = pool.block_size
    _, short = _lengths(model, pool)
    limit = context_limit(model)
    long = 3 * bs + 3 if limit is None else max(2, min(3 * bs + 3, limit - 4))
    prompts = [_tokens(model, long, 1), _tokens(model, short, 2)]
    new = 3
    try:
        private = _private_pool(model, pool, [len(p) + new for p in prompts])
        with forced(PAGED):
            runner = runner_type(model, pool=private, compile=False, attention_backend=backend)
            # a chunk of several blocks: pieces of several tokens continue a state from a snapshot point; closing the
            # Engine closes its runner (the model's attention given back)
            with Engine(runner, max_num_batched_tokens=2 * bs + 3) as engine:
                params = SamplingParams(max_new_tokens=new, ignore_eos=True, return_logits=True)
                outputs = engine.generate(prompts, params, use_tqdm=False)
        errors = [out.error for out in outputs if out.error is not None]
        if errors:
            raise RuntimeError(errors[0])
        got = torch.cat([torch.stack(list(out.samples[0].logits or [])).float() for out in outputs])
        device = _device(model)
        with torch.inference_mode():
            want = torch.cat(
                [
                    model(input_ids=torch.tensor([prompt + list(out.token_ids[:-1])], device=device))
                    .logits[0, len(prompt) - 1 :]
                    .float()
                    for prompt, out in zip(prompts, outputs)
                ]
            )
        check = _compare(PAGED, got, want, pool, None)
    except Exception as exc:
        check = _failed(PAGED, exc)
    return Verdict(
        "engine", PAGED if check.exact else None, (check,), time.perf_counter() - started, type(model).__name__
    )


def _check_engine(
    model: Any,
    pool: PagedKVPool,
    runner_type: type,
    backend: str | None,
    schedule: _Schedule,
    want: torch.Tensor,
    path: str,
) -> PathCheck:
    """The Engine's own runner on ``path`` over a private pool: its ``prepare`` and ``execute`` of each step."""
    trace = ProbeTrace.of(pool.spec) if path == PAGED else None
    try:
        private = _private_pool(model, pool, [len(p) for p in schedule.prompts])
        with forced(path), _tracing(trace):
            runner = runner_type(model, pool=private, compile=False, attention_backend=backend)
            try:
                got = torch.cat([runner.execute(runner.prepare(batch)) for batch in schedule.batches(private)])
            finally:
                runner.close()
    except Exception as exc:
        return _failed(path, exc)
    return _compare(path, got, want, pool, trace)


# ---------------------------------------------------------------------- the PagedCache's probe
@dataclass(frozen=True)
class _Batch:
    """A left-padded batch of two rows and the forwards ``generate`` would run: the prompt, then three tokens on
    the warm cache (a multi-token query meets cached keys: masks must be exact), then one (a model with
    recurrent-state layers: one at a time after the prompt, as ``generate`` runs it)."""

    ids: torch.Tensor  # (2, prompt + 4)
    mask: torch.Tensor
    cuts: tuple[int, ...]  # the forwards' ends
    later_masks: bool = True  # the forwards after the prompt get the mask (generate drops it for Mamba)

    @classmethod
    def of(cls, model: Any, pool: PagedKVPool) -> _Batch:
        long, _ = _lengths(model, pool)
        # MiniMax's own cache (the reference) folds a row's left padding into its linear-attention state: the probe
        # checks it on unpadded rows (its padded batches: tests/test_hybrid_prefix.py, against stock generate)
        custom = pool.state_spec.custom_cache
        pad = 2 if long > 3 and not custom else 0
        width = long + 4
        ids = torch.tensor([_tokens(model, width, 3), _tokens(model, width, 4)])
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0
        ids[1, :pad] = ids[0, 0]  # a pad position holds some token: the mask hides it
        if pool.state_spec.has_states:  # as generate runs them: one token at a time on a warm state (Mamba's and
            # MiniMax's forwards take no multi-token query after the prompt with a mask of the whole sequence), with
            # the mask where generate passes one (Mamba's forward, from transformers 5.25, multiplies each token by it)
            cuts = (long, long + 1, long + 2, long + 3, long + 4)
            return cls(ids, mask, cuts, _decode_gets_mask(model, ids, mask))
        return cls(ids, mask, (long, long + 3, long + 4))

    def run(self, model: Any, cache: Any) -> torch.Tensor:
        """The logits of every real position, forward after forward (an encoder-decoder model: of its decoder, over
        an encoder output computed once, ``cache`` the self-attention half of an ``EncoderDecoderCache``)."""
        parameters = _forward_kwargs(model)
        device = _device(model)
        positions = (self.mask.cumsum(-1) - 1).clamp_min(0)
        prefix, extra = "", {}
        if is_encoder_decoder(model):
            prefix, extra = "decoder_", {"encoder_outputs": _encoder_output(model, self.ids.shape[0])}
            cache = EncoderDecoderCache(cache, DynamicCache())
        rows, start = [], 0
        with torch.inference_mode():
            for end in self.cuts:
                kwargs: dict[str, Any] = {
                    f"{prefix}input_ids": self.ids[:, start:end].to(device),
                    "cache": cache,
                    "use_cache": True,
                    **extra,
                }
                if f"{prefix}attention_mask" in parameters and (start == 0 or self.later_masks):
                    kwargs[f"{prefix}attention_mask"] = self.mask[:, :end].to(device)
                if f"{prefix}position_ids" in parameters:
                    kwargs[f"{prefix}position_ids"] = positions[:, start:end].to(device)
                logits = model(**kwargs).logits.float()
                rows.append(logits[self.mask[:, start:end].bool().to(logits.device)])
                start = end
        return torch.cat(rows)


def _decode_gets_mask(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``generate`` passes the attention mask to a decode step of ``model`` (its own
    ``prepare_inputs_for_generation`` says; Mamba's drops it after the prompt). True when it cannot tell."""
    try:
        inputs = model.prepare_inputs_for_generation(
            ids, attention_mask=mask, cache=DynamicCache(), use_cache=True, is_first_iteration=False,
            next_sequence_length=1,
        )  # fmt: skip
    except Exception:  # a model whose preparation needs more than this: it keeps the mask, as most do
        return True
    return not isinstance(inputs, dict) or "attention_mask" not in inputs or inputs["attention_mask"] is not None


def _encoder_output(model: Any, rows: int) -> Any:
    """An encoder-decoder model's encoder output for ``rows`` inputs of its kind: token ids, or audio features of
    the length its encoder takes (Whisper: ``2 * max_source_positions`` frames)."""
    name = getattr(model, "main_input_name", "input_ids")
    config = model.config
    generator = torch.Generator().manual_seed(5)
    if name == "input_features":
        bins = int(getattr(config, "num_mel_bins", 80))
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        value = torch.randn(rows, bins, frames, generator=generator).to(_device(model), model.dtype)
    elif name == "input_ids":
        value = torch.tensor([_tokens(model, 8, 6 + r) for r in range(rows)], device=_device(model))
    else:
        raise UnsupportedModelError(f"{type(model).__name__}: pagedcore cannot make a probe input for its {name!r}")
    with torch.inference_mode():
        return model.get_encoder()(**{name: value})


def _reference_cache(model: Any, pool: PagedKVPool) -> Any:
    """The cache stock ``generate`` gives the model: a ``DynamicCache``, or the cache class of its own that its
    modeling file defines where it requires one (MiniMax's ``MiniMaxCache``: ``StateSpec.custom_cache``)."""
    if pool.state_spec.custom_cache:
        module = sys.modules[type(model).__module__]
        own = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, DynamicCache)]
        own = [v for v in own if v.__module__ == module.__name__]
        if own:
            return own[0]()
    return DynamicCache(config=model.config)


def _probe_cache(model: Any, pool: PagedKVPool, backend: str | None, cache_type: type) -> Verdict:
    started = time.perf_counter()
    batch = _Batch.of(model, pool)
    try:
        want = batch.run(model, _reference_cache(model, pool))
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__}: pagedcore could not check this model (its own forward with a DynamicCache "
            f"raised {type(exc).__name__}: {str(exc)[:300]})"
        ) from exc
    checks = []
    if getattr(text_config(model), "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        checks.append(_check_cache(model, pool, backend, cache_type, PAGED, batch, want))
    if not checks or not checks[0].exact:
        checks.append(_check_cache(model, pool, backend, cache_type, GATHERED, batch, want))
    path = next((c.path for c in checks if c.exact), None)
    windowed = checks[0] if checks[0].path == PAGED else _window_check(model, pool, backend, cache_type, batch, want)
    reuse = windowed.reason if windowed is not None and windowed.window else ""
    return Verdict("cache", path, tuple(checks), time.perf_counter() - started, type(model).__name__, reuse)


def _window_check(
    model: Any, pool: PagedKVPool, backend: str | None, cache_type: type, batch: _Batch, want: torch.Tensor
) -> PathCheck | None:
    """For a model with sliding-window layers that does not attend with ``"paged"``: its windows checked by a paged
    run (the mask builder and the attention calls say which windows it keeps), its attention restored after."""
    if all(g.sliding_window is None for g in pool.kv.groups):
        return None
    original = getattr(text_config(model), "_attn_implementation", None)
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if getattr(text_config(model), "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            return None  # it attends in its own code: its mask is its own
        return _check_cache(model, pool, backend, cache_type, PAGED, batch, want)
    finally:
        if original is not None and getattr(text_config(model), "_attn_implementation", None) != original:
            model.set_attn_implementation(original)


def _check_cache(
    model: Any, pool: PagedKVPool, backend: str | None, cache_type: type, path: str, batch: _Batch, want: torch.Tensor
) -> PathCheck:
    trace = ProbeTrace.of(pool.spec) if path == PAGED else None
    try:
        private = _private_pool(model, pool, [batch.cuts[-1]] * 2)
        with forced(path), _tracing(trace):
            cache = cache_type(model, pool=private, attention_backend=backend)
            got = batch.run(model, cache)
        cache.release()
    except Exception as exc:
        return _failed(path, exc)
    return _compare(path, got, want, pool, trace)
