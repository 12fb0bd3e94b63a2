"""Namespace identity and chained block keys: the one owner of how a namespace and a prompt's blocks are named.

Three holders name the same things and must agree: the prefix trie and the scheduler (in memory), the tiers below
the pool (on disk, across processes) and the Ray router (in the ingress). They all ask this module.

**Namespaces.** :func:`namespace_bytes` encodes a namespace by type and value, the same in every process (None,
``str``, ``bytes``, ``int``, ``bool``, ``float`` and tuples of them; ``1``, ``1.0`` and ``True`` are three
namespaces, ``0.0`` and ``-0.0`` two). :func:`namespace_key`, the in-memory identity, *is* that encoding whenever
there is one, so two namespaces are one in memory exactly when they are one on disk and in the router. Namespaces
without a stable encoding (frozensets, named tuples, subclasses of the built-in types, other hashable objects) keep a
typed in-memory identity (type and value, element by element) and are never written to a store nor routed by
prefix. A NaN (alone or inside a tuple or frozenset) is refused: it is not equal to itself, so it names nothing. An
unhashable namespace is refused too (:class:`~pagedcore.errors.ConfigError`).

**Adapters.** A request served with an adapter (a LoRA) computes other keys and values than the base model for the
same tokens, so its namespace is narrowed to the adapter: :class:`AdapterNamespace` (the request's own namespace, the
adapter's name and its version: a digest of its weights) is one more namespace kind, encoded with its own tag, so no
base-model namespace, however chosen, equals an adapter's, and two adapters (or two versions of one) never share a
block in memory, on disk or in the router. Its :func:`namespace_scope` names the adapter version every namespace of
it shares, which the pool can close as one when that version's weights change (``KVPool.close_scope``).

**Chains.** A block's key covers the whole token chain up to and including it: :func:`chain_digests` hashes a seed
(what the chain belongs to: a namespace, a model) and then each full block after its parent's digest (SHA-256).
:func:`chain_keys` are the tiers' keys (the seed covers the model fingerprint, the KV group and the namespace),
:func:`prefix_hashes` the router's (the seed covers the namespace alone).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedcore.errors import ConfigError

__all__ = [
    "AdapterNamespace",
    "chain_digests",
    "chain_keys",
    "namespace_bytes",
    "namespace_key",
    "namespace_scope",
    "prefix_hashes",
]

_LEN = struct.Struct("<q")
_TIERS = b"pagedcore-kv/1\0"
_ROUTES = b"pagedcore-route/1\0"


@dataclass(frozen=True)
class AdapterNamespace:
    """The namespace of a request served with an adapter: ``base`` (the request's own namespace: its tenant, its
    salt), narrowed to one version of one adapter.

    Attributes:
        base: the namespace the request would have without the adapter.
        adapter: the adapter's name.
        version: the identity of the adapter's weights (a digest of them); "" where only the name is known (the
            router's key).

    Example:
        >>> plain, tuned = namespace_key("tenant"), namespace_key(AdapterNamespace("tenant", "sql", "v1"))
        >>> plain == tuned, tuned == namespace_key(AdapterNamespace("tenant", "sql", "v2"))
        (False, False)
        >>> namespace_scope(AdapterNamespace("a", "sql", "v1")) == namespace_scope(AdapterNamespace("b", "sql", "v1"))
        True
    """

    base: Hashable
    adapter: str
    version: str = ""

    def __post_init__(self) -> None:
        if type(self.adapter) is not str or not self.adapter or type(self.version) is not str:
            raise ConfigError(f"an adapter namespace names its adapter and version as str, got {self!r}")


def namespace_scope(namespace: Hashable) -> tuple[str, str, str] | None:
    """The adapter version a namespace belongs to (every tenant's namespace of it shares one scope), or None for a
    namespace of the base model.

    Example:
        >>> namespace_scope("tenant"), namespace_scope(AdapterNamespace("tenant", "sql", "v1"))
        (None, ('adapter', 'sql', 'v1'))
    """
    if type(namespace) is AdapterNamespace:
        return ("adapter", namespace.adapter, namespace.version)
    return None


def namespace_bytes(namespace: Hashable) -> bytes | None:
    """A namespace's encoding, the same in every process (type and value), or None when it has none.

    Raises :class:`~pagedcore.errors.ConfigError` for a NaN (see the module docstring).

    Example:
        >>> namespace_bytes("a") != namespace_bytes(("a",)), namespace_bytes(1) != namespace_bytes(True)
        (True, True)
        >>> namespace_bytes(object()) is None, namespace_bytes(0.0) != namespace_bytes(-0.0)
        (True, True)
    """
    if namespace is None:
        return b"N"
    kind = type(namespace)
    if kind is str:
        raw = namespace.encode("utf-8", "surrogatepass")  # type: ignore[attr-defined]
        return b"s" + _LEN.pack(len(raw)) + raw
    if kind is bytes:
        return b"b" + _LEN.pack(len(namespace)) + namespace  # type: ignore[arg-type, operator]
    if kind is bool:
        return b"?1" if namespace else b"?0"
    if kind is int:
        raw = str(namespace).encode()
        return b"i" + _LEN.pack(len(raw)) + raw
    if kind is float:
        _refuse_nan(namespace)
        raw = float.hex(namespace).encode()  # type: ignore[arg-type]
        return b"f" + _LEN.pack(len(raw)) + raw
    if kind is tuple:
        parts = [namespace_bytes(item) for item in namespace]  # type: ignore[attr-defined]
        if any(part is None for part in parts):
            return None
        return b"(" + _LEN.pack(len(parts)) + b"".join(p for p in parts if p is not None) + b")"
    if kind is AdapterNamespace:
        base = namespace_bytes(namespace.base)  # type: ignore[attr-defined]
        if base is None:
            return None
        name, version = namespace.adapter.encode("utf-8", "surrogatepass"), namespace.version.encode()  # type: ignore[attr-defined]
        return b"A" + base + _LEN.pack(len(name)) + name + _LEN.pack(len(version)) + version
    return None


def namespace_key(namespace: Hashable) -> Hashable:
    """The identity of a namespace in memory: its :func:`namespace_bytes` where it has them, else its type and value
    (element by element for tuples and frozensets).

    Namespaces that a dict would conflate because they compare equal (``1 == 1.0 == True``) stay distinct. Raises
    :class:`~pagedcore.errors.ConfigError` for an unhashable namespace or a NaN.

    Example:
        >>> namespace_key("tenant-a") == namespace_key("tenant-a")
        True
        >>> namespace_key(1) == namespace_key(True), namespace_key(("t", 1)) == namespace_key(("t", 1.0))
        (False, False)
        >>> namespace_key(float("nan"))
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: a NaN namespace is not equal to itself and names nothing; use a str
    """
    encoded = namespace_bytes(namespace)
    if encoded is not None:
        return encoded
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
    if type(value) is AdapterNamespace:
        return (AdapterNamespace, _typed(value.base), value.adapter, value.version)
    if isinstance(value, float):
        _refuse_nan(value)
    return (type(value), value)


def _refuse_nan(value: object) -> None:
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError("a NaN namespace is not equal to itself and names nothing; use a str")


def chain_digests(
    seed: bytes, token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None
) -> list[bytes]:
    """The SHA-256 digest of every full block of ``token_ids`` (at most ``max_blocks``), each covering ``seed`` and
    every token up to the end of its block: two prompts share their first ``k`` digests exactly when they share
    their first ``k`` blocks and the seed (collisions aside).

    Example:
        >>> a = chain_digests(b"ns", [1, 2, 3, 4, 5], 2)
        >>> b = chain_digests(b"ns", [1, 2, 9, 9], 2)
        >>> len(a), a[0] == b[0], a[1] == b[1], chain_digests(b"other", [1, 2], 2)[0] == a[0]
        (2, True, False, False)
    """
    if type(block_size) is not int or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    digest = hashlib.sha256(seed).digest()
    digests = []
    for start in range(0, count * block_size, block_size):
        block = b"".join(_LEN.pack(int(t)) for t in token_ids[start : start + block_size])
        digest = hashlib.sha256(digest + block).digest()
        digests.append(digest)
    return digests


def chain_keys(fingerprint: str, group: int, namespace: bytes, token_ids: Sequence[int], block_size: int) -> list[str]:
    """The tiers' key of every full block of ``token_ids`` in KV group ``group`` of the model ``fingerprint`` names
    (``namespace``: its :func:`namespace_bytes`), as lowercase hex.

    Example:
        >>> a = chain_keys("fp", 0, b"N", [1, 2, 3, 4], 2)
        >>> b = chain_keys("fp", 0, b"N", [9, 9, 3, 4], 2)
        >>> len(a), a[1] != b[1], chain_keys("fp", 0, b"N", [1, 2], 2) == a[:1], len(a[0])
        (2, True, True, 64)
    """
    seed = _TIERS + fingerprint.encode() + b"\0" + _LEN.pack(group) + namespace
    return [digest.hex() for digest in chain_digests(seed, token_ids, block_size)]


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, namespace: Hashable = None, *, max_blocks: int = 64
) -> tuple[int, ...]:
    """The router's chained hashes of the prompt's full blocks (at most ``max_blocks``), as 64-bit integers: two
    prompts share the first ``k`` exactly when they share their first ``k`` blocks in the same namespace
    (collisions aside, which can only misroute a request, never serve it another prompt's cache). A namespace
    without a stable encoding has none (the request is routed by load alone).

    Example:
        >>> a = prefix_hashes(list(range(40)), 16)
        >>> b = prefix_hashes(list(range(32)) + [7] * 16, 16)
        >>> len(a), a[0] == b[0], a[1] == b[1], len(b)
        (2, True, True, 3)
        >>> prefix_hashes(list(range(40)), 16, namespace="tenant-a")[0] == a[0], prefix_hashes([1] * 16, 16, object())
        (False, ())
    """
    encoded = namespace_bytes(namespace)
    if encoded is None:
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
        return ()
    digests = chain_digests(_ROUTES + encoded, token_ids, block_size, max_blocks=max_blocks)
    return tuple(int.from_bytes(digest[:8], "little") for digest in digests)
