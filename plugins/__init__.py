"""Built-in plugins, registered through the ``pagedcore`` entry points exactly as a third party's would be.

- ``torch``: the reference attention backend (any device).
- ``xformers``: paged attention with xformers' kernels (CUDA, fp16/bf16).
- ``lru``: the default eviction policy.
- ``logging``: logs request and cache events at DEBUG level.
"""
