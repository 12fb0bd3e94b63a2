"""Tiers below the pool: blocks the pool evicts are written down, and a prefix match continues into the stores.

The core owns the bookkeeping (which block goes where, under which key, what may be loaded); the framework adapter
owns the tensors through a :class:`BlockIO` (copy a block out, turn the copy into bytes, copy bytes into a block).

**Keys that cannot lie.** A block's key is a SHA-256 chain (:func:`pagedcore.block_keys.chain_keys`, re-exported
here): the root digest covers the model fingerprint (the adapter's: weights content hash, the hidden-state config,
dtype, block size, stored layout, layers, KV heads), the KV group and the namespace (its
:func:`~pagedcore.block_keys.namespace_bytes`, which is the trie's own identity of it); each block's digest covers
its parent's and its own tokens, so a key names the whole token chain up to and including the block, as the trie
matches it. The framed block (:mod:`pagedcore.kv_frame`) repeats the fingerprint, the group and the block's tokens
under a checksum: a file that fails any check is a miss, counted and removed. Namespaces that have no stable
encoding across processes (anything but None, str, bytes, int, bool, float and tuples of them) are never stored,
so nothing is ever served to another namespace.

**Writes** (:meth:`KVTiers.evicting`, called by the block manager before it forgets an evicted block, under the
pool's lock): the adapter copies the block out (a host copy: the block is reused right after), and a bounded queue
hands it to one writer thread, which encodes, frames and puts it into every store. A full queue skips the block
(counted); nothing on the step loop waits for a store. :meth:`KVTiers.save` writes every cached block (a clean
shutdown, so a restart finds them).

**State snapshots** (:mod:`pagedcore.state_slots`) go down and come back the same way, keyed by the chain key of the
block they are filed beside (KV group :data:`STATE_GROUP`): written when their slot is evicted or their block is
(:meth:`KVTiers.evicting_snapshot`) and by :meth:`KVTiers.save`; a load restores the deepest snapshot the stores hold
along the prompt's cached chain, deeper than any the pool holds, into a free or evictable slot. Only snapshots at whole
blocks go down (as only whole blocks do); the adapter's :class:`StateIO` owns their bytes.

**Loads** (:meth:`KVTiers.load`, called before the trie is matched for a request's prefill, under the pool's lock):
after the blocks the pool matches, the following ones are looked up in the stores in order; the run found in every
group is read and checked first, then loaded into freshly allocated blocks (never more than the pool can spare
without touching other holders' reservations: :meth:`~pagedcore.kv_pool.KVPool.shortfalls`), registered in the
trie and released to the prefix cache, so the ordinary match that follows attaches them like any pool hit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pagedcore.block_keys import chain_keys, namespace_bytes
from pagedcore.kv_frame import FrameError, decode, encode
from pagedcore.kv_store import KVStore

if TYPE_CHECKING:
    from pagedcore.kv_pool import KVPool
    from pagedcore.prefix_trie import PrefixTrie

__all__ = ["STATE_GROUP", "BlockIO", "KVTiers", "StateIO", "TierStats", "chain_keys", "namespace_bytes"]

logger = logging.getLogger(__name__)
STATE_GROUP = -1
"""The KV group number in the keys and frames of state snapshots (one per block of the anchor group's chain)."""


class BlockIO(Protocol):
    """What the adapter does for the tiers (it owns the tensors): the transformers adapter's is
    :class:`~pagedcore.adapters.transformers.kv_io.TensorBlockIO`; :class:`KVTiers` shows a fake one.

    Example:
        >>> sorted(name for name in vars(BlockIO) if not name.startswith("_"))
        ['block_nbytes', 'fingerprint', 'read_block', 'to_bytes', 'write_block']
    """

    def fingerprint(self) -> str | None:
        """The model fingerprint for keys now, or None when nothing may be stored or loaded (no model bound yet,
        or no tensors to load into)."""

    def block_nbytes(self, group: int) -> int:
        """The payload size of one block of ``group``."""

    def read_block(self, group: int, block_id: int) -> object:
        """A copy of the block's keys and values, taken now (the block is reused right after)."""

    def to_bytes(self, copy: object) -> bytes:
        """A copy from :meth:`read_block` as the payload (in the writer thread)."""

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        """Copy a payload of :meth:`block_nbytes` bytes into the block's keys and values."""


@runtime_checkable
class StateIO(Protocol):
    """What the adapter of a model with recurrent-state layers does for the tiers (besides :class:`BlockIO`):
    a state slot's bytes.

    Example:
        >>> sorted(name for name in vars(StateIO) if not name.startswith("_"))
        ['read_state', 'state_nbytes', 'write_state']
    """

    def state_nbytes(self) -> int:
        """The payload size of one state slot (0: no state tensors to load into yet)."""

    def read_state(self, slot: int) -> object:
        """A copy of the slot's state, taken now (the slot is reused right after)."""

    def write_state(self, slot: int, payload: bytes) -> None:
        """Copy a payload of :meth:`state_nbytes` bytes into the slot."""


@dataclass
class TierStats:
    """What the tiers did (counters since they were made; ``stores`` holds each store's own stats and hits).

    Attributes:
        blocks_loaded / tokens_loaded: blocks (summed over KV groups) and prompt tokens served from the stores.
        load_seconds: time spent looking up, reading, checking and copying blocks in.
        blocks_written / write_seconds: blocks the writer thread put into a store (one that every store refused
            counts in ``write_failures`` only), and its time doing so.
        writes_skipped: evicted blocks not written because the writer's queue was full.
        write_failures: puts a store refused (no room for it, disk full).
        snapshots_written / snapshots_loaded: state snapshots put into and restored from the stores.
        refused_checksum / refused_fingerprint / refused_foreign: stored blocks found and not loaded (removed).
        pending_writes: blocks waiting in the writer's queue now.
        stores: per store name: its ``stats()`` plus ``hits`` (blocks loaded from it).

    Example:
        >>> TierStats().blocks_loaded
        0
    """

    blocks_loaded: int = 0
    tokens_loaded: int = 0
    load_seconds: float = 0.0
    blocks_written: int = 0
    write_seconds: float = 0.0
    writes_skipped: int = 0
    write_failures: int = 0
    snapshots_written: int = 0
    snapshots_loaded: int = 0
    refused_checksum: int = 0
    refused_fingerprint: int = 0
    refused_foreign: int = 0
    pending_writes: int = 0
    stores: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Write:
    key: str
    fingerprint: str
    group: int
    tokens: tuple[int, ...]
    copy: object


class KVTiers:
    """The stores below one pool, and the writer thread that fills them.

    Args:
        stores: the tiers, fastest first: a load takes a block from the first that holds a good copy; a write goes
            to every one.
        io: the adapter's tensors (:class:`BlockIO`).
        queue_size: evicted blocks waiting to be written at most (more are skipped and counted).

    Example (the core alone, with a fake adapter that keeps each block's contents in a dict):
        >>> from pagedcore.kv_pool import KVPool
        >>> from pagedcore.kv_store import MemoryKVStore
        >>> class FakeIO:
        ...     def __init__(self): self.blocks = {}
        ...     def fingerprint(self): return "fake-model"
        ...     def block_nbytes(self, group): return 4
        ...     def read_block(self, group, block_id): return self.blocks[block_id]
        ...     def to_bytes(self, copy): return copy
        ...     def write_block(self, group, block_id, payload): self.blocks[block_id] = payload
        >>> pool = KVPool(num_blocks=2, block_size=2)
        >>> io = FakeIO()
        >>> tiers = KVTiers([MemoryKVStore(1 << 20)], io)
        >>> pool.attach_tiers(tiers)
        >>> ids = pool.groups[0].block_manager.allocate(2)
        >>> io.blocks.update({ids[0]: b"kv12", ids[1]: b"kv34"})
        >>> _ = pool.groups[0].trie.insert([1, 2, 3, 4], ids)
        >>> pool.groups[0].block_manager.release(ids[::-1])
        >>> other = pool.groups[0].block_manager.allocate(2)      # evicts both: they are written down
        >>> tiers.flush(), pool.num_cached_blocks
        (True, 0)
        >>> pool.groups[0].block_manager.release(other)
        >>> pool.load_prefix([1, 2, 3, 4, 5]), pool.match([1, 2, 3, 4, 5]).num_tokens   # back from the store
        (4, 4)
        >>> tiers.close()
    """

    def __init__(self, stores: Sequence[KVStore], io: BlockIO, *, queue_size: int = 256) -> None:
        self._stores = list(stores)
        self._io = io
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=queue_size)
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._hits = {store.name: 0 for store in self._stores}
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def stores(self) -> tuple[KVStore, ...]:
        """The stores, fastest first."""
        return tuple(self._stores)

    def stats(self) -> TierStats:
        """A snapshot of the counters (see :class:`TierStats`)."""
        with self._lock:
            snap = TierStats(**{k: v for k, v in vars(self._stats).items() if k != "stores"})
            hits = dict(self._hits)
        snap.pending_writes = self._queue.unfinished_tasks
        snap.stores = {store.name: {**store.stats(), "hits": hits.get(store.name, 0)} for store in self._stores}
        return snap

    # ------------------------------------------------------------------ writes
    def evicting(self, group: int, block_id: int, trie: PrefixTrie) -> None:
        """``block_id`` (cached in ``trie``) is about to be evicted from KV group ``group``: queue it for writing
        unless a store holds it already. Called under the pool's lock; never raises."""
        try:
            self._capture(group, block_id, trie, wait=False)
        except Exception:  # a tier must never break an allocation
            logger.exception("pagedcore: writing an evicted block down failed; it is dropped")

    def evicting_snapshot(self, slot: int, block_id: int, offset: int, trie: PrefixTrie) -> None:
        """The state snapshot in ``slot``, filed in ``block_id`` of the anchor group's ``trie`` after ``offset`` of its
        tokens, is about to be evicted (or its block is): queue it for writing unless a store holds it (only
        snapshots at a whole block's end go down). Under the pool's lock; never raises."""
        if offset != trie.block_size:
            return
        try:
            self._capture_snapshot(slot, block_id, trie, wait=False)
        except Exception:
            logger.exception("pagedcore: writing an evicted state snapshot down failed; it is dropped")

    def save(self, pool: KVPool, timeout: float | None = None) -> bool:
        """Write every block and state snapshot cached in ``pool`` now (not only the evicted ones) and wait for the
        writer, so that a restart finds them. Hold the pool's lock while calling. True when everything queued was
        written."""
        for group in pool.groups:
            bm = group.block_manager
            for block_id in range(bm.num_blocks):
                if bm.is_cached(block_id):
                    self._capture(group.index, block_id, group.trie, wait=True)
        if pool.states is not None:
            trie = pool.groups[pool.anchor].trie
            for block_id, offset, slot in pool.states.snapshots():
                if offset == trie.block_size:
                    self._capture_snapshot(slot, block_id, trie, wait=True)
        return self.flush(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has written what is queued (at most ``timeout`` seconds). True when it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                done.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, then stop the writer thread. Later evictions are not written."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _capture(self, group: int, block_id: int, trie: PrefixTrie, *, wait: bool) -> None:
        if self._closed or not self._stores:
            return
        fingerprint = self._io.fingerprint()
        if fingerprint is None:
            return
        namespace, tokens = trie.chain(block_id)
        if len(tokens) % trie.block_size:  # a partly filled last block (token-granular reuse): loads are whole blocks
            return
        encoded = namespace_bytes(namespace)
        if encoded is None:
            return
        bs = trie.block_size
        key = chain_keys(fingerprint, group, encoded, tokens, bs)[-1]
        self._queue_write(
            key, fingerprint, group, tuple(tokens[-bs:]), lambda: self._io.read_block(group, block_id), wait
        )

    def _capture_snapshot(self, slot: int, block_id: int, trie: PrefixTrie, *, wait: bool) -> None:
        io = self._io
        if self._closed or not self._stores or not isinstance(io, StateIO):
            return
        fingerprint = io.fingerprint()
        if fingerprint is None:
            return
        namespace, tokens = trie.chain(block_id)
        encoded = namespace_bytes(namespace)
        bs = trie.block_size
        if len(tokens) % bs or encoded is None:  # a snapshot inside a block: only whole blocks go down
            return
        key = chain_keys(fingerprint, STATE_GROUP, encoded, tokens, bs)[-1]
        self._queue_write(key, fingerprint, STATE_GROUP, tuple(tokens[-bs:]), lambda: io.read_state(slot), wait)

    def _queue_write(
        self, key: str, fingerprint: str, group: int, tokens: tuple[int, ...], read: Callable[[], object], wait: bool
    ) -> None:
        """Queue a copy (``read()``, taken now) for the writer under ``key``, unless it is queued or stored."""
        with self._lock:
            if key in self._pending:
                return
        if all(store.contains(key) for store in self._stores):
            return
        item = _Write(key, fingerprint, group, tokens, read())
        self._start_writer()
        with self._lock:
            self._pending.add(key)
        try:
            self._queue.put(item, block=wait)  # the writer never takes the pool's lock: waiting here is safe
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self._stats.writes_skipped += 1

    def _start_writer(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="pagedcore-kv-writer", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:
                logger.exception("pagedcore: the KV store writer failed on one block; it is dropped")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item.key)
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        started = time.perf_counter()
        data = encode(item.key, item.fingerprint, item.group, item.tokens, self._io.to_bytes(item.copy))
        failures = sum(not store.put(item.key, data) for store in self._stores)
        with self._lock:
            stored = failures < len(self._stores)  # one no store took counts as failures only
            if item.group == STATE_GROUP:
                self._stats.snapshots_written += stored
            else:
                self._stats.blocks_written += stored
            self._stats.write_failures += failures
            self._stats.write_seconds += time.perf_counter() - started

    # ------------------------------------------------------------------ loads
    def load(self, pool: KVPool, token_ids: Sequence[int], namespace: Hashable) -> int:
        """Continue ``token_ids``' prefix match into the stores and load what they hold into the pool (see the
        module docstring). Hold the pool's lock. Returns the prompt tokens the pool covers now beyond what it
        matched before; never raises for a store's fault (a bad block is a miss)."""
        if self._closed or not self._stores:
            return 0
        started = time.perf_counter()
        try:
            loaded = self._load(pool, token_ids, namespace)
            if pool.states is not None:
                self._load_snapshot(pool, token_ids, namespace)
        except Exception:
            logger.exception("pagedcore: loading blocks from the KV store failed; the prompt is computed instead")
            loaded = 0
        with self._lock:
            self._stats.load_seconds += time.perf_counter() - started
            self._stats.tokens_loaded += loaded
        return loaded

    def _load(self, pool: KVPool, token_ids: Sequence[int], namespace: Hashable) -> int:
        encoded = namespace_bytes(namespace)
        bs = pool.block_size
        limit = (len(token_ids) - 1) // bs  # the prompt's last token is always computed
        if encoded is None or limit <= 0:
            return 0
        # Whole blocks only: a match that ends inside a block (to the token) still computes, or loads, that block.
        matches = [g.trie.match(token_ids[: limit * bs], namespace) for g in pool.groups]
        matched = [m.block_ids[: m.num_tokens // bs] for m in matches]
        before = min(len(m) for m in matched)
        if before >= limit:
            return 0
        fingerprint = self._io.fingerprint()
        if fingerprint is None:
            return 0
        target = self._fit(pool, matched, limit)  # what the pool can spare, before reading anything
        if target <= before:
            return 0
        found = [self._fetch(fingerprint, g, encoded, token_ids, len(m), target, bs) for g, m in enumerate(matched)]
        target = min(len(m) + len(run) for m, run in zip(matched, found))
        if target <= before:
            return 0
        for group, chain, run in zip(pool.groups, matched, found):
            self._install(group.index, pool, chain, run[: max(0, target - len(chain))], token_ids, namespace)
        return (target - before) * bs

    def _load_snapshot(self, pool: KVPool, token_ids: Sequence[int], namespace: Hashable) -> bool:
        """Restore the deepest state snapshot the stores hold along the prompt's whole blocks cached in every group,
        when it is deeper than every snapshot the pool holds there, into a slot the pool can spare."""
        io, states = self._io, pool.states
        encoded = namespace_bytes(namespace)
        bs = pool.block_size
        limit = (len(token_ids) - 1) // bs  # the prompt's last token is always computed
        if states is None or not isinstance(io, StateIO) or encoded is None or limit <= 0:
            return False
        matches = [g.trie.match(token_ids[: limit * bs], namespace) for g in pool.groups]
        depth = min(m.num_tokens for m in matches) // bs
        chain = matches[pool.anchor].block_ids[:depth]
        held = next((i + 1 for i in range(depth - 1, -1, -1) if states.snapshot_of(chain[i], bs) is not None), 0)
        fingerprint = io.fingerprint() if depth > held else None
        resource = pool.state_resource
        if fingerprint is None or resource is None or pool.available_blocks(resource) < 1 or not io.state_nbytes():
            return False
        keys = chain_keys(fingerprint, STATE_GROUP, encoded, token_ids[: depth * bs], bs)
        for index in range(depth - 1, held - 1, -1):
            tokens = token_ids[index * bs : (index + 1) * bs]
            found = self._read(keys[index], fingerprint, STATE_GROUP, tokens, io.state_nbytes())
            if found is None:
                continue
            slot = states.allocate()
            try:
                io.write_state(slot, found[0])
                states.register(chain[index], bs, slot)
            finally:
                states.release(slot)  # filed now: evictable like any unheld snapshot
            with self._lock:
                self._stats.snapshots_loaded += 1
                self._hits[found[1]] += 1
            return True
        return False

    def _fetch(
        self, fingerprint: str, group: int, namespace: bytes, token_ids: Sequence[int], start: int, stop: int, bs: int
    ) -> list[tuple[bytes, str]]:
        """The checked payloads (and the store each came from) of blocks ``start, start + 1, ...`` of ``group``
        while the stores hold them, up to ``stop``."""
        keys = chain_keys(fingerprint, group, namespace, token_ids[: stop * bs], bs)
        run = []
        size = self._io.block_nbytes(group)
        for index in range(start, stop):
            tokens = token_ids[index * bs : (index + 1) * bs]
            payload = self._read(keys[index], fingerprint, group, tokens, size)
            if payload is None:
                break
            run.append(payload)
        return run

    def _read(
        self, key: str, fingerprint: str, group: int, tokens: Sequence[int], size: int
    ) -> tuple[bytes, str] | None:
        for store in self._stores:
            data = store.get(key)
            if data is None:
                continue
            try:
                payload = decode(data, key, fingerprint, group, tokens)
                if len(payload) != size:
                    raise FrameError("foreign", f"{len(payload)} payload bytes, a block holds {size}")
            except FrameError as exc:
                store.delete(key)
                with self._lock:
                    counter = f"refused_{exc.reason}"
                    setattr(self._stats, counter, getattr(self._stats, counter) + 1)
                logger.warning("pagedcore: a block in the %s store was refused and removed (%s)", store.name, exc)
                continue
            return payload, store.name
        return None

    def _fit(self, pool: KVPool, matched: list[list[int]], target: int) -> int:
        """The longest run up to ``target`` blocks whose new blocks the pool can spare now, less what other holders
        reserved (the matched chains are kept while the new blocks are allocated, so they do not count as
        available)."""
        for group, chain in zip(pool.groups, matched):
            kept = sum(1 for b in chain if group.block_manager.ref_count(b) == 0)
            spare = pool.available_blocks(group.index) - kept
            target = min(target, len(chain) + max(0, spare))
        return target

    def _install(
        self,
        group: int,
        pool: KVPool,
        chain: list[int],
        run: list[tuple[bytes, str]],
        token_ids: Sequence[int],
        ns: Hashable,
    ) -> None:
        if not run:
            return
        g = pool.groups[group]
        bm, bs = g.block_manager, pool.block_size
        bm.retain(chain)  # the matched chain must not be evicted to make room for its own continuation
        try:
            new = bm.allocate(len(run))
            try:
                for block_id, (payload, _) in zip(new, run):
                    self._io.write_block(group, block_id, payload)
                start = len(chain) * bs
                g.trie.insert(token_ids[start : start + len(new) * bs], new, ns, parent=chain[-1] if chain else None)
            finally:
                bm.release(new[::-1])  # cached now: evictable like any released prefix (tail first)
        finally:
            bm.release(chain[::-1])
        with self._lock:
            self._stats.blocks_loaded += len(run)
            for _, name in run:
                self._hits[name] += 1
