"""The prefix trie: chains of token blocks -> cached KV block ids, matched to the token.

Each node is one block; its path from the namespace's root is the exact token prefix whose keys and values the block
holds. A node is a full block of ``block_size`` tokens, or a **partial block**: a leaf of 1 .. ``block_size - 1``
tokens, the partly filled last block of a finished sequence (a chat turn ends inside a block), registered with
:meth:`PrefixTrie.insert_partial`. A node's children are keyed by their token tuples themselves, so a child is found by
content: two blocks whose hashes collide are still told apart by comparing their tokens, and a collision can never
serve another prompt's KV.

**Token granularity** (SGLang's radix tree is the prior art): :meth:`PrefixTrie.match` walks whole blocks, then takes
the child (full or partial) sharing the longest run of leading tokens with the rest of the prompt, so a prompt that
continues a cached sequence inside a block, or branches off inside one, reuses the cached positions of that block
too. Only positions computed for exactly that prefix are served: the keys of a position depend on the tokens up to
it, so the first ``n`` positions of a block hold the KV of its first ``n`` tokens whatever follows. The holder that
attaches such a block shares it and copies it before its first write (copy-on-write, as for any cached block). A
node's children are also kept in token order, so the longest common run is found by bisection (it lies next to the
prompt's place in that order), not by a scan. A partial block that a later block extends (one holding its tokens and
more) is redundant and leaves the cache when that block is registered.

**Namespaces.** Every namespace (a cache salt, e.g. the tenant) has its own root: entries in different namespaces
never match each other. Namespace identity is :func:`pagedcore.block_keys.namespace_key` (re-exported here), the one
the tiers' keys and the router use too: two namespaces are the same when they have the same type and equal values,
element by element for tuples, so ``1``, ``1.0`` and ``True`` are three namespaces although a dict would take them
for one key. An unhashable or NaN namespace raises :class:`~pagedcore.errors.ConfigError`. A root lives only while
its namespace has a cached block: the trie never holds more than ``num_blocks`` nodes plus one root per namespace
with a cached block, however many namespaces a long-running pool has served.

The trie owns the token -> block mapping; the :class:`~pagedcore.block_manager.BlockManager` owns reference counts
and decides when to evict. A cached block at reference count 0 sits in the manager's evictable pool; when the
manager evicts it, it calls :meth:`PrefixTrie.drop_block`, which also forgets the block's descendants (they can no
longer be reached).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from typing import cast

from pagedcore.block_keys import namespace_key
from pagedcore.block_manager import BlockManager
from pagedcore.errors import ConfigError, InvalidBlockError
from pagedcore.validation import as_integer, integer

__all__ = ["PrefixMatch", "PrefixTrie", "namespace_key"]

Namespace = Hashable


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _token_tuple(values: Sequence[object], op: str) -> tuple[int, ...]:
    """``values`` as a tuple of ``int`` token ids (any integer, negative ones included: encoder inputs use them), else
    :class:`InvalidBlockError` naming the bad ones: a string or None is no token, and a float or bool cached as one
    would stand in for the integer it equals (``2.0``, ``True``)."""
    tokens = tuple(values)
    if set(map(type, tokens)) <= _INT:
        return cast("tuple[int, ...]", tokens)
    numbers = [as_integer(value) for value in tokens]
    bad = [repr(value) for value, number in zip(tokens, numbers) if number is None]
    if bad:
        shown = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        raise InvalidBlockError(f"{op}: token ids must be integers, got {shown}", param="token_ids")
    return tuple(number for number in numbers if number is not None)


_INT = {int}


def _cached_elsewhere(block_id: int, position: int) -> InvalidBlockError:
    return InvalidBlockError(
        f"insert: block {block_id} is already cached for other content (position {position} of this chain)"
    )


class _Node:
    __slots__ = ("block_id", "children", "is_partial", "key", "namespace", "order", "parent", "partials", "tokens")

    def __init__(
        self,
        tokens: tuple[int, ...],
        block_id: int | None,
        parent: _Node | None,
        namespace: Namespace,
        key: Hashable,
        is_partial: bool = False,
    ) -> None:
        self.tokens = tokens
        self.is_partial = is_partial  # a leaf holding fewer than block_size tokens
        self.block_id = block_id  # None only for a namespace root
        self.parent = parent
        self.namespace = namespace  # as first given for this namespace (what namespaces() reports)
        self.key = key  # namespace_key(namespace): the namespace's identity
        # Keyed by content: the dict compares the tokens themselves, so equal hashes never conflate two blocks. Full
        # and partial children share it (a partial key is shorter than a block, so a full block never finds one).
        self.children: dict[tuple[int, ...], _Node] = {}
        self.order: list[tuple[int, ...]] = []  # the children's keys, sorted: the longest common run by bisection
        self.partials = 0  # partial children among them

    def add(self, child: _Node) -> None:
        self.children[child.tokens] = child
        insort(self.order, child.tokens)
        self.partials += child.is_partial

    def discard(self, child: _Node) -> None:
        del self.children[child.tokens]
        order = self.order
        del order[bisect_left(order, child.tokens)]
        self.partials -= child.is_partial

    def longest_run(self, window: Sequence[int]) -> tuple[_Node | None, int]:
        """The child sharing the most leading tokens with ``window`` (at most a block's), and how many it shares."""
        order = self.order
        if not order or not window:
            return None, 0
        key = tuple(window)
        at = bisect_left(order, key)
        best, run = None, 0
        for i in (at - 1, at):  # the longest common prefix in a sorted list is next to the query's place
            if 0 <= i < len(order):
                n = _common(order[i], key)
                if n > run:
                    best, run = order[i], n
        return (self.children[best], run) if best is not None else (None, 0)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence, to the token.

    Attributes:
        block_ids: the chain's blocks, root first. Not retained: call ``BlockManager.retain`` to use them.
        num_tokens: tokens covered: the full blocks' and, when it ends inside a block, the leading positions of the
            last one (a partial block, or a full block whose first tokens match), which a holder copies before
            writing into it.

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
        >>> trie.match([1, 2, 3, 9])                    # to the token: block 1's first position is this prefix's too
        PrefixMatch(block_ids=[0, 1], num_tokens=3)
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
        self._on_drop: Callable[[list[int]], object] | None = None
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

    def block_tokens(self, block_id: int) -> int:
        """Tokens a cached block holds: ``block_size``, or fewer for a partly filled block (0: not cached)."""
        node = self._by_block.get(block_id)
        return 0 if node is None else len(node.tokens)

    def watch_drops(self, listener: Callable[[list[int]], object] | None) -> None:
        """Call ``listener(block_ids)`` whenever blocks leave the trie (evicted, removed, cleared, made redundant),
        after they left: what is filed beside them (state snapshots, :mod:`pagedcore.state_slots`) leaves with them."""
        self._on_drop = listener

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
        """Longest cached prefix of ``token_ids`` in ``namespace``, to the token: the chain of full blocks, then the
        child sharing the most leading tokens with the rest (a partial block, or a full one used in part). No side
        effects."""
        root = self._roots.get(namespace_key(namespace))
        ids: list[int] = []
        if root is None:
            return PrefixMatch(ids, 0)
        node = root
        bs = self._block_size
        start, end = 0, len(token_ids)
        while start + bs <= end:
            child = node.children.get(tuple(token_ids[start : start + bs]))
            if child is None:
                break
            assert child.block_id is not None
            ids.append(child.block_id)
            node = child
            start += bs
        if not node.children:
            return PrefixMatch(ids, start)
        partly, run = node.longest_run(token_ids[start : start + bs])
        if partly is not None:
            assert partly.block_id is not None
            ids.append(partly.block_id)
        return PrefixMatch(ids, start + run)

    # ------------------------------------------------------------------ commands
    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup that was acted on: ``num_query_tokens`` asked for, ``num_hit_tokens`` served (integers,
        ``0 <= num_hit_tokens <= num_query_tokens``, else :class:`~pagedcore.errors.ConfigError` naming the one)."""
        queries, hits = num_query_tokens, num_hit_tokens
        if type(queries) is not int or type(hits) is not int or queries < 0 or hits < 0:  # the rule: integer()
            for name, value in (("num_query_tokens", queries), ("num_hit_tokens", hits)):
                integer(f"record: {name}", value, minimum=0, error=ConfigError, param=name)
            queries, hits = int(queries), int(hits)
        if hits > queries:
            raise ConfigError(
                f"record: num_hit_tokens ({hits}) must be <= num_query_tokens ({queries})", param="num_hit_tokens"
            )
        self._queries += queries
        self._hits += hits

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
        for the returned one (``retain`` it, ``release`` its own). Token ids and block ids must be integers (block
        ids in range, each once; also where the content is cached already), else :class:`InvalidBlockError`. Atomic:
        on error nothing changes.

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
        if parent is not None and type(block_ids) is list and len(block_ids) == 1 and len(token_ids) >= bs:
            return self._insert_one(token_ids, block_ids[0], namespace, parent)
        blocks = self._bm.check_ids(block_ids, "insert")  # every id, also where the content is cached already
        if len(token_ids) < len(blocks) * bs:
            raise InvalidBlockError(
                f"insert: {len(blocks)} blocks of {bs} tokens need {len(blocks) * bs} tokens, got {len(token_ids)}"
            )
        key = namespace_key(namespace)
        # Plan first (no changes), so that a bad block anywhere leaves the trie and the manager untouched.
        root = self._insert_root(key, namespace, parent, "insert")
        canonical, to_create = self._plan_insert(root, token_ids, blocks)
        if to_create:
            self._bm.mark_cached([blocks[i] for i in to_create])  # validates: in use, not cached, no duplicates
        if root is None:
            if not canonical:
                return canonical  # nothing to cache: no root for an empty namespace
            root = self._roots[key] = _Node((), None, None, namespace, key)
        self._apply_insert(root, key, canonical, to_create)
        return canonical

    def _insert_one(self, token_ids: Sequence[int], block_id: int, namespace: Namespace, parent: int) -> list[int]:
        """:meth:`insert` of one block under ``parent`` (a growing sequence's newest block, once per block it fills):
        the same checks, order and result as the general path, without its plan of many positions."""
        if type(block_id) is not int or not 0 <= block_id < self._bm.num_blocks:
            (block_id,) = self._bm.check_ids([block_id], "insert")  # as the general path checks it, first
        key = namespace_key(namespace)
        root = self._insert_root(key, namespace, parent, "insert")
        assert root is not None  # a parent is a cached block
        tokens = _token_tuple(token_ids[: self._block_size], "insert")
        child = root.children.get(tokens)
        if child is not None:
            assert child.block_id is not None
            return [child.block_id]
        if block_id in self._by_block:
            raise _cached_elsewhere(block_id, 0)
        self._bm.mark_cached([block_id])  # validates: in use, not cached
        self._add_child(root, tokens, block_id, key)
        return [block_id]

    def _insert_root(self, key: Hashable, namespace: Namespace, parent: int | None, caller: str) -> _Node | None:
        """The node an insert starts from: the namespace's root (None while it has none) or the block ``parent``,
        which must be a full block (a partial block has no children)."""
        if parent is None:
            return self._roots.get(key)
        root = self._by_block.get(parent)
        if root is None or root.key != key or root.is_partial:
            raise InvalidBlockError(
                f"{caller}: parent block {parent} is not a full block cached in namespace {namespace!r}"
            )
        return root

    def _plan_insert(
        self, root: _Node | None, token_ids: Sequence[int], blocks: list[int]
    ) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """Walk ``blocks`` down from ``root`` without changing anything: the cached block for each position, and
        the positions (with their tokens) that are new. A new block already cached elsewhere is an error."""
        bs = self._block_size
        node: _Node | None = root
        canonical: list[int] = []
        to_create: dict[int, tuple[int, ...]] = {}
        by_block = self._by_block
        for i, block_id in enumerate(blocks):
            tokens = _token_tuple(token_ids[i * bs : (i + 1) * bs], "insert")
            if node is not None:
                child = node.children.get(tokens)  # content decides: the tokens are the key
                if child is not None:
                    assert child.block_id is not None
                    canonical.append(child.block_id)
                    node = child
                    continue
            if block_id in by_block:
                raise _cached_elsewhere(block_id, i)
            canonical.append(block_id)
            to_create[i] = tokens
            node = None  # every later block is new as well
        return canonical, to_create

    def _apply_insert(
        self, root: _Node, key: Hashable, canonical: list[int], to_create: dict[int, tuple[int, ...]]
    ) -> None:
        """Create the planned nodes under ``root``, walking the positions already cached."""
        at = root
        for i, block_id in enumerate(canonical):
            new = to_create.get(i)
            at = self._add_child(at, new, block_id, key) if new is not None else self._by_block[block_id]

    def _add_child(
        self, at: _Node, tokens: tuple[int, ...], block_id: int, key: Hashable, partial: bool = False
    ) -> _Node:
        """Cache ``block_id`` (holding ``tokens``) as a child of ``at``; ``at``'s partial children that it covers
        leave the cache."""
        child = _Node(tokens, block_id, at, at.namespace, key, partial)
        at.add(child)
        self._by_block[block_id] = child
        self._drop_covered(at, tokens)  # after the add: a root losing its last partial child stays
        return child

    def insert_partial(
        self, token_ids: Sequence[int], block_id: int, namespace: Namespace = None, *, parent: int | None = None
    ) -> bool:
        """Register a partly filled block: ``block_id`` holds the KV of ``token_ids`` (1 .. ``block_size - 1``
        tokens), which follow the cached block ``parent`` of ``namespace`` (None: the prompt's first block).

        The block must be held by the caller and not cached; once registered it is shared content, so its holders
        copy it before writing into it (the BlockManager's copy-on-write of a cached block) and its first
        ``len(token_ids)`` positions never change. A partial block whose tokens a cached sibling already holds (with
        more after them, or the same) is redundant: nothing changes and False is returned. Siblings that this one
        makes redundant (partial blocks holding a prefix of its tokens) leave the cache. Atomic: on error nothing
        changes.

        Example:
            >>> bm = BlockManager(num_blocks=4, block_size=4)
            >>> trie = PrefixTrie(bm)
            >>> full, last = bm.allocate(2)
            >>> trie.insert([1, 2, 3, 4], [full]), trie.insert_partial([5, 6], last, parent=full)
            ([0], True)
            >>> trie.match([1, 2, 3, 4, 5, 6, 7])        # a continuation inside the block reuses its two positions
            PrefixMatch(block_ids=[0, 1], num_tokens=6)
        """
        tokens = _token_tuple(token_ids, "insert_partial")
        (block_id,) = self._bm.check_ids([block_id], "insert_partial")
        if not 0 < len(tokens) < self._block_size:
            raise InvalidBlockError(
                f"insert_partial: a partial block holds 1 .. {self._block_size - 1} tokens, got {len(tokens)}"
            )
        key = namespace_key(namespace)
        node = self._insert_root(key, namespace, parent, "insert_partial")
        if block_id in self._by_block:
            raise InvalidBlockError(f"insert_partial: block {block_id} is already cached")
        if node is not None and node.longest_run(tokens)[1] == len(tokens):
            return False  # a cached sibling holds these positions already
        self._bm.mark_cached([block_id])  # validates: in use, not cached
        if node is None:
            node = self._roots[key] = _Node((), None, None, namespace, key)
        self._add_child(node, tokens, block_id, key, True)
        return True

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
            dropped = [block_id]
        else:
            dropped = self._subtree(node)
            by_block = self._by_block
            for dropped_id in dropped:
                del by_block[dropped_id]
        if self._on_drop is not None:
            self._on_drop(dropped)
        return dropped

    def subtree(self, block_id: int, skip: Container[int] = ()) -> list[int]:
        """``block_id`` and every descendant (what :meth:`drop_block` would drop), changing nothing; a descendant in
        ``skip`` is left out with everything below it (the manager skips what it counted already)."""
        node = self._by_block.get(block_id)
        if node is None:
            raise InvalidBlockError(f"subtree: block {block_id} is not cached")
        children = node.children
        if not children or (len(children) == 1 and next(iter(children.values())).block_id in skip):
            return [block_id]  # a leaf, or a chain's next block up (LRU takes a chain leaf first): one step
        return self._subtree(node, skip)

    @staticmethod
    def _subtree(node: _Node, skip: Container[int] = ()) -> list[int]:
        assert node.block_id is not None
        if not node.children:  # a leaf: the usual victim of LRU eviction
            return [node.block_id]
        ids: list[int] = []
        stack = [node]
        while stack:
            current = stack.pop()
            assert current.block_id is not None
            ids.append(current.block_id)
            stack.extend(child for child in current.children.values() if child.block_id not in skip)
        return ids

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
                order = node.order
                assert order == sorted(node.children), "children out of token order"
                assert node.partials == sum(c.is_partial for c in node.children.values()), "partial count is off"
                for i, tokens in enumerate(order[:-1]):  # a partial block no sibling holds more of
                    assert not node.children[tokens].is_partial or order[i + 1][: len(tokens)] != tokens, (
                        f"partial block {node.children[tokens].block_id} is redundant"
                    )
                for tokens, child in node.children.items():
                    assert tokens == child.tokens, "child filed under the wrong tokens"
                    assert child.parent is node, "child points to the wrong parent"
                    assert child.key == key and child.namespace is root.namespace, "child of another namespace"
                    if child.is_partial:
                        assert 0 < len(child.tokens) < self._block_size and not child.children, "a bad partial block"
                    else:
                        assert len(child.tokens) == self._block_size, "a full block of the wrong length"
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

    def _drop_covered(self, node: _Node, tokens: tuple[int, ...]) -> None:
        """Forget ``node``'s partial children holding a strict prefix of ``tokens``: a child with ``tokens`` is about
        to hold those positions and more."""
        if not node.partials:
            return
        children = node.children
        for length in range(1, len(tokens)):
            child = children.get(tokens[:length])
            if child is not None and child.is_partial:
                assert child.block_id is not None
                self.remove(child.block_id)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        parent.discard(node)
        if parent.block_id is None and not parent.children:
            del self._roots[parent.key]  # the namespace's last cached block is gone: so is its root
