"""Building pagedcore's C kernels at first use: the source compiled with the system's C compiler into a private
temporary folder (mode 0700, this user's), loaded with ``ctypes``, and the folder removed. Nothing is read from a
folder another user could write, and the source is the text read when the kernel's module was imported (the ctypes
signatures written for it), not the file as it may be later.

Who builds what: ``adapters/transformers/row_kernel.py`` (the few-row linears), ``plugins/decode_kernel.py``
(decode attention from the paged pool) and ``adapters/transformers/direct_layers.py`` (the direct layers' norm and
rotary steps). Each says where it cannot serve; :func:`can_build_avx2` holds what they share.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build", "can_build_avx2", "cpu_flags"]

logger = logging.getLogger(__name__)


def can_build_avx2(switch: str, needs: Sequence[str] = ()) -> bool:
    """Whether an AVX2 + FMA kernel may be built here: the environment variable ``switch`` is not ``0``, Linux on
    x86-64, torch's CPU check says AVX2 or better, and the CPU lists the extra flags ``needs`` (``/proc/cpuinfo``).

    Example:
        >>> can_build_avx2("PAGEDCORE_NO_SUCH_SWITCH") in (True, False)
        True
    """
    if os.environ.get(switch, "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    import torch  # here, not at import: the core imports no tensor library (its kernels' callers have torch)

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    return not needs or set(needs) <= cpu_flags()


def build(name: str, source_text: str | None, flags: Sequence[str]) -> ctypes.CDLL | None:
    """``source_text`` compiled as the shared library ``name`` with ``flags`` and loaded; None (and why, at debug
    level) when there is no source, no C compiler (``$CC``, ``cc``, ``gcc``), or the build failed.

    Example:
        >>> library = build("answer", "int answer(void) { return 42; }", ("-shared", "-fPIC"))
        >>> library is None or library.answer() == 42
        True
    """
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or source_text is None:
        logger.debug("pagedcore: no C compiler or no source for %s", name)
        return None
    with tempfile.TemporaryDirectory(prefix="pagedcore-kernel-") as folder:  # mode 0700, this user's
        library, source = Path(folder) / f"{name}.so", Path(folder) / f"{name}.c"
        source.write_text(source_text)
        command = [compiler, *flags, "-o", str(library), str(source)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.debug("pagedcore: %s did not build: %s", name, exc)
            return None
        if done.returncode != 0:
            logger.debug("pagedcore: %s did not build: %s", name, done.stderr[-2000:])
            return None
        return ctypes.CDLL(str(library))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where it cannot be read).

    Example:
        >>> flags = cpu_flags()
        >>> isinstance(flags, set)
        True
    """
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()
