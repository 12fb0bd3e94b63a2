"""glibc's malloc tuned for a process that runs a model on the CPU, on request: freed memory kept for the next step.

A forward allocates tensors of megabytes (a prefill chunk's activations, a step's logits) and frees them, step after
step. With its defaults glibc hands large blocks back to the kernel on ``free`` and maps fresh, zeroed pages on the next
``malloc``: a prefill of 16 x 128 tokens on the benchmark model faults in about 60,000 pages. CPU users of CTranslate2
set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` against this.
``scripts/allocator_bench.py`` measured the Engine under glibc's defaults, those settings (through the environment and
through :func:`tune_malloc`), jemalloc and tcmalloc on this project's machine (docs/benchmarks.md, "Allocators"): the
settings make prefill 1.07-1.20x faster (under 200 page faults) but decode steps about 4% slower (0.93-1.03x over four
runs), and peak RSS 5% higher; tcmalloc (``LD_PRELOAD``) makes prefill 1.08-1.21x faster at 16 and 64 rows with decode
0.97-1.14x (three runs); jemalloc loses at 64 rows. Decode is most of a generation's time, so glibc's defaults stay the
default, and tcmalloc is what the docs recommend for CPU serving.

``PAGEDCORE_MALLOC=tuned`` asks ``pagedcore generate``, ``serve`` and ``bench`` for the settings (``mallopt`` in the
running process, for prompt-heavy work such as scoring); their start-up line says what malloc does. Where the
environment already chose (any ``MALLOC_*_`` variable, or ``LD_PRELOAD`` naming another allocator) or the process is
not on glibc, nothing changes. Plain Python (``ctypes``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV", "SETTINGS", "MallocChoice", "tune_malloc"]

ENV = "PAGEDCORE_MALLOC"  # "tuned": apply SETTINGS; unset or "default": glibc's defaults
_INT_MAX = 2**31 - 1  # mallopt takes an int
# mallopt's parameters (malloc.h) and the values: what the CTranslate2 tuning sets, within mallopt's int
SETTINGS: dict[str, tuple[int, int]] = {
    "M_MMAP_THRESHOLD": (-3, _INT_MAX),  # blocks below 2 GiB come from the heap, not fresh mappings
    "M_TRIM_THRESHOLD": (-1, _INT_MAX),  # free memory at the heap's top is kept, up to 2 GiB
    "M_TOP_PAD": (-2, 1 << 30),  # the heap grows by 1 GiB of address space at a time (pages are touched lazily)
}
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True)
class MallocChoice:
    """What :func:`tune_malloc` did: ``tuned`` (the settings applied) and why, as a start-up line says it.

    Example:
        >>> MallocChoice(True, "").describe()
        'malloc keeps freed memory (PAGEDCORE_MALLOC=tuned)'
        >>> MallocChoice(False, "default").describe()
        "glibc's malloc defaults (PAGEDCORE_MALLOC=tuned keeps freed memory)"
        >>> MallocChoice(False, "MALLOC_TRIM_THRESHOLD_ is set").describe()
        'malloc as the environment sets it (MALLOC_TRIM_THRESHOLD_ is set)'
    """

    tuned: bool
    reason: str

    def describe(self) -> str:
        """One phrase for a start-up line."""
        if self.tuned:
            return f"malloc keeps freed memory ({ENV}=tuned)"
        if self.reason == "default":
            return f"glibc's malloc defaults ({ENV}=tuned keeps freed memory)"
        return f"malloc as the environment sets it ({self.reason})"


def tune_malloc(environ: Mapping[str, str] | None = None, *, apply: bool = True) -> MallocChoice:
    """Apply :data:`SETTINGS` with glibc's ``mallopt`` where ``PAGEDCORE_MALLOC=tuned`` asks and the environment has
    not chosen otherwise (see the module docstring); ``apply=False`` only says what it would do.

    Example:
        >>> tune_malloc({}, apply=False).reason
        'default'
        >>> tune_malloc({"PAGEDCORE_MALLOC": "tuned", "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"},
        ...     apply=False).reason
        'LD_PRELOAD loads tcmalloc'
    """
    env = os.environ if environ is None else environ
    reason = _why_not(env)
    if reason is not None:
        return MallocChoice(False, reason)
    if not apply:
        return MallocChoice(True, "")
    mallopt = _mallopt()
    if mallopt is None:
        return MallocChoice(False, "not glibc")
    for name, (param, value) in SETTINGS.items():
        if mallopt(param, value) != 1:
            return MallocChoice(False, f"mallopt({name}) refused")
    return MallocChoice(True, "")


def _why_not(env: Mapping[str, str]) -> str | None:
    """Why the environment's choice stands, or None to tune."""
    choice = env.get(ENV, "").strip().lower()
    if choice not in ("", "default", "tuned"):
        return f"{ENV}={env[ENV]!r} is neither 'tuned' nor 'default'"
    if choice != "tuned":
        return "default"
    own = sorted(k for k in env if k.startswith("MALLOC_") and k.endswith("_"))
    if own:
        return f"{own[0]} is set"
    preload = env.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD loads {name}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``mallopt``, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
