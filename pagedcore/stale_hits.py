"""StaleHitAudit: an independent count of prefix hits served from keys and values computed before a weight update.

A prefix cache inside a training loop (RL: GRPO, RLOO, online DPO) must never serve a rollout keys and values that
older weights computed. The pool forgets its prefixes when its weights watch sees an update (``check_weights``);
this audit checks that from the outside, without asking the watch: the trainer tells it when the weights changed
(:meth:`StaleHitAudit.weights_changed`, after each ``optimizer.step()``), it notes how many times each block had
been handed out for new contents then (:meth:`BlockManager.fill_counts
<pagedcore.block_manager.BlockManager.fill_counts>`), and every prefix hit (the ``pagedcore_prefix_hit`` event,
which names the blocks that served it) that reads a block not handed out again since then is a stale hit: its keys
and values were written before the update.

Register it on the plugin manager of the audited pool (a pool of its own: ``PagedKVPool(model,
plugins=PluginManager())``, so that no other pool's events reach it). Plain Python, no torch.

What it does not follow: a copy-on-write copy made after the update from a block filled before it (a sequence that
ran across the update and registers its blocks afterwards) is a new block to the audit. The pool registers no block
of such a sequence (:class:`~pagedcore.block_tables.BlockTables` keeps the epoch it started in), so none is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedcore.hookspecs import hookimpl
from pagedcore.kv_pool import KVPool

__all__ = ["StaleHitAudit"]


class StaleHitAudit:
    """Counts prefix hits, and those served from blocks filled before the latest weight update.

    Args:
        pool: the block bookkeeping whose hits are audited (``PagedKVPool.kv``).

    Attributes:
        num_updates: weight updates declared (:meth:`weights_changed`).
        num_hits: prefix hits seen (lookups that served at least one token).
        num_hit_tokens: tokens they served.
        num_stale_hits: hits that read at least one block filled before the latest update.
        num_stale_hit_tokens: tokens those hits served.

    Example:
        >>> from pagedcore.block_tables import BlockTables
        >>> from pagedcore.plugin_manager import PluginManager
        >>> pool = KVPool(num_blocks=8, block_size=4)
        >>> audit = StaleHitAudit(pool)
        >>> first = BlockTables(pool); _ = first.append(8)
        >>> first.cache_full_blocks(list(range(8)), 8); first.release()     # 2 blocks cached
        >>> audit.weights_changed()                                          # an optimizer step
        >>> match = pool.match(list(range(9)))
        >>> audit.pagedcore_prefix_hit(num_hit_tokens=8, block_ids=match.head(8, 4))   # a cache that forgot nothing
        >>> audit.num_stale_hits, audit.num_stale_hit_tokens
        (1, 8)
    """

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self._marks: list[list[int]] | None = None
        self.num_updates = 0
        self.num_hits = 0
        self.num_hit_tokens = 0
        self.num_stale_hits = 0
        self.num_stale_hit_tokens = 0

    def weights_changed(self) -> None:
        """Declare that the weights changed now: blocks filled before this moment hold stale keys and values."""
        self._marks = [group.block_manager.fill_counts() for group in self._pool.groups]
        self.num_updates += 1

    def is_stale(self, block_ids: Sequence[Sequence[int]]) -> bool:
        """Whether any of these blocks (per group) was filled before the latest declared update."""
        marks = self._marks
        if marks is None:
            return False
        for group, ids in zip(self._pool.groups, block_ids):
            manager = group.block_manager
            if any(marks[group.index][b] and marks[group.index][b] == manager.fill_count(b) for b in ids):
                return True
        return False

    @hookimpl
    def pagedcore_prefix_hit(self, num_hit_tokens: int, block_ids: Sequence[Sequence[int]]) -> None:
        """The audit's view of a prefix hit (registered as a pagedcore plugin)."""
        if num_hit_tokens <= 0:
            return
        self.num_hits += 1
        self.num_hit_tokens += num_hit_tokens
        if self.is_stale(block_ids):
            self.num_stale_hits += 1
            self.num_stale_hit_tokens += num_hit_tokens

    def summary(self) -> dict[str, Any]:
        """The counters as a dict (for logs and reports)."""
        return {
            "updates": self.num_updates,
            "hits": self.num_hits,
            "hit_tokens": self.num_hit_tokens,
            "stale_hits": self.num_stale_hits,
            "stale_hit_tokens": self.num_stale_hit_tokens,
        }
