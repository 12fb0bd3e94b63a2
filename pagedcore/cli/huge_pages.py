"""Transparent huge pages for the command line's tensors: torch's own switch, turned on before torch loads.

A decode step streams every weight once and a large step writes and reads logits of tens of megabytes; on 4 KiB pages
that is a TLB miss every 4 KiB and, for each fresh tensor, one page fault per 4 KiB. torch's CPU allocator asks the
kernel for 2 MiB pages (``madvise(MADV_HUGEPAGE)``, tensors of 2 MiB or more) when ``THP_MEM_ALLOC_ENABLE=1`` is set, a
variable it reads once, at its first allocation. ``scripts/allocator_bench.py`` measured the Engine with and without it
on this project's machine (docs/benchmarks.md, "Allocators"; two runs of three rounds, kernel THP mode ``madvise``):
prefill 1.03-1.14x faster with 1.7-11x fewer page faults at 16 and 64 rows, decode steps 1.00-1.09x, slower in neither
run, peak RSS within 0.5%, the same greedy tokens. So ``pagedcore generate`` and ``serve`` turn it on by default, and
their start-up line says so. ``pagedcore bench`` leaves torch's default (off) unless the environment sets it: its peers
run in its process, and a transformers user runs them under torch's default (an A/B of its section 4 with and without
huge pages gave the padded ``generate`` batch, whose ``DynamicCache`` allocates fresh tensors of megabytes every step,
1.07x slower with them, the Engine 0.99x); its start-up line says which.

Where it does not apply: the environment already set ``THP_MEM_ALLOC_ENABLE`` (``0`` turns huge pages off: a host
whose memory is fragmented can stall a page fault while the kernel compacts memory for a 2 MiB page), the kernel's
THP mode is ``never``, or torch was loaded before the choice (a program that imports pagedcore as a library sets the
variable itself, before it imports torch). Tensors under 2 MiB (a small model's attention projections) stay on 4 KiB
pages.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "HugePagesChoice", "huge_pages"]

ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch (c10's CPU allocator): "1" asks for huge pages
_KERNEL_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugePagesChoice:
    """What :func:`huge_pages` decided: ``on`` (tensors of 2 MiB or more on huge pages) and why, for a start-up line.

    Example:
        >>> HugePagesChoice(True, "").describe()
        'huge pages for tensors of 2 MiB+ (THP_MEM_ALLOC_ENABLE=0 turns them off)'
        >>> HugePagesChoice(False, "THP_MEM_ALLOC_ENABLE=0 is set").describe()
        'no huge pages (THP_MEM_ALLOC_ENABLE=0 is set)'
    """

    on: bool
    reason: str

    def describe(self) -> str:
        """One phrase for a start-up line."""
        if self.on and not self.reason:
            return f"huge pages for tensors of 2 MiB+ ({ENV}=0 turns them off)"
        if self.on:
            return f"huge pages for tensors of 2 MiB+ ({self.reason})"
        return f"no huge pages ({self.reason})"


_CHOSEN: HugePagesChoice | None = None  # the process's choice: made once, before torch loads


def huge_pages(
    environ: MutableMapping[str, str] | None = None,
    *,
    kernel_mode: str | None = None,
    torch_loaded: bool | None = None,
    enable: bool = True,
) -> HugePagesChoice:
    """Turn torch's huge pages on for this process where nothing above says otherwise (see the module docstring), or
    with ``enable=False`` leave torch's default and only say what it is; later calls return the first call's choice.
    ``environ``, ``kernel_mode`` and ``torch_loaded`` stand in for the process's own (a call that passes any of them
    decides afresh and remembers nothing).

    Example:
        >>> huge_pages({}, kernel_mode="always [madvise] never", torch_loaded=False).on
        True
        >>> huge_pages({"THP_MEM_ALLOC_ENABLE": "0"}, kernel_mode="always [madvise] never", torch_loaded=False)
        HugePagesChoice(on=False, reason='THP_MEM_ALLOC_ENABLE=0 is set')
        >>> huge_pages({}, kernel_mode="always madvise [never]", torch_loaded=False).reason
        "the kernel's transparent huge pages are off"
        >>> huge_pages({}, kernel_mode="always [madvise] never", torch_loaded=False, enable=False).describe()
        "no huge pages (torch's default; THP_MEM_ALLOC_ENABLE=1 turns them on)"
    """
    global _CHOSEN
    own = environ is None and kernel_mode is None and torch_loaded is None
    if own and _CHOSEN is not None:
        return _CHOSEN
    env = os.environ if environ is None else environ
    mode = _kernel_mode() if kernel_mode is None else kernel_mode
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    choice = _decide(env, mode, loaded, enable)
    if own:
        _CHOSEN = choice
    return choice


def _decide(env: MutableMapping[str, str], mode: str, loaded: bool, enable: bool) -> HugePagesChoice:
    if ENV in env:
        return HugePagesChoice(env[ENV].strip() == "1", f"{ENV}={env[ENV]} is set")
    if not enable:
        return HugePagesChoice(False, f"torch's default; {ENV}=1 turns them on")
    if "[never]" in mode:
        return HugePagesChoice(False, "the kernel's transparent huge pages are off")
    if not mode:
        return HugePagesChoice(False, "the kernel offers no transparent huge pages")
    if loaded:
        return HugePagesChoice(False, f"torch was loaded first; set {ENV}=1 before it loads")
    env[ENV] = "1"  # read by torch's allocator at its first allocation, after this
    return HugePagesChoice(True, "")


def _kernel_mode() -> str:
    """The kernel's THP mode line (``always [madvise] never``), or ``""`` where it has none (not Linux)."""
    try:
        return _KERNEL_MODE.read_text().strip()
    except OSError:
        return ""
