"""The tiers below the pool, core side (issue 22): the disk store, the block frame, and KVTiers over a KVPool with a
fake adapter (each block's contents as bytes), so the bookkeeping is tested without a model."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pagedcore.disk_store import DiskKVStore
from pagedcore.errors import ConfigError
from pagedcore.kv_frame import FrameError, decode, encode
from pagedcore.kv_pool import KVPool
from pagedcore.kv_store import MemoryKVStore
from pagedcore.kv_tiers import KVTiers, chain_keys, namespace_bytes

ROOT = Path(__file__).resolve().parents[1]
BS = 2


class FakeIO:
    """A block's keys and values are ``bytes`` derived from its token chain, so a wrong load is visible."""

    def __init__(self, fingerprint: str = "model-a") -> None:
        self.blocks: dict[tuple[int, int], bytes] = {}
        self.fp: str | None = fingerprint
        self.reads = 0

    def fingerprint(self) -> str | None:
        return self.fp

    def block_nbytes(self, group: int) -> int:
        return 8

    def read_block(self, group: int, block_id: int) -> object:
        self.reads += 1
        return self.blocks[group, block_id]

    def to_bytes(self, copy: object) -> bytes:
        assert isinstance(copy, bytes)
        return copy

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        self.blocks[group, block_id] = payload


def content(tokens: list[int]) -> bytes:
    """What the fake model computes for the last block of a chain."""
    return (sum(tokens) * 31 + len(tokens)).to_bytes(8, "little")


def fill(pool: KVPool, io: FakeIO, tokens: list[int], namespace: object = None) -> None:
    """A finished request: its full blocks computed, cached, released (tail first)."""
    for group in pool.groups:
        bm = group.block_manager
        n = len(tokens) // BS
        ids = bm.allocate(n)
        for i, block_id in enumerate(ids):
            io.blocks[group.index, block_id] = content(tokens[: (i + 1) * BS])
        cached = group.trie.insert(tokens[: n * BS], ids, namespace)
        assert cached == ids
        bm.release(ids[::-1])


def evict_all(pool: KVPool) -> None:
    for group in pool.groups:
        bm = group.block_manager
        bm.release(bm.allocate(bm.num_available_blocks)[::-1])
    assert pool.num_cached_blocks == 0


def loaded_ok(pool: KVPool, io: FakeIO, tokens: list[int], namespace: object = None) -> int:
    """Blocks the pool matches for ``tokens``, each checked to hold its own chain's contents."""
    match = pool.match(tokens, namespace)
    for group, ids in zip(pool.groups, match.block_ids):
        for i, block_id in enumerate(ids):
            assert io.blocks[group.index, block_id] == content(tokens[: (i + 1) * BS]), "wrong KV served"
    return match.num_tokens // BS


def make(tmp_path: Path, fingerprint: str = "model-a", num_blocks: int = 6, windows=(None,)):
    pool = KVPool(num_blocks=num_blocks, block_size=BS, sliding_windows=windows)
    io = FakeIO(fingerprint)
    tiers = KVTiers([DiskKVStore(tmp_path, 1 << 20)], io)
    pool.attach_tiers(tiers)
    return pool, io, tiers


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 4 full blocks + 1 token: at most 4 loadable blocks


def test_evicted_blocks_are_written_and_loaded_back_with_their_own_contents(tmp_path):
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT)
    evict_all(pool)
    assert tiers.flush(5)
    assert tiers.stats().blocks_written == 4
    assert pool.load_prefix(PROMPT) == 4 * BS
    assert loaded_ok(pool, io, PROMPT) == 4
    stats = tiers.stats()
    assert stats.blocks_loaded == 4 and stats.stores["disk"]["hits"] == 4
    assert pool.load_prefix(PROMPT) == 0  # in the pool now: nothing more to load
    pool.check_invariants()
    assert pool.num_used_blocks == 0  # loaded blocks are cached, not held
    tiers.close()


def test_a_partly_filled_block_is_never_written_down(tmp_path):
    """Token-granular reuse caches a finished sequence's partly filled last block; the tiers key and load whole
    blocks, so evicting it writes nothing (before the guard it was written under a key no load asks for, framed with
    the previous block's tokens)."""
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT)
    group = pool.groups[0]
    (tail,) = group.block_manager.allocate(1)
    io.blocks[0, tail] = content(PROMPT)
    assert group.trie.insert_partial(PROMPT[8:], tail, None, parent=group.trie.match(PROMPT).block_ids[-1])
    group.block_manager.release([tail])
    full = group.trie.match(PROMPT[:8]).block_ids
    group.block_manager.retain(full)  # the full blocks used again: the partial one is evicted first
    group.block_manager.release(full[::-1])
    evict_all(pool)
    assert tiers.flush(5)
    assert tiers.stats().blocks_written == 4  # the 4 full blocks, not the partial one
    assert pool.load_prefix(PROMPT) == 4 * BS
    assert loaded_ok(pool, io, PROMPT) == 4  # each under its own key (the partial one was once keyed as its parent)
    pool.check_invariants()
    tiers.close()


def test_a_partial_pool_match_continues_into_the_store(tmp_path):
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT)
    evict_all(pool)
    tiers.flush(5)
    fill(pool, io, PROMPT[:4])  # the first two blocks are in the pool again
    assert pool.load_prefix(PROMPT) == 2 * BS
    assert loaded_ok(pool, io, PROMPT) == 4
    pool.check_invariants()
    tiers.close()


def test_a_match_that_ends_inside_a_block_loads_from_that_block_on(tmp_path):
    """The trie matches to the token: [5, 6, 7, 99, ...] matches A=(5, 6) and the first token of its child B=(7, 8).
    The load counted B as matched, fetched from the block after it and filed (9, 10)'s KV under B, where the prompt
    [5, 6, 7, 8, 9, 10] then found it: another chain's keys and values."""
    pool, io, tiers = make(tmp_path)
    other = [5, 6, 7, 99, 9, 10, 11]
    fill(pool, io, other[:6])
    evict_all(pool)
    assert tiers.flush(5)
    fill(pool, io, [5, 6, 7, 8])  # A and B in the pool
    assert pool.load_prefix(other) == 2 * BS  # (7, 99) and (9, 10), after A
    assert loaded_ok(pool, io, other) == 3
    assert loaded_ok(pool, io, [5, 6, 7, 8, 9, 10, 11]) == 2  # A and B only
    pool.check_invariants()
    tiers.close()


def test_another_namespace_and_another_model_get_nothing(tmp_path):
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT, namespace="tenant-a")
    evict_all(pool)
    tiers.flush(5)
    assert pool.load_prefix(PROMPT) == 0  # the default namespace
    assert pool.load_prefix(PROMPT, "tenant-b") == 0
    assert pool.load_prefix(PROMPT, ("tenant-a",)) == 0
    io.fp = "model-b"  # weights updated, or another model on the same directory
    assert pool.load_prefix(PROMPT, "tenant-a") == 0
    io.fp = "model-a"
    assert pool.load_prefix(PROMPT, "tenant-a") == 4 * BS
    assert loaded_ok(pool, io, PROMPT, "tenant-a") == 4
    tiers.close()


def test_a_namespace_without_a_stable_encoding_is_never_stored(tmp_path):
    pool, io, tiers = make(tmp_path)
    token = object()  # its repr differs per process: two such namespaces could not be told apart on disk
    fill(pool, io, PROMPT, namespace=token)
    evict_all(pool)
    tiers.flush(5)
    assert tiers.stats().blocks_written == 0 and io.reads == 0
    assert namespace_bytes(token) is None and namespace_bytes(("a", 1, 2.5, None, b"x", True)) is not None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "swap", "delete"])
def test_a_damaged_or_missing_file_is_a_miss_and_is_removed(tmp_path, damage):
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT)
    evict_all(pool)
    tiers.flush(5)
    keys = chain_keys("model-a", 0, namespace_bytes(None), PROMPT, BS)
    (store,) = tiers.stores
    files = [store.path_of(k) for k in keys]
    assert all(f.is_file() for f in files)
    target = files[2]
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "swap":  # a whole, valid block under another block's name
        target.write_bytes(files[1].read_bytes())
    else:
        target.unlink()
    assert pool.load_prefix(PROMPT) == 2 * BS  # the run stops before the bad block
    assert loaded_ok(pool, io, PROMPT) == 2
    stats = tiers.stats()
    refused = stats.refused_checksum + stats.refused_foreign
    assert refused == (0 if damage == "delete" else 1)
    assert not target.exists()  # removed (or gone already)
    pool.check_invariants()
    tiers.close()


def test_a_load_never_takes_blocks_other_holders_reserved(tmp_path):
    pool, io, tiers = make(tmp_path, num_blocks=6)
    fill(pool, io, PROMPT)
    evict_all(pool)
    tiers.flush(5)
    held = pool.reserve([5])  # 5 of 6 blocks
    assert pool.load_prefix(PROMPT) == 1 * BS  # one block could be spared
    held.release()
    assert pool.load_prefix(PROMPT) == 3 * BS
    assert loaded_ok(pool, io, PROMPT) == 4
    pool.check_invariants()
    tiers.close()


def test_a_load_keeps_the_matched_chain_while_it_allocates(tmp_path):
    # A pool with room for the whole prompt only if the loads reuse nothing of the matched head.
    pool, io, tiers = make(tmp_path, num_blocks=4)
    fill(pool, io, PROMPT)  # 4 blocks: the pool is full of this chain
    fill(pool, io, [50, 51, 52, 53])  # evicts the chain's two tail blocks: written down
    tiers.flush(5)
    assert pool.match(PROMPT).num_tokens == 2 * BS
    assert pool.load_prefix(PROMPT) == 2 * BS
    assert loaded_ok(pool, io, PROMPT) == 4
    pool.check_invariants()
    tiers.close()


def test_every_group_loads_the_same_run(tmp_path):
    pool, io, tiers = make(tmp_path, windows=(None, 4))
    fill(pool, io, PROMPT)
    evict_all(pool)
    tiers.flush(5)
    assert tiers.stats().blocks_written == 8  # 4 per group
    assert pool.load_prefix(PROMPT) == 4 * BS
    assert loaded_ok(pool, io, PROMPT) == 4
    pool.check_invariants()
    tiers.close()


def test_a_full_writer_queue_skips_the_block_and_counts_it(tmp_path):
    pool = KVPool(num_blocks=6, block_size=BS)
    io = FakeIO()
    tiers = KVTiers([MemoryKVStore(1 << 20)], io, queue_size=1)
    pool.attach_tiers(tiers)
    entered, gate = threading.Event(), threading.Event()
    real = io.to_bytes

    def slow(copy: object) -> bytes:
        entered.set()
        gate.wait(30)
        return real(copy)

    io.to_bytes = slow  # type: ignore[method-assign]
    fill(pool, io, PROMPT)
    bm = pool.groups[0].block_manager
    first = bm.allocate(3)  # 2 free + 1 eviction: the writer takes it and waits
    assert entered.wait(30)
    rest = bm.allocate(3)  # 3 evictions: one fits the queue, two are skipped
    gate.set()
    assert tiers.flush(30)
    bm.release(first + rest)
    stats = tiers.stats()
    assert stats.writes_skipped == 2 and stats.blocks_written == 2
    tiers.close()


def test_save_writes_every_cached_block(tmp_path):
    pool, io, tiers = make(tmp_path)
    fill(pool, io, PROMPT)
    assert tiers.save(pool, timeout=5)
    assert tiers.stats().blocks_written == 4
    assert tiers.save(pool, timeout=5) and tiers.stats().blocks_written == 4  # already stored: not again
    tiers.close()


# ---------------------------------------------------------------- the disk store


def test_disk_store_layout_is_owner_only(tmp_path):
    store = DiskKVStore(tmp_path, 1 << 20)
    assert store.put("ab" * 32, b"x")
    folder = tmp_path / "pagedcore-kv"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    path = store.path_of("ab" * 32)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "secret").stat().st_mode) == 0o600


def test_disk_store_refuses_a_missing_or_read_only_directory(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not an existing directory"):
        DiskKVStore(tmp_path / "missing", 1024)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not an existing directory"):
        DiskKVStore(tmp_path / "file", 1024)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes into a 0o500 directory: a read-only file system it cannot
        real_open = os.open

        def read_only(path, flags, *args, **kwargs):
            if flags & os.O_CREAT:
                raise OSError(errno.EROFS, "Read-only file system")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match="not writable"):
        DiskKVStore(ro, 1024)


def test_a_closed_disk_store_keeps_and_finds_nothing_and_its_files_stay(tmp_path):
    store = DiskKVStore(tmp_path, 1 << 20)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    assert store.put("aa", b"kept") and not store.closed
    store.close()
    store.close()  # again: nothing
    assert store.closed
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before - 1  # its directory's descriptor
    assert not store.put("bb", b"new") and store.get("aa") is None and not store.contains("aa")
    store.delete("aa")  # nothing: a closed store touches no file
    assert store.stats()["entries"] == 1 and store.stats()["writes"] == 1
    assert DiskKVStore(tmp_path, 1 << 20).get("aa") == b"kept"  # the next store on the folder finds the file


def test_disk_store_budget_evicts_least_recently_used_and_survives_a_restart(tmp_path):
    store = DiskKVStore(tmp_path, 30)
    for key in ("aa", "bb", "cc"):
        assert store.put(key, b"0123456789")
        time.sleep(0.01)  # distinct modification times, for the restart's order
    assert store.get("aa") == b"0123456789"  # aa is recent now
    assert store.put("dd", b"0123456789")
    assert not store.contains("bb") and store.contains("aa")
    assert store.stats()["bytes"] == 30 and store.stats()["evicted"] == 1
    assert not store.put("ee", b"x" * 31) and store.stats()["too_large"] == 1
    again = DiskKVStore(tmp_path, 30)
    assert again.stats()["entries"] == 3 and again.get("cc") == b"0123456789"


def test_disk_full_skips_the_write_and_counts_it(tmp_path, monkeypatch):
    store = DiskKVStore(tmp_path, 1 << 20)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert store.put("abcd", b"block") is False
    monkeypatch.undo()
    assert store.stats()["disk_full"] == 1 and store.stats()["write_errors"] == 1
    assert not store.contains("abcd")
    assert not list(store.path_of("abcd").parent.iterdir())  # no temporary file left behind


def test_a_killed_writers_temporary_files_are_never_read_and_old_ones_are_removed(tmp_path):
    DiskKVStore(tmp_path, 1024)
    shard = tmp_path / "pagedcore-kv" / "ab"
    shard.mkdir(mode=0o700)
    old, new = shard / ".tmp-1-2-old", shard / ".tmp-1-2-new"
    old.write_bytes(b"half a blo")
    new.write_bytes(b"half a blo")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    store = DiskKVStore(tmp_path, 1024)
    assert not old.exists() and new.exists()  # a recent one may be another process's write in progress
    assert store.stats()["entries"] == 0


def test_two_processes_writing_the_same_directory(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pagedcore.disk_store import DiskKVStore
        from pagedcore.kv_frame import encode
        store = DiskKVStore({str(tmp_path)!r}, 1 << 24)
        me = int(sys.argv[1])
        for i in range(200):
            key = format(i % 50, "02x") * 32       # 50 keys both processes write, same content
            own = format(1000 * me + i, "064x")   # 200 of its own
            for k in (key, own):
                store.put(k, encode(k, "fp", 0, [i % 50], bytes(range(256)) * 8))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)]) for n in (1, 2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    reader = DiskKVStore(tmp_path, 1 << 24)
    assert reader.stats()["entries"] == 50 + 400
    for i in range(50):
        key = format(i, "02x") * 32
        data = reader.get(key)
        assert data is not None and decode(data, key, "fp", 0, [i]) == bytes(range(256)) * 8
    leftovers = [p for p in (tmp_path / "pagedcore-kv").rglob(".tmp-*")]
    assert not leftovers


def test_frame_checks():
    data = encode("k", "fp", 1, [3, 4], b"payload")
    assert decode(data, "k", "fp", 1, [3, 4]) == b"payload"
    for bad, reason in [
        (data[:-1], "checksum"),
        (data[:10], "checksum"),
        (b"x" * len(data), "checksum"),
        (data[:20] + b"!" + data[21:], "checksum"),
    ]:
        with pytest.raises(FrameError) as info:
            decode(bad, "k", "fp", 1, [3, 4])
        assert info.value.reason == reason
    for args, reason in [
        (("k", "other", 1, [3, 4]), "fingerprint"),
        (("j", "fp", 1, [3, 4]), "foreign"),
        (("k", "fp", 0, [3, 4]), "foreign"),
        (("k", "fp", 1, [3, 5]), "foreign"),
    ]:
        with pytest.raises(FrameError) as info:
            decode(data, *args)
        assert info.value.reason == reason


def test_two_nan_namespaces_never_share_stored_blocks(tmp_path):
    """Two NaN objects were two namespaces in memory (a NaN is not equal to another) and one on disk (``float.hex``
    gives 'nan' for both), so one tenant's stored blocks were loaded for the other. A NaN names nothing: refused."""
    pool, io, tiers = make(tmp_path)
    first, second = float("nan"), float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        fill(pool, io, PROMPT, namespace=first)
    with pytest.raises(ConfigError, match="NaN"):
        pool.load_prefix(PROMPT, second)
    assert tiers.stats().blocks_loaded == 0
    pool.check_invariants()
    tiers.close()


def test_blocks_every_store_refused_are_not_counted_written(tmp_path):
    """Regression (an outside audit): with a budget smaller than one block, ``written_blocks`` counted every block
    although none was kept (each also counted under ``write_failures``)."""
    pool = KVPool(num_blocks=6, block_size=BS)
    io = FakeIO()
    tiers = KVTiers([DiskKVStore(tmp_path, 16)], io)  # a framed block is larger than 16 bytes
    pool.attach_tiers(tiers)
    fill(pool, io, PROMPT)
    evict_all(pool)
    assert tiers.flush(5)
    stats = tiers.stats()
    assert stats.blocks_written == 0 and stats.write_failures == 4 and stats.stores["disk"]["too_large"] == 4
    tiers.close()


def test_a_file_larger_than_the_budget_under_a_block_name_is_refused_unread(tmp_path, monkeypatch):
    """Regression (an outside audit): a 1 GiB file under a block's name was read whole on the step loop (5 s for
    every client) before its frame was refused. It is refused from its size, unread, removed and counted."""
    from pagedcore import disk_store
    from pagedcore.engine.stats import _store_fields

    store = DiskKVStore(tmp_path, 1 << 20)
    key = "cd" * 32
    path = store.path_of(key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with open(path, "wb") as planted:
        planted.truncate(1 << 30)  # sparse: no disk used
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(disk_store.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    assert store.get(key) is None and reads == []
    assert store.stats()["refused_files"] == 1 and not os.path.lexists(path)
    tiers = KVTiers([store], FakeIO())
    assert _store_fields(tiers.stats())["kv_store_refused"]["file"] == 1  # what /metrics reports as reason="file"
    tiers.close()
