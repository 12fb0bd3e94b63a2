"""The peers the benchmarks run side by side, each one small adapter, and the equality check that comes first.

- :class:`CacheKind`: how one ``generate`` call keeps its KV cache: ``DynamicCache``, ``StaticCache``, a
  ``PagedCache`` with sdpa or with ``attn_implementation="paged"``, or no cache passed (``enable(model)`` supplies
  one). The single-sequence benchmarks (prefix, cold, memory, decode) time these.
- :class:`Peer`: a way of serving a :class:`Batch` of greedy requests: ``generate`` one request at a time
  (:class:`OneAtATime`), ``generate`` on the left-padded batch (:class:`PaddedBatch`), transformers' continuous
  batching (:class:`ContinuousBatching`), the pagedcore Engine (:class:`EnginePeer`), CTranslate2's ``Generator`` in
  a worker process of its own (:class:`CTranslate2Peer`, on the model converted by its converter). A peer opens a
  session (a server's lifetime: an Engine, a manager's thread) whose ``serve(batch)`` returns :class:`Served`: each
  request's tokens and completion time, and the peer's own counters. A new peer is one more such class.
- :func:`measure`: a peer warmed up, then served once, timed from before its session opens (an Engine or a manager
  created inside the timed run, as a server would) to its last completion, the positions its forwards compute
  counted; :func:`compare`: the equality check, each peer's greedy tokens against the reference's, request by
  request, and its prefill count against the forward hook's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, StaticCache

from pagedcore.adapters.transformers import Engine, EngineStats, PagedCache, PagedKVPool, SamplingParams

from .common import BLOCK_SIZE, PAD, attn, cache_tensor_bytes, counting, generate, greedy, left_padded
from .ct2 import TUNED_MALLOC, Worker
from .runner import Runner, clock

__all__ = [
    "ENGINE_COMPILE",
    "Batch",
    "CTranslate2Peer",
    "CacheKind",
    "ContinuousBatching",
    "EnginePeer",
    "EngineSession",
    "OneAtATime",
    "PaddedBatch",
    "Peer",
    "PeerResult",
    "Served",
    "check_outputs",
    "compare",
    "finished_results",
    "kept_engine",
    "measure",
    "measure_all",
    "mismatches",
]

ONE_AT_A_TIME = "generate, one at a time"
PADDED_BATCH = "generate, padded batch"
HF_CONTINUOUS = "transformers continuous batching"
ENGINE = "pagedcore Engine"
ENGINE_COMPILE: contextvars.ContextVar[bool | str] = contextvars.ContextVar("engine_compile", default="auto")
"""The ``compile=`` of the Engines :class:`EnginePeer` builds (set for a run by ``pagedcore bench --engine-compile``:
:func:`~pagedcore.benchmarks.suite.run_benchmarks`)."""


# ---------------------------------------------------------------------------------------------------- caches
@dataclass(frozen=True)
class CacheKind:
    """How one ``generate`` call keeps its KV cache: ``kind`` is ``"dynamic"``, ``"static"`` (sized to the context),
    ``"paged"`` (a ``PagedCache``, on a pool given or its own) or ``"none"`` (no cache passed: ``enable(model)``
    supplies one); ``attention`` is the attention implementation the call runs with.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> tokens = {kind.name: kind.run(model, [5, 6, 7], 3) for kind in (DYNAMIC, STATIC, PAGED_SDPA, PAGED_ATTN)}
        >>> len(set(map(tuple, tokens.values()))), model.config._attn_implementation   # the same tokens; restored
        (1, 'sdpa')
    """

    name: str
    kind: str
    attention: str = "sdpa"

    def new_cache(self, model: PreTrainedModel, length: int = 0, pool: PagedKVPool | None = None) -> Any:
        """A new cache of this kind (None for ``"none"``); ``length``: a StaticCache's ``max_cache_len``."""
        if self.kind == "dynamic":
            return DynamicCache(config=model.config)
        if self.kind == "static":
            return StaticCache(config=model.config, max_cache_len=length)
        if self.kind == "paged":
            return PagedCache(model, pool=pool)
        return None

    @contextlib.contextmanager
    def cache(self, model: PreTrainedModel, length: int = 0, pool: PagedKVPool | None = None) -> Iterator[Any]:
        """A new cache for the block; a PagedCache gives its blocks back afterwards."""
        cache = self.new_cache(model, length, pool)
        try:
            yield cache
        finally:
            if isinstance(cache, PagedCache):
                cache.release()

    def greedy(self, model: PreTrainedModel, prompt: list[int], new: int, cache: Any, **kwargs: Any) -> list[int]:
        """Greedy ``generate`` of one prompt with ``cache``, in this kind's attention; the new tokens."""
        passed = {} if cache is None else {"cache": cache}
        with attn(model, self.attention), torch.inference_mode():
            return greedy(model, prompt, new, **passed, **kwargs)

    def batch(self, model: PreTrainedModel, prompts: list[list[int]], new: int, cache: Any) -> list[list[int]]:
        """Greedy ``generate`` of the left-padded prompts with ``cache``: each row's ``new`` tokens."""
        ids, mask = left_padded(prompts, model.device)
        passed = {} if cache is None else {"cache": cache}
        with attn(model, self.attention), torch.inference_mode():
            out = generate(model, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **passed)
        return [list(row) for row in out[:, ids.shape[1] :].tolist()]

    def run(self, model: PreTrainedModel, prompt: list[int], new: int, **kwargs: Any) -> list[int]:
        """:meth:`greedy` with a new cache of this kind, sized for the prompt and its new tokens."""
        with self.cache(model, len(prompt) + new) as cache:
            return self.greedy(model, prompt, new, cache, **kwargs)


DYNAMIC = CacheKind("DynamicCache (sdpa)", "dynamic")
STATIC = CacheKind("StaticCache (sdpa)", "static")
PAGED_SDPA = CacheKind("PagedCache (sdpa)", "paged")
PAGED_ATTN = CacheKind('PagedCache + attn_implementation="paged"', "paged", "paged")
ENABLED = CacheKind("generate + `enable(model)`", "none")


# ---------------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Batch:
    """Greedy requests served together: prompts and each one's ``max_new_tokens`` (eos ignored).

    Example:
        >>> Batch([[5, 6], [7]], [4, 2]).size
        2
    """

    prompts: list[list[int]]
    new_tokens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.new_tokens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.new_tokens)} max_new_tokens")

    @property
    def size(self) -> int:
        """Requests."""
        return len(self.prompts)


@dataclass
class Served:
    """What a peer's session computed for one batch.

    Attributes:
        tokens: per request, its greedy tokens (its own ``max_new_tokens`` of them).
        finished: per request, ``time.perf_counter()`` when it completed.
        ended: when the serve call had every result (the wall time ends here).
        prefill: prompt positions computed, by the peer's own counter (None: it has none).
        padding: padding positions computed besides (a padded batch).
        decode_positions: positions computed as decode steps (one per row and step after the first).
        peak_kv_bytes: KV memory at the peak, as ``kv_how`` says.
        steps: the peer's steps, where it counts them.
        note: anything the reader needs to interpret its figures.
        first_tokens: per request, ``time.perf_counter()`` when its first token was generated (None: not stamped).

    Example:
        >>> Served([[1, 2]], finished=[3.0], ended=3.0, decode_positions=1).tokens
        [[1, 2]]
    """

    tokens: list[list[int]]
    finished: list[float]
    ended: float
    prefill: int | None = None
    padding: int = 0
    decode_positions: int = 0
    peak_kv_bytes: int | None = None
    kv_how: str = ""
    steps: int | None = None
    note: str = ""
    first_tokens: list[float] | None = None


Serve = Callable[[Batch], Served]


class Peer(Protocol):
    """A way of serving batches of requests: its ``name`` and a ``session(model)`` that yields its serve call
    (``serve(batch) -> Served``) for the block. A new peer (e.g. another engine) is one class of this shape.

    Example:
        >>> class Echo:   # serves each prompt's last token back, as many times as asked
        ...     name = "echo"
        ...     @contextlib.contextmanager
        ...     def session(self, model: object) -> Iterator[Serve]:
        ...         yield lambda batch: Served([[p[-1]] * n for p, n in zip(batch.prompts, batch.new_tokens)],
        ...                                    finished=[1.0] * batch.size, ended=1.0)
        >>> peer: Peer = Echo()
        >>> with peer.session(None) as serve:
        ...     serve(Batch([[5, 6]], [3])).tokens
        [[6, 6, 6]]
    """

    @property
    def name(self) -> str:
        """What the report calls it."""

    def session(self, model: PreTrainedModel) -> contextlib.AbstractContextManager[Serve]:
        """The peer set up on ``model`` (inside the timed run), as a serve call for the block."""


@dataclass(frozen=True)
class OneAtATime:
    """``generate`` on each request in turn, a fresh cache of ``cache``'s kind each (the reference tokens).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> with OneAtATime().session(model) as serve:
        ...     served = serve(Batch([[5, 6, 7], [8, 9]], [3, 2]))
        >>> [len(t) for t in served.tokens], served.decode_positions
        ([3, 2], 3)
    """

    name: str = ONE_AT_A_TIME
    cache: CacheKind = DYNAMIC

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """Nothing to set up: each request gets its own cache."""
        yield lambda batch: self.serve(model, batch)

    def serve(self, model: PreTrainedModel, batch: Batch) -> Served:
        """Each request in turn; the peak KV is the largest cache's tensor bytes."""
        tokens, finished, peak = [], [], 0
        for prompt, new in zip(batch.prompts, batch.new_tokens):
            with self.cache.cache(model, len(prompt) + new) as cache:
                tokens.append(self.cache.greedy(model, prompt, new, cache))
                finished.append(clock(model.device))
                peak = max(peak, cache_tensor_bytes(cache))
        return Served(tokens, finished, finished[-1], peak_kv_bytes=peak, decode_positions=_decodes(batch),
                      kv_how=f"measured: largest {self.cache.name.split()[0]}, tensor bytes")  # fmt: skip


@dataclass(frozen=True)
class PaddedBatch:
    """One ``generate`` call on the left-padded batch with a fresh DynamicCache, run to the largest
    ``max_new_tokens``, each request's output truncated to its own.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> with PaddedBatch().session(model) as serve:
        ...     served = serve(Batch([[5, 6, 7], [8, 9]], [3, 2]))
        >>> [len(t) for t in served.tokens], served.padding, served.decode_positions
        ([3, 2], 1, 4)
    """

    name: str = PADDED_BATCH

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """Nothing to set up: each call gets its own cache."""
        yield lambda batch: self.serve(model, batch)

    def serve(self, model: PreTrainedModel, batch: Batch) -> Served:
        """The batch in one call; every request completes at the end."""
        width, longest = max(len(p) for p in batch.prompts), max(batch.new_tokens)
        cache = DynamicCache(config=model.config)
        out = DYNAMIC.batch(model, batch.prompts, longest, cache)
        end = clock(model.device)
        return Served(
            tokens=[row[:n] for row, n in zip(out, batch.new_tokens)],
            finished=[end] * batch.size,
            ended=end,
            prefill=sum(len(p) for p in batch.prompts),
            padding=sum(width - len(p) for p in batch.prompts),
            decode_positions=batch.size * (longest - 1),  # every row runs `longest` steps
            peak_kv_bytes=cache_tensor_bytes(cache),
            kv_how="measured: DynamicCache tensor bytes at the end",
            note=(
                f"one `generate` call with max_new_tokens={longest} (the largest), each request's output truncated to "
                f"its own max_new_tokens; it computes {batch.size * longest} tokens for {sum(batch.new_tokens)} "
                "useful ones, and every request completes at the end"
            ),
        )


@dataclass(frozen=True)
class ContinuousBatching:
    """transformers' continuous batching: ``model.continuous_batching_context_manager`` (the manager
    ``generate_batch`` wraps) with ``add_request(max_new_tokens=...)`` per request, added in the order
    ``generate_batch`` uses (sorted by prompt when block sharing is on), sdpa attention.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> batch = Batch([[5, 6, 7], [8, 9]], [3, 2])
        >>> with ContinuousBatching(num_blocks=16, budget=64, max_requests=2).session(model) as serve:
        ...     served = serve(batch)
        >>> served.tokens == OneAtATime().serve(model, batch).tokens
        True
    """

    num_blocks: int
    budget: int
    max_requests: int
    max_new_tokens: int = 16
    name: str = HF_CONTINUOUS

    def config(self) -> Any:
        """Its ``ContinuousBatchingConfig``."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        return ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=self.num_blocks,
                                        max_batch_tokens=self.budget, max_requests_per_batch=self.max_requests,
                                        allow_block_sharing=True)  # fmt: skip

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """The manager's thread for the block; the last batch's note says how long stopping it took."""
        generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD, bos_token_id=1,
                                      max_new_tokens=self.max_new_tokens)  # fmt: skip
        manager_context = model.continuous_batching_context_manager(  # type: ignore[operator]
            generation_config=generation, continuous_batching_config=self.config(), block=True, timeout=30,
            warmup=False,
        )  # fmt: skip
        served: list[Served] = []

        def serve(batch: Batch) -> Served:
            served.append(_manager_serve(manager, batch, len(served)))
            return served[-1]

        with attn(model, "sdpa"), manager_context as manager:
            yield serve
        if served:
            served[-1].note += (
                "prefill tokens computed counted with a forward hook (it reports no counter of its own); wall time "
                "ends at the last request's completion: stopping the manager's thread afterwards took "
                f"{time.perf_counter() - served[-1].ended:.2f} s more, which `generate_batch` also waits for but is "
                "not counted here."
            )


def _manager_serve(manager: Any, batch: Batch, call: int) -> Served:
    order = sorted(range(batch.size), key=lambda i: batch.prompts[i], reverse=True)
    ids = {}
    for i in order:
        rid = manager.add_request(batch.prompts[i], request_id=f"c{call}r{i}", max_new_tokens=batch.new_tokens[i],
                                  eos_token_id=-1)  # fmt: skip
        if rid is None:
            raise RuntimeError(f"the continuous batching manager refused request {i}")
        ids[rid] = i
    tokens: list[list[int]] = [[] for _ in range(batch.size)]
    finished = [0.0] * batch.size
    for result in finished_results(manager, batch.size):
        i = ids[result.request_id]
        tokens[i] = list(result.generated_tokens)
        finished[i] = result.lifespan[1] if result.lifespan[1] > 0 else time.perf_counter()
    processor = getattr(manager, "batch_processor", None)
    tensor = getattr(getattr(processor, "cache", None), "cache_tensor", None)
    reserved = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else None
    return Served(tokens, finished, max(finished), decode_positions=_decodes(batch), peak_kv_bytes=reserved,
                  kv_how="reserved: preallocated cache tensor")  # fmt: skip


def finished_results(manager: Any, count: int) -> Iterator[Any]:
    """The next ``count`` finished results of transformers' continuous batching ``manager``, as they come; a request
    that failed, or the manager's thread stopping first, raises :class:`RuntimeError`.

    Example:
        >>> class Finished:
        ...     request_id, error = "r0", None
        ...     def is_finished(self) -> bool:
        ...         return True
        >>> class Manager:
        ...     def get_result(self, timeout: float) -> Finished:
        ...         return Finished()
        ...     def is_running(self) -> bool:
        ...         return True
        >>> [result.request_id for result in finished_results(Manager(), 2)]
        ['r0', 'r0']
    """
    seen = 0
    while seen < count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before every request finished")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            seen += 1
            yield result


@dataclass(frozen=True)
class EnginePeer:
    """pagedcore's :class:`~pagedcore.adapters.transformers.Engine` (prefix caching on), one Engine per session:
    each serve is one ``Engine.generate`` call, its prefill the Engine's ``stats().prompt_tokens_computed`` since the
    previous call.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> with EnginePeer(num_blocks=16).session(model) as serve:
        ...     first, again = serve(Batch([[5] * 20], [2])), serve(Batch([[5] * 20 + [6]], [2]))
        >>> first.prefill, again.prefill   # the second prompt finds the first one's 20 positions in the prefix cache
        (20, 1)
    """

    num_blocks: int = 64
    budget: int = 512
    max_seqs: int = 64
    name: str = ENGINE

    def engine(self, model: PreTrainedModel) -> Engine:
        """A new Engine of this configuration (block size :data:`~pagedcore.benchmarks.common.BLOCK_SIZE`; decode
        steps as :data:`ENGINE_COMPILE` says)."""
        return Engine(model, num_blocks=self.num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=self.budget,
                      max_num_seqs=self.max_seqs, compile=ENGINE_COMPILE.get())  # fmt: skip

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """One Engine for the block."""
        with self.kept(model) as session:
            yield session.serve

    @contextlib.contextmanager
    def kept(self, model: PreTrainedModel) -> Iterator[EngineSession]:
        """One Engine for the block, as an :class:`EngineSession` (its serve call and the reset between rounds)."""
        with self.engine(model) as engine:
            yield EngineSession(engine)


def kept_engine(stack: contextlib.ExitStack, model: PreTrainedModel, peer: EnginePeer, batch: Batch,
                ) -> EngineSession:  # fmt: skip
    """One Engine for a workload, open until ``stack`` closes, as a server keeps one, warmed untimed on ``batch``
    (the workload itself): it has met the workload's row counts (its row split's and greedy head's trials; decode
    graphs with ``pagedcore bench --engine-compile``) before its timed runs, each of which opens a session that
    forgets the cached prefixes first (:meth:`EngineSession.session`).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model, batch = bench_model(size="tiny"), Batch([[5] * 20], [2])
        >>> with contextlib.ExitStack() as stack:
        ...     session = kept_engine(stack, model, EnginePeer(num_blocks=16), batch)
        ...     with session.session(model) as serve:
        ...         timed = serve(batch)
        >>> timed.prefill, timed.note   # the warm-up's prefixes forgotten; the note counts the session's own work
        (20, '2 steps, 0 preemptions, prefix hits 0 of 20 looked-up prompt tokens')
    """
    session = stack.enter_context(peer.kept(model))
    session.serve(batch)
    return session


class EngineSession:
    """Serves batches on one Engine; a batch's prefill and steps are the Engine's counters since the previous one
    (read after the wall time's end, so no counter read is timed), its note's counts those since the session opened.
    :meth:`reset` forgets the cached prefixes, so an Engine kept across rounds meets each round's prompts as a new
    one would, while what it measured and compiled for the batch's shapes (the row split's ways, the head's,
    compiled decode graphs) stays, as in a server.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> with EnginePeer(num_blocks=16).kept(bench_model(size="tiny")) as session:
        ...     first = session.serve(Batch([[5] * 20], [2]))
        ...     session.reset()
        ...     again = session.serve(Batch([[5] * 20], [2]))
        >>> first.prefill, again.prefill   # the reset forgot the first prompt's blocks
        (20, 20)
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prefill = 0  # the counters as the previous batch left them (a new Engine's are 0)
        self.steps = 0
        self.opened = (0, 0, 0, 0)  # steps, preemptions, prefix hit and looked-up tokens when the session opened

    name = ENGINE

    def reset(self) -> None:
        """Forget every cached prefix (``Engine.reset_prefix_cache``)."""
        self.engine.reset_prefix_cache()

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """This Engine as a :class:`Peer`'s session (``model`` is the one it serves already): its cached prefixes
        forgotten first, so each session meets its prompts as a new Engine would."""
        self.reset()
        stats = self.engine.stats()
        self.opened = (stats.num_steps, stats.num_preemptions, stats.prefix_hit_tokens, stats.prefix_query_tokens)
        yield self.serve

    def serve(self, batch: Batch) -> Served:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in batch.new_tokens]
        outputs = self.engine.generate(batch.prompts, params, use_tqdm=False)
        ended = clock(self.engine.model.device)
        check_outputs(outputs)
        stats = self.engine.stats()
        prefill, steps = stats.prompt_tokens_computed - self.prefill, stats.num_steps - self.steps
        self.prefill, self.steps = stats.prompt_tokens_computed, stats.num_steps
        return Served(
            tokens=[list(o.token_ids) for o in outputs],
            finished=[o.metrics.finish_time or ended for o in outputs],
            first_tokens=[o.metrics.first_token_time or ended for o in outputs],
            ended=ended,
            prefill=prefill,
            decode_positions=_decodes(batch),
            peak_kv_bytes=stats.kv_peak_used_bytes,
            kv_how="measured: blocks held at the peak since the Engine was built",
            steps=steps,
            note=self._note(stats),
        )

    def _note(self, stats: EngineStats) -> str:
        """The Engine's counters since the session opened (a new Engine's: since it was built)."""
        now = (stats.num_steps, stats.num_preemptions, stats.prefix_hit_tokens, stats.prefix_query_tokens)
        steps, preemptions, hits, queries = (a - b for a, b in zip(now, self.opened))
        return f"{steps} steps, {preemptions} preemptions, prefix hits {hits} of {queries} looked-up prompt tokens"


@dataclass(frozen=True)
class CTranslate2Peer:
    """CTranslate2's ``Generator`` on ``model_dir`` (the model converted with its converter:
    :func:`~pagedcore.benchmarks.ct2.convert_model`), one worker process per session
    (:class:`~pagedcore.benchmarks.ct2.Worker`): ``compute_type`` ``"float32"`` or ``"int8"`` (weights quantized as
    they load), ``threads`` intra-op threads, glibc's malloc tuned with ``malloc`` (None: glibc's defaults).

    Each serve is one greedy ``generate_batch`` call (eos ignored, the prompts forwarded at once, each request stopped
    at its own ``max_new_tokens``); with ``static_prompt``, a batch of several prompts that share a prefix passes it
    as ``static_prompt``, which the Generator computes once and caches for the session, as the Engine's prefix cache
    does. Times: the wall from sending the request to its reply, in this process; first and last tokens as the
    worker stamped them, counted from the request's sending (the worker receives it well under a millisecond later).

    Example:
        >>> CTranslate2Peer("ct2-model").shared_prefix(Batch([[5, 6, 7, 8], [5, 6, 9]], [2, 2]))   # at most len - 1
        2
        >>> CTranslate2Peer("ct2-model").shared_prefix(Batch([[5, 6, 7]], [2]))   # one prompt: nothing to share
        0
        >>> from pagedcore.benchmarks.common import bench_model
        >>> from pagedcore.benchmarks.ct2 import convert_model
        >>> model = bench_model(size="tiny")
        >>> peer = CTranslate2Peer(convert_model(model, "/tmp/ct2-tiny"), threads=1)  # doctest: +SKIP
        >>> with peer.session(model) as serve:  # doctest: +SKIP
        ...     [len(t) for t in serve(Batch([[5, 6, 7], [8, 9, 10]], [3, 2])).tokens]
        [3, 2]
    """

    model_dir: str | os.PathLike[str]
    compute_type: str = "float32"
    threads: int = 2
    malloc: tuple[tuple[str, str], ...] | None = tuple(TUNED_MALLOC.items())
    static_prompt: bool = True
    name: str = "CTranslate2"

    @contextlib.contextmanager
    def session(self, model: PreTrainedModel) -> Iterator[Serve]:
        """A worker process for the block, serving ``model`` as converted into ``model_dir``."""
        malloc = None if self.malloc is None else dict(self.malloc)
        with Worker(self.model_dir, self.compute_type, self.threads, malloc) as worker:
            yield lambda batch: self.serve(worker, batch)

    def shared_prefix(self, batch: Batch) -> int:
        """Tokens passed as ``static_prompt``: the prompts' common prefix when there are several (each keeps at
        least one token of its own), else 0."""
        if not self.static_prompt or batch.size < 2:
            return 0
        first, limit = batch.prompts[0], min(len(p) for p in batch.prompts) - 1
        n = 0
        while n < limit and all(p[n] == first[n] for p in batch.prompts):
            n += 1
        return n

    def serve(self, worker: Worker, batch: Batch) -> Served:
        """One ``generate_batch`` call on the worker."""
        shared = self.shared_prefix(batch)
        sent = time.perf_counter()
        reply = worker.generate([p[shared:] for p in batch.prompts], batch.new_tokens, batch.prompts[0][:shared])
        ended = time.perf_counter()
        return Served(
            tokens=reply.tokens,
            finished=[sent + t for t in reply.last],
            first_tokens=[sent + t for t in reply.first],
            ended=ended,
            decode_positions=_decodes(batch),
            note=f"generate_batch took {reply.seconds:.3f} s of the {ended - sent:.3f} s wall"
            + (f"; static_prompt: the {shared} shared tokens" if shared else "")
            + f"; malloc settings in the worker: {' '.join(f'{k}={v}' for k, v in worker.malloc.items()) or 'none'}",
        )


def check_outputs(outputs: Sequence[Any]) -> None:
    """Raise :class:`RuntimeError` when an Engine output carries an error: a benchmark measures finished requests only.

    Example:
        >>> from types import SimpleNamespace
        >>> check_outputs([SimpleNamespace(error=None)])
        >>> check_outputs([SimpleNamespace(error=None), SimpleNamespace(error="boom")])
        Traceback (most recent call last):
        ...
        RuntimeError: 1 requests failed: boom
    """
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")


def _decodes(batch: Batch) -> int:
    return sum(n - 1 for n in batch.new_tokens)


# ---------------------------------------------------------------------------------------------------- measuring
@dataclass
class PeerResult:
    """One peer's run of a batch: wall time, per-request latencies, what it computed, and the equality check.

    Attributes:
        name: the peer.
        wall: seconds from the start to the last request's completion (None when the peer could not run).
        latencies: per request, seconds from the start (all requests arrive at once) to its completion.
        generated_tokens: useful generated tokens (each request's own ``max_new_tokens``).
        prefill_computed: prompt positions computed (real tokens; see ``padding_computed``).
        padding_computed: padding positions computed besides (padded batch).
        peak_kv_bytes: KV memory at the peak; ``kv_how`` says how it was obtained.
        mismatches: requests whose greedy tokens differ from the reference's.
        error: why the peer could not run ("n/a (reason)").
        note: anything the reader needs to interpret the row.
        tokens: per request, its greedy tokens.
        counted_positions: positions the model computed, counted by a forward hook.
        decode_positions: of those, the decode positions (one per generated token after the first, per row run).

    Example:
        >>> PeerResult("pagedcore Engine", wall=2.0, latencies=[1.25, 2.0], generated_tokens=96).tokens_per_second
        48.0
        >>> PeerResult("transformers continuous batching", error="n/a (ImportError: ...)").tokens_per_second is None
        True
    """

    name: str
    wall: float | None = None
    latencies: list[float] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_computed: int | None = None
    padding_computed: int = 0
    peak_kv_bytes: int | None = None
    kv_how: str = ""
    mismatches: list[int] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    tokens: list[list[int]] | None = field(default=None, repr=False)
    counted_positions: int | None = None
    decode_positions: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        """Useful generated tokens per second of wall time."""
        return self.generated_tokens / self.wall if self.wall else None


def measure(model: PreTrainedModel, peer: Peer, batch: Batch, warm: Batch) -> PeerResult:
    """Warm ``peer`` up on ``warm`` (untimed, its own session), then serve ``batch`` in a new session, timed from
    before the session opens to the last completion, counting the positions the model's forwards compute.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> result = measure(model, PaddedBatch(), Batch([[5, 6, 7], [8, 9]], [3, 2]), Batch([[4, 4]], [2]))
        >>> result.generated_tokens, result.counted_positions, result.padding_computed   # 2 x 3 prompt + 2 x 2 decode
        (5, 10, 1)
    """
    with peer.session(model) as serve:
        serve(warm)
    with counting(model) as counter:
        start = clock(model.device)
        with peer.session(model) as serve:
            served = serve(batch)
    return PeerResult(
        peer.name,
        wall=served.ended - start,
        latencies=[t - start for t in served.finished],
        generated_tokens=sum(len(t) for t in served.tokens),
        prefill_computed=served.prefill,
        padding_computed=served.padding,
        peak_kv_bytes=served.peak_kv_bytes,
        kv_how=served.kv_how,
        note=served.note,
        tokens=served.tokens,
        counted_positions=counter.positions,
        decode_positions=served.decode_positions,
    )


def mismatches(reference: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> list[int]:
    """The requests whose tokens differ from the reference's.

    Example:
        >>> mismatches([[1, 2], [3]], [[1, 2], [4]])
        [1]
    """
    return [i for i, (a, b) in enumerate(zip(reference, tokens)) if list(a) != list(b)]


def compare(results: list[PeerResult]) -> None:
    """The equality check, before any figure is read: each peer's tokens against the first peer's (the reference),
    and its own prefill count against the forward hook's (filled in where the peer has no counter of its own).

    Example:
        >>> ref = PeerResult("ref", tokens=[[1], [2]], counted_positions=9, decode_positions=0)
        >>> other = PeerResult("other", tokens=[[1], [3]], counted_positions=5, decode_positions=0, prefill_computed=4)
        >>> compare([ref, other])
        >>> ref.prefill_computed, other.mismatches, other.note
        (9, [1], ' Forward-hook count of prefill positions: 5 (differs from its own counter).')
    """
    reference = results[0].tokens
    for peer in results:
        if reference is not None and peer.tokens is not None:
            peer.mismatches = mismatches(reference, peer.tokens)
        if peer.counted_positions is not None and peer.error is None:
            computed = peer.counted_positions - peer.decode_positions - peer.padding_computed
            if peer.prefill_computed is None:
                peer.prefill_computed = computed
            elif computed != peer.prefill_computed:
                peer.note += f" Forward-hook count of prefill positions: {computed} (differs from its own counter)."


def measure_all(
    model: PreTrainedModel, peers: Sequence[Peer], batch: Batch, warm: Batch, runner: Runner
) -> list[PeerResult]:
    """:func:`measure` for every peer in turn (one that cannot run keeps its row with the reason), then
    :func:`compare` against the first: the first peer's tokens are the reference.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> from pagedcore.benchmarks.context import BenchContext
        >>> ctx = BenchContext(BenchOptions(progress=False, model_size="tiny"))
        >>> model, batch = ctx.model(), Batch([[5, 6, 7], [8, 9]], [3, 2])
        >>> with Runner(ctx, "peers", 2) as runner:
        ...     results = measure_all(model, [OneAtATime(), PaddedBatch()], batch, Batch([[4]], [2]), runner)
        >>> [(r.name, r.mismatches, r.prefill_computed) for r in results]
        [('generate, one at a time', [], 5), ('generate, padded batch', [], 5)]
    """
    results = []
    for peer in peers:
        runner.label(peer.name)
        result, error = runner.attempt(functools.partial(measure, model, peer, batch, warm))
        results.append(result if result is not None else PeerResult(peer.name, error=error))
        runner.tick()
    compare(results)
    return results
