"""The Engine's compiled decode step: a step whose every sequence decodes one token runs as a compiled graph.

The eager step packs its sequences with Python-sized metadata (:mod:`.step_batch`) that changes every step, which a
graph would have to be re-traced for. The decode step here takes only tensors whose shapes are **buckets**: the rows
padded to a power of two (the batch bucket) and each KV group's block tables padded to a power-of-two width (the
width bucket), so a run whose batch and contexts vary compiles once per ``(rows, width)`` bucket and never again.
Prefill and mixed steps stay eager.

- :class:`DecodeInputs`: one decode step's tensors, bucketed, built from the step's packed inputs
  (:meth:`DecodeInputs.from_batch`): token ids, positions, and per KV group the block tables, the new tokens' slots
  and the position of each table's first key. Padding rows are token 0 at position 0 over the pad block; their
  keys are written to the pad block, which is zeroed again in the same op (:func:`store_kv`, one in-place custom op:
  a write through a view of the pool would be functionalized into a copy of the whole pool), and their logits dropped.
- :class:`DecodeAttention`: the layers' attention in that graph (``paged_attention_forward`` hands it every layer's
  call): write the new keys and values to their slots, then attend over each row's blocks under the causal (and
  window, or chunk) mask of its position in one opaque op (:func:`attend_blocks`: on the CPU the torch backend's
  own forward over the step's packed metadata, the eager step's attention to the bit; on CUDA its gathers and
  arithmetic over the bucket, with no host op; never traced into per-element loops over the bucket's padded width).
  Each layer as its description says: a KV-shared layer reads its source's blocks, an MLA layer attends in its latent
  space, sinks join the softmax, Llama 4's query temperature is put right from the positions (:mod:`.layer_attention`).
- :class:`CompiledDecode`: the compiled callable over a model and pool, and its counters (graphs compiled, buckets
  seen, steps run): ``torch.compile`` with inductor on the CPU; on CUDA inductor with CUDA graphs (what
  ``mode="reduce-overhead"`` selects), the pool's tensors marked as static addresses so a captured graph writes
  them in place. Dynamo guards on the modules' forward hooks here (by default it does not: a hook added after a
  graph was compiled would be skipped), so a changed hook compiles the bucket again; the runner runs the step eagerly
  while a global module hook is set, which no guard sees.

What inductor would do worse than the eager step stays an opaque op the graph calls (:mod:`.graph_ops`), so the graph
fuses the norms, rotary embeddings and activations around them and nothing else changes: the pool's writes, the
attention, each linear layer (the eager forward's row split across the threads, its way for the graph's row count
measured by :meth:`CompiledDecode.settle` and traced, or :data:`~.prepacked.ROW_LINEAR`, decided when the graph runs,
while unmeasured; inductor's own ``mm`` is a one-thread GEMV at one row) and the head
(:data:`~.argmax_head.HEAD_CALL`: an argmax-only step's tokens taken inside it, as in the eager step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.attention import PagedAttentionMetadata, bucket, long_tensor, to_device, write_kv
from pagedcore.engine.packing import PackedTokens
from pagedcore.engine.runner import CompileCounts
from pagedcore.plugins.torch_backend import TorchPagedAttention, attend_rows, gather_blocks

from . import row_split
from .attention import CONTEXT_KEY, StepAttention
from .graph_ops import graph_op
from .layer_attention import LatentProjection, pool_read, retemper
from .pool import PagedKVPool
from .prepacked import active_linears
from .step_batch import PackedCache

__all__ = [
    "CompileCounts",
    "CompiledDecode",
    "DecodeAttention",
    "DecodeInputs",
    "attend_blocks",
    "bucket",
    "store_kv",
]

MIN_WIDTH = 4  # the narrowest table bucket, in blocks: short contexts share one graph
BACKEND: str | None = "inductor"  # an Engine's CompiledDecode backend (tests set "eager" or None: see CompiledDecode)
SETTLE_STEPS = 1 + 2 * row_split.TRIALS  # uncompiled runs before a row count's first graph (CompiledDecode.settle)
RECOMPILE_LIMIT = 256  # dynamo's per-function graph limit while a CompiledDecode compiles (_DYNAMO)
_TORCH = TorchPagedAttention()
# dynamo's settings while a CompiledDecode compiles and runs: its per-function graph limit (its default is 8), and
# guards on the modules' hooks (dynamo leaves them out by default, so a hook added after a graph was compiled, a
# steering vector say, would be skipped by every later step: with them a changed hook recompiles the bucket)
_DYNAMO: dict[str, Any] = {"recompile_limit": RECOMPILE_LIMIT, "skip_nnmodule_hook_guards": False}


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor, pad_block: int) -> None:  # fmt: skip
    """Write ``key``/``value`` ``(rows, kv_heads, dim)`` to their ``slots``, then zero the pad block again (padding
    rows wrote there). One op that mutates the pool in place: a graph that wrote through views of the pool would be
    functionalized into a copy of every layer's whole pool per step.

    Example:
        >>> kc, vc = torch.zeros(3, 2, 1, 1), torch.zeros(3, 2, 1, 1)
        >>> store_kv(kc, vc, torch.ones(2, 1, 1), torch.ones(2, 1, 1), torch.tensor([1, 4]), pad_block=2)
        >>> kc.flatten().tolist()   # slot 4 is in the pad block: zeroed again
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """
    write_kv(key_cache, value_cache, key, value, slots)
    key_cache[pad_block].zero_()
    value_cache[pad_block].zero_()


def _store_kv_shapes(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     slots: torch.Tensor, pad_block: int) -> None:  # fmt: skip
    return None


STORE_KV = graph_op("store_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slots, "
                    "int pad_block) -> ()", store_kv, _store_kv_shapes)  # fmt: skip


def store_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, pad_block: int) -> None:
    """Write ``rows (n, heads, dim)`` of one pool tensor (an MLA layer's latent rows: one tensor holds its "keys"
    and "values") to their ``slots``, then zero the pad block again, as :func:`store_kv` does for a key/value pair.

    Example:
        >>> cache = torch.zeros(3, 2, 1, 2)
        >>> store_rows(cache, torch.ones(2, 1, 2), torch.tensor([1, 4]), pad_block=2)
        >>> cache.sum().item()   # slot 1 written, slot 4 (the pad block) zeroed again
        2.0
    """
    cache.view(-1, *cache.shape[-2:]).index_copy_(0, slots, rows.to(cache.dtype))
    cache[pad_block].zero_()


def _store_rows_shapes(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, pad_block: int) -> None:
    return None


STORE_ROWS = graph_op("store_rows(Tensor(a!) cache, Tensor rows, Tensor slots, int pad_block) -> ()", store_rows,
                      _store_rows_shapes)  # fmt: skip


_STEP = threading.local()  # .metadata: the running compiled step's packed metadata per KV group (CompiledDecode)


def attend_blocks(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                  mask: torch.Tensor, pad_block: int, scale: float, softcap: float | None,
                  sinks: torch.Tensor | None, group: int = -1) -> torch.Tensor:  # fmt: skip
    """Attention of ``query (rows, heads, 1, dim)`` over each row's blocks ``tables (rows, width)`` of the pool,
    under ``mask (rows, 1, 1, width * block_size)``, as one op the compiled graph calls without tracing into it
    (traced, the gathers became generated per-element loops over the bucket's padded width, and the step lost to the
    eager one at 16 rows: docs/benchmarks.md, "Compiled decode").

    On the CPU, inside a :class:`CompiledDecode` step (``group``: the KV group of the layer), the torch backend's
    own forward over the step's packed metadata (:data:`_STEP`): the eager step's attention, bit for bit, with its
    plan made once per step and group for every layer (one sequence reads its keys as a view of the pool, a shared
    prefix is read once); the padding rows' output is zero. Elsewhere the gathers and :func:`attend_rows` over the
    bucket.

    Example:
        >>> cache = torch.ones(3, 2, 1, 4)   # 3 blocks of 2 slots, 1 KV head, dim 4
        >>> mask = torch.tensor([[True, True, False, False]])[:, None, None, :]
        >>> attend_blocks(torch.ones(1, 2, 1, 4), cache, cache, torch.tensor([[0, 2]]), mask, 2, 0.5, None, None).shape
        torch.Size([1, 2, 1, 4])
    """
    metadata = getattr(_STEP, "metadata", None)
    if metadata is not None and 0 <= group < len(metadata) and tables.device.type == "cpu":
        meta = metadata[group]
        count = meta.num_tokens  # the step's sequences: the bucket's first rows
        out = query.new_zeros(*query.shape[:3], value_cache.shape[-1])
        packed = query[:count, :, 0]  # (tokens, heads, dim), the eager step's layout
        out[:count, :, 0] = _TORCH.forward(packed, key_cache, value_cache, meta, scale=scale, softcap=softcap,
                                           sinks=sinks)  # fmt: skip
        return out
    if tables.device.type == "cpu":  # only the columns some row uses (on CUDA a graph replays fixed shapes)
        used = (tables != pad_block).any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 1
        if width < tables.shape[1]:
            tables, mask = tables[:, :width], mask[..., : width * key_cache.shape[1]]
        hidden = (~mask).reshape(-1).nonzero().squeeze(1)  # zeroed in the copies: what an earlier owner left there
        k, v = gather_blocks(key_cache, tables, hidden), gather_blocks(value_cache, tables, hidden)
    else:  # no nonzero (a host sync) inside a graph: the hidden slots are zeroed by a mask over the copies
        seen = mask.transpose(-1, -2)  # (rows, 1, keys, 1)
        k = gather_blocks(key_cache, tables).masked_fill(~seen, 0)
        v = gather_blocks(value_cache, tables).masked_fill(~seen, 0)
    return attend_rows(query, k, v, mask, scale, softcap, sinks).contiguous()


def _attend_blocks_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          tables: torch.Tensor, mask: torch.Tensor, pad_block: int, scale: float,
                          softcap: float | None, sinks: torch.Tensor | None,
                          group: int = -1) -> torch.Tensor:  # fmt: skip
    return query.new_empty((*query.shape[:3], value_cache.shape[-1]))


ATTEND_BLOCKS = graph_op("attend_blocks(Tensor query, Tensor key_cache, Tensor value_cache, Tensor tables, "
                         "Tensor mask, int pad_block, float scale, float? softcap, Tensor? sinks, int group=-1) "
                         "-> Tensor", attend_blocks, _attend_blocks_shapes)  # fmt: skip


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step's tensors, ``rows`` (the batch bucket) long; per KV group ``tables`` ``(rows, width)``
    (int64, padded with the pad block), ``slots`` ``(rows,)`` and ``starts`` ``(rows,)``: the position of each
    table's first key (its dropped blocks times the block size). ``real`` rows are the step's sequences.

    Example:
        >>> inputs = DecodeInputs(torch.tensor([7, 0]), torch.tensor([5, 0]), (torch.zeros(2, 4, dtype=torch.long),),
        ...                       (torch.tensor([5, 0]),), (torch.tensor([0, 0]),), real=1)
        >>> inputs.key
        (2, 4)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    tables: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    starts: tuple[torch.Tensor, ...]
    real: int
    metadata: tuple[PagedAttentionMetadata, ...] | None = None  # the eager packing's, per KV group (attend_blocks)

    @property
    def key(self) -> tuple[int, ...]:
        """The bucket: the rows, then each group's table width."""
        return (int(self.input_ids.shape[0]), *(int(t.shape[1]) for t in self.tables))

    @classmethod
    def from_batch(cls, batch: PackedTokens, pool: PagedKVPool, device: torch.device) -> DecodeInputs:
        """The bucketed tensors of a decode-only step's packed inputs (every sequence decodes one token:
        :attr:`~pagedcore.engine.runner.ForwardBatch.is_decode`) on ``device``."""
        n = batch.num_tokens
        rows, pad, pad_slot = bucket(n), rows_pad(bucket(n) - n), pool.pad_block * pool.block_size
        tables, slots, starts = [], [], []
        for meta in batch.metadata:
            width = bucket(int(meta.block_tables.shape[1]), MIN_WIDTH)
            table = torch.full((rows, width), pool.pad_block, dtype=torch.long)
            table[:n, : meta.block_tables.shape[1]] = meta.block_tables
            tables.append(to_device(table, device))
            slots.append(to_device(torch.cat([meta.slot_mapping, pad(pad_slot)]), device))
            offsets = long_tensor(meta.block_offsets) * pool.block_size
            starts.append(to_device(torch.cat([offsets, pad(0)]), device))
        ids = long_tensor(batch.input_ids + [0] * (rows - n))
        positions = long_tensor(batch.position_ids + [0] * (rows - n))
        return cls(to_device(ids, device), to_device(positions, device), tuple(tables), tuple(slots), tuple(starts), n,
                   tuple(batch.metadata))  # fmt: skip


def rows_pad(count: int) -> Callable[[int], torch.Tensor]:
    """``count`` padding entries of a value, as an int64 tensor."""
    return lambda value: torch.full((count,), value, dtype=torch.long)


@dataclass
class DecodeAttention(StepAttention):
    """Every layer's attention in a compiled decode step (see the module docstring): the pool, the step's
    positions and each KV group's tables, slots and first-key positions.

    Example:
        One row at position 0 in block 0 of a 4-block pool (block 4 is the pad block): it sees its own key alone.

        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> pool = PagedKVPool(model, num_blocks=4, block_size=4)
        >>> config = model.config
        >>> kv, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        >>> new = torch.full((1, kv, 1, dim), 2.0)
        >>> _ = pool.layer_kv(0, new[0].transpose(0, 1), new[0].transpose(0, 1))   # the layer's pool tensors
        >>> one = torch.tensor([0])
        >>> attention = DecodeAttention(pool, one, [torch.tensor([[0, 4, 4, 4]])], [one], [one])
        >>> out = attention.attend(0, torch.ones(1, config.num_attention_heads, 1, dim), new, new, 1.0, None, None)
        >>> out.shape[:3], bool((out == 2.0).all()), pool.layer_tensors(0)[0][0, 0].eq(2.0).all().item()
        (torch.Size([1, 1, 4]), True, True)
    """

    pool: PagedKVPool
    positions: torch.Tensor
    tables: Sequence[torch.Tensor]
    slots: Sequence[torch.Tensor]
    starts: Sequence[torch.Tensor]

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               softcap: float | None, sliding_window: int | None, *, module: torch.nn.Module | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``query (1, heads, rows, dim)``, the new ``key``/``value`` ``(1, kv_heads, rows, dim)``: the keys stored
        (by a layer with a cache of its own; a KV-shared layer's source stored them), then attention over each
        row's blocks, as the layer's description says (:mod:`.layer_attention`); returns ``(1, rows, heads,
        dim_v)``."""
        layer = self.pool.spec.layers[layer_idx]
        group, key_cache, value_cache = pool_read(self.pool, layer_idx)
        if layer.has_cache and layer.latent is None:  # an MLA layer's latents were stored by update (store_latent)
            new_keys, new_values = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
            STORE_KV(key_cache, value_cache, new_keys, new_values, self.slots[group], self.pool.pad_block)
        projection = None
        if layer.latent is not None:
            assert module is not None, "an MLA layer's attention needs its module (kv_b_proj)"
            projection = LatentProjection(module, layer.latent)
            query = projection.query(query)
        query = retemper(query, layer, self.positions)
        tables, starts = self.tables[group], self.starts[group]
        keys = tables.shape[1] * self.pool.block_size
        key_pos = starts[:, None] + torch.arange(keys, device=tables.device)[None, :]
        mask = self.pool.kv.groups[group].kind.sees(self.positions[:, None], key_pos)  # causal, window or chunk
        q = query[0].transpose(0, 1).unsqueeze(2)  # (rows, heads, 1, dim)
        out = ATTEND_BLOCKS(
            q, key_cache, value_cache, tables, mask[:, None, None, :], self.pool.pad_block, scale, softcap, sinks, group
        )
        if projection is not None:
            out = projection.output(out.transpose(1, 2)).transpose(1, 2)
        return out.transpose(1, 2).reshape(1, q.shape[0], q.shape[1], -1)

    def store_latent(self, layer_idx: int, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Write an MLA layer's new latents ``(1, 1, rows, rank)`` and rotary keys ``(1, 1, rows, rope)`` to their
        slots, as one row each: its attention function gets them expanded, so its cache's ``update`` stores them."""
        group, pool_latent, _ = pool_read(self.pool, layer_idx)
        rows = torch.cat([latent[0], rope[0]], dim=-1).transpose(0, 1).contiguous()  # (rows, 1, rank + rope)
        STORE_ROWS(pool_latent, rows, self.slots[group], self.pool.pad_block)


class _PassThroughCache(PackedCache):
    """The compiled step's cache: ``update`` hands the new keys to the attention, which stores them (an MLA
    layer's latents it stores itself: its attention gets them expanded)."""

    attention: DecodeAttention | None = None  # the running step's (set by CompiledDecode._decode)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attention is not None and self.attention.pool.spec.layers[layer_idx].latent is not None:
            self.attention.store_latent(layer_idx, key_states, value_states)
        return key_states, value_states


class CompiledDecode:
    """The decode forward of ``model`` over ``pool``, compiled (see the module docstring). ``backend`` is
    torch.compile's (``"inductor"``; ``"eager"`` / ``"aot_eager"`` capture the graph without generating code;
    ``"default"``: :data:`BACKEND`), or None: the same bucketed decode function run as Python, uncompiled (the
    tests check its arithmetic so).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> compiled = CompiledDecode(model, PagedKVPool(model, num_blocks=8, block_size=4))
        >>> compiled.counts
        CompileCounts(graphs=0, buckets=0, steps=0, failures=0)
    """

    def __init__(self, model: Any, pool: PagedKVPool, backend: str | None = "default") -> None:
        backend = BACKEND if backend == "default" else backend
        self.model, self.pool, self.backend = model, pool, backend
        self._cache = _PassThroughCache(pool)
        self._lock = threading.Lock()
        self._graphs = 0
        self._buckets: set[tuple[int, ...]] = set()
        self._steps = 0
        self._static: set[int] = set()  # ids of pool tensors marked static (CUDA graphs)
        self._settled: set[tuple[int, int]] = set()  # (rows, threads) whose row split settle() measured
        self._compiled: Callable[..., torch.Tensor] = self._decode
        if backend is not None:
            self._compiled = torch.compile(self._decode, backend=self._compiler, dynamic=False, fullgraph=True)

    @property
    def counts(self) -> CompileCounts:
        """The counters so far."""
        with self._lock:
            return CompileCounts(self._graphs, len(self._buckets), self._steps)

    def _compiler(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """torch.compile's backend: count the graph, then compile it with ``backend`` (CUDA graphs on CUDA)."""
        with self._lock:
            self._graphs += 1
        if self.backend != "inductor":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(str(self.backend))(graph, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        return compile_fx(graph, example_inputs, config_patches={"triton.cudagraphs": cuda})

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, tables: tuple[torch.Tensor, ...],
                slots: tuple[torch.Tensor, ...], starts: tuple[torch.Tensor, ...]) -> torch.Tensor:  # fmt: skip
        attention = self._cache.attention = DecodeAttention(self.pool, positions, tables, slots, starts)
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], cache=self._cache, use_cache=True,
                         **{CONTEXT_KEY: attention})  # fmt: skip
        return out.logits[0]

    def bucket_logits(self, inputs: DecodeInputs) -> torch.Tensor:
        """The logits of every row of the bucket (padding rows too), from the decode function run as Python:
        neither compiled nor counted (what :class:`~.decode_graphs.DecodeGraphs` captures)."""
        return self._decode(inputs.input_ids, inputs.positions, inputs.tables, inputs.slots, inputs.starts)

    def settle(self, inputs: DecodeInputs) -> None:
        """Before the first compiled step of a row count on the CPU: the bucket's step run uncompiled
        (:data:`SETTLE_STEPS` times) inside the runner's forward, so that its row split has checked and timed both
        ways for that count and the graph traces the faster one (:meth:`.prepacked.PrepackedLinears.linear`)
        instead of an op that decides at each call. Each run writes the step's keys to their slots, the values the
        compiled step then writes again."""
        key = (inputs.key[0], torch.get_num_threads())
        if self.backend is None or key in self._settled or active_linears() is None:
            return
        if inputs.input_ids.device.type != "cpu":
            return
        self._settled.add(key)
        _STEP.metadata = inputs.metadata
        try:
            with torch.inference_mode():
                for _ in range(SETTLE_STEPS):
                    self.bucket_logits(inputs)
        finally:
            _STEP.metadata = None

    def _mark_static(self) -> None:
        """On CUDA, the pool's tensors as static addresses: a captured graph writes into them in place (an MLA
        layer's latent tensor itself, not its two views)."""
        for layer in range(len(self.pool.spec.layers)):
            tensors = self.pool.attention_tensors(layer) if self.pool.spec.layers[layer].latent is not None else None
            for tensor in tensors[:1] if tensors is not None else self.pool.layer_tensors(layer) or ():
                if tensor.is_cuda and id(tensor) not in self._static:
                    torch._dynamo.mark_static_address(tensor)  # noqa: SLF001
                    self._static.add(id(tensor))

    def __call__(self, inputs: DecodeInputs) -> torch.Tensor:
        """The logits ``(inputs.real, vocab)`` of the step's sequences."""
        self._mark_static()
        with self._lock:
            self._buckets.add(inputs.key)
            self._steps += 1
        _STEP.metadata = inputs.metadata
        try:
            with torch.inference_mode(), torch._dynamo.config.patch(_DYNAMO):  # noqa: SLF001
                logits = self._compiled(inputs.input_ids, inputs.positions, inputs.tables, inputs.slots, inputs.starts)
        finally:
            _STEP.metadata = None
        return logits[: inputs.real]
