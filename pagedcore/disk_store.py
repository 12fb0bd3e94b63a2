"""The built-in disk tier: one file per block in a directory only its user may write, named by a keyed hash.

Layout: ``DIR/pagedcore-kv/<2 hex>/<name>.kv`` plus ``DIR/pagedcore-kv/secret``. The folder is created owner-only
(``0o700``), the files ``0o600``. A write goes to a temporary name in the same folder, is flushed and ``fsync``-ed,
then renamed over the final name (``os.replace``, atomic on POSIX): a reader sees a whole file or none, and two
processes writing the same key both write the same content (the key is a content hash), the last rename winning. A
process killed mid-write leaves a temporary file, never a partial block; temporary files older than an hour are
removed at the next start. Disk full (or any ``OSError`` while writing): the write is skipped and counted
(``write_errors``), nothing fails.

**Who may use the folder** (the threat model: other local users, e.g. of a shared ``/tmp``). The store refuses to
start (:class:`~pagedcore.errors.ConfigError` naming the folder, its owner and its mode) when ``pagedcore-kv``
exists but is not a directory owned by this user, is writable by its group or others, or is a symbolic link. The
folder is opened once (``O_NOFOLLOW``, checked with ``fstat``) and every file operation is relative to that open
folder, so renaming or replacing the path later (in a directory others may write) changes nothing for the store.
Another user can neither read, list nor plant anything in it. Every file is opened with ``O_NOFOLLOW |
O_NONBLOCK`` and read only if ``fstat`` says it is a regular file of this user no larger than the budget: a
symbolic link, a FIFO, a device or a file larger than the store could ever have written under a block's name is a
miss (removed and counted as ``refused_files``, unread), never a hang.

**Names that reveal nothing.** A block's key names its token chain (:func:`pagedcore.block_keys.chain_keys`), so a
list of keys would tell which prompts were seen by anyone able to guess them. Files are named
``HMAC-SHA256(secret, key)`` instead, with a 32-byte secret made at the folder's first use (``secret``, ``0o600``):
without it a name cannot be tied to a prompt, nor a block planted under a name the store would read.

The budget is this process's view: it indexes the folder at start (oldest modification first) and evicts its least
recently used files when a write would exceed ``max_bytes``. Processes sharing a folder each count every file they
found at their start or read since, other processes' too, in their own budget, so the smallest budget among them
bounds the folder: give them the same one. A file another process deleted is a miss. A write that fails for another
reason than a full disk (the folder deleted under the store, say) is logged once, with its error.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path

from pagedcore.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DiskKVStore"]

_FOLDER = "pagedcore-kv"
_SECRET = "secret"
_SECRET_BYTES = 32
_SUFFIX = ".kv"
_STALE_TMP_SECONDS = 3600.0
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class DiskKVStore:
    """Files in a directory (see the module docstring).

    Args:
        directory: an existing, writable directory (else :class:`~pagedcore.errors.ConfigError`); the store keeps
            its files in ``directory/pagedcore-kv``, which must be this user's alone (see the module docstring).
        max_bytes: the budget for this process's view of the folder.

    Example:
        >>> import tempfile
        >>> store = DiskKVStore(tempfile.mkdtemp(), max_bytes=1 << 20)
        >>> store.put("ab12", b"block"), store.get("ab12"), store.contains("cd34")
        (True, b'block', False)
        >>> oct(store.folder.stat().st_mode & 0o777), "ab12" in store.path_of("ab12").name
        ('0o700', False)
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise ConfigError(f"kv_store_bytes must be a non-negative number of bytes, got {max_bytes!r}")
        if not os.fspath(directory):  # Path("") is the current directory
            raise ConfigError("kv_store: the directory '' is empty: give its path (the current one as '.')")
        self.folder = Path(directory) / _FOLDER
        self._fd = _open_folder(Path(directory))  # every operation is relative to this open, checked folder
        self._close_folder = weakref.finalize(self, os.close, self._fd)
        self._secret = _secret(self._fd, self.folder)
        self._max = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recently used first
        self._bytes = 0
        self._warned = False  # a write failed (not for a full disk) and was logged
        self._counts = dict.fromkeys(
            ("writes", "write_errors", "evicted", "vanished", "too_large", "disk_full", "refused_files"), 0
        )
        self._scan()

    # ------------------------------------------------------------------ the store protocol
    def put(self, key: str, data: bytes) -> bool:
        name = self._name(key)
        size = len(data)
        with self._lock:
            if self.closed:
                return False
            if name in self._index:
                self._index.move_to_end(name)
                return True
            if size > self._max:
                self._counts["too_large"] += 1
                return False
            victims = self._make_room(size)
        for victim in victims:
            _unlink(_relative(victim), self._fd)
        if not self._write(name, data):
            with self._lock:
                self._counts["write_errors"] += 1
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = size
                self._bytes += size
            self._counts["writes"] += 1
        return True

    def get(self, key: str) -> bytes | None:
        name = self._name(key)
        if self.closed:
            return None
        try:
            data = _read_regular(_relative(name), self._fd, self._max)
        except _NotRegular:
            _unlink(_relative(name), self._fd)
            self._forget(name, vanished=False)
            with self._lock:
                self._counts["refused_files"] += 1
            return None
        except OSError:
            self._forget(name, vanished=True)
            return None
        with self._lock:
            if name not in self._index:  # written by another process
                self._index[name] = len(data)
                self._bytes += len(data)
            self._index.move_to_end(name)
        return data

    def contains(self, key: str) -> bool:
        name = self._name(key)
        if self.closed:
            return False
        with self._lock:
            if name in self._index:
                return True
        try:
            return stat.S_ISREG(os.stat(_relative(name), dir_fd=self._fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def delete(self, key: str) -> None:
        name = self._name(key)
        if self.closed:
            return
        _unlink(_relative(name), self._fd)
        self._forget(name, vanished=False)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self._bytes, "max_bytes": self._max, "entries": len(self._index), **self._counts}

    def close(self) -> None:
        """Close the folder (the open directory every operation goes through) when nothing uses the store any more;
        closing again does nothing. A closed store keeps and finds nothing (a put is refused, a get misses); its files
        stay for the next store on the folder. A pool closes the stores it made from a location with its tiers
        (:meth:`~pagedcore.adapters.transformers.PagedKVPool.close_tiers`).

        Example:
            >>> import tempfile
            >>> store = DiskKVStore(tempfile.mkdtemp(), max_bytes=1024)
            >>> store.put("ab12", b"block"), store.close(), store.close(), store.closed
            (True, None, None, True)
            >>> store.put("cd34", b"block"), store.get("ab12")
            (False, None)
        """
        with self._lock:
            self._fd = -1  # no call after this one reaches the descriptor, nor a later file under its number
        self._close_folder()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd < 0

    def path_of(self, key: str) -> Path:
        """The file ``key`` is (or would be) stored in: its name is a keyed hash of the key.

        Example:
            >>> import tempfile
            >>> store = DiskKVStore(tempfile.mkdtemp(), max_bytes=1024)
            >>> store.path_of("ab12").suffix, store.path_of("ab12") == store.path_of("ab12")
            ('.kv', True)
        """
        return self.folder / _relative(self._name(key))

    def __repr__(self) -> str:
        return f"DiskKVStore({str(self.folder)!r}, bytes={self._bytes}, max_bytes={self._max})"

    # ------------------------------------------------------------------ internals
    def _name(self, key: str) -> str:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"DiskKVStore: a key must be lowercase hex, got {key!r}")
        return hmac.new(self._secret, key.encode("ascii"), hashlib.sha256).hexdigest()

    def _make_room(self, size: int) -> list[str]:
        victims = []
        while self._index and self._bytes + size > self._max:
            victim, old = self._index.popitem(last=False)
            self._bytes -= old
            self._counts["evicted"] += 1
            victims.append(victim)
        return victims

    def _forget(self, name: str, *, vanished: bool) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size
                if vanished:
                    self._counts["vanished"] += 1

    def _write(self, name: str, data: bytes) -> bool:
        fd = self._fd
        tmp = f"{name[:2]}/.tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex}"
        try:
            try:
                os.mkdir(name[:2], 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(tmp, _relative(name), src_dir_fd=fd, dst_dir_fd=fd)
            return True
        except OSError as exc:
            _unlink(tmp, fd)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self._counts["disk_full"] += 1
            elif not self._warned:
                self._warned = True
                logger.warning(
                    "pagedcore: the disk KV store in %s cannot write (%s); blocks are skipped", self.folder, exc
                )
            return False

    def _scan(self) -> None:
        found = []
        now = time.time()
        for shard in os.scandir(self._fd):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry_name, info in _listing(self._fd, shard.name):
                if not stat.S_ISREG(info.st_mode):
                    continue  # never ours: refused (and removed) if a lookup ever names it
                if entry_name.startswith(".tmp-"):
                    if now - info.st_mtime > _STALE_TMP_SECONDS:  # left by a killed writer
                        _unlink(f"{shard.name}/{entry_name}", self._fd)
                elif entry_name.endswith(_SUFFIX):
                    found.append((info.st_mtime, entry_name[: -len(_SUFFIX)], info.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size


class _NotRegular(Exception):
    """A name the store would read holds something else than a regular file of this user."""


def _relative(name: str) -> str:
    """A file name's path inside the folder."""
    return f"{name[:2]}/{name}{_SUFFIX}"


def _listing(folder_fd: int, shard: str) -> list[tuple[str, os.stat_result]]:
    """Each entry of a shard and its own ``lstat`` (none when the shard cannot be opened as a real directory)."""
    try:
        fd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder_fd)
    except OSError:
        return []
    out = []
    try:
        for entry in os.scandir(fd):
            try:
                out.append((entry.name, os.stat(entry.name, dir_fd=fd, follow_symlinks=False)))
            except OSError:
                continue
    finally:
        os.close(fd)
    return out


def _open_folder(root: Path) -> int:
    """An open descriptor of ``root/pagedcore-kv``, made or checked to be this user's alone (the module docstring)."""
    if not root.is_dir():
        raise ConfigError(f"kv_store: {str(root)!r} is not an existing directory (create it first)")
    folder = root / _FOLDER
    try:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and folder.is_symlink()):
            raise ConfigError(f"kv_store: {str(folder)!r} is a symbolic link; remove it") from exc
        raise ConfigError(f"kv_store: directory {str(root)!r} is not writable ({exc.strerror or exc})") from exc
    try:
        _check_folder(folder, fd)
        _probe(folder, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_folder(folder: Path, fd: int) -> None:
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid() or mode & 0o022:
        raise ConfigError(
            f"kv_store: {str(folder)!r} belongs to {_owner(info.st_uid)} with mode {oct(mode)}; a KV store folder "
            f"must be owned by this user ({_owner(os.geteuid())}) and writable by nobody else, or another user could "
            "read which prompts were served or plant keys and values. Remove it, or choose another --kv-store "
            "directory."
        )
    if mode != 0o700:
        os.fchmod(fd, 0o700)  # readable by others (an earlier umask): owner-only now; nobody else could write it


def _probe(folder: Path, fd: int) -> None:
    probe = f".probe-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
    except OSError as exc:
        raise ConfigError(f"kv_store: directory {str(folder)!r} is not writable ({exc.strerror or exc})") from exc


def _secret(fd: int, folder: Path) -> bytes:
    """The folder's 32-byte secret, made once (written aside, then linked into place: readers never see half of
    it, and of two processes starting together one secret wins)."""
    try:
        os.stat(_SECRET, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        tmp = f".tmp-secret-{os.getpid()}-{uuid.uuid4().hex}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            os.write(out, secrets.token_bytes(_SECRET_BYTES))
            os.fsync(out)
        finally:
            os.close(out)
        try:
            os.link(tmp, _SECRET, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            pass
        finally:
            _unlink(tmp, fd)
    path = folder / _SECRET
    try:
        value = _read_regular(_SECRET, fd, _SECRET_BYTES)
    except (OSError, _NotRegular) as exc:
        raise ConfigError(f"kv_store: cannot read the store's secret {str(path)!r} ({exc}); remove it") from exc
    if len(value) != _SECRET_BYTES:
        raise ConfigError(f"kv_store: the store's secret {str(path)!r} is damaged; remove the folder's files")
    return value


def _read_regular(name: str, folder_fd: int, max_bytes: int) -> bytes:
    """The bytes of ``name`` (inside the folder) if it is a regular file of this user of at most ``max_bytes`` (never
    a link, FIFO, device or larger file: those raise :class:`_NotRegular` without reading); ``OSError`` when it is
    missing."""
    try:
        fd = os.open(name, _READ, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotRegular(f"{name} is a symbolic link") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise _NotRegular(f"{name} is not a regular file of this user")
        if info.st_size > max_bytes:
            raise _NotRegular(f"{name} holds {info.st_size} bytes, more than the store's budget")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _unlink(name: str, folder_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=folder_fd)
    except OSError:
        pass
