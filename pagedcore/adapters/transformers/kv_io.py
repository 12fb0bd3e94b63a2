"""The tensors' side of the tiers below the pool (:mod:`pagedcore.kv_tiers`): copy a block out, bytes in, and the
model fingerprint a stored block is keyed by.

A block's payload is, for each layer of its KV group in layer order, its keys then its values as
``(block_size, kv_heads, head_dim)`` in the pool's dtype, C-contiguous: the same bytes whatever the pool's own
layout (``"slots"`` or ``"heads"``), so the fingerprint names this stored layout, not the pool's.

The fingerprint covers the weights (:meth:`~pagedcore.adapters.transformers.weights.WeightsWatch.content_hash`,
once per weight epoch and again after every :meth:`~pagedcore.kv_pool.KVPool.reset_prefix_cache`), the stored dtype,
the block size, the stored layout, the model type and every layer's group, KV heads and head sizes.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pool import PagedKVPool

__all__ = ["STORED_LAYOUT", "TensorBlockIO"]

STORED_LAYOUT = "layer,kv,slot,head,dim"


class TensorBlockIO:
    """A pool's :class:`~pagedcore.kv_tiers.BlockIO`.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> model = tiny_llama()
        >>> pool = PagedKVPool(model, num_blocks=4, block_size=2)
        >>> io = TensorBlockIO(pool)
        >>> io.fingerprint() is None           # no weights watch yet: the pool has not checked the model
        True
        >>> _ = pool.check_weights(); len(io.fingerprint())
        64
    """

    def __init__(self, pool: PagedKVPool) -> None:
        self._pool = pool
        self._cached: tuple[tuple[int, int, int], str | None] | None = None

    def fingerprint(self) -> str | None:
        pool = self._pool
        watch = pool.weights
        if watch is None or pool.stale_placement is not None or watch.placement is None:
            return None
        dtype, device = watch.placement
        if not pool.has_all_tensors and not pool.create_tensors(device, dtype):
            return None
        epoch = (id(watch), watch.epoch, pool.kv.epoch)
        cached = self._cached
        if cached is None or cached[0] != epoch:
            fresh = cached is not None and cached[0][:2] == epoch[:2]  # only a reset moved: a change no check saw
            weights = watch.content_hash(fresh=fresh)
            cached = self._cached = (epoch, None if weights is None else self._describe(weights))
        return cached[1]

    def block_nbytes(self, group: int) -> int:
        return self._pool.block_bytes(group)

    def state_nbytes(self) -> int:
        states = self._pool.states
        return 0 if states is None or not states.complete() else states.slot_nbytes()

    def read_state(self, slot: int) -> object:
        states = self._pool.states
        assert states is not None
        return states.read(slot)

    def write_state(self, slot: int, payload: bytes) -> None:
        states = self._pool.states
        assert states is not None
        states.write(slot, payload)

    def read_block(self, group: int, block_id: int) -> object:
        out: list[torch.Tensor] = []
        for layer in self._layers(group):
            tensors = self._pool.layer_tensors(layer)
            assert tensors is not None
            out.extend(t[block_id].clone(memory_format=torch.contiguous_format) for t in tensors)
        return out

    def to_bytes(self, copy: object) -> bytes:
        assert isinstance(copy, list)
        return b"".join(t.to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes() for t in copy)

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for layer in self._layers(group):
            tensors = self._pool.layer_tensors(layer)
            assert tensors is not None
            for t in tensors:
                target = t[block_id]
                size = target.numel() * t.element_size()
                piece = raw[offset : offset + size].view(t.dtype).view(target.shape)
                target.copy_(piece.to(t.device))
                offset += size
        if offset != len(payload):
            raise ValueError(f"write_block: a payload of {len(payload)} bytes for a block of {offset}")

    def _layers(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self._pool.spec.layer_groups) if g == group]

    def _describe(self, weights: str) -> str:
        pool = self._pool
        spec = pool.spec
        layers = [
            [group, layer.num_kv_heads, layer.head_dim, layer.v_head_dim]
            for layer, group in zip(spec.layers, spec.layer_groups)
        ]
        described = {
            "weights": weights,
            "dtype": str(pool.dtype),
            "block_size": pool.block_size,
            "layout": STORED_LAYOUT,
            "model_type": spec.model_type,
            "layers": layers,
        }
        shapes = None if pool.states is None else pool.states.shapes
        if shapes:  # recurrent states: their snapshots are stored too, in this layout
            described["states"] = [[s.layer, s.kind, s.index, list(s.shape), str(s.dtype)] for s in shapes]
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
