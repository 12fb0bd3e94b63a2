"""API keys and tenants.

A key file maps each API key to a tenant; the tenant becomes the prefix-cache namespace of every request made with
that key, so tenants never share cached blocks (and cannot time each other's prompts). Clients cannot choose a
namespace. Two formats:

- text: one ``KEY TENANT`` pair per line (whitespace between them); blank lines and lines starting with ``#`` are
  skipped;
- JSON: an object ``{"KEY": "TENANT", ...}``.

Several keys may map to one tenant. Keys are compared in constant time (SHA-256 digests with
:func:`hmac.compare_digest`, every key checked), so response times do not reveal how much of a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedcore.errors import ConfigError

__all__ = ["ApiKeys", "ApiKeysError", "api_keys_of", "load_api_keys"]


class ApiKeysError(ConfigError):
    """The key file cannot be read or is malformed (the message names the line)."""


class ApiKeys:
    """Known API keys and their tenants.

    Args:
        tenants: API key -> tenant name.

    Example:
        >>> keys = ApiKeys({"sk-alice": "alice", "sk-bob": "bob"})
        >>> keys.tenant("Bearer sk-bob"), keys.tenant("Bearer sk-eve"), keys.tenant(None)
        ('bob', None, None)
        >>> len(keys)
        2
    """

    def __init__(self, tenants: Mapping[str, str]) -> None:
        if not tenants:
            raise ApiKeysError("no API keys given")
        for key, tenant in tenants.items():
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ApiKeysError("API keys must be non-empty strings without whitespace")
            if not isinstance(tenant, str) or not tenant.strip():
                raise ApiKeysError(f"the tenant of a key must be a non-empty string, got {tenant!r}")
        self._digests = [(_digest(key), tenant) for key, tenant in tenants.items()]

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """Read a key file (text or JSON, see the module docstring).

        Example:
            >>> import tempfile, os
            >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            ...     _ = f.write("# key tenant\\nsk-1 team-a\\nsk-2 team-b\\n")
            >>> ApiKeys.from_file(f.name).tenant("Bearer sk-2")
            'team-b'
            >>> os.unlink(f.name)
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeysError(f"cannot read the API key file {str(path)!r}: {exc}") from exc
        if text.lstrip().startswith("{"):
            return cls(_json_tenants(text, path))
        tenants: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ApiKeysError(f"{path}, line {number}: expected 'KEY TENANT', got {len(parts)} fields")
            if parts[0] in tenants:
                raise ApiKeysError(f"{path}, line {number}: this key appears twice")
            tenants[parts[0]] = parts[1]
        return cls(tenants)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header value, or None when the key is unknown."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(key.strip())
        found: str | None = None
        for digest, tenant in self._digests:  # no early exit: the same work whichever key matches
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found


def _json_tenants(text: str, path: str | Path) -> Mapping[str, str]:
    """The ``{KEY: TENANT}`` object of a JSON key file. A key given twice is an error naming both entries, never
    the key (the file holds secrets), as the text format refuses it too: ``json`` would keep the last tenant."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        first: dict[str, int] = {}
        for number, (key, _) in enumerate(pairs, 1):
            if key in first:
                raise ApiKeysError(
                    f"{path}: entry {number} repeats the key of entry {first[key]} (a key names one tenant)"
                )
            first[key] = number
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except ValueError as exc:
        raise ApiKeysError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiKeysError(f"{path}: expected a JSON object mapping keys to tenants")
    return data


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path: str | None, usage_error: type[Exception]) -> ApiKeys | None:
    """The :class:`ApiKeys` of ``--api-keys FILE`` (None without one); a bad file raises ``usage_error`` with the
    file's problem in one line (the commands that take the flag: ``pagedcore serve``, with or without Ray).

    Example:
        >>> load_api_keys(None, ValueError) is None
        True
    """
    if not path:
        return None
    try:
        return ApiKeys.from_file(path)
    except ApiKeysError as exc:
        raise usage_error(str(exc)) from exc


def api_keys_of(args: Any, error: type[Exception]) -> tuple[ApiKeys | None, str]:
    """The API keys in force and where they come from: ``--api-keys FILE``, ``--api-key KEY`` (each tenant
    ``default``), or vLLM's ``VLLM_API_KEY`` environment variable when neither is given (as vLLM: ``--api-key``
    wins over it). An empty or blank ``VLLM_API_KEY`` is refused (``error``): a server believed protected would
    answer everyone.

    Example:
        >>> import os
        >>> os.environ.pop("VLLM_API_KEY", None) and None
        >>> import argparse
        >>> api_keys_of(argparse.Namespace(api_keys=None, api_key=None), ValueError)
        (None, 'no API key: every client is served')
    """
    from_file = load_api_keys(args.api_keys, error)
    keys = getattr(args, "api_key", None) or []
    env = os.environ.get("VLLM_API_KEY")
    if env is not None and not env.strip():
        raise error("VLLM_API_KEY is set but empty: set it to the key clients must send, or unset it")
    ignored = " (VLLM_API_KEY is set and not used)" if env is not None else ""
    if from_file is not None:
        if keys:
            raise error("give --api-key or --api-keys FILE, not both")
        return from_file, f"API keys from --api-keys {args.api_keys} ({len(from_file)} keys){ignored}"
    source, given = ("--api-key", keys) if keys else ("VLLM_API_KEY", [env] if env is not None else [])
    if not given:
        return None, "no API key: every client is served"
    try:
        found = ApiKeys(dict.fromkeys(given, "default"))
    except ApiKeysError as exc:
        raise error(f"{source}: {exc}") from exc
    return found, f"API keys from {source} ({len(found)} keys){ignored if keys else ''}"
