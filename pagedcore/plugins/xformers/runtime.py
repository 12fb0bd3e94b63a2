"""Import xformers so that its compiled library loads beside the installed torch.

xformers 0.0.35's wheel is built against CUDA 12.8: its ``_C.so`` needs ``libcudart.so.12`` and has no RPATH to find
it (it uses torch's stable ABI, so any torch >= 2.10 suits it otherwise). A CUDA 12 build of torch loads that runtime
itself; a CUDA 13 build (the package index's torch 2.11+) does not, the load fails, xformers marks itself "not built
with CUDA" and every one of its ops then refuses CUDA tensors, although the ops this backend uses (``triton_splitk``,
``flash`` through torch's flash attention, ``cutlass`` through ``aten::_efficient_attention_forward``) never call
``_C``.

The fix, :func:`import_xformers`: before xformers is first imported, read the CUDA runtime that ``_C.so`` needs from
its ELF header (:func:`elf_dependencies`) and, when the process has not loaded it, load it from the
``nvidia-cuda-runtime-cu12`` wheel's directory (``nvidia/cuda_runtime/lib``, :func:`find_wheel_library`). The dynamic
loader matches a library's needed names against the sonames of the libraries already loaded, so ``_C.so`` then finds
it. The outcome is kept for :mod:`.status` to explain.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = [
    "ElfDependencies",
    "PreloadResult",
    "elf_dependencies",
    "find_wheel_library",
    "import_xformers",
    "preload_library",
    "preload_result",
    "xformers_library_path",
]

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME = 0, 1, 5, 14


@dataclass(frozen=True)
class ElfDependencies:
    """What a shared library's dynamic section says.

    Attributes:
        soname: its own soname, or None.
        needed: the sonames it needs, in order (``DT_NEEDED``).

    Example:
        >>> ElfDependencies(None, ("libcudart.so.12", "libc.so.6")).cuda_runtime
        'libcudart.so.12'
    """

    soname: str | None
    needed: tuple[str, ...]

    @property
    def cuda_runtime(self) -> str | None:
        """The CUDA runtime it needs (``libcudart.so.N``), or None."""
        return next((name for name in self.needed if name.startswith("libcudart.so")), None)


def elf_dependencies(path: str | os.PathLike[str]) -> ElfDependencies:
    """The soname and needed libraries of a 64-bit little-endian ELF shared library (what ``readelf -d`` shows).

    Raises ``ValueError`` for a file that is not one.

    Example:
        >>> import torch
        >>> from pathlib import Path
        >>> libs = sorted(Path(torch.__file__).parent.glob("lib/libtorch_cpu.so"))
        >>> elf_dependencies(libs[0]).soname if libs else 'libtorch_cpu.so'
        'libtorch_cpu.so'
    """
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, size)
    for n in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + n * phentsize)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return ElfDependencies(None, ())
    entries = []
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    strtab_addr = next((value for tag, value in entries if tag == _DT_STRTAB), None)
    if strtab_addr is None:
        return ElfDependencies(None, ())
    strtab = next(off + strtab_addr - vaddr for vaddr, off, size in loads if vaddr <= strtab_addr < vaddr + size)

    def string(offset: int) -> str:
        start = strtab + offset
        return data[start : data.index(b"\0", start)].decode()

    soname = next((string(value) for tag, value in entries if tag == _DT_SONAME), None)
    return ElfDependencies(soname, tuple(string(value) for tag, value in entries if tag == _DT_NEEDED))


def find_wheel_library(soname: str, search_path: list[str] | None = None) -> Path | None:
    """Where an NVIDIA runtime wheel installed ``soname``: ``nvidia/*/lib/<soname>`` under an import path entry.

    Example:
        >>> find_wheel_library("libnot-a-cuda-library.so.1") is None
        True
    """
    for entry in sys.path if search_path is None else search_path:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            found = sorted(root.glob(f"*/lib/{soname}"))
            if found:
                return found[0]
    return None


@dataclass(frozen=True)
class PreloadResult:
    """What :func:`import_xformers` did about the CUDA runtime xformers' library needs.

    Attributes:
        needed: the runtime ``_C.so`` needs (``libcudart.so.12``), or None (no ``_C.so``, or it needs none).
        action: ``"already loaded"`` (torch loaded it), ``"loaded"`` (from ``path``), ``"not found"`` (no wheel
            provides it: the system loader may still find it), ``"failed"`` (``error``), ``"skipped"`` (nothing to
            load, or xformers was imported before pagedcore could load it: ``error`` says which).
        path: the file loaded.
        error: why it failed or was skipped.

    Example:
        >>> PreloadResult("libcudart.so.12", "not found").action
        'not found'
    """

    needed: str | None
    action: str
    path: str | None = None
    error: str | None = None


def preload_library(soname: str, search_path: list[str] | None = None) -> PreloadResult:
    """Load ``soname`` into the process unless it is loaded already, from an NVIDIA runtime wheel's directory.

    Example:
        >>> preload_library("libnot-a-cuda-library.so.1").action
        'not found'
    """
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
    except OSError:
        pass
    else:
        return PreloadResult(soname, "already loaded")
    path = find_wheel_library(soname, search_path)
    if path is None:
        return PreloadResult(soname, "not found")
    try:
        ctypes.CDLL(str(path))  # the loader now matches later DT_NEEDED entries of `soname` to it
    except OSError as exc:
        return PreloadResult(soname, "failed", str(path), str(exc))
    return PreloadResult(soname, "loaded", str(path))


def xformers_library_path() -> Path | None:
    """The installed xformers' compiled library (``_C.so``), found without importing xformers.

    Example:
        >>> path = xformers_library_path()
        >>> path is None or path.name.startswith("_C")
        True
    """
    spec = importlib.util.find_spec("xformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    for directory in spec.submodule_search_locations:
        found = sorted(Path(directory).glob("_C.*so"))
        if found:
            return found[0]
    return None


_lock = threading.Lock()
_result: PreloadResult | None = None


def _preload() -> PreloadResult:
    import torch

    if "xformers" in sys.modules:
        return PreloadResult(None, "skipped", error="xformers was imported before pagedcore's xformers backend")
    library = xformers_library_path()
    if library is None:
        return PreloadResult(None, "skipped", error="xformers has no compiled library")
    try:
        needed = elf_dependencies(library).cuda_runtime
    except (OSError, ValueError) as exc:
        return PreloadResult(None, "skipped", error=f"cannot read {library}: {exc}")
    if needed is None:
        return PreloadResult(None, "skipped", error=f"{library.name} needs no CUDA runtime")
    if torch.version.cuda is None:
        return PreloadResult(needed, "skipped", error="torch is not a CUDA build")
    return preload_library(needed)


def preload_result() -> PreloadResult | None:
    """The outcome of the preload (None before :func:`import_xformers` ran).

    Example:
        >>> preload_result() is None or isinstance(preload_result(), PreloadResult)
        True
    """
    return _result


def import_xformers(name: str = "xformers.ops.fmha") -> ModuleType:
    """Import an xformers module, loading the CUDA runtime its library needs first (once per process).

    Raises ``ImportError`` when xformers is not installed.

    Example:
        >>> import_xformers("xformers.ops.fmha.attn_bias").__name__
        'xformers.ops.fmha.attn_bias'
    """
    global _result
    if _result is None:
        with _lock:
            if _result is None:
                _result = _preload()
    return importlib.import_module(name)
