"""Built-in observer: logs request and prefix-cache events on the ``pagedcore.events`` logger at DEBUG level.

Enable with ``logging.getLogger("pagedcore.events").setLevel(logging.DEBUG)``.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedcore.hookspecs import hookimpl

logger = logging.getLogger("pagedcore.events")


@hookimpl
def pagedcore_request_admitted(request_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
    """Log an admission."""
    logger.debug("admitted %s: %d prompt tokens, %d from cache", request_id, num_prompt_tokens, num_cached_tokens)


@hookimpl
def pagedcore_request_preempted(request_id: str, num_computed_tokens: int) -> None:
    """Log a preemption."""
    logger.debug("preempted %s after %d computed tokens", request_id, num_computed_tokens)


@hookimpl
def pagedcore_request_finished(request_id: str, finish_reason: str, num_output_tokens: int) -> None:
    """Log a finished request."""
    logger.debug("finished %s (%s) with %d tokens", request_id, finish_reason, num_output_tokens)


@hookimpl
def pagedcore_prefix_hit(request_id: str, num_query_tokens: int, num_hit_tokens: int, namespace: Any) -> None:
    """Log a prefix lookup."""
    logger.debug(
        "prefix %s: %d of %d tokens cached (namespace %r)", request_id, num_hit_tokens, num_query_tokens, namespace
    )


@hookimpl
def pagedcore_blocks_evicted(group: int, block_ids: list[int]) -> None:
    """Log an eviction."""
    logger.debug("evicted %d blocks from group %d", len(block_ids), group)
