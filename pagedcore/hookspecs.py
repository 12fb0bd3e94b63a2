"""Every pagedcore plugin hook, in one place.

Plugins implement these with ``@pagedcore.hookimpl`` and are found through the ``pagedcore`` entry-point group (the
built-ins, which implement them the same way, are registered by the host: :mod:`pagedcore.plugin_manager`).
Hooks are always called with keyword arguments, and an implementation may accept fewer arguments than its spec,
so specs can grow without breaking plugins. Selection hooks are ``firstresult`` and asked through
:meth:`~pagedcore.plugin_manager.PluginManager.select`: every installed plugin first (two answering one call are
refused), the built-ins (``trylast``) only when none did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pagedcore.attention import AttentionBackend
    from pagedcore.eviction import EvictionPolicy
    from pagedcore.kv_store import KVStore

hookspec = pluggy.HookspecMarker("pagedcore")
hookimpl = pluggy.HookimplMarker("pagedcore")


# ---------------------------------------------------------------- selection hooks
@hookspec(firstresult=True)
def pagedcore_attention_backend(device_type: str, dtype: Any, name: str | None) -> AttentionBackend | None:
    """Return an attention backend for tensors of ``device_type`` ("cpu", "cuda", ...) and ``dtype``, or None.

    ``name`` is the backend the user asked for ("torch", "xformers", ...) or None for the best available.
    """


@hookspec(firstresult=True)
def pagedcore_eviction_policy(name: str | None, num_blocks: int) -> EvictionPolicy | None:
    """Return a new, empty eviction policy for a pool of ``num_blocks`` blocks, or None.

    ``name`` is the policy the user asked for ("lru", ...) or None for the default.
    """


@hookspec(firstresult=True)
def pagedcore_kv_store(location: str, max_bytes: int) -> KVStore | None:
    """Return a store below the pool for ``location`` (``kv_store=`` / ``--kv-store``), or None when the location is
    not this plugin's (a scheme such as ``"redis://..."``). ``max_bytes`` is its budget (``kv_store_bytes``). Raise
    :class:`~pagedcore.errors.ConfigError` for a location that is this plugin's but unusable. See
    :mod:`pagedcore.kv_store` for the protocol; the built-in answers ``"memory://"`` and a directory path last.
    """


# ---------------------------------------------------------------- events (observers)
@hookspec
def pagedcore_request_admitted(request_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
    """A request got its blocks and starts running (also after a preemption)."""


@hookspec
def pagedcore_request_preempted(request_id: str, num_computed_tokens: int) -> None:
    """A running request gave its blocks back under memory pressure; it will be recomputed."""


@hookspec
def pagedcore_request_finished(request_id: str, finish_reason: str, num_output_tokens: int) -> None:
    """A request finished ("stop", "length", "abort" or "error")."""


@hookspec
def pagedcore_prefix_hit(
    request_id: str, num_query_tokens: int, num_hit_tokens: int, namespace: Any, block_ids: tuple[list[int], ...]
) -> None:
    """A prompt was looked up in the prefix cache and ``num_hit_tokens`` of its tokens were served from it: per KV
    group, from the blocks ``block_ids`` (empty without a hit)."""


@hookspec
def pagedcore_blocks_evicted(group: int, block_ids: list[int]) -> None:
    """Cached blocks of KV group ``group`` were evicted to make room."""
