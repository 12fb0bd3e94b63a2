"""A prompt's prefix-cache key when it carries images, videos or audio: token ids whose placeholders name the content.

A multimodal prompt holds one placeholder token per image patch (Qwen2-VL's ``<|image_pad|>``, LLaVA's ``<image>``),
the same id whatever the image, so token ids alone would let a prompt with another image hit blocks computed for the
first one. As vLLM hashes each multimodal input into the block keys, :func:`prompt_keys` replaces every placeholder
of an item with ids derived from a digest of that item's content: blocks before the first image are shared by any
prompt, blocks from an image on only by prompts with the same content there. The derived ids are negative, so they
never equal a real token.

What counts as content is every tensor a ``generate`` call passes to the model that is not laid out per token
(``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``input_features``...). Items are split per image or
video where the layout says how (Qwen-style ``*_grid_thw``: each item's patch rows; else one item per entry of the
first dimension); when the split does not match the placeholder runs, every run is keyed by a digest of all the
call's content and its place among the runs. A call with content but no placeholder token to key it by gets None:
it neither reuses nor caches prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .model_inputs import model_inputs

__all__ = ["CallItems", "call_keys", "covers_items", "placeholder_spans", "prompt_keys", "usable_length"]

# (placeholder id fields of the config, content fields, grid field): one stream of items per entry.
_STREAMS = (
    (("image_token_id", "image_token_index"), ("pixel_values", "image_embeds"), "image_grid_thw"),
    (("video_token_id", "video_token_index"), ("pixel_values_videos", "video_embeds"), "video_grid_thw"),
    (("audio_token_id", "audio_token_index"), ("input_features", "audio_values", "input_values"), None),
)
_SPACE = 1 << 62  # derived ids are -1 .. -2**62


def prompt_keys(config: Any, input_ids: torch.Tensor, content: Mapping[str, Any]) -> list[list[int]] | None:
    """The prefix-cache key of every row of ``input_ids`` ``(batch, length)``: its token ids, placeholders of
    multimodal items replaced by ids derived from the items' content (``content``: the call's tensors that are not
    laid out per token). None when ``content`` has tensors but no placeholder of the config occurs.

    Example:
        >>> from types import SimpleNamespace
        >>> config = SimpleNamespace(image_token_id=9)
        >>> ids = torch.tensor([[5, 9, 9, 6], [5, 9, 9, 6]])
        >>> cat, dog = torch.zeros(1, 3, 2, 2), torch.ones(1, 3, 2, 2)
        >>> keys = prompt_keys(config, ids, {"pixel_values": torch.cat([cat, dog])})
        >>> keys[0][0], keys[0][1] < 0, keys[0][1] != keys[1][1], keys[0][3]   # same text, other image
        (5, True, True, 6)
        >>> prompt_keys(config, ids, {}) == ids.tolist(), prompt_keys(config, ids[:, [0, 3]], {"pixel_values": cat})
        (True, None)
    """
    rows = input_ids.tolist()
    tensors = {k: v for k, v in content.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return rows
    keyed = False
    for ids_fields, content_fields, grid_field in _STREAMS:
        token = _config_id(config, ids_fields)
        runs = _runs(rows, token) if token is not None else []
        if not runs:
            continue
        items = _items(tensors, content_fields, grid_field)
        digests = items if items is not None and len(items) == len(runs) else None
        whole = _digest(*(tensors[k] for k in sorted(tensors)))
        for k, (row, start, end) in enumerate(runs):
            base = digests[k] if digests is not None else _digest(whole, torch.tensor([k]))
            for j in range(start, end):
                rows[row][j] = -1 - (base * 1_000_003 + (j - start)) % _SPACE
        keyed = True
    return rows if keyed else None


def _config_id(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _runs(rows: list[list[int]], token: int) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every run of ``token``, row after row."""
    runs = []
    for r, row in enumerate(rows):
        start = None
        for i, t in enumerate([*row, None]):
            if t == token and start is None:
                start = i
            elif t != token and start is not None:
                runs.append((r, start, i))
                start = None
    return runs


def _items(tensors: Mapping[str, torch.Tensor], content_fields: tuple[str, ...], grid: str | None) -> list[int] | None:
    """One digest per item of the stream, in order (None: the stream's content is not in the call)."""
    data = next((tensors[name] for name in content_fields if name in tensors), None)
    if data is None:
        return None
    grids = tensors.get(grid) if grid is not None else None
    if grids is not None and grids.dim() == 2:  # Qwen-style: each item is t * h * w rows of patches
        sizes = [int(n) for n in grids.prod(dim=-1).tolist()]
        if sum(sizes) != data.shape[0]:
            return None
        return [_digest(part, g) for part, g in zip(torch.split(data, sizes), grids)]
    return [_digest(item) for item in data]


def _digest(*tensors: torch.Tensor | int) -> int:
    """A 62-bit digest of tensors' shapes, dtypes and bytes (or of digests)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        if isinstance(t, int):
            h.update(t.to_bytes(8, "little", signed=False))
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") % _SPACE


def placeholder_spans(rows: list[list[int]]) -> list[tuple[int, int] | None]:
    """Per row of keys, the first and last index of a keyed placeholder (None: the row has none).

    Example:
        >>> placeholder_spans([[5, -7, -8, 6], [5, 6]])
        [(1, 2), None]
    """
    spans: list[tuple[int, int] | None] = []
    for row in rows:
        marked = [i for i, t in enumerate(row) if t < 0]
        spans.append((marked[0], marked[-1]) if marked else None)
    return spans


def usable_length(spans: list[tuple[int, int] | None], pads: list[int], length: int, may_cover: bool) -> int:
    """The rectangular prefix a multimodal call may take from the cache: ``length`` when no row has an item, or
    (``may_cover``) when it holds every item of every row, the call's content then being left out; otherwise it
    ends before the first item (the model gets every item with its placeholders: a prefix may not hold a part of
    them).

    Example:
        >>> usable_length([(4, 7), None], [0, 0], 10, True), usable_length([(4, 7), None], [0, 0], 10, False)
        (10, 4)
        >>> usable_length([(4, 7)], [2], 8, True)   # row 0's prefix is 6 tokens: the image's middle
        6
    """
    rows = [(span, pad) for span, pad in zip(spans, pads) if span is not None]
    if not rows:
        return length
    if may_cover and all(length - pad > span[1] for span, pad in rows):
        return length
    return min(length, *(pad + span[0] for span, pad in rows))


def covers_items(spans: list[tuple[int, int] | None], pads: list[int], length: int) -> bool:
    """Whether a prefix of ``length`` rectangular positions holds every item of every row (and there is one).

    Example:
        >>> covers_items([(1, 2), None], [0, 0], 3), covers_items([(1, 2)], [0], 2), covers_items([None], [0], 5)
        (True, False, False)
    """
    rows = [(span, pad) for span, pad in zip(spans, pads) if span is not None]
    return bool(rows) and all(length - pad > span[1] for span, pad in rows)


def rope_deltas_owner(model: Any) -> Any:
    """The module that keeps multimodal RoPE's ``rope_deltas`` and computes them (``get_rope_index``), or None."""
    return next((m for m in model.modules() if hasattr(m, "rope_deltas") and hasattr(m, "get_rope_index")), None)


def whole_prompt_deltas(owner: Any, input_ids: torch.Tensor, mask: torch.Tensor, content: Mapping[str, Any]) -> Any:
    """``rope_deltas`` of the whole prompt, as the model computes them for a call that starts empty (None when it
    cannot: then a prefix never holds an item of such a model's prompt)."""
    names = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    try:
        _, deltas = owner.get_rope_index(
            input_ids, attention_mask=mask, **{k: content[k] for k in names if k in content}
        )
    except Exception:
        return None
    return deltas


def call_keys(model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> list[list[int]] | None:
    """Every row's prefix-cache key (:func:`prompt_keys`): its token ids, with the placeholders of the images,
    videos or audio the call passes named by their content; None when content cannot be placed.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> call_keys(tiny_llama(), torch.tensor([[5, 6, 7]]), {"max_new_tokens": 2})   # text only: its ids
        [[5, 6, 7]]
    """
    return prompt_keys(model.config, input_ids.detach().cpu(), _content(model, input_ids, kwargs))


@dataclass
class CallItems:
    """A call's multimodal items (images, videos, audio): where their placeholders are, whether a prefix may hold
    them all (then the call's content is left out, as the cache holds what it gave), the content, and the whole
    prompt's multimodal-RoPE deltas (Qwen2-VL and its kind place tokens after a cached prefix by them).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> items = CallItems.of(tiny_llama(), ids, torch.ones_like(ids), {}, [[5, 6, 7]])
        >>> items.spans, items.may_cover
        ([None], True)
    """

    spans: list[tuple[int, int] | None]
    may_cover: bool
    content: dict[str, Any]
    owner: Any = None
    deltas: Any = None

    @classmethod
    def of(
        cls, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: dict, rows: list[list[int]] | None
    ) -> CallItems:
        spans = placeholder_spans(rows) if rows is not None else []
        content = _content(model, input_ids, kwargs)
        if not any(spans):
            return cls(spans, True, content)
        owner = rope_deltas_owner(model)
        deltas = whole_prompt_deltas(owner, input_ids, mask, model_inputs(model, kwargs)) if owner else None
        return cls(spans, owner is None or deltas is not None, content, owner, deltas)

    def after_hit(self, model: Any, kwargs: dict, pads: list[int], length: int) -> dict:
        """The call's arguments once ``length`` cached positions are attached: without the content when the prefix
        holds every item; the model's multimodal-RoPE deltas those of this prompt (stale ones cleared)."""
        _forget_rope_deltas(model)
        if not covers_items(self.spans, pads, length):
            return kwargs
        if self.owner is not None:
            self.owner.rope_deltas = self.deltas
        return {k: v for k, v in kwargs.items() if k not in self.content}


def _content(model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's model inputs that are content (images, videos, audio): tensors not laid out per token."""
    return {
        k: v
        for k, v in model_inputs(model, kwargs).items()
        if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(input_ids.shape)
    }


def _forget_rope_deltas(model: Any) -> None:
    """Multimodal-RoPE models (Qwen2-VL and its kind) keep the last call's ``rope_deltas`` and, when the cache already
    holds tokens, place the new ones by them: after another prompt they are stale. Cleared, they are computed from
    the whole prompt again, as for a call that starts empty."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None
