"""The built-in disk tier: one file per block in a directory, written atomically, within a byte budget.

Layout: ``DIR/pagedcore-kv/<2 hex>/<key>.kv``, the folders created owner-only (``0o700``), the files ``0o600``. A
write goes to a temporary name in the same folder, is flushed and ``fsync``-ed, then renamed over the final name
(``os.replace``, atomic on POSIX): a reader sees a whole file or none, and two processes writing the same key both
write the same content (the key is a content hash), the last rename winning. A process killed mid-write leaves a
temporary file, never a partial block; temporary files older than an hour are removed at the next start. Disk full
(or any ``OSError`` while writing): the write is skipped and counted (``write_errors``), nothing fails.

The budget is this process's view: it indexes the folder at start (oldest modification first) and evicts its least
recently used files when a write would exceed ``max_bytes``; processes sharing a folder each keep their own budget,
so the folder can hold up to their sum. A file another process deleted is a miss.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from pagedcore.errors import ConfigError

__all__ = ["DiskKVStore"]

_FOLDER = "pagedcore-kv"
_SUFFIX = ".kv"
_STALE_TMP_SECONDS = 3600.0


class DiskKVStore:
    """Files in a directory (see the module docstring).

    Args:
        directory: an existing, writable directory (else :class:`~pagedcore.errors.ConfigError`).
        max_bytes: the budget for this process's view of the folder.

    Example:
        >>> import tempfile
        >>> store = DiskKVStore(tempfile.mkdtemp(), max_bytes=1 << 20)
        >>> store.put("ab12", b"block"), store.get("ab12"), store.contains("cd34")
        (True, b'block', False)
        >>> oct(store.folder.stat().st_mode & 0o777)
        '0o700'
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise ConfigError(f"kv_store_bytes must be a non-negative number of bytes, got {max_bytes!r}")
        root = Path(directory)
        if not root.is_dir():
            raise ConfigError(f"kv_store: {str(root)!r} is not an existing directory (create it first)")
        folder = root / _FOLDER
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            if folder.stat().st_uid == os.getuid():
                folder.chmod(0o700)  # owner-only, whatever the umask or an earlier run left
            probe = folder / f".probe-{os.getpid()}-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"kv_store: directory {str(root)!r} is not writable ({exc.strerror or exc})") from exc
        self.folder = folder
        self._max = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._bytes = 0
        self._counts = {"writes": 0, "write_errors": 0, "evicted": 0, "vanished": 0, "too_large": 0, "disk_full": 0}
        self._scan()

    # ------------------------------------------------------------------ the store protocol
    def put(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        size = len(data)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self._max:
                self._counts["too_large"] += 1
                return False
            victims = self._make_room(size)
        for victim in victims:
            _unlink(self._path(victim))
        if not self._write(path, data):
            with self._lock:
                self._counts["write_errors"] += 1
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
            self._counts["writes"] += 1
        return True

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(key, vanished=True)
            return None
        with self._lock:
            if key not in self._index:  # written by another process
                self._index[key] = len(data)
                self._bytes += len(data)
            self._index.move_to_end(key)
        return data

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        _unlink(self._path(key))
        self._forget(key, vanished=False)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self._bytes, "max_bytes": self._max, "entries": len(self._index), **self._counts}

    def __repr__(self) -> str:
        return f"DiskKVStore({str(self.folder)!r}, bytes={self._bytes}, max_bytes={self._max})"

    # ------------------------------------------------------------------ internals
    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"DiskKVStore: a key must be lowercase hex, got {key!r}")
        return self.folder / key[:2] / (key + _SUFFIX)

    def _make_room(self, size: int) -> list[str]:
        victims = []
        while self._index and self._bytes + size > self._max:
            victim, old = self._index.popitem(last=False)
            self._bytes -= old
            self._counts["evicted"] += 1
            victims.append(victim)
        return victims

    def _forget(self, key: str, *, vanished: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
                if vanished:
                    self._counts["vanished"] += 1

    def _write(self, path: Path, data: bytes) -> bool:
        tmp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self._counts["disk_full"] += 1
            return False

    def _scan(self) -> None:
        found = []
        now = time.time()
        for shard in self.folder.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                try:
                    info = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - info.st_mtime > _STALE_TMP_SECONDS:  # left by a killed writer
                        _unlink(Path(entry.path))
                elif entry.name.endswith(_SUFFIX):
                    found.append((info.st_mtime, entry.name[: -len(_SUFFIX)], info.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
