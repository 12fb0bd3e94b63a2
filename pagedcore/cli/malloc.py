"""glibc's malloc tuned for a process that runs a model on the CPU: freed memory is kept for the next step.

A forward allocates tensors of megabytes (a prefill chunk's activations, a step's logits) and frees them, step after
step. With its defaults glibc hands every block above its mmap threshold to the kernel on ``free`` and maps fresh,
zeroed pages on the next ``malloc``: each step pays page faults for memory it just gave back. CPU users of
CTranslate2 set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` for this;
``scripts/allocator_bench.py`` measured the Engine under glibc's defaults, those settings (through the environment
and through :func:`tune_malloc`), jemalloc and tcmalloc on this project's machine: prefill 1.07-1.20x faster with
the settings (tcmalloc alike, jemalloc less; a prefill of 16 x 128 tokens went from about 60,000 page faults to
under 1,000), decode steps unchanged within noise, peak RSS about 5% higher (docs/benchmarks.md, "Allocators").

:func:`tune_malloc` applies the same settings in a running process (``mallopt``), which ``pagedcore generate``,
``serve`` and ``bench`` do at start-up and state in their start-up line. It changes nothing where the process is not
on glibc, where the environment already chose (any ``MALLOC_*_`` variable, or ``LD_PRELOAD`` naming another
allocator), or where ``PAGEDCORE_MALLOC=default`` says to keep glibc's defaults. The cost: memory a step frees stays
in the process (its peak stays its resident size) instead of going back to the system. Plain Python (``ctypes``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV", "SETTINGS", "MallocChoice", "tune_malloc"]

ENV = "PAGEDCORE_MALLOC"  # "default": keep glibc's defaults
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
        "malloc keeps freed memory (PAGEDCORE_MALLOC=default for glibc's defaults)"
        >>> MallocChoice(False, "MALLOC_TRIM_THRESHOLD_ is set").describe()
        'malloc as the environment sets it (MALLOC_TRIM_THRESHOLD_ is set)'
    """

    tuned: bool
    reason: str

    def describe(self) -> str:
        """One phrase for a start-up line."""
        if self.tuned:
            return f"malloc keeps freed memory ({ENV}=default for glibc's defaults)"
        return f"malloc as the environment sets it ({self.reason})"


def tune_malloc(environ: Mapping[str, str] | None = None, *, apply: bool = True) -> MallocChoice:
    """Apply :data:`SETTINGS` with glibc's ``mallopt`` unless the environment has chosen (see the module docstring);
    ``apply=False`` only says what it would do.

    Example:
        >>> tune_malloc({"PAGEDCORE_MALLOC": "default"}, apply=False).reason
        'PAGEDCORE_MALLOC=default'
        >>> tune_malloc({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, apply=False).reason
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
    if choice == "default":
        return f"{ENV}=default"
    if choice not in ("", "tuned"):
        return f"{ENV}={env[ENV]!r} is neither 'tuned' nor 'default'"
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
