"""The responses a server keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, per tenant
(one API key's responses are never another's), bounded in bytes and entries per tenant (least recently used
dropped first), so the store cannot grow with traffic. A response not kept (``store: false``), dropped, or from
another tenant is not found.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_STORE_BYTES", "ResponseStore", "StoredResponse"]

DEFAULT_STORE_BYTES = 64 * 2**20
_MAX_ENTRIES = 4096


@dataclass(frozen=True)
class StoredResponse:
    """A kept response: the object as it was answered, and its conversation (chat messages, without the
    instructions) that a follow-up continues.

    Example:
        >>> StoredResponse({"id": "resp_1"}, [], 10).response["id"]
        'resp_1'
    """

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int


class ResponseStore:
    """Responses by tenant and id, at most ``max_bytes`` (of their JSON) and ``max_entries`` per tenant.

    Example:
        >>> store = ResponseStore(max_bytes=200)
        >>> store.put("alice", {"id": "resp_1"}, [{"role": "user", "content": "x" * 50}])
        >>> store.get("alice", "resp_1") is not None, store.get("bob", "resp_1")
        (True, None)
        >>> store.put("alice", {"id": "resp_2"}, [{"role": "user", "content": "y" * 120}])  # over 200 bytes
        >>> store.get("alice", "resp_1")
    """

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES, max_entries: int = _MAX_ENTRIES) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._tenants: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str | None, int] = {}

    def put(self, tenant: str | None, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a response (one larger than the whole budget is not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return
        with self._lock:
            kept = self._tenants.setdefault(tenant, OrderedDict())
            old = kept.pop(response["id"], None)
            used = self._bytes.get(tenant, 0) - (old.size if old is not None else 0) + size
            kept[response["id"]] = StoredResponse(response, conversation, size)
            while used > self.max_bytes or len(kept) > self.max_entries:
                _, dropped = kept.popitem(last=False)
                used -= dropped.size
            self._bytes[tenant] = used

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """A kept response of this tenant (now the most recently used), or None."""
        with self._lock:
            kept = self._tenants.get(tenant)
            found = kept.get(response_id) if kept is not None else None
            if found is not None and kept is not None:
                kept.move_to_end(response_id)
            return found

    def delete(self, tenant: str | None, response_id: str) -> bool:
        """Forget a kept response; whether it was kept."""
        with self._lock:
            kept = self._tenants.get(tenant)
            found = kept.pop(response_id, None) if kept is not None else None
            if found is not None:
                self._bytes[tenant] -= found.size
            return found is not None
