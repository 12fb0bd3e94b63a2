"""Attention kinds: each kind of attention layer's rules about positions and blocks, in one place. Plain Python.

A KV group (:class:`~pagedcore.kv_pool.KVGroup`) holds the kind of its layers, and everything that needs a rule of
that kind asks it: which keys a query sees (the attention backends), which blocks may be given back (the block
tables), how many blocks a request can need at worst (admission), whether a sequence can be cut back (``crop``), and
the mask sizes transformers expects (the cache). Three kinds exist:

- :class:`FullAttention`: a query at position ``p`` sees every key at ``0 .. p``;
- :class:`SlidingWindow`: a query at ``p`` sees the keys at ``p - window + 1 .. p`` (transformers' convention: the
  window counts the query's own key), so blocks wholly before the window of every later query can be released;
- :class:`ChunkedAttention` (Llama 4's local layers): the positions are cut into chunks of ``chunk`` tokens and a
  query sees only the keys of its own chunk up to itself, so a finished chunk's blocks are given back as soon as the
  next chunk starts.

A new kind is one more subclass of :class:`AttentionKind` here (the backends' masks come from its
:meth:`~AttentionKind.sees`).

Example:
    >>> window = SlidingWindow(4)
    >>> window.first_visible(10), FullAttention().first_visible(10)
    (7, 0)
    >>> window.sees(10, 7), window.sees(10, 6)
    (True, False)
    >>> attention_kind(None), attention_kind(4)
    (FullAttention(), SlidingWindow(window=4))
    >>> ChunkedAttention(8).first_visible(10), ChunkedAttention(8).sees(10, 7)
    (8, False)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedcore.errors import ConfigError
from pagedcore.validation import integer

__all__ = ["AttentionKind", "ChunkedAttention", "FullAttention", "SlidingWindow", "attention_kind"]

_P = TypeVar("_P")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AttentionKind(ABC):
    """The rules of one kind of attention layer (see the module docstring). Immutable and hashable.

    Example:
        >>> kind = SlidingWindow(4)
        >>> kind.first_needed_block(9, block_size=2), kind.max_blocks(40, block_size=2, chunk=1)
        (3, 3)
    """

    @property
    @abstractmethod
    def sliding_window(self) -> int | None:
        """The window in tokens, or None for full attention."""

    @property
    def is_sliding(self) -> bool:
        """Whether queries see only a bounded span of the keys before them (a window, a chunk), so that blocks no
        later query sees are given back (transformers' ``is_sliding`` of such a cache layer)."""
        return self.sliding_window is not None

    @property
    def is_relative(self) -> bool:
        """Whether which keys a query sees depends only on their distance to it (full attention, a window), not on
        where the sequence's first position is (chunks): a sequence stored with leading padding then needs no
        care."""
        return True

    @abstractmethod
    def first_visible(self, position: int) -> int:
        """The first key position a query at ``position`` sees."""

    @abstractmethod
    def sees(self, query_position: _P, key_position: _P) -> _P:
        """Whether a query at ``query_position`` sees the key at ``key_position``: causal, and in the window.

        Works element-wise on anything with comparison operators and ``&`` (ints, tensors of positions), so
        attention backends build their masks from this rule rather than restating it.
        """

    @abstractmethod
    def last_query_seeing(self, key_position: int) -> int | None:
        """The last query position that still sees the key at ``key_position`` (None: every later query does)."""

    def first_needed_block(self, next_position: int, block_size: int) -> int:
        """The first logical block that a query at ``next_position`` or later may see: the blocks before it may be
        given back.

        Example:
            >>> SlidingWindow(5).first_needed_block(12, 4)   # a query at 12 sees keys 8..12: blocks 0 and 1 go
            2
        """
        return self.first_visible(next_position) // block_size

    def can_truncate(self, num_tokens: int, num_dropped_blocks: int, block_size: int) -> bool:
        """Whether a sequence whose first ``num_dropped_blocks`` blocks were given back can be cut back to
        ``num_tokens`` positions: the query at ``num_tokens`` must not need a key that is gone.

        Example:
            >>> SlidingWindow(2).can_truncate(5, 2, 2), SlidingWindow(2).can_truncate(3, 2, 2)
            (True, False)
        """
        return self.first_visible(num_tokens) >= num_dropped_blocks * block_size

    def mask_sizes(self, past: int, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a layer holding ``past`` positions that gets ``query_length`` more, as
        transformers' dynamic layers report them (its masks are built from these).

        Example:
            >>> SlidingWindow(4).mask_sizes(10, 2), FullAttention().mask_sizes(10, 2)
            ((5, 7), (12, 0))
        """
        offset = self.first_visible(past)
        return past - offset + query_length, offset

    @property
    def max_cache_length(self) -> int:
        """Most positions a layer of this kind needs to keep (transformers' ``get_max_length``): -1 for no limit."""
        return -1 if self.sliding_window is None else self.sliding_window

    def blocks_held(self, computed: int, num_new_tokens: int, block_size: int) -> int:
        """Blocks one sequence holds right after a step that gives ``num_new_tokens`` positions a slot after its
        ``computed`` ones, its blocks that no query from ``computed`` on sees having been given back before it."""
        return _cdiv(computed + num_new_tokens, block_size) - self.first_needed_block(computed, block_size)

    def max_blocks(self, num_tokens: int, block_size: int, *, chunk: int | None = None, start: int = 0) -> int:
        """The most blocks one sequence holds at once while its positions ``start .. num_tokens - 1`` get their
        slots, in steps of at most ``chunk`` positions each (None: any step, e.g. the rest of a prompt at once),
        starting wherever the previous step ended.

        A step at ``computed = c`` of ``n`` positions holds :meth:`blocks_held` ``(c, n)``. The bound is over every
        way of splitting ``start .. num_tokens`` into steps, so it holds however a scheduler chunks prompts, shares
        its token budget or recomputes a preempted sequence; a pool of exactly this many blocks serves the
        sequence alone, and some split needs every one of them. Full attention: all of the sequence's blocks.

        Example:
            >>> FullAttention().max_blocks(10, 4), SlidingWindow(8).max_blocks(100, 4, chunk=1)
            (3, 3)
            >>> SlidingWindow(8).max_blocks(100, 4, chunk=6)   # e.g. a 6-token step at c = 11 holds blocks 1..4
            4
        """
        if num_tokens <= start:
            return 0
        last_step = num_tokens - 1  # the last position to get a slot
        span = num_tokens - start if chunk is None else min(chunk, num_tokens - start)
        # A full-size step at c + block_size holds at least as many blocks as one at c (one more block at the end,
        # at most one more given back at the start): among full-size steps the last block_size starts suffice.
        # A shorter step ends at num_tokens and gives back no more than one starting earlier: the first such start.
        full_end = num_tokens - span  # the last start of a full-size step
        starts = set(range(max(start, full_end - block_size + 1), full_end + 1))
        if full_end + 1 <= last_step:
            starts.add(full_end + 1)
        return max(self.blocks_held(c, min(span, num_tokens - c), block_size) for c in starts)


@dataclass(frozen=True)
class FullAttention(AttentionKind):
    """Every query sees every key before it (and its own).

    Example:
        >>> FullAttention().sees(5, 0), FullAttention().last_query_seeing(0) is None
        (True, True)
    """

    @property
    def sliding_window(self) -> None:
        """None: no window."""
        return None

    def first_visible(self, position: int) -> int:
        """0: every key from the first on."""
        return 0

    def sees(self, query_position: Any, key_position: Any) -> Any:
        """Causal: keys at or before the query."""
        return key_position <= query_position

    def last_query_seeing(self, key_position: int) -> int | None:
        """None: every later query sees every key."""
        return None

    def max_blocks(self, num_tokens: int, block_size: int, *, chunk: int | None = None, start: int = 0) -> int:
        """All of the sequence's blocks (nothing is given back while it runs)."""
        return _cdiv(num_tokens, block_size) if num_tokens > start else 0


@dataclass(frozen=True)
class SlidingWindow(AttentionKind):
    """A query at ``p`` sees the keys at ``p - window + 1 .. p`` (Mistral, Gemma2/3's local layers).

    Args:
        window: the window in tokens, a positive integer (the query's own key included).

    Example:
        >>> SlidingWindow(3).first_visible(1), SlidingWindow(3).last_query_seeing(4)
        (0, 6)
        >>> SlidingWindow(0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: sliding window must be a positive integer or None, got 0
    """

    window: int

    def __post_init__(self) -> None:
        checked = integer(
            "sliding window", self.window, minimum=1, error=ConfigError, expected="a positive integer or None"
        )
        object.__setattr__(self, "window", checked)

    @property
    def sliding_window(self) -> int:
        """The window in tokens."""
        return self.window

    def first_visible(self, position: int) -> int:
        """``position - window + 1``, or 0 near the start."""
        return max(0, position - self.window + 1)

    def sees(self, query_position: Any, key_position: Any) -> Any:
        """Causal and within the window."""
        return (key_position <= query_position) & (key_position > query_position - self.window)

    def last_query_seeing(self, key_position: int) -> int:
        """``key_position + window - 1``."""
        return key_position + self.window - 1


@dataclass(frozen=True)
class ChunkedAttention(AttentionKind):
    """Positions are cut into chunks of ``chunk`` tokens (``0 .. chunk - 1``, ``chunk .. 2 * chunk - 1``, ...) and a
    query sees the keys of its own chunk up to itself (Llama 4's chunked layers, transformers' ``chunked_attention``).
    Positions count from the sequence's first token (its left padding excluded, as transformers' chunked mask does).

    The blocks before a query's chunk are given back when the chunk starts. The mask sizes are those of
    transformers' cache layer for these layers (a sliding window of ``chunk`` tokens: the keys any query of any
    chunk alignment may need); positions of it that were given back read as zeros, which the chunked mask hides.

    Args:
        chunk: the chunk size in tokens, a positive integer.

    Example:
        >>> kind = ChunkedAttention(4)
        >>> kind.first_visible(9), kind.last_query_seeing(9), kind.sees(9, 8), kind.sees(9, 7)
        (8, 11, True, False)
        >>> kind.mask_sizes(10, 1), kind.first_needed_block(9, block_size=2), kind.is_sliding
        ((4, 7), 4, True)
    """

    chunk: int

    def __post_init__(self) -> None:
        checked = integer(
            "attention chunk size", self.chunk, minimum=1, error=ConfigError, expected="a positive integer"
        )
        object.__setattr__(self, "chunk", checked)

    @property
    def sliding_window(self) -> None:
        """None: not a sliding window (see :attr:`is_sliding`)."""
        return None

    @property
    def is_sliding(self) -> bool:
        """True: a finished chunk's blocks are given back."""
        return True

    @property
    def is_relative(self) -> bool:
        """False: chunks are counted from the sequence's first position."""
        return False

    @property
    def max_cache_length(self) -> int:
        """``chunk``, as transformers' cache layer for these layers reports."""
        return self.chunk

    def first_visible(self, position: int) -> int:
        """The first position of the query's chunk."""
        return position - position % self.chunk

    def sees(self, query_position: Any, key_position: Any) -> Any:
        """Causal and in the same chunk."""
        return (key_position <= query_position) & (key_position // self.chunk == query_position // self.chunk)

    def last_query_seeing(self, key_position: int) -> int:
        """The last position of the key's chunk."""
        return key_position - key_position % self.chunk + self.chunk - 1

    def mask_sizes(self, past: int, query_length: int) -> tuple[int, int]:
        """A sliding window of ``chunk`` tokens' sizes (transformers' ``DynamicSlidingWindowLayer``)."""
        offset = max(0, past - self.chunk + 1)
        return past - offset + query_length, offset

    def max_blocks(self, num_tokens: int, block_size: int, *, chunk: int | None = None, start: int = 0) -> int:
        """As :meth:`AttentionKind.max_blocks`; within one attention chunk a later step holds more, so besides the
        last full-size steps the candidates are each chunk's last start (for the chunk boundaries whose alignment to
        the blocks differs: at most ``block_size`` of them)."""
        if num_tokens <= start:
            return 0
        span = num_tokens - start if chunk is None else min(chunk, num_tokens - start)
        full_end = num_tokens - span
        starts = set(range(max(start, full_end - block_size + 1), full_end + 1))
        if full_end + 1 <= num_tokens - 1:
            starts.add(full_end + 1)
        boundary = full_end - full_end % self.chunk
        for _ in range(block_size):
            if boundary - 1 < start:
                break
            starts.add(boundary - 1)
            boundary -= self.chunk
        return max(self.blocks_held(c, min(span, num_tokens - c), block_size) for c in starts)


_FULL = FullAttention()


def attention_kind(sliding_window: int | AttentionKind | None) -> AttentionKind:
    """The kind of layers with this window (None: full attention), or the kind itself when given one. Raises
    ``ConfigError`` for a bad window.

    Example:
        >>> attention_kind(4096).sliding_window, attention_kind(None).is_sliding, attention_kind(ChunkedAttention(8))
        (4096, False, ChunkedAttention(chunk=8))
    """
    if isinstance(sliding_window, AttentionKind):
        return sliding_window
    return _FULL if sliding_window is None else SlidingWindow(sliding_window)
