"""The start-up heap frozen (``gc.freeze``) in a server process once its model and Engine are built, so that the
collector's full passes skip torch, transformers, the model's modules and the server's own objects from then on.

Why: CPython's full (generation 2) collection walks every tracked object. With torch, transformers and a model
loaded there are about 385 000 of them (the server's imports add some 35 000), and one full pass over them took
239-335 ms on this project's machine (2 cores). Nothing else runs meanwhile: the Engine's step loop stops, and every
stream with it. A serving process makes full passes on its own: ``scripts/gc_pauses.py`` kept an Engine stepping
under load (the tiny model, 64 sampled requests at a time) for 60 s and saw 3 full passes, the longest 305-342 ms,
and a longest step gap of 352-395 ms against a median of 13 ms; with the start-up heap frozen, full passes of 14-21 ms
and a longest step gap of 67-71 ms. Through ``pagedcore serve`` (8 streaming clients, 150 s), the longest gap between
two chunks of a stream went from 416-505 ms to 188-249 ms (docs/benchmarks.md, "Garbage-collector pauses"). vLLM
freezes its servers' start-up heaps the same way.

What it costs: nothing alive at start-up is ever collected as a cycle. Objects are still freed when their last
reference goes (a request's, a sampler's, an adapter loaded later); only a reference cycle among the frozen objects
stays, as it would anyway for a module, a model or a tokenizer kept for the life of the process. The collection that
runs first (:func:`freeze_startup_heap`) frees what start-up left behind, so garbage is not frozen.

Where it applies: ``pagedcore serve``, and each Ray Serve replica in the process Ray gives it
(:class:`~pagedcore.serve.ray.EngineReplica`: 498 552 objects frozen in a replica of the tiny model, checked by
hand); not ``generate``, whose run ends with its prompts, ``bench``, whose peers share its process, or Ray Data's
``GenerateBatch``, whose workers run a batch job. ``PAGEDCORE_GC_FREEZE=0`` leaves the heap as it is (a leak hunt
that needs every object collectable). A program that runs its own Engine for long can do the same after building
it: ``gc.collect(); gc.freeze()``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping

__all__ = ["ENV", "freeze_startup_heap"]

ENV = "PAGEDCORE_GC_FREEZE"  # "0": leave the start-up heap to the collector


def freeze_startup_heap(environ: Mapping[str, str] | None = None) -> int | None:
    """Collect every generation, then freeze what is left (:mod:`gc`); the number of objects now frozen, or None
    where ``PAGEDCORE_GC_FREEZE=0`` says not to (nothing done).

    Example:
        >>> freeze_startup_heap({"PAGEDCORE_GC_FREEZE": "0"}) is None
        True
    """
    env = os.environ if environ is None else environ
    if env.get(ENV, "1").strip() == "0":
        return None
    gc.collect()  # garbage first: a frozen cycle is never collected
    gc.freeze()
    return gc.get_freeze_count()
