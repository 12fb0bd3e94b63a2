"""The xformers attention backend, in parts; the plugin itself (the hook) is :mod:`pagedcore.plugins.xformers_backend`.

- :mod:`.plan`: which kernel runs which sequences of a forward, and the shape buckets that bound Triton compiles;
- :mod:`.biases`: the attention biases and index tensors of a forward, built once on the host and copied without a
  wait for the GPU;
- :mod:`.kernels`: the xformers ops themselves, behind a small protocol that CPU tests replace;
- :mod:`.backend`: :class:`~pagedcore.plugins.xformers.backend.XFormersPagedAttention`, its counters and its fallback;
- :mod:`.runtime` and :mod:`.status`: loading xformers so that its CUDA library works beside the installed torch, and
  why it does not where it does not.

Nothing here imports xformers at import time.
"""
