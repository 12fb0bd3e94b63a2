"""pagedcore: paged KV-cache memory with prefix caching for LLM inference.

The core is framework-agnostic plain Python: :class:`BlockManager` (ref-counted blocks), :class:`PrefixTrie`
(token blocks -> cached block ids), :class:`KVPool` (one manager and trie per attention kind), :class:`Scheduler`
(continuous batching) and the pluggy hooks. Framework adapters live in ``pagedcore.adapters``; built-in plugins in
``pagedcore.plugins``.

Example:
    >>> from pagedcore import BlockManager, PrefixTrie
    >>> bm = BlockManager(num_blocks=4, block_size=2)
    >>> trie = PrefixTrie(bm)
    >>> ids = bm.allocate(1)
    >>> trie.insert([7, 8], ids)
    [0]
"""

from pagedcore.block_manager import BlockManager, SlotAppend
from pagedcore.block_tables import BlockTables
from pagedcore.errors import (
    ConcurrentUseError,
    ConfigError,
    DoubleReleaseError,
    DuplicateRequestError,
    GrammarError,
    GrammarTimeoutError,
    InvalidBlockError,
    InvalidRequestError,
    OutOfBlocksError,
    PagedCoreError,
    PluginError,
    PoolMismatchError,
    RequestNotFoundError,
    SharedBlockError,
    UnsupportedModelError,
)
from pagedcore.eviction import EvictionPolicy, LRUEvictionPolicy
from pagedcore.hookspecs import hookimpl
from pagedcore.kv_pool import KVGroup, KVPool, PoolMatch
from pagedcore.plugin_manager import PluginManager, default_plugin_manager
from pagedcore.prefix_trie import PrefixMatch, PrefixTrie
from pagedcore.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats
from pagedcore.sequence import FinishReason, SequenceState, SequenceStatus, deprecated_sequence
from pagedcore.stale_hits import StaleHitAudit

__version__ = "0.1.0"

__all__ = [
    "BlockManager",
    "BlockTables",
    "ConcurrentUseError",
    "ConfigError",
    "DoubleReleaseError",
    "DuplicateRequestError",
    "EvictionPolicy",
    "FinishReason",
    "GrammarError",
    "GrammarTimeoutError",
    "InvalidBlockError",
    "InvalidRequestError",
    "KVGroup",
    "KVPool",
    "LRUEvictionPolicy",
    "OutOfBlocksError",
    "PagedCoreError",
    "PluginError",
    "PluginManager",
    "PoolMatch",
    "PoolMismatchError",
    "PrefixMatch",
    "PrefixTrie",
    "RequestNotFoundError",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SequenceState",
    "SequenceStatus",
    "SharedBlockError",
    "SlotAppend",
    "StaleHitAudit",
    "UnsupportedModelError",
    "__version__",
    "default_plugin_manager",
    "hookimpl",
]


def __getattr__(name: str) -> object:
    if name == "Sequence":  # the old name of SequenceState
        return deprecated_sequence()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
