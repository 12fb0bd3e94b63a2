"""The Engine's compatible path: a step run as left-padded batches over the model's own attention.

The Engine's usual forward packs every scheduled token into one ``(1, num_tokens)`` row and lets
``attn_implementation="paged"`` read each sequence's keys from the pool. That needs the model to hand the Engine's
context to every layer's attention and to attend over the keys and values its cache returned, unchanged. A model
that does neither (Falcon and Bloom attend in their own code; JetMoE and DiffLlama reshape keys or values after the
cache returned them) is served here instead, exactly as ``generate`` serves a left-padded batch with a
``DynamicCache``: the step's sequences become rows (all its decodes in one forward, each prefill chunk in its own),
each row's keys and values are gathered from the pool into a rectangle (left padding where a row is shorter, a
zero slot where a sliding window dropped a block), and the model attends with its own attention and the standard
2-D attention mask. New keys and values are still written to the pool, so prefix caching, preemption and the
scheduler work as on the paged path. :mod:`.probe` decides which path an Engine takes.

The cost against the packed path: one forward per prefill chunk, and each layer gathers its rows' contexts (a copy
of ``rows x longest context`` keys and values per layer and step).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import PagedAttentionMetadata, to_device, write_kv

from .pool import PagedKVPool
from .step_batch import PreparedStep

__all__ = ["PaddedStep"]


class _GatheredLayer(CacheLayerMixin):
    """One layer of a :class:`_GatherCache`: what transformers' mask code asks a layer."""

    is_compileable = False

    def __init__(self, cache: _GatherCache, sliding_window: int | None) -> None:
        super().__init__()
        self._cache = cache
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("updated through the cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.width, 0

    def get_seq_length(self) -> int:
        return self._cache.width - self._cache.q_len

    def get_max_length(self) -> int:
        return -1


class _GatherCache(Cache):
    """One padded forward's cache: writes each row's new keys and values to their slots and returns every row's
    context gathered from the pool, ``(rows, kv_heads, width, head_dim)`` (zeros at left padding)."""

    def __init__(self, pool: PagedKVPool, forward: _Forward) -> None:
        layers: list[Any] = [
            _GatheredLayer(self, spec.sliding_window) if spec.has_cache else DummyLayer() for spec in pool.spec.layers
        ]
        super().__init__(layers=layers)
        self._pool = pool
        self.width = forward.width
        self.q_len = forward.q_len
        self._forward = forward
        self._on: dict[tuple[str, int, torch.device], torch.Tensor] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = self._pool.group_of(layer_idx)
        rows, _, q_len, _ = key_states.shape
        keys = key_states.transpose(1, 2).reshape(rows * q_len, *key_states.shape[1:2], key_states.shape[-1])
        values = value_states.transpose(1, 2).reshape(rows * q_len, *value_states.shape[1:2], value_states.shape[-1])
        key_cache, value_cache = self._pool.layer_kv(layer_idx, keys, values)
        write_kv(key_cache, value_cache, keys, values, self._index("slots", group, keys.device))
        index = self._index("gather", group, keys.device)  # (rows, width)
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        k = flat_k.index_select(0, index.view(-1)).view(*index.shape, *flat_k.shape[1:])
        v = flat_v.index_select(0, index.view(-1)).view(*index.shape, *flat_v.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)

    def _index(self, what: str, group: int, device: torch.device) -> torch.Tensor:
        moved = self._on.get((what, group, device))
        if moved is None:
            host = self._forward.slots[group] if what == "slots" else self._forward.gather[group]
            moved = self._on[(what, group, device)] = to_device(host, device)
        return moved

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width - self.q_len

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.width, 0

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass(frozen=True)
class _Forward:
    """One padded forward: its sequences (indices into the step's packed order) as rows."""

    seqs: list[int]
    q_len: int
    width: int  # the longest row's context after the forward
    lengths: list[int]  # each row's context after the forward
    slots: list[torch.Tensor]  # per KV group: the new tokens' slots, row after row
    gather: list[torch.Tensor]  # per KV group: (rows, width) slot of every position (the pad slot at padding)


class PaddedStep:
    """The Engine's compatible path over ``model`` and ``pool``: :meth:`logits` runs one prepared step.

    Example:
        One step of one sequence, its three prompt tokens, as the Engine's runner prepares it:

        >>> from pagedcore import Scheduler, SequenceState
        >>> from pagedcore.engine.packing import pack_tokens
        >>> from pagedcore.adapters.transformers.attention import ForwardContext
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> pool = PagedKVPool(model, num_blocks=8, block_size=4)
        >>> scheduler = Scheduler(pool.kv)
        >>> scheduler.add(SequenceState("r", [5, 6, 7], max_new_tokens=2))
        >>> packed = pack_tokens(scheduler.schedule().scheduled, pool.kv)
        >>> step = PreparedStep(packed, ForwardContext(pool, list(packed.metadata), None), [2], False)
        >>> logits = PaddedStep(model, pool).logits(step)
        >>> torch.allclose(logits[0], model(torch.tensor([[5, 6, 7]])).logits[0, -1], atol=1e-5)
        True
    """

    def __init__(self, model: Any, pool: PagedKVPool) -> None:
        self.model = model
        self.pool = pool
        parameters = inspect.signature(model.forward).parameters
        self._positions = "position_ids" in parameters
        self._keeps_logits = "logits_to_keep" in parameters

    def logits(self, batch: PreparedStep) -> torch.Tensor:
        """The logits of the step's kept positions (``batch.keep``, packed indices), ``(len(kept), vocab)`` in
        float32."""
        metadata = batch.packed.metadata
        meta = metadata[0]
        query_lens, seq_lens = list(meta.query_lens), list(meta.seq_lens)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        owner = {}  # packed index -> (sequence, offset among its new tokens)
        for i, (start, q) in enumerate(zip(starts, query_lens)):
            owner.update({start + j: (i, j) for j in range(q)})
        kept = [owner[k] for k in batch.keep]
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        plans = ([decodes] if decodes else []) + [[i] for i, q in enumerate(query_lens) if q > 1]
        out: dict[int, torch.Tensor] = {}
        for seqs in plans:
            forward = self._plan(metadata, seqs, query_lens, seq_lens, starts)
            wanted = [(n, seqs.index(i), j) for n, (i, j) in enumerate(kept) if i in seqs]
            for (n, _, _), row in zip(wanted, self._run(batch, forward, starts, wanted)):
                out[n] = row
        if not kept:
            return torch.empty(0)
        return torch.stack([out[n] for n in range(len(kept))]).float()

    def _plan(
        self,
        metadata: Sequence[PagedAttentionMetadata],
        seqs: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        starts: list[int],
    ) -> _Forward:
        """The rows of one forward: the sequences' new tokens' slots and every position's slot, per KV group."""
        q_len = query_lens[seqs[0]]
        lengths = [seq_lens[i] for i in seqs]
        width = max(lengths)
        bs = self.pool.block_size
        pad_slot = self.pool.pad_block * bs
        slots: list[torch.Tensor] = []
        gather: list[torch.Tensor] = []
        for meta in metadata:
            mapping = meta.slot_mapping.cpu()
            slots.append(torch.cat([mapping[starts[i] : starts[i] + q_len] for i in seqs]))
            tables = meta.host_tables.long()
            rows = []
            for i, length in zip(seqs, lengths):
                pos = torch.arange(length)
                block = pos // bs - int(meta.block_offsets[i])  # the table holds no block that left a window
                live = block >= 0
                slot = torch.full((width,), pad_slot, dtype=torch.long)  # left padding, and dropped blocks
                slot[width - length :][live] = tables[i, block[live]] * bs + pos[live] % bs
                rows.append(slot)
            gather.append(torch.stack(rows))
        return _Forward(seqs, q_len, width, lengths, slots, gather)

    def _run(
        self, batch: PreparedStep, forward: _Forward, starts: list[int], wanted: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """One padded forward; the logits of ``wanted`` ``(kept index, row, offset among the new tokens)``."""
        device = self.model.get_input_embeddings().weight.device
        q_len, width = forward.q_len, forward.width
        ids = torch.tensor([batch.packed.input_ids[starts[i] : starts[i] + q_len] for i in forward.seqs])
        lengths = torch.tensor(forward.lengths)
        mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()  # left padding
        kwargs: dict[str, Any] = {
            "input_ids": to_device(ids, device),
            "attention_mask": to_device(mask, device),
            "cache": _GatherCache(self.pool, forward),
            "use_cache": True,
        }
        if self._positions:
            positions = lengths[:, None] - q_len + torch.arange(q_len)[None, :]
            kwargs["position_ids"] = to_device(positions, device)
        offsets = sorted({j for _, _, j in wanted})
        if self._keeps_logits:
            kwargs["logits_to_keep"] = to_device(torch.tensor(offsets or [q_len - 1]), device)
        with torch.inference_mode():
            logits = self.model(**kwargs).logits  # (rows, len(offsets) or q_len, vocab)
        if self._keeps_logits:
            return [logits[r, offsets.index(j)] for _, r, j in wanted]
        return [logits[r, j] for _, r, j in wanted]
