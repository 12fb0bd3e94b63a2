"""XFormersPagedAttention: paged attention with xformers' kernels (CUDA, fp16/bf16); the torch backend's results.

Per forward and KV group, the first layer plans the steps (:func:`~.plan.plan_steps`) and builds their tensors
(:func:`~.biases.prepare_steps`, counted in :attr:`XFormersStats.metadata_builds`); every other layer finds them in
``metadata.backend_state`` and goes straight to the kernel. Which op runs a step is decided once per op and shape
bucket (:attr:`XFormersStats.support_checks`): a paged step no kernel accepts (head dim, GPU generation) runs as a
gather step, and a gather step no kernel accepts runs on the torch backend.

What xformers' kernels cannot compute runs on the torch backend, whole forwards at a time (counted in
:attr:`XFormersStats.torch_forwards`): logit softcapping (Gemma 2) and attention sinks (gpt-oss: xformers has no sink
logit). Chunked attention (Llama 4) is planned like a sliding window (per-sequence key starts; a gather step cuts each
sequence's queries at its chunk boundaries, see :func:`~.biases.build_gathered_keys`). An MLA layer's latent (keys of
``kv_lora_rank + rope`` values, values the first ``kv_lora_rank`` of them, one KV head) goes to the ops whose support
check accepts those head sizes, else to the torch backend like any step no kernel takes.

A kernel that raises (a Triton compile or launch failure, say) does not fail the forward: the failing layer and the
KV group's later layers of that forward run on the torch backend, the failure is logged once and counted
(:attr:`XFormersStats.kernel_failures`, which an Engine's stats can report), and the op is not used again for inputs
of that shape. Out-of-memory errors are not caught: the torch backend needs more memory, not less.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.attention import PagedAttentionMetadata
from pagedcore.plugins.torch_backend import TorchPagedAttention

from .biases import PreparedStep, build_gathered_keys, prepare_steps
from .kernels import AttentionKernels, XFormersKernels
from .plan import Step, plan_steps

logger = logging.getLogger(__name__)

__all__ = ["GATHER_OPS", "XFormersPagedAttention", "XFormersStats"]

GATHER_OPS = ("flash", "cutlass")
"""The non-paged ops a gather step tries, in order."""

_STEPS = "xformers.steps"
_FAILED = "xformers.failed"  # backend_state flag: a kernel failed in this forward; the rest of it runs on torch
_Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]  # query, key, value, bias as a kernel takes them


@dataclass
class XFormersStats:
    """Counters of one backend (diagnostics; not synchronised between threads).

    Attributes:
        metadata_builds: forwards (per KV group and device) whose steps and device tensors were built: one per
            forward and group, however many layers the group has.
        support_checks: ``supports`` questions asked of the kernels: one per op and shape bucket, not per step.
        kernel_failures: kernel calls that raised; each sent its forward to the torch backend.
        torch_forwards: layer calls the torch backend computed (softcap, no op for the inputs, a failure).
        launch_shapes: distinct ``(op, bias rows, table width, query shape, dtype)`` of paged launches; for
            ``triton_splitk`` each is one compiled kernel.

    Example:
        >>> XFormersStats().kernel_failures
        0
    """

    metadata_builds: int = 0
    support_checks: int = 0
    kernel_failures: int = 0
    torch_forwards: int = 0
    launch_shapes: set[tuple[Any, ...]] = field(default_factory=set)


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class XFormersPagedAttention:
    """Paged attention with xformers' kernels (CUDA, fp16/bf16); same results as the torch backend.

    Args:
        kernels: what runs an xformers op (default :class:`~.kernels.XFormersKernels`; tests pass a dense CPU one).
        flash_paged: allow FA2's paged kernel; default: whether the ``flash_attn`` package is installed.

    Attributes:
        last_ops: the ops the last forward ran, one per step: ``"triton_splitk"``, ``"flash_paged"``, ``"flash"``,
            ``"cutlass"``, or ``("torch",)`` (diagnostics; not synchronised between threads).
        stats: :class:`XFormersStats`.

    Example:
        A dense stand-in for the kernels runs the whole plan on CPU (the tests do this against the torch backend):

        >>> class Dense:
        ...     def supports(self, op, query, key, value, bias, scale):
        ...         return True
        ...     def run(self, op, query, key, value, bias, scale):
        ...         return query.new_zeros(*query.shape[:-1], value.shape[-1])
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 1], seq_lens=[70, 9],
        ...     block_offsets=[0, 0], tables=[[0, 1], [2]], slots=[[69], [136]], sliding_window=None, pad_block=3)
        >>> backend = XFormersPagedAttention(Dense(), flash_paged=False)
        >>> out = backend.forward(torch.randn(2, 4, 8), torch.zeros(4, 64, 2, 8), torch.zeros(4, 64, 2, 8), meta,
        ...     scale=8 ** -0.5)
        >>> out.shape, backend.last_ops, backend.stats.metadata_builds
        (torch.Size([2, 4, 8]), ('triton_splitk',), 1)
    """

    name = "xformers"

    def __init__(self, kernels: AttentionKernels | None = None, *, flash_paged: bool | None = None) -> None:
        self.kernels: AttentionKernels = kernels if kernels is not None else XFormersKernels()
        self._flash_paged = flash_paged
        self._torch = TorchPagedAttention()
        self._supported: dict[tuple[Any, ...], bool] = {}
        self.stats = XFormersStats()
        self.last_ops: tuple[str, ...] = ()

    @property
    def flash_paged(self) -> bool:
        """Whether FA2's paged kernel may be planned."""
        return _flash_attn_installed() if self._flash_paged is None else self._flash_paged

    def plan(self, metadata: PagedAttentionMetadata) -> list[Step]:
        """The steps a forward over ``metadata`` runs (before each op's support check)."""
        return plan_steps(metadata, flash_paged=self.flash_paged)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        *,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if query.shape[0] != metadata.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens but the metadata has {metadata.num_tokens}")
        # xformers' kernels have no softcapping and no sink logit: those layers run on the torch backend.
        if softcap is not None or sinks is not None or metadata.backend_state.get(_FAILED):
            return self._torch_forward(query, key_cache, value_cache, metadata, scale, softcap, sinks)
        try:
            return self._forward(query, key_cache, value_cache, metadata, scale)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:
            self.stats.kernel_failures += 1
            log = logger.warning if self.stats.kernel_failures == 1 else logger.debug
            log(
                "pagedcore: an xformers kernel failed (%s: %s); this forward runs on the torch backend, and the op "
                "is not used again for inputs of this shape (failures so far: %d)",
                type(exc).__name__,
                exc,
                self.stats.kernel_failures,
                exc_info=self.stats.kernel_failures == 1,
            )
            metadata.backend_state[_FAILED] = True
            return self._torch_forward(query, key_cache, value_cache, metadata, scale, None)

    # ------------------------------------------------------------------ internals
    def _torch_forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.stats.torch_forwards += 1
        self.last_ops = ("torch",)
        return self._torch.forward(query, key_cache, value_cache, meta, scale=scale, softcap=softcap, sinks=sinks)

    def _prepare(self, meta: PagedAttentionMetadata, device: torch.device) -> list[PreparedStep]:
        key = (_STEPS, device, self.flash_paged)
        prepared: list[PreparedStep] | None = meta.backend_state.get(key)
        if prepared is None:
            self.stats.metadata_builds += 1
            prepared = meta.backend_state[key] = prepare_steps(meta, self.plan(meta), device)
        return prepared

    def _forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, q_heads, _ = query.shape
        shapes = (query.dtype, query.shape[1:], key_cache.shape, value_cache.shape)
        launches: list[tuple[PreparedStep, str, _Inputs | None]] = []
        for prepared in self._prepare(meta, query.device):
            op = prepared.resolved.get(shapes)
            inputs = None
            if op is None:  # the group's first layer in this forward
                op, inputs = self._resolve(prepared, meta, query, key_cache, value_cache, scale)
                prepared.resolved[shapes] = op
            launches.append((prepared, op, inputs))
        if any(op == "torch" for _, op, _ in launches):
            return self._torch_forward(query, key_cache, value_cache, meta, scale, None)
        out: torch.Tensor | None = None
        for prepared, op, inputs in launches:
            if inputs is None:
                inputs = self._inputs(prepared, meta, op, query, key_cache, value_cache)
            o = self._launch(prepared, op, inputs, scale).reshape(-1, q_heads, value_cache.shape[-1])
            o = o[: prepared.num_queries]  # (step queries, Hq, Dv), without the bucket padding
            if prepared.token_index is None:
                out = o
            else:
                if out is None:
                    out = query.new_zeros(num_tokens, q_heads, value_cache.shape[-1])
                out.index_copy_(0, prepared.token_index, o)
        self.last_ops = tuple(op for _, op, _ in launches)
        return query.new_zeros(0, q_heads, value_cache.shape[-1]) if out is None else out

    def _resolve(
        self,
        prepared: PreparedStep,
        meta: PagedAttentionMetadata,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> tuple[str, _Inputs | None]:
        """The first op that accepts the step (its own paged op, then the gather ops), with its inputs."""
        candidates = ((prepared.step.op,) if prepared.step.paged else ()) + GATHER_OPS
        for op in candidates:
            inputs = self._inputs(prepared, meta, op, query, key_cache, value_cache)
            key = _support_key(op, *inputs)
            supported = self._supported.get(key)
            if supported is None:
                self.stats.support_checks += 1
                supported = self._supported[key] = self.kernels.supports(op, *inputs, scale)
            if supported:
                return op, inputs
        return "torch", None

    def _inputs(
        self,
        prepared: PreparedStep,
        meta: PagedAttentionMetadata,
        op: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> _Inputs:
        q_heads = query.shape[1]
        q = query if prepared.token_index is None else query.index_select(0, prepared.token_index)
        if op == prepared.step.op:  # paged: over the pool, queries padded to the bias's bucket
            extra = prepared.padded_queries - prepared.num_queries
            if extra:
                q = torch.cat([q, q.new_zeros(extra, *q.shape[1:])])
            k, v, bias = _pool_view(key_cache, q_heads), _pool_view(value_cache, q_heads), prepared.bias
        else:
            gathered = prepared.gathered
            if gathered is None:  # a paged step no paged kernel takes
                gathered = prepared.gathered = build_gathered_keys(meta, query.device, rows=list(prepared.step.rows))
            k = _gathered_view(key_cache, gathered.slots, q_heads)
            v = _gathered_view(value_cache, gathered.slots, q_heads)
            bias = gathered.bias
        return _split_heads(q, key_cache.shape[2]), k, v, bias

    def _launch(self, prepared: PreparedStep, op: str, inputs: _Inputs, scale: float) -> torch.Tensor:
        query, key, value, bias = inputs
        try:
            out = self.kernels.run(op, query, key, value, bias, scale)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:
            self._supported[_support_key(op, *inputs)] = False  # not again for inputs of this shape
            raise
        if op == prepared.step.op:
            shape = (op, len(bias.q_seqinfo.seqstart_py) - 1, bias.block_tables.shape[1], tuple(query.shape))
            self.stats.launch_shapes.add((*shape, query.dtype))
        return out


def _support_key(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any) -> tuple[Any, ...]:
    """What an op's support depends on, without the token counts that change every step (but, for a paged op,
    with the query lengths per bias row, which ``triton_splitk``'s causal mode restricts)."""
    lengths = None
    if hasattr(bias, "block_tables"):
        lengths = (bias.q_seqinfo.min_seqlen, bias.q_seqinfo.max_seqlen, key.shape[1])
    return (op, type(bias), query.dtype, query.device, query.shape[2:], key.shape[2:], value.shape[2:], lengths)


def _split_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(T, Hq, D)`` -> ``[1, T, Hq, D]``, or ``[1, T, Hkv, Hq // Hkv, D]`` with GQA (query head h uses h // R)."""
    num_tokens, q_heads, dim = query.shape
    if q_heads == kv_heads:
        return query.unsqueeze(0)
    return query.reshape(1, num_tokens, kv_heads, q_heads // kv_heads, dim)


def _expand_heads(kv: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[1, L, Hkv, D]`` -> itself, or with GQA ``[1, L, Hkv, Hq // Hkv, D]`` expanded at stride 0 (no copy)."""
    _, length, kv_heads, dim = kv.shape
    if q_heads == kv_heads:
        return kv
    return kv.unsqueeze(3).expand(1, length, kv_heads, q_heads // kv_heads, dim)


def _pool_view(cache: torch.Tensor, q_heads: int) -> torch.Tensor:
    num_blocks, block_size, kv_heads, dim = cache.shape
    return _expand_heads(cache.view(1, num_blocks * block_size, kv_heads, dim), q_heads)  # (1, slots, Hkv[, R], D)


def _gathered_view(cache: torch.Tensor, slots: torch.Tensor, q_heads: int) -> torch.Tensor:
    kv_heads, dim = cache.shape[2:]
    return _expand_heads(cache.view(-1, kv_heads, dim).index_select(0, slots).unsqueeze(0), q_heads)
