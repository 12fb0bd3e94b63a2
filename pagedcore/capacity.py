"""Capacity: how many blocks a request can need at worst, and the reservations that hold them for it. Plain Python.

**The worst case** has one owner, :func:`blocks_to_allocate`, asked through :meth:`KVPool.worst_case
<pagedcore.kv_pool.KVPool.worst_case>`: from a request's shape (a :class:`Demand`: its prompt and new tokens, what it
holds already from a prefix hit or an earlier call, how many sequences it becomes, how its positions are computed,
whether its sliding layers keep their blocks) and each KV group's attention kind, the most blocks it allocates before
it ends. The pieces are the growth rule of a table (:func:`~pagedcore.block_manager.blocks_to_grow`: whole blocks,
plus a copy of a partly filled shared block) and the window bound of a kind
(:meth:`~pagedcore.attention_kinds.AttentionKind.max_blocks`); nothing else restates them. The scheduler asks it
whether a request could ever fit, ``enable()`` how much to reserve for a ``generate`` call.

**A reservation** (:class:`Reservation`, made by :meth:`KVPool.reserve <pagedcore.kv_pool.KVPool.reserve>`) holds
blocks back for one holder: while it is live nobody else can have them, the holder's block tables draw from it as
they allocate, and what they give back returns to it (up to its size, so the blocks a sliding window recycles stay the
holder's). Releasing it returns what it did not use. The pool tracks live reservations weakly, so one that is dropped
without :meth:`Reservation.release` stops counting when it is garbage collected: reservations never leak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from pagedcore.attention_kinds import AttentionKind, FullAttention
from pagedcore.block_manager import blocks_to_grow
from pagedcore.errors import ConfigError
from pagedcore.validation import integer

__all__ = ["Demand", "Ledger", "Reservation", "blocks_to_allocate", "max_new_tokens", "slots_to_allocate"]

_FULL = FullAttention()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Demand:
    """The shape of one request (or one batch row of a ``generate`` call), as far as its blocks are concerned.

    Attributes:
        num_prompt_tokens: real tokens of the input (for a continued cache: the whole input row, history included).
        max_new_tokens: tokens it generates at most; the last one is sampled but never stored.
        num_held_tokens: leading positions it holds already (a prefix hit attached, or a continued cache); their
            blocks are not allocated again, but a partly filled last one is copied on the first write (a prefix hit
            ends inside a block wherever it matched to the token: a cached block used in part is always copied).
        num_copies: sequences it becomes (``num_return_sequences``, beams, the Engine's ``n`` when its samples must
            run at once); they share what was computed before they forked.
        share_prompt: the input but its last token is computed once, then forked ``num_copies`` times (``enable()``'s
            shared prefill); else every copy stores the whole request.
        chunk: the most positions one forward computes (the Engine's token budget: every split into such steps is
            covered); None: ``generate``'s pattern, the uncached input in one forward, then one position per step.
        keeps_window: sliding-window groups keep every block (assisted decoding records the past until a crop), so
            they count as full attention.
        snapshots: a model with recurrent state layers keeps snapshots of its state: its input is computed in pieces
            that end at snapshot points (``enable()``'s prefill: each point keeps a snapshot until the request
            registers it; with ``chunk``, the Engine's: see :func:`slots_to_allocate`).

    Example:
        >>> Demand(num_prompt_tokens=10, max_new_tokens=7).num_stored_tokens   # the last new token is never stored
        16
    """

    num_prompt_tokens: int
    max_new_tokens: int
    num_held_tokens: int = 0
    num_copies: int = 1
    share_prompt: bool = False
    chunk: int | None = None
    keeps_window: bool = False
    snapshots: bool = False

    def __post_init__(self) -> None:
        for name in ("num_prompt_tokens", "max_new_tokens", "num_held_tokens"):
            object.__setattr__(self, name, integer(f"Demand.{name}", getattr(self, name), minimum=0, error=ConfigError))
        object.__setattr__(
            self, "num_copies", integer("Demand.num_copies", self.num_copies, minimum=1, error=ConfigError)
        )
        if self.chunk is not None:
            object.__setattr__(self, "chunk", integer("Demand.chunk", self.chunk, minimum=1, error=ConfigError))

    @property
    def num_stored_tokens(self) -> int:
        """Positions stored at the end (prompt + new tokens - 1), at least those held already."""
        return max(self.num_prompt_tokens + self.max_new_tokens - 1, self.num_held_tokens)


def blocks_to_allocate(kind: AttentionKind, demand: Demand, block_size: int) -> int:
    """The most blocks ``demand`` allocates in a KV group of ``kind`` from now until it ends (the one worst case).

    Full attention keeps every block: the growth of the held table to the stored positions (a copy of a partly filled
    held block included), once per copy, or with ``share_prompt`` the input once and then every fork's own tail. A
    sliding window holds at most :meth:`~pagedcore.attention_kinds.AttentionKind.max_blocks` blocks per copy at once,
    and the blocks it gives back come back to the request's reservation, so that bound is what it needs (the held
    blocks are not subtracted: another holder may keep them in use after the window lets go of them).

    Example:
        >>> from pagedcore.attention_kinds import SlidingWindow
        >>> full, window = FullAttention(), SlidingWindow(8)
        >>> blocks_to_allocate(full, Demand(10, 7), 4), blocks_to_allocate(window, Demand(5, 30), 4)
        (4, 3)
        >>> blocks_to_allocate(FullAttention(), Demand(10, 7, num_held_tokens=6), 4)   # 2 held, 1 copied, 2 more
        3
    """
    if demand.keeps_window:
        kind = _FULL
    bs, held, final, copies = block_size, demand.num_held_tokens, demand.num_stored_tokens, demand.num_copies
    if demand.share_prompt:
        once = max(demand.num_prompt_tokens - 1, held)  # computed before the forks, for the unexpanded row
        shared = once // bs * bs  # the forks share the full blocks before it and copy the rest
        need = blocks_to_grow(held, once - held, bs, copy=True) + copies * blocks_to_grow(
            shared, final - shared, bs, copy=False
        )
    else:
        need = blocks_to_grow(held, final - held, bs, copy=True) + (copies - 1) * _cdiv(final, bs)
    if not kind.is_sliding:
        return need
    return min(need, copies * _window_peak(kind, demand, bs) + int(held % bs != 0))


def slots_to_allocate(demand: Demand, spacing: int) -> int:
    """The most recurrent-state slots ``demand`` takes from the pool before it ends (:mod:`pagedcore.state_slots`):
    a live slot per sequence, the snapshot a prefix hit restores (retained, then copied on the first write), and with
    ``snapshots`` one more slot per snapshot point of the input (every ``spacing`` tokens after what it holds, and its
    last computed position), each kept until the request registers it. With ``share_prompt`` the input is computed on
    one slot, then every copy writes its own.

    With ``chunk`` (the Engine) a sequence registers its blocks every step, and the snapshots taken in a step are
    filed with them: what it must hold is a live slot per copy and one more, the restored snapshot while its first
    write copies it, or the snapshot at the prompt's last-but-one token (filed where the sequence stops). The snapshot
    points inside a step's chunk take slots only when the pool has them to spare (the scheduler leaves them out
    otherwise), so they are not part of the worst case.

    Example:
        >>> slots_to_allocate(Demand(10, 5), spacing=4), slots_to_allocate(Demand(10, 5, snapshots=True), spacing=4)
        (1, 4)
        >>> slots_to_allocate(Demand(10, 5, num_held_tokens=4, num_copies=3, share_prompt=True, snapshots=True), 4)
        7
        >>> slots_to_allocate(Demand(100, 5, chunk=16, snapshots=True), 4)   # the Engine: live + one held snapshot
        2
    """
    restored = int(demand.num_held_tokens > 0)
    if demand.chunk is not None:
        return demand.num_copies + int(restored or demand.snapshots)
    points = 0
    if demand.snapshots:
        last = max(demand.num_prompt_tokens - 1, demand.num_held_tokens)  # the input's last computed position
        points = max(0, last // spacing - demand.num_held_tokens // spacing) + int(last % spacing != 0)
    if demand.share_prompt:
        return restored + 1 + points + demand.num_copies
    return demand.num_copies * (restored + 1 + points)


def _window_peak(kind: AttentionKind, demand: Demand, bs: int) -> int:
    """The most blocks one copy holds at once in a sliding group, by how its positions are computed."""
    held, final = demand.num_held_tokens, demand.num_stored_tokens
    if demand.chunk is not None:
        return kind.max_blocks(final, bs, chunk=demand.chunk, start=held)
    computed = max(demand.num_prompt_tokens - (1 if demand.share_prompt else 0), held)  # the input's forward
    return max(kind.max_blocks(computed, bs, start=held), kind.max_blocks(final, bs, chunk=1, start=computed))


def max_new_tokens(
    kind: AttentionKind, num_prompt_tokens: int, block_size: int, num_blocks: int, *, chunk: int | None = None
) -> int | None:
    """The most new tokens one sequence with a prompt of ``num_prompt_tokens`` tokens can ever be given in a KV group
    of ``kind`` holding ``num_blocks`` blocks: the largest ``n`` whose worst case (:func:`blocks_to_allocate` of
    ``Demand(num_prompt_tokens, n, chunk=chunk)``, the rule admission applies) fits; 0 when not even one new token
    fits; None when every ``n`` fits (a sliding window holds a bounded number of blocks however long it runs).

    Exact, not a probe: full attention keeps every block, so ``ceil((prompt + n - 1) / block_size) <= num_blocks``
    solves for ``n``; a window's worst case grows with ``n`` until its bound, so past the point where it is
    constant the answer is None or found by bisection on the rule itself.

    Example:
        >>> from pagedcore.attention_kinds import SlidingWindow
        >>> max_new_tokens(FullAttention(), 10, 4, 8), max_new_tokens(FullAttention(), 40, 4, 8)
        (23, 0)
        >>> max_new_tokens(SlidingWindow(8), 10, 4, 8, chunk=16) is None   # a window of 8 never needs 8 blocks
        True
    """

    def need(n: int) -> int:
        return blocks_to_allocate(kind, Demand(num_prompt_tokens, n, chunk=chunk), block_size)

    if num_prompt_tokens < 1 or need(1) > num_blocks:
        return 0
    if not kind.is_sliding:  # need(n) = ceil((prompt + n - 1) / block_size)
        return num_blocks * block_size - num_prompt_tokens + 1
    # From here the window's worst case no longer grows: every step it can take lies past the window's start.
    window = kind.sliding_window or 0
    constant = num_prompt_tokens + window + (chunk or num_prompt_tokens) + 2 * block_size + 1
    if need(constant) <= num_blocks:
        return None
    low, high = 1, constant  # need(low) fits, need(high) does not; need is non-decreasing in n
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle) <= num_blocks else (low, middle)
    return low


class BlockSource(Protocol):
    """What a reservation asks of its pool (:class:`~pagedcore.kv_pool.KVPool`): how many blocks of a group its
    holder can have now, its own reservation counted as its own."""

    def available_blocks(self, group: int, reservation: Reservation | None = None) -> int:
        """Free and evictable blocks of ``group`` less what other holders reserved."""
        ...


class Ledger:
    """The live reservations of one pool (a :class:`~pagedcore.kv_pool.KVPool` owns one), tracked weakly: a
    reservation counts while it holds blocks and is alive.

    Example:
        >>> ledger = Ledger(num_groups=1)
        >>> ledger.reserved(0), len(ledger)
        (0, 0)
    """

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self._live: weakref.WeakSet[Reservation] = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._live))

    def reserved(self, group: int, excluding: Reservation | None = None) -> int:
        """Blocks of ``group`` reserved and not yet drawn, by every reservation but ``excluding``."""
        if not self._live:
            return 0
        return sum(r.remaining[group] for r in list(self._live) if r is not excluding)

    def others(self, reservation: Reservation | None) -> bool:
        """Whether a reservation other than ``reservation`` holds blocks."""
        return any(r is not reservation for r in list(self._live))

    def track(self, reservation: Reservation, holding: bool) -> None:
        """Count ``reservation`` (while it holds blocks) or stop counting it (called by :class:`Reservation`)."""
        if holding:
            self._live.add(reservation)
        else:
            self._live.discard(reservation)


class Reservation:
    """Blocks held back in every KV group of a pool for one holder: made by :meth:`KVPool.reserve
    <pagedcore.kv_pool.KVPool.reserve>` (see the module docstring).

    Its holder's :class:`~pagedcore.block_tables.BlockTables` draw from it (``BlockTables(pool, reservation=r)``):
    an allocation (or a cached block revived by a prefix hit) takes from what is left, a block given back that becomes
    free returns to it up to its size. Everyone else sees the reserved blocks as taken (the pool's ``shortfalls`` and
    ``available_blocks``). A context manager: leaving the block releases it.

    Example:
        >>> from pagedcore.kv_pool import KVPool
        >>> pool = KVPool(num_blocks=8, block_size=4)
        >>> with pool.reserve([5]) as reservation:
        ...     pool.available_blocks(0), pool.available_blocks(0, reservation), reservation.remaining
        (3, 8, (5,))
        >>> pool.available_blocks(0), reservation.released
        (8, True)
    """

    def __init__(self, pool: BlockSource, ledger: Ledger, needs: Sequence[int]) -> None:
        self._pool = pool
        self._ledger = ledger
        self._size = list(needs)
        self._remaining = list(needs)
        self._released = False
        self._holding = False
        self._track()

    @property
    def remaining(self) -> tuple[int, ...]:
        """Per KV group, the blocks still held back (0 everywhere once released)."""
        return tuple(self._remaining)

    @property
    def size(self) -> tuple[int, ...]:
        """Per KV group, the most it holds back (what was reserved, or the last :meth:`resize`)."""
        return tuple(self._size)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    @property
    def active(self) -> bool:
        """Whether its holder's tables must account with it (it is live and has a size)."""
        return not self._released and any(self._size)

    def take(self, group: int, count: int) -> None:
        """Record that the holder took ``count`` blocks of ``group`` (negative: that many became free again): what is
        left goes down, never below 0 (the rest came from unreserved blocks), or back up, never above its size."""
        if self._released or count == 0:
            return
        left = self._remaining[group] - count
        self._remaining[group] = 0 if left < 0 else min(left, self._size[group])
        self._track()

    def resize(self, needs: Sequence[int]) -> bool:
        """Hold back ``needs[g]`` blocks per group from now on, as far as the other holders leave room; returns whether
        all of it was had. For a holder whose needs change as it runs (the scheduler)."""
        if self._released:
            raise ConfigError("resize: this reservation was released")
        pool = self._pool  # available_blocks(g, self): what the others leave, this one's own blocks included
        needs = [*needs, *[0] * (len(self._size) - len(needs))]  # the groups' counts only: no state slots
        granted = [min(n, max(0, pool.available_blocks(g, self))) for g, n in enumerate(needs)]
        self._size, self._remaining = list(needs), granted
        self._track()
        return granted == list(needs)

    def release(self) -> None:
        """Return what is left to the pool. Idempotent."""
        if self._released:
            return
        self._released = True
        self._remaining = [0] * len(self._remaining)
        self._track()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"remaining={tuple(self._remaining)}"
        return f"Reservation(size={tuple(self._size)}, {state})"

    def _track(self) -> None:
        holding = any(self._remaining)
        if holding != self._holding:
            self._holding = holding
            self._ledger.track(self, holding)
