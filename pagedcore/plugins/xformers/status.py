"""Whether xformers' kernels run here, and if not, why and what to install.

:func:`environment` reads the facts without importing xformers (versions, what xformers was built for, the CUDA
runtime its library needs, whether a wheel provides it); :func:`install_plan` turns them into what to install;
:func:`xformers_status` imports xformers (through :func:`~.runtime.import_xformers`), checks that its library loaded
and runs the backend itself on two tiny cases on the GPU (a paged decode, a prefill), against the torch backend.
``pagedcore plugins`` prints the result; the plugin hook offers the backend only when it is available.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
from dataclasses import dataclass

import torch

from pagedcore.extras import install_hint

from .runtime import PreloadResult, elf_dependencies, find_wheel_library, xformers_library_path

__all__ = [
    "GPU_EXTRA",
    "PROBE_CASES",
    "Environment",
    "XFormersStatus",
    "describe",
    "diagnose",
    "environment",
    "install_plan",
    "xformers_status",
]

GPU_EXTRA = install_hint("gpu")
"""The install extra of a CUDA machine: xformers 0.0.35 and the CUDA 12 runtime its library needs."""


@dataclass(frozen=True)
class Environment:
    """What decides whether xformers' kernels can run, read without importing xformers.

    Attributes:
        torch_version / torch_cuda: torch's version and the CUDA it was built with (None: a CPU build).
        cuda_devices / device_name / capability: the visible GPUs (0 / None without CUDA).
        triton_version / xformers_version / flash_attn_version: installed versions (None: not installed).
        xformers_built_for: what xformers' ``cpp_lib.json`` says it was built with, e.g. ``"torch 2.10.0+cu128,
            CUDA 12.8"``.
        needed_runtime: the CUDA runtime xformers' ``_C.so`` needs (``libcudart.so.12``), from its ELF header.
        runtime_wheel: where an NVIDIA wheel installed that runtime, or None.

    Example:
        >>> env = environment()
        >>> env.torch_version == torch.__version__
        True
    """

    torch_version: str
    torch_cuda: str | None
    cuda_devices: int
    device_name: str | None
    capability: tuple[int, int] | None
    triton_version: str | None
    xformers_version: str | None
    xformers_built_for: str | None
    needed_runtime: str | None
    runtime_wheel: str | None
    flash_attn_version: str | None

    def lines(self) -> list[str]:
        """The facts as ``name: value`` lines (for reports)."""
        gpu = f"{self.cuda_devices} x {self.device_name} (sm{''.join(map(str, self.capability or ()))})"
        return [
            f"torch: {self.torch_version} (CUDA {self.torch_cuda or 'none: a CPU build'})",
            f"GPUs: {gpu if self.cuda_devices else 'none visible'}",
            f"triton: {self.triton_version or 'not installed'}",
            f"xformers: {self.xformers_version or 'not installed'}"
            + (f", built for {self.xformers_built_for}" if self.xformers_built_for else ""),
            f"xformers' library needs: {self.needed_runtime or 'no CUDA runtime (or no library)'}"
            + (f", provided by {self.runtime_wheel}" if self.runtime_wheel else ""),
            f"flash_attn: {self.flash_attn_version or 'not installed (paged FA2 off; prefill uses torch flash)'}",
        ]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> Environment:
    """The facts of this process's machine (no xformers import, no GPU work).

    Example:
        >>> facts = environment()
        >>> facts.torch_cuda == torch.version.cuda, facts.cuda_devices == torch.cuda.device_count()
        (True, True)
    """
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    library = xformers_library_path()
    built_for = needed = wheel = None
    if library is not None:
        try:
            info = json.loads((library.parent / "cpp_lib.json").read_text())["version"]
            cuda = info.get("cuda")
            built_for = f"torch {info.get('torch')}, CUDA {cuda // 100}.{cuda % 100}" if cuda else None
        except (OSError, ValueError, KeyError, TypeError):
            built_for = None
        try:
            needed = elf_dependencies(library).cuda_runtime
        except (OSError, ValueError):
            needed = None
        found = find_wheel_library(needed) if needed else None
        wheel = str(found) if found else None
    return Environment(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_devices=devices,
        device_name=torch.cuda.get_device_name(0) if devices else None,
        capability=torch.cuda.get_device_capability(0) if devices else None,
        triton_version=_version("triton") or _version("pytorch-triton"),
        xformers_version=_version("xformers"),
        xformers_built_for=built_for,
        needed_runtime=needed,
        runtime_wheel=wheel,
        flash_attn_version=_version("flash-attn") or _version("flash_attn"),
    )


def _major(version: str | None) -> str | None:
    return None if version is None else version.split(".")[0]


def install_plan(env: Environment) -> list[str]:
    """What to install so that xformers' kernels can run on a CUDA machine like ``env`` (empty: nothing).

    A CPU machine gets the steps a CUDA machine would need beyond a CUDA build of torch.

    Example:
        >>> env = Environment("2.13.0", "13.0", 1, "H200", (9, 0), "3.6.0", "0.0.35", "torch 2.10.0+cu128, CUDA 12.8",
        ...     "libcudart.so.12", None, None)
        >>> install_plan(env)   # doctest: +NORMALIZE_WHITESPACE
        ["pip install nvidia-cuda-runtime-cu12 (or make install EXTRAS=gpu in the pagedcore checkout, or pip install
          -e '.[gpu]' there): xformers' library needs libcudart.so.12 and torch 2.13.0 is a CUDA 13.0 build, which
          does not load it"]
    """
    steps = []
    if env.torch_cuda is None:
        steps.append(f"install a CUDA build of torch (torch {env.torch_version} is a CPU build; see docs/gpu.md)")
    if env.xformers_version is None:
        steps.append(f"{GPU_EXTRA} (xformers is not installed)")
    if env.torch_cuda is not None and env.triton_version is None:
        steps.append("pip install triton (xformers' triton_splitk, the paged decode kernel, needs it)")
    runtime_major = env.needed_runtime.rsplit(".", 1)[-1] if env.needed_runtime else None
    if runtime_major is not None and runtime_major != _major(env.torch_cuda) and env.runtime_wheel is None:
        install = f"pip install nvidia-cuda-runtime-cu{runtime_major} (or {GPU_EXTRA})"
        if env.torch_cuda is None:
            steps.append(
                f"with a torch built for another CUDA than {runtime_major}, also {install}: xformers' library "
                f"needs {env.needed_runtime}"
            )
        else:
            steps.append(
                f"{install}: xformers' library needs {env.needed_runtime} and torch {env.torch_version} is "
                f"a CUDA {env.torch_cuda} build, which does not load it"
            )
    return steps


@dataclass(frozen=True)
class XFormersStatus:
    """Whether the xformers backend runs here, and why (not).

    Attributes:
        available: the plugin hook offers the backend (CUDA, fp16/bf16).
        reason: one line: what runs, or why nothing does and what to install.
        ops: the xformers ops that ran in the check (``triton_splitk``, ``flash``, ``cutlass``, ``flash_paged``).

    Example:
        >>> status = xformers_status()
        >>> status.available or bool(status.reason)
        True
    """

    available: bool
    reason: str
    ops: tuple[str, ...] = ()


def diagnose(
    env: Environment,
    *,
    load_error: str | None = None,
    preload: PreloadResult | None = None,
    probe: dict[str, tuple[str, ...]] | None = None,
    probe_error: str | None = None,
) -> XFormersStatus:
    """The status from the facts: ``env``, then (on a GPU) xformers' library load error, the runtime preload and the
    ops each probe case ran (``{"decode": ("triton_splitk",), "prefill": ("flash",)}``).

    Example:
        >>> env = Environment("2.13.0+cpu", None, 0, None, None, None, "0.0.35", None, "libcudart.so.12", None, None)
        >>> diagnose(env).reason
        'torch 2.13.0+cpu is a CPU build (torch.version.cuda is None): xformers needs CUDA'
    """
    if env.xformers_version is None:
        return XFormersStatus(False, f"xformers is not installed ({GPU_EXTRA})")
    if env.torch_cuda is None:
        return XFormersStatus(
            False, f"torch {env.torch_version} is a CPU build (torch.version.cuda is None): xformers needs CUDA"
        )
    if env.cuda_devices == 0:
        return XFormersStatus(False, f"no CUDA device is visible (torch {env.torch_version}, CUDA {env.torch_cuda})")
    if load_error is not None:
        advice = "; ".join(install_plan(env))
        if preload is not None and preload.action == "skipped" and preload.error:
            advice = advice or preload.error
            if "imported before" in preload.error:
                advice += " (import pagedcore's xformers backend before xformers, so that it loads the runtime first)"
        elif preload is not None and preload.action == "failed":
            advice = f"loading {preload.path} failed: {preload.error}"
        return XFormersStatus(
            False,
            f"xformers' compiled library did not load ({load_error}), so xformers refuses CUDA tensors"
            + (f"; fix: {advice}" if advice else ""),
        )
    if probe_error is not None:
        return XFormersStatus(False, f"the xformers backend failed its check on the GPU: {probe_error}")
    probe = probe or {}
    ran = tuple(dict.fromkeys(op for ops in probe.values() for op in ops if op != "torch"))
    missing = [case for case, ops in probe.items() if "torch" in ops]
    if not ran:
        return XFormersStatus(False, "no xformers op accepted the check's inputs on this GPU (see DEBUG logs)")
    summary = ", ".join(f"{case}: {'/'.join(ops)}" for case, ops in probe.items())
    if missing:
        return XFormersStatus(True, f"partly: {summary} (torch = no xformers op took it)", ran)
    return XFormersStatus(True, summary, ran)


def _load_error() -> str | None:
    """The innermost cause of xformers' failed library load (torch wraps the loader's message), or None."""
    cpp_lib = sys.modules.get("xformers._cpp_lib")
    exc = getattr(cpp_lib, "_cpp_library_load_exception", None)
    if exc is None:
        return None
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


PROBE_CASES: dict[str, tuple[list[int], list[int], list[list[int]], list[list[int]]]] = {
    # name: (query_lens, seq_lens, tables, slots), pages of 64, pad block 5
    "decode": ([1, 1], [70, 9], [[0, 1], [2]], [[69], [136]]),
    # 20 queries: more than triton_splitk's causal limit (16), so the prefill is a gather step (flash, else cutlass)
    "prefill": ([20], [70], [[3, 4]], [[*range(3 * 64 + 50, 4 * 64), *range(4 * 64, 4 * 64 + 6)]]),
}
"""The probe's cases: a paged decode and a prefill (the first GPU run's prefill had 5 queries, which triton_splitk
takes, so the status said "prefill: triton_splitk" and never tried the op real prefills run)."""


def _probe() -> dict[str, tuple[str, ...]]:
    """Run the backend on a paged decode and a prefill (fp16, GQA 4/2, head dim 64) and check it against torch."""
    from pagedcore.attention import PagedAttentionMetadata
    from pagedcore.plugins.torch_backend import TorchPagedAttention

    from .backend import XFormersPagedAttention

    generator = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, 6, 64, 2, 64, generator=generator, device="cuda", dtype=torch.float16)
    cache[:, 5] = 0  # the pad block
    out = {}
    for name, (query_lens, seq_lens, tables, slots) in PROBE_CASES.items():
        meta = PagedAttentionMetadata.build(
            block_size=64,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_offsets=[0] * len(tables),
            tables=tables,
            slots=slots,
            sliding_window=None,
            pad_block=5,
            device="cuda",
        )
        query = torch.randn(meta.num_tokens, 4, 64, generator=generator, device="cuda", dtype=torch.float16)
        backend = XFormersPagedAttention()
        got = backend.forward(query, cache[0], cache[1], meta, scale=0.125)
        if backend.stats.kernel_failures:
            raise RuntimeError(f"an xformers kernel raised on the {name} check (see the WARNING log)")
        fresh = PagedAttentionMetadata(**{**vars(meta), "backend_state": {}})
        want = TorchPagedAttention().forward(query.float(), cache[0].float(), cache[1].float(), fresh, scale=0.125)
        torch.testing.assert_close(got.float(), want, atol=5e-3, rtol=5e-3)
        out[name] = backend.last_ops
    return out


@functools.cache
def xformers_status() -> XFormersStatus:
    """Whether the xformers backend runs in this process (checked once; on a GPU it runs two tiny forwards).

    Example:
        >>> xformers_status().available if not torch.cuda.is_available() else False
        False
    """
    env = environment()
    status = diagnose(env)
    if env.xformers_version is None or env.torch_cuda is None or env.cuda_devices == 0:
        return status
    from .runtime import import_xformers, preload_result

    try:
        import_xformers("xformers.ops.fmha")
    except Exception as exc:  # a broken install: report it, never fail the caller
        return XFormersStatus(False, f"importing xformers failed: {type(exc).__name__}: {exc}")
    load_error = _load_error()
    if load_error is not None:
        return diagnose(env, load_error=load_error, preload=preload_result())
    try:
        probe = _probe()
    except Exception as exc:
        return diagnose(env, probe_error=f"{type(exc).__name__}: {exc}".replace("\n", " "))
    return diagnose(env, probe=probe)


def describe(status: XFormersStatus) -> str:
    """The one line ``pagedcore plugins`` prints about xformers.

    Example:
        >>> describe(XFormersStatus(False, "no CUDA device is visible"))
        'xformers: unavailable: no CUDA device is visible; softcap models (Gemma2) always use the torch backend'
    """
    state = "available" if status.available else "unavailable"
    return f"xformers: {state}: {status.reason}; softcap models (Gemma2) always use the torch backend"
