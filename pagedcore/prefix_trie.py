"""The prefix trie: chains of full token blocks -> cached KV block ids.

Each node is one full block of ``block_size`` tokens; its path from the namespace's root is the exact token
prefix whose keys and values the block holds. A node's children are keyed by their token tuples themselves, so a
child is found by content: two blocks whose hashes collide are still told apart by comparing their tokens, and a
collision can never serve another prompt's KV.

**Namespaces.** Every namespace (a cache salt, e.g. the tenant) has its own root: entries in different namespaces
never match each other. The trie is the one owner of namespace identity (:func:`namespace_key`): two namespaces
are the same when they have the same type and equal values, element by element for tuples and frozensets, so
``1``, ``1.0`` and ``True`` are three namespaces although a dict would take them for one key. An unhashable
namespace raises :class:`~pagedcore.errors.ConfigError`. A root lives only while its namespace has a cached block:
the trie never holds more than ``num_blocks`` nodes plus one root per namespace with a cached block, however many
namespaces a long-running pool has served.

The trie owns the token -> block mapping; the :class:`~pagedcore.block_manager.BlockManager` owns reference counts
and decides when to evict. A cached block at reference count 0 sits in the manager's evictable pool; when the
manager evicts it, it calls :meth:`PrefixTrie.drop_block`, which also forgets the block's descendants (they can no
longer be reached).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedcore.block_manager import BlockManager
from pagedcore.errors import ConfigError, InvalidBlockError

__all__ = ["PrefixMatch", "PrefixTrie", "namespace_key"]

Namespace = Hashable


def namespace_key(namespace: Namespace) -> Hashable:
    """The identity of a namespace: its type and value (element by element for tuples and frozensets).

    Namespaces that a dict would conflate because they compare equal (``1 == 1.0 == True``) stay distinct.
    Raises :class:`~pagedcore.errors.ConfigError` for an unhashable namespace.

    Example:
        >>> namespace_key("tenant-a") == namespace_key("tenant-a")
        True
        >>> namespace_key(1) == namespace_key(True), namespace_key(("t", 1)) == namespace_key(("t", 1.0))
        (False, False)
    """
    key = _typed(namespace)
    try:
        hash(key)
    except TypeError as exc:
        raise ConfigError(f"namespace must be hashable (a str is best), got {namespace!r}") from exc
    return key


def _typed(value: object) -> Hashable:
    if isinstance(value, tuple):  # named tuples included
        return (type(value), tuple(_typed(item) for item in value))
    if isinstance(value, frozenset):
        return (type(value), frozenset(_typed(item) for item in value))
    return (type(value), value)


class _Node:
    __slots__ = ("block_id", "children", "key", "namespace", "parent", "tokens")

    def __init__(
        self,
        tokens: tuple[int, ...],
        block_id: int | None,
        parent: _Node | None,
        namespace: Namespace,
        key: Hashable,
    ) -> None:
        self.tokens = tokens
        self.block_id = block_id  # None only for a namespace root
        self.parent = parent
        self.namespace = namespace  # as first given for this namespace (what namespaces() reports)
        self.key = key  # namespace_key(namespace): the namespace's identity
        # Keyed by content: the dict compares the tokens themselves, so equal hashes never conflate two blocks.
        self.children: dict[tuple[int, ...], _Node] = {}


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached chain for a token sequence.

    Attributes:
        block_ids: the chain's blocks, root first. Not retained: call ``BlockManager.retain`` to use them.
        num_tokens: tokens covered (``len(block_ids) * block_size``).

    Example:
        >>> PrefixTrie(BlockManager(num_blocks=2, block_size=2)).match([1, 2, 3])
        PrefixMatch(block_ids=[], num_tokens=0)
    """

    block_ids: list[int]
    num_tokens: int


class PrefixTrie:
    """Token-block trie over one BlockManager's blocks.

    Args:
        block_manager: the manager whose blocks this trie indexes (one trie per manager).

    Example:
        >>> bm = BlockManager(num_blocks=8, block_size=2)
        >>> trie = PrefixTrie(bm)
        >>> blocks = bm.allocate(2)
        >>> trie.insert([1, 2, 3, 4], blocks)           # a finished sequence's two full blocks
        [0, 1]
        >>> bm.release(blocks[::-1])                    # its holder is done; the blocks stay cached
        >>> trie.match([1, 2, 3, 4, 5]).block_ids       # a new prompt with the same prefix
        [0, 1]
        >>> trie.match([1, 2, 3, 4], namespace="tenant-b").block_ids   # other namespaces see nothing
        []
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self._bm = block_manager
        self._block_size = block_manager.block_size
        self._roots: dict[Hashable, _Node] = {}  # namespace_key -> root; only namespaces with a cached block
        self._by_block: dict[int, _Node] = {}
        self._queries = 0
        self._hits = 0
        block_manager.attach_cache(self)

    # ------------------------------------------------------------------ queries
    @property
    def block_size(self) -> int:
        """Tokens per block (the manager's)."""
        return self._block_size

    @property
    def num_cached_blocks(self) -> int:
        """Blocks indexed by the trie, in all namespaces."""
        return len(self._by_block)

    @property
    def num_query_tokens(self) -> int:
        """Prompt tokens looked up through :meth:`record` (the hit rate's denominator)."""
        return self._queries

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens served from the cache, as reported to :meth:`record`."""
        return self._hits

    @property
    def hit_rate(self) -> float:
        """``num_hit_tokens / num_query_tokens`` (0.0 before any query)."""
        return self._hits / self._queries if self._queries else 0.0

    @property
    def num_namespaces(self) -> int:
        """Namespaces that hold at least one cached block (each has a root node; never more than cached blocks)."""
        return len(self._roots)

    def namespaces(self) -> list[Namespace]:
        """Namespaces that hold at least one cached block, in the order they got their first one."""
        return [root.namespace for root in self._roots.values()]

    def contains(self, block_id: int) -> bool:
        """Whether ``block_id`` is indexed."""
        return block_id in self._by_block

    def chain(self, block_id: int) -> tuple[Namespace, list[int]]:
        """The namespace of a cached block and the tokens from its root up to and including the block (what a tier
        below the pool keys it by: :mod:`pagedcore.kv_tiers`). O(depth).

        Example:
            >>> bm = BlockManager(num_blocks=4, block_size=2)
            >>> trie = PrefixTrie(bm)
            >>> trie.insert([1, 2, 3, 4], bm.allocate(2), namespace="a")
            [0, 1]
            >>> trie.chain(1)
            ('a', [1, 2, 3, 4])
        """
        node = self._by_block.get(block_id)
        if node is None:
            raise InvalidBlockError(f"chain: block {block_id} is not cached")
        parts: list[tuple[int, ...]] = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return node.namespace, [token for part in reversed(parts) for token in part]

    def match(self, token_ids: Sequence[int], namespace: Namespace = None) -> PrefixMatch:
        """Longest chain of cached full blocks that prefixes ``token_ids`` in ``namespace``. No side effects."""
        root = self._roots.get(namespace_key(namespace))
        ids: list[int] = []
        if root is None:
            return PrefixMatch(ids, 0)
        node = root
        bs = self._block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            child = node.children.get(tuple(token_ids[start : start + bs]))
            if child is None:
                break
            assert child.block_id is not None
            ids.append(child.block_id)
            node = child
        return PrefixMatch(ids, len(ids) * bs)

    # ------------------------------------------------------------------ commands
    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup that was acted on: ``num_query_tokens`` asked for, ``num_hit_tokens`` served."""
        if not 0 <= num_hit_tokens <= num_query_tokens:
            raise ValueError(f"record: need 0 <= hits ({num_hit_tokens}) <= queries ({num_query_tokens})")
        self._queries += num_query_tokens
        self._hits += num_hit_tokens

    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        namespace: Namespace = None,
        *,
        parent: int | None = None,
    ) -> list[int]:
        """Register a sequence's full blocks: ``block_ids[i]`` holds ``token_ids[i*bs:(i+1)*bs]``.

        Blocks must be held by the caller (reference count >= 1). Where the same content is cached already, the
        existing block is kept and returned in its place: the caller then holds a duplicate, which it may swap
        for the returned one (``retain`` it, ``release`` its own). Atomic: on error nothing changes.

        Args:
            token_ids: the blocks' tokens (from the root, or from after ``parent``).
            block_ids: the blocks.
            namespace: the cache salt.
            parent: a cached block of ``namespace`` the new blocks follow, so a growing sequence registers its
                newest block in O(1) instead of walking its whole chain again.

        Returns:
            The cached block id for each position (the caller's own where it was newly cached).
        """
        bs = self._block_size
        blocks = list(block_ids)
        if len(token_ids) < len(blocks) * bs:
            raise InvalidBlockError(
                f"insert: {len(blocks)} blocks of {bs} tokens need {len(blocks) * bs} tokens, got {len(token_ids)}"
            )
        key = namespace_key(namespace)
        # Plan first (no changes), so that a bad block anywhere leaves the trie and the manager untouched.
        if parent is None:
            root = self._roots.get(key)
        else:
            root = self._by_block.get(parent)
            if root is None or root.key != key:
                raise InvalidBlockError(f"insert: parent block {parent} is not cached in namespace {namespace!r}")
        node: _Node | None = root
        canonical: list[int] = []
        to_create: dict[int, tuple[int, ...]] = {}
        by_block = self._by_block
        for i, block_id in enumerate(blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if node is not None:
                child = node.children.get(tokens)  # content decides: the tokens are the key
                if child is not None:
                    assert child.block_id is not None
                    canonical.append(child.block_id)
                    node = child
                    continue
            if block_id in by_block:
                raise InvalidBlockError(
                    f"insert: block {block_id} is already cached for other content (position {i} of this chain)"
                )
            canonical.append(block_id)
            to_create[i] = tokens
            node = None  # every later block is new as well
        if to_create:
            self._bm.mark_cached([blocks[i] for i in to_create])  # validates: in use, not cached, no duplicates
        # Apply.
        if root is None:
            if not canonical:
                return canonical  # nothing to cache: no root for an empty namespace
            root = self._roots[key] = _Node((), None, None, namespace, key)
        at = root
        for i, block_id in enumerate(canonical):
            new = to_create.get(i)
            if new is not None:
                child = _Node(new, block_id, at, at.namespace, key)
                at.children[new] = child
                by_block[block_id] = child
                at = child
            else:
                at = by_block[block_id]
        return canonical

    def drop_block(self, block_id: int) -> list[int]:
        """Forget ``block_id`` and every descendant. Called by the BlockManager when it evicts ``block_id``.

        Returns ``[block_id, *descendants]``; the caller updates the manager's cached flags.
        """
        node = self._by_block.get(block_id)
        if node is None:
            raise InvalidBlockError(f"drop_block: block {block_id} is not cached")
        self._detach(node)
        if not node.children:  # a leaf: the usual victim of LRU eviction
            del self._by_block[block_id]
            return [block_id]
        dropped: list[int] = []
        stack = [node]
        while stack:
            current = stack.pop()
            assert current.block_id is not None
            dropped.append(current.block_id)
            del self._by_block[current.block_id]
            stack.extend(current.children.values())
        return dropped

    def remove(self, block_id: int) -> list[int]:
        """Drop a cached block and its descendants from the cache now (they stay allocated if still in use)."""
        dropped = self.drop_block(block_id)
        self._bm.uncache(dropped)
        return dropped

    def clear(self) -> int:
        """Forget every cached block in every namespace. Returns how many were forgotten."""
        return sum(self._clear(root) for root in list(self._roots.values()))

    def clear_namespace(self, namespace: Namespace) -> int:
        """Forget every cached block of one namespace. Returns how many were forgotten."""
        root = self._roots.get(namespace_key(namespace))
        return 0 if root is None else self._clear(root)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping (tests and debugging; O(cached blocks))."""
        seen: set[int] = set()
        for key, root in self._roots.items():
            assert root.block_id is None and root.parent is None
            assert root.key == key == namespace_key(root.namespace), "root filed under the wrong namespace"
            assert root.children, f"namespace {root.namespace!r} keeps a root without cached blocks"
            stack = [root]
            while stack:
                node = stack.pop()
                for tokens, child in node.children.items():
                    assert tokens == child.tokens, "child filed under the wrong tokens"
                    assert child.parent is node, "child points to the wrong parent"
                    assert child.key == key and child.namespace is root.namespace, "child of another namespace"
                    assert len(child.tokens) == self._block_size
                    assert child.block_id is not None and child.block_id not in seen
                    assert self._by_block.get(child.block_id) is child
                    assert self._bm.is_cached(child.block_id), f"block {child.block_id} indexed but not cached"
                    seen.add(child.block_id)
                    stack.append(child)
        assert seen == set(self._by_block), "index and tree disagree"
        assert self._bm.num_cached_blocks == len(seen), "manager's cached flags disagree with the trie"

    def __repr__(self) -> str:
        return f"PrefixTrie(cached_blocks={len(self._by_block)}, namespaces={len(self._roots)})"

    # ------------------------------------------------------------------ internals
    def _clear(self, root: _Node) -> int:
        count = 0
        for child in list(root.children.values()):  # removing the last child removes the root
            assert child.block_id is not None
            count += len(self.remove(child.block_id))
        return count

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens]
        if parent.block_id is None and not parent.children:
            del self._roots[parent.key]  # the namespace's last cached block is gone: so is its root
