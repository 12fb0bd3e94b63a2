"""A third-party pagedcore plugin: logs every prefix-cache lookup (and keeps a tally).

Install it (``pip install examples/prefix_logger_plugin``) and pagedcore loads it through its ``pagedcore``
entry point on first use; no code change in the application. See ``examples/plugin_observer.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedcore import hookimpl

logger = logging.getLogger("pagedcore_prefix_logger")

TALLY = {"lookups": 0, "query_tokens": 0, "hit_tokens": 0}


@hookimpl
def pagedcore_prefix_hit(request_id: str, num_query_tokens: int, num_hit_tokens: int, namespace: Any) -> None:
    """Log one lookup and add it to the tally."""
    TALLY["lookups"] += 1
    TALLY["query_tokens"] += num_query_tokens
    TALLY["hit_tokens"] += num_hit_tokens
    logger.info(
        "%s: %d of %d prompt tokens from the cache (namespace %r)",
        request_id,
        num_hit_tokens,
        num_query_tokens,
        namespace,
    )
