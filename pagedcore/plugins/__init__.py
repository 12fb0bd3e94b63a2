"""Built-in plugins. They implement the same hooks as a third party's, but the host registers them itself, on first
use (:data:`pagedcore.plugin_manager.BUILTIN_PLUGINS`), not through entry points:

- ``lru``: the default eviction policy.
- ``kv-store``: the stores below the pool: a directory (:mod:`pagedcore.disk_store`) and ``"memory://"``, asked last.
- ``logging``: logs request and cache events at DEBUG level.
- ``xformers``: paged attention with xformers' kernels (CUDA, fp16/bf16); registered where xformers is installed.
- ``torch``: the reference attention backend (any device), asked last.
"""
