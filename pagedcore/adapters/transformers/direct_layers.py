"""The Engine's packed forward with a known family's decoder layers run as direct calls: the same operations, in
the same order, on the same modules' weights as the family's own ``forward`` code, without its module calls, keyword
plumbing, mask building and output wrappers around each layer.

Why: at one to a few decoding rows a forward of a small model is mostly the time around its matrix products. On the
benchmark's Llama (8 layers, hidden 512) transformers' structure around them (``LlamaDecoderLayer.__call__`` and
its attention's, their keyword arguments and decorators, the causal mask, the output dataclasses) and the small ops
of the norms and the rotary embedding took about 1.9 ms of a 12.1 ms decode step at batch 1 (docs/benchmarks.md,
"Decoder layers called directly").

What runs: the model's embedding, rotary embedding, linear layers, activation and head are still called (so their
hooks, the runner's own linear forwards and the fused greedy head apply as before: straight through their ``forward``
where nothing hooks them, as ``Module.__call__`` itself does, else as modules); the decoder layer, its attention
and its MLP are not: their bodies are written out here, in transformers' order (``LlamaDecoderLayer``,
``LlamaAttention`` with the Engine's paged attention, ``LlamaMLP``). The norms and the rotary embedding with the
keys' and values' store run in C (:class:`DirectKernel`: the same float32 operations in the same order, so the same
bits; a norm's variance summed in torch's own order where that was found to give torch's bits for its row width,
else torch's variance and the scale in C) where it serves, else as transformers' torch ops and the cache's update; a
hooked or replaced norm is called as its module. A decode step whose calls have all settled on C code runs every
layer's C calls as one C call (:mod:`.decode_tape`: the same calls and arguments, so the same bits). Mistral's and
Qwen2's layers are Llama's with a sliding window handed to the attention (their attention modules' one difference),
Qwen3's Qwen2's with each query and key head normalized before the rotary embedding (:data:`FAMILIES`).

When it runs (:meth:`DirectLayers.serves`, checked at each step): every bypassed module (the causal LM, its base
model, each decoder layer, attention and MLP) is exactly the family's class, has no hook (transformers' output
recorders aside: :func:`~.hook_ids.recorders_only`) and no ``forward`` of its own on the instance, and no global
module hook is set; for a PEFT model of plain LoRA adapters, its ``PeftModel`` and ``LoraModel`` too
(:func:`_peft_chain`). Otherwise, and for steps with the Engine's per-request LoRA adapters or a probe's, the model's
own forward runs. The first step it would serve, it is checked: the base model's own forward runs too and the two
last hidden states must be equal to the bit; if not (another transformers version whose layer code changed), it is
turned off for this runner with a warning and the model's are used.
``PAGEDCORE_DIRECT_LAYERS=0`` turns it off, ``PAGEDCORE_DIRECT_KERNEL=0`` only its C steps.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pagedcore.c_library import build, can_build_avx2

from . import decode_tape
from .argmax_head import same_bits
from .attention import CONTEXT_KEY, paged_attention_forward
from .decode_tape import Tapes
from .hook_ids import recorders_only

__all__ = ["FAMILIES", "DirectCounts", "DirectKernel", "DirectLayers", "load_kernel"]

logger = logging.getLogger("pagedcore")

ENV = "PAGEDCORE_DIRECT_LAYERS"
KERNEL_ENV = "PAGEDCORE_DIRECT_KERNEL"


def _no_window(attention: Any) -> int | None:
    return None


def _config_window(attention: Any) -> int | None:  # MistralAttention: the config's window on every layer
    return getattr(attention.config, "sliding_window", None)


def _layer_window(attention: Any) -> int | None:  # Qwen2Attention: its layer type's window
    return attention.sliding_window


# model_type -> (modeling module, class prefix, the window its attention modules hand the attention function,
# whether its attention normalizes each query and key head before the rotary embedding: Qwen3's q_norm and k_norm)
FAMILIES: dict[str, tuple[str, str, Callable[[Any], int | None], bool]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama", _no_window, False),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral", _config_window, False),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2", _layer_window, False),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3", _layer_window, True),
}


@dataclass
class DirectCounts:
    """Steps the direct layers ran, and the step that checked them (``verified``: None until it ran; False: they
    were turned off).

    Example:
        >>> DirectCounts().verified is None
        True
    """

    steps: int = 0
    verified: bool | None = None


@dataclass(frozen=True)
class _Classes:
    causal_lm: type
    model: type
    layer: type
    attention: type
    mlp: type
    norm: type
    rotate_half: Callable[[torch.Tensor], torch.Tensor]
    window: Callable[[Any], int | None]
    head_norms: bool


class DirectLayers:
    """A causal LM's decoder layers as direct calls (module docstring); :meth:`of` builds one where the model's
    family is known.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> DirectLayers.of(tiny_llama()) is not None
        True
    """

    def __init__(self, model: Any, classes: _Classes, wrappers: tuple[Any, Any] | None = None) -> None:
        self._model = model
        self._classes = classes
        self._wrappers = wrappers  # a PEFT model around ``model``: the PeftModel and its tuner (_peft_chain)
        self.counts = DirectCounts()
        self.tapes: Tapes | bool | None = None  # None: not asked yet; False: no tape kernel here

    @classmethod
    def of(cls, model: Any) -> DirectLayers | None:
        """The direct layers of ``model`` (a known family's causal LM, or a PEFT LoRA model of one: the causal LM
        its forward runs, :func:`_peft_chain`), or None: another model, or turned off (``ENV``)."""
        if os.environ.get(ENV, "1") == "0":
            return None
        model, wrappers = _peft_chain(model)
        family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
        if family is None:
            return None
        classes = _classes(*family)
        if classes is None or type(model) is not classes.causal_lm:
            return None
        return cls(model, classes, wrappers)

    def serves(self) -> bool:
        """Whether this step may run the layers directly (module docstring: the bypassed modules unchanged and
        unhooked), and they were not turned off. A layer set to checkpoint (gradient checkpointing in ``train()``
        mode) is served too: the runner's forward records no gradient, and there transformers' checkpointing layer
        (5.24 on) runs its ``forward`` as is, cache included, which is what the direct calls write out."""
        if self.counts.verified is False or _global_hooks():
            return False
        classes, model = self._classes, self._model
        if self._wrappers is not None and not _peft_runs(*self._wrappers, model):
            return False
        inner = model._modules.get("model")  # noqa: SLF001  (no __getattr__ per read)
        if not _plain(model, classes.causal_lm) or not _plain(inner, classes.model):
            return False
        for layer in _layers(inner):
            if not _plain(layer, classes.layer):
                return False
            children = layer._modules  # noqa: SLF001
            if not _plain(children.get("self_attn"), classes.attention) or not _plain(children.get("mlp"), classes.mlp):
                return False
        return True

    def logits(self, kwargs: dict[str, Any]) -> torch.Tensor:
        """The logits ``(1, kept rows, vocab)`` of the runner's packed forward (``kwargs``: what it passes the model:
        ``input_ids``, ``position_ids``, ``cache``, the context, ``logits_to_keep``); the first step through
        :meth:`_checked`."""
        model = self._model
        if self.counts.verified is None:
            return self._head(self._checked(kwargs), kwargs)
        self.counts.steps += 1
        return self._head(self._hidden(model.model, kwargs), kwargs)

    def _head(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """LlamaForCausalLM.forward after its base model: the kept positions through the head (one module call)."""
        keep = kwargs.get("logits_to_keep", 0)
        index = slice(-keep, None) if isinstance(keep, int) else keep  # transformers' slice_logits_to_keep
        return _call(self._model.lm_head, hidden[:, index, :])

    def _checked(self, kwargs: dict[str, Any]) -> torch.Tensor:
        """The first step: the direct layers' last hidden states, then the base model's own forward's (writing the
        same slots again), compared to the bit (:func:`~.argmax_head.same_bits`); returns the base model's, and
        turns the direct layers off for good where they differ or raised. (Hidden states, not logits: the head then
        runs once, as in every step, so the fused greedy head sees the one call it checks for.)"""
        inner = self._model.model
        try:
            direct: torch.Tensor | None = self._hidden(inner, kwargs)
        except Exception:  # e.g. a layer attribute another transformers version renamed: the model's forward runs
            logger.warning("pagedcore: %s's decoder layers called directly failed", type(self._model).__name__,
                           exc_info=True)  # fmt: skip
            direct = None
        base = {name: value for name, value in kwargs.items() if name != "logits_to_keep"}
        theirs = inner(**base).last_hidden_state
        same = direct is not None and same_bits(direct, theirs)
        self.counts.verified = same
        if same:
            self.counts.steps += 1
        elif direct is not None:
            logger.warning(
                "pagedcore: %s's decoder layers called directly gave other hidden states than its own forward "
                "(another transformers version's layer code?): this Engine runs the model's own forward from here on",
                type(self._model).__name__,
            )
        return theirs

    def _hidden(self, inner: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        """The base model's last hidden states: LlamaModel.forward's loop over LlamaDecoderLayer.forward,
        LlamaAttention.forward (paged) and LlamaMLP.forward, written out (their elementwise steps in
        :class:`DirectKernel` where it serves: the same bits); a decode step's layers as one C call where this row
        count's tape serves (:mod:`.decode_tape`)."""
        hidden = _call(inner.embed_tokens, kwargs["input_ids"])
        cos, sin = _call(inner.rotary_emb, hidden, position_ids=kwargs["position_ids"])
        kernel = _kernel_for(hidden, cos, sin)
        tapes = self._tapes_for(kernel)
        layers = _layers(inner) if tapes is not None else []  # (a tape checks they are those it was written from)
        out = None if tapes is None else tapes.hidden(self, inner, layers, hidden, cos, sin, kwargs)
        if out is None:
            out = self.layers_hidden(inner, hidden, cos, sin, kwargs)
            if tapes is not None:
                tapes.offer(self._classes, layers, kernel, hidden, cos, kwargs)
                tapes.check_new(self, inner, layers, hidden, cos, sin, kwargs, out)
        return _norm(kernel, self._classes.norm, inner.norm, out)

    def _tapes_for(self, kernel: DirectKernel | None) -> Tapes | None:
        """The decode tapes, where the direct kernel serves this step and the tape's kernel was built."""
        if kernel is None or self.tapes is False:
            return None
        if self.tapes is None:
            tape_kernel = decode_tape.load()
            self.tapes = False if tape_kernel is None else Tapes(tape_kernel)
        return self.tapes if isinstance(self.tapes, Tapes) else None

    def layers_hidden(self, inner: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kwargs: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        """The decoder layers' output (before the final norm) for the embedded ``hidden`` and the rotary tables."""
        cache, context = kwargs["cache"], kwargs[CONTEXT_KEY]
        kernel = _kernel_for(hidden, cos, sin)
        norm = functools.partial(_norm, kernel, self._classes.norm)
        cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)  # apply_rotary_pos_emb's, once (views: the same values)
        rotate_half, window, head_norms = self._classes.rotate_half, self._classes.window, self._classes.head_norms
        extra: dict[str, Any] = {CONTEXT_KEY: context}
        for layer in _layers(inner):
            attention, mlp = layer.self_attn, layer.mlp
            residual = hidden
            hidden = norm(layer.input_layernorm, hidden)
            input_shape = hidden.shape[:-1]
            hidden_shape = (*input_shape, -1, attention.head_dim)
            q, k, v = _call(attention.q_proj, hidden), _call(attention.k_proj, hidden), _call(attention.v_proj, hidden)
            if head_norms:  # Qwen3Attention: each query and key head normalized, then (1, tokens, heads * d) again
                q = norm(attention.q_norm, q.view(hidden_shape)).view(q.shape)
                k = norm(attention.k_norm, k.view(hidden_shape)).view(k.shape)
            stored = None if kernel is None else kernel.rope_store(cache, attention, q, k, v, cos, sin)
            if stored is not None:  # the rotated queries; keys and values in the pool
                query, key, value = stored, k.view(hidden_shape).transpose(1, 2), v.view(hidden_shape).transpose(1, 2)
            else:
                query = q.view(hidden_shape).transpose(1, 2)
                key = k.view(hidden_shape).transpose(1, 2)
                value = v.view(hidden_shape).transpose(1, 2)
                query = (query * cos4) + (rotate_half(query) * sin4)  # apply_rotary_pos_emb
                key = (key * cos4) + (rotate_half(key) * sin4)
                key, value = cache.update(key, value, attention.layer_idx, kwargs=extra)
            out, _ = paged_attention_forward(
                attention, query, key, value, None, dropout=0.0, scaling=attention.scaling,
                sliding_window=window(attention), **extra,
            )  # fmt: skip
            out = out.reshape(*input_shape, -1).contiguous()
            hidden = residual + _call(attention.o_proj, out)
            residual = hidden
            hidden = norm(layer.post_attention_layernorm, hidden)
            gate, up = _call(mlp.gate_proj, hidden), _call(mlp.up_proj, hidden)
            hidden = residual + _call(mlp.down_proj, _call(mlp.act_fn, gate) * up)
        return hidden


def _norm(kernel: DirectKernel | None, cls: type, module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``module(hidden)``: an unhooked RMSNorm of the family's class through the kernel (in one call where its sum of
    squares was found to give torch's bits at this width, else torch's variance and the kernel's scale)."""
    if kernel is None or not _plain(module, cls) or not hidden.is_contiguous():
        return module(hidden)
    out = kernel.rms_norm(hidden, module.weight, module.variance_epsilon)  # where its sum's bits are torch's
    if out is not None:
        return out
    variance = hidden.pow(2).mean(-1, keepdim=True)  # LlamaRMSNorm.forward's (its .to(float32) is the same tensor)
    return kernel.rms_scale(hidden, variance, module.weight, module.variance_epsilon)


class DirectKernel:
    """The direct layers' C steps (``direct_kernel.c``): the norm (:meth:`rms_norm`; its scale after torch's
    variance, :meth:`rms_scale`, where the C sum's bits are not torch's), and the
    rotary embedding with the keys' and values' store into the pool, each the same float32 operations in the same
    order as transformers' torch ops (no fused multiply-add), so the same bits. Serves float32 CPU tensors outside
    autograd and dispatch modes (:func:`_kernel_for`); ``PAGEDCORE_DIRECT_KERNEL=0`` turns it off.

    Example:
        >>> kernel = load_kernel()
        >>> x, w = torch.randn(2, 8), torch.randn(8)
        >>> variance = x.pow(2).mean(-1, keepdim=True)
        >>> want = w * (x * torch.rsqrt(variance + 1e-6))
        >>> kernel is None or torch.equal(kernel.rms_scale(x, variance, w, 1e-6), want)
        True
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._rms = library.rms_scale
        self._rms.argtypes = [ptr, ptr, ptr, ctypes.c_float, ptr, i64, i64]
        self._rms.restype = None
        self._norm = library.rms_norm
        self._norm.argtypes = [ptr, ptr, ctypes.c_float, ptr, ptr, i64, i64, i64]
        self._norm.restype = ctypes.c_int
        self._rope = library.rope_store
        self._rope.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        self._rope.restype = None
        # the float32 lanes of torch's CPU sum kernel: its order (None: none the C code follows)
        self._lanes = self._found_lanes()
        self._widths: dict[int, bool] = {}  # row width -> whether the C sum's bits were found equal to torch's
        self._lock = threading.Lock()

    def _found_lanes(self) -> int | None:
        """The vector width (of :data:`SUM_LANES`) whose order gives torch's bits for ``pow(2).mean(-1)`` of rows of
        4096 random values over twelve orders of magnitude, else None: which of ATen's kernels torch dispatches to is
        read from what it computes, not from its capability's name (an AVX512 torch 2.13 sums in 8 lanes: its sum
        kernel has no AVX512 build, found on an Intel Xeon)."""
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            return None
        rows = _drawn_rows(4096)
        return next((lanes for lanes in SUM_LANES if self._sums_match(rows, lanes)), None)

    def _sums_match(self, rows: torch.Tensor, lanes: int) -> bool:
        """Whether the C code's variance of contiguous float32 ``rows`` summed in ``lanes`` lanes has the bits of
        torch's ``pow(2).mean(-1)``."""
        count, n = rows.shape
        ours, ones, out = torch.empty(count, 1, dtype=torch.float32), torch.ones(n), torch.empty_like(rows)
        code = self._norm(rows.data_ptr(), ones.data_ptr(), 1e-6, out.data_ptr(), ours.data_ptr(), count, n, lanes)
        return code == 0 and same_bits(ours, rows.pow(2).mean(-1, keepdim=True))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """LlamaRMSNorm.forward over contiguous float32 ``x (..., n)`` in one C call, its variance summed in torch's
        order; None (nothing done) where the weight is not a contiguous float32 ``(n,)``, or this row width's bits
        were not found equal to torch's (:meth:`sums_as_torch`, asked once per width)."""
        n = x.shape[-1]
        if weight.dtype != torch.float32 or weight.shape != (n,) or not weight.is_contiguous():
            return None
        same = self._widths.get(n)
        if same is None:
            same = self.sums_as_torch(x)
        if not same:
            return None
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), None, x.numel() // n, n, self._lanes)
        return out

    def sums_as_torch(self, x: torch.Tensor) -> bool:
        """Whether the C code's variance of rows of ``x``'s width has torch's bits: checked on ``x``'s first eight
        rows and on eight rows of random values over twelve orders of magnitude, against ``pow(2).mean(-1)``;
        remembered per width (``False`` for good where torch's CPU capability is one the C code does not follow)."""
        n = x.shape[-1]
        with self._lock:
            if n in self._widths:
                return self._widths[n]
            lanes = self._lanes
            samples = (x.reshape(-1, n)[:8].contiguous(), _drawn_rows(n))
            same = lanes is not None and all(self._sums_match(sample, lanes) for sample in samples)
            self._widths[n] = same
            return same

    def rms_scale(self, x: torch.Tensor, variance: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(variance + eps))`` over contiguous float32 ``x (..., n)``, ``variance (..., 1)``."""
        n = x.shape[-1]
        if weight.dtype != torch.float32 or weight.shape != (n,) or not weight.is_contiguous():
            return weight * (x * torch.rsqrt(variance + eps))
        out = torch.empty_like(x)
        rows = x.numel() // n
        self._rms(x.data_ptr(), variance.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), rows, n)
        return out

    def rope_store(
        self, cache: Any, attention: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:  # fmt: skip
        """The rotated queries ``(1, q_heads, tokens, d)`` of the linear outputs ``q, k, v (1, tokens, heads * d)``,
        the rotated keys and the values written to the layer's pool slots; None (nothing done) where the layouts
        are not the ones the kernel reads (the caller then runs the torch ops and the cache's update)."""
        d = attention.head_dim
        tokens = q.shape[1]
        if q.dim() != 3 or q.shape[0] != 1 or cos.shape != (1, tokens, d) or d % 2:
            return None
        kv_heads, dv = k.shape[-1] // d, v.shape[-1] // max(1, k.shape[-1] // d)
        keys, values = k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, dv)
        key_cache, value_cache = cache.pool.layer_kv(attention.layer_idx, keys, values)
        slots = cache.slots(attention.layer_idx, q.device)
        fits = (
            all(t.stride(-1) == 1 and t.stride(1) == t.shape[-1] for t in (q, k, v))
            and cos.is_contiguous() and sin.is_contiguous()
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.dtype == value_cache.dtype == torch.float32
            and key_cache.shape[-2:] == (kv_heads, d) and value_cache.shape[-2:] == (kv_heads, dv)
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
        )  # fmt: skip
        if not fits:
            return None
        heads = q.shape[-1] // d
        out = q.new_empty(tokens, heads, d)
        self._rope(
            q.data_ptr(), q.stride(1), k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1), cos.data_ptr(),
            sin.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), tokens,
            heads, kv_heads, d, dv,
        )  # fmt: skip
        return out.view(1, tokens, heads, d).transpose(1, 2)


def _drawn_rows(n: int) -> torch.Tensor:
    """Eight float32 rows of ``n`` random values (seeded by ``n``) over twelve orders of magnitude: what a sum-order
    check runs on beside a call's own rows."""
    scales = torch.logspace(-6, 6, 8, dtype=torch.float32).unsqueeze(1)
    return torch.randn(8, n, generator=torch.Generator().manual_seed(n), dtype=torch.float32) * scales


_SOURCE = Path(__file__).with_name("direct_kernel.c")
_SOURCE_TEXT = _SOURCE.read_text() if _SOURCE.is_file() else None  # read with this module (see c_library)
# the float32 lanes of ATen's Vectorized<float> its sum kernel may run with (AVX2: 8; AVX512: 16 where that kernel is
# built for it): DirectKernel._found_lanes tries each
SUM_LANES = (8, 16)
_FLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
# Where AVX2 may be built: the same source vectorized (each lane its own IEEE operations in the same order: nothing
# reassociated or contracted); the norm 3x faster at 16 rows of 512, 4x at 64 (docs/benchmarks.md, "Weights past
# the caches")
_AVX2_FLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
_KERNEL_LOCK = threading.Lock()
_KERNEL: list[DirectKernel | None] = []


def load_kernel() -> DirectKernel | None:
    """The process's :class:`DirectKernel`, built at the first call; None without a C compiler, off Linux, or with
    ``PAGEDCORE_DIRECT_KERNEL=0``.

    Example:
        >>> load_kernel() is load_kernel()
        True
    """
    with _KERNEL_LOCK:
        if not _KERNEL:
            usable = os.environ.get(KERNEL_ENV, "1") != "0" and sys.platform == "linux"
            flags = _AVX2_FLAGS if usable and can_build_avx2(KERNEL_ENV) else _FLAGS
            built = build("direct_kernel", _SOURCE_TEXT, flags) if usable else None
            _KERNEL.append(DirectKernel(built) if built is not None else None)
        return _KERNEL[0]


def _kernel_for(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> DirectKernel | None:
    """The kernel, where this forward's tensors are float32 on the CPU and nothing records or traces the ops."""
    if hidden.dtype != torch.float32 or hidden.device.type != "cpu" or torch.is_grad_enabled():
        return None
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or _get_current_dispatch_mode() is not None:
        return None
    if torch.compiler.is_compiling():
        return None
    return load_kernel()


def _peft_chain(model: Any) -> tuple[Any, tuple[Any, Any] | None]:
    """The causal LM whose forward a PEFT model's forward runs, and the PEFT model and its tuner around it, where
    ``model`` is a ``PeftModel`` or ``PeftModelForCausalLM`` of a ``LoraModel`` (``get_peft_model`` with LoRA: an RL
    loop's policy); else ``(model, None)``. Its forward then only calls the causal LM (``base_model.model``) with the
    same arguments (:func:`_peft_runs` checks the conditions each step), and the LoRA layers injected into the causal
    LM are called as the modules they are."""
    peft = sys.modules.get("peft")
    wrapping = (getattr(peft, "PeftModel", None), getattr(peft, "PeftModelForCausalLM", None))
    if peft is None or type(model) not in wrapping:
        return model, None
    tuner = model._modules.get("base_model")  # noqa: SLF001
    if type(tuner) is not getattr(peft, "LoraModel", None) or not _peft_runs(model, tuner, tuner.model):
        return model, None
    return tuner.model, (model, tuner)


def _peft_runs(peft_model: Any, tuner: Any, model: Any) -> bool:
    """A PEFT model's forward, now, is its tuner's model's ``forward`` with the same arguments: the PEFT model and the
    tuner exactly their classes, unhooked, no instance ``forward``, still wrapping ``model``; every adapter config a
    plain LoRA's (not prompt learning, which adds virtual tokens, nor activated LoRA, whose offsets the forward
    computes from the input ids and hands the layers through hooks)."""
    if not _plain(peft_model, type(peft_model)) or not _plain(tuner, type(tuner)):
        return False
    if peft_model._modules.get("base_model") is not tuner or tuner._modules.get("model") is not model:  # noqa: SLF001
        return False
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return False
    return all(
        getattr(config, "peft_type", None) == "LORA"  # PeftType is a str enum
        and not getattr(config, "is_prompt_learning", True)
        and getattr(config, "alora_invocation_tokens", None) is None
        for config in configs.values()
    )


def _layers(inner: Any) -> list[Any]:
    """The layers the base model's loop runs (``self.layers[: config.num_hidden_layers]``)."""
    return list(inner.layers._modules.values())[: inner.config.num_hidden_layers]  # noqa: SLF001


def _plain(module: Any, cls: Any) -> bool:
    """``module`` is exactly ``cls``, with no hook and no instance ``forward``: what the direct call stands for.
    transformers' output recorders do not count as hooks (:func:`~.hook_ids.recorders_only`: installed on every
    layer by the first ``output_hidden_states`` call, they put nothing into the values)."""
    hooks = module._forward_hooks  # noqa: SLF001
    return (
        type(module) is cls
        and (not hooks or recorders_only(hooks))
        and not module._forward_pre_hooks  # noqa: SLF001
        and "forward" not in module.__dict__
    )


def _call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """``module(*args)`` as ``Module.__call__`` runs it when nothing hooks it: its ``forward`` straight (about 4 µs a
    call less). Where the module has a hook of any kind or a compiled call of its own, through ``__call__``; the
    global hooks and tracing, which ``__call__`` also checks, turn the direct layers off for the step
    (:meth:`DirectLayers.serves`)."""
    if (
        module._forward_hooks  # noqa: SLF001
        or module._forward_pre_hooks  # noqa: SLF001
        or module._backward_hooks  # noqa: SLF001
        or module._backward_pre_hooks  # noqa: SLF001
        or module._compiled_call_impl is not None  # noqa: SLF001
    ):
        return module(*args, **kwargs)
    return module.forward(*args, **kwargs)


def _global_hooks() -> bool:
    """A global module hook is set (``register_module_forward_hook`` and the like: it would miss the bypassed modules
    and :func:`_call`'s), or the JIT is tracing (``Module.__call__`` then calls ``_slow_forward``)."""
    return bool(
        torch_module._global_forward_hooks  # noqa: SLF001
        or torch_module._global_forward_pre_hooks  # noqa: SLF001
        or torch_module._global_forward_hooks_always_called  # noqa: SLF001
        or torch_module._global_backward_hooks  # noqa: SLF001
        or torch_module._global_backward_pre_hooks  # noqa: SLF001
        or torch._C._get_tracing_state()  # noqa: SLF001
    )


_CLASSES: dict[str, _Classes | None] = {}


def _classes(path: str, prefix: str, window: Callable[[Any], int | None], head_norms: bool) -> _Classes | None:
    """The family's classes and ``rotate_half`` from its modeling module (None if this transformers lacks one)."""
    if path not in _CLASSES:
        try:
            module = __import__(path, fromlist=["_"])
            _CLASSES[path] = _Classes(
                getattr(module, f"{prefix}ForCausalLM"), getattr(module, f"{prefix}Model"),
                getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}Attention"),
                getattr(module, f"{prefix}MLP"), getattr(module, f"{prefix}RMSNorm"), module.rotate_half, window,
                head_norms,
            )  # fmt: skip
        except (ImportError, AttributeError):
            _CLASSES[path] = None
    return _CLASSES[path]
