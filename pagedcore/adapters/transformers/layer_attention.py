"""How one layer's attention meets the pool, by its description (:class:`~.spec.LayerSpec`): what paged attention
reads for it, what it asks the backend, and what it hands back to the model.

- **What it reads** (:func:`pool_read`): its KV group's metadata and its tensors, or, for a KV-shared layer (Gemma 3n /
  Gemma 4), those of the layer whose keys and values it reuses (it stores none of its own).
- **Multi-head latent attention** (:class:`LatentProjection`; DeepSeek V2/V3, Kimi): the pool holds the latent
  ``c_kv`` and the rotary key, not per-head keys and values. Attention runs in that latent space, as one KV head: the
  query's no-rope part is absorbed through the key half of the up-projection ``kv_b_proj`` (``q_nope @ W_UK``), the
  keys are the cached ``[c_kv | k_rope]`` rows and the values their ``c_kv`` part, and the output is brought back
  through the value half (``@ W_UV^T``). Mathematically the model's own expansion; the latent is never expanded.
- **Sinks** (:func:`sinks_of`): the ``s_aux`` logits a gpt-oss style layer hands to its attention function.
- **Llama 4's query temperature** (:func:`retemper`): its NoPE layers scale each query by a function of the query's
  position, which the model computes from the cache's length. The Engine's packed forwards have no such length, so
  the scale is put right per token from the real positions.
- **The dense fallback** (:func:`model_space`): keys and values gathered from the pool as a model's attention
  function expects them (an MLA layer's latents expanded by the module's own ``expand_kv``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from pagedcore.errors import UnsupportedModelError

from .spec import LatentLayout, LayerSpec
from .weights import WeightsWatch

if TYPE_CHECKING:
    from .pool import PagedKVPool

__all__ = [
    "LatentProjection",
    "check_paged_attention",
    "model_space",
    "pool_read",
    "retemper",
    "sinks_of",
    "temperature",
    "verify_latent",
]

# A wrapped kv_b_proj's probed matrix, with the watch over its weights (PEFT adapters switched or merged included)
# and the watch's epoch it was probed in.
_PROJECTIONS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[WeightsWatch, int, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def pool_read(pool: PagedKVPool, layer_idx: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(group, key_cache, value_cache)`` a layer's paged attention reads: its own, or its KV source's; an MLA
    layer's whole latent rows as keys and their latent part as values (see the module docstring).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> pool = PagedKVPool(tiny_llama(), num_blocks=4, block_size=2)
        >>> _ = pool.layer_kv(1, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
        >>> group, keys, values = pool_read(pool, 1)
        >>> group, tuple(keys.shape)
        (0, (5, 2, 2, 16))
    """
    group = pool.read_group(layer_idx)
    tensors = pool.attention_tensors(layer_idx)
    if tensors is None:
        raise RuntimeError(f"layer {layer_idx} has no pool tensors: its keys were never stored")
    return group, tensors[0], tensors[1]


class LatentProjection:
    """The two halves of an MLA layer's up-projection ``kv_b_proj`` (``c_kv -> [k_nope | v]`` per head), to attend
    in the latent space.

    Args:
        module: the layer's attention module (it has ``kv_b_proj``).
        latent: the layer's :class:`~.spec.LatentLayout`.

    Example:
        >>> from pagedcore.adapters.transformers.spec import LatentLayout
        >>> layout = LatentLayout(kv_lora_rank=4, rope_dim=2, num_heads=2, nope_dim=3, v_head_dim=5)
        >>> module = torch.nn.Module()
        >>> module.kv_b_proj = torch.nn.Linear(4, 2 * (3 + 5), bias=False)
        >>> projection = LatentProjection(module, layout)
        >>> query = torch.randn(1, 2, 1, 3 + 2)            # (batch, heads, q_len, nope + rope)
        >>> projection.query(query).shape                   # the no-rope part absorbed: latent + rope
        torch.Size([1, 2, 1, 6])
        >>> projection.output(torch.randn(1, 2, 4)).shape   # (tokens, heads, latent) -> (tokens, heads, v)
        torch.Size([1, 2, 5])
    """

    def __init__(self, module: torch.nn.Module, latent: LatentLayout) -> None:
        self.latent = latent
        weight = _up_projection(module, latent).view(latent.num_heads, latent.nope_dim + latent.v_head_dim, -1)
        self.w_uk = weight[:, : latent.nope_dim]  # (heads, nope, rank)
        self.w_uv = weight[:, latent.nope_dim :]  # (heads, v, rank)

    def expand(self, latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head keys ``[c @ W_UK^T | k_rope]`` and values ``c @ W_UV^T`` of latents ``(batch, 1, tokens,
        rank)`` and rotary keys ``(batch, 1, tokens, rope)``: what this projection takes a module's ``expand_kv``
        to compute (:func:`verify_latent` checks that it does)."""
        nope = torch.einsum("bxtr,hnr->bhtn", latent, self.w_uk.to(latent.dtype))
        keys = torch.cat([nope, rope.expand(-1, nope.shape[1], -1, -1)], dim=-1)
        return keys, torch.einsum("bxtr,hvr->bhtv", latent, self.w_uv.to(latent.dtype))

    def query(self, query: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, q, nope + rope)`` -> ``(batch, heads, q, rank + rope)``: ``[q_nope @ W_UK | q_rope]``."""
        nope = self.latent.nope_dim
        absorbed = torch.einsum("bhqn,hnr->bhqr", query[..., :nope], self.w_uk.to(query.dtype))
        return torch.cat([absorbed, query[..., nope:]], dim=-1)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """``(..., heads, rank)`` attention outputs in the latent space -> ``(..., heads, v_head_dim)``."""
        return torch.einsum("...hr,hvr->...hv", out, self.w_uv.to(out.dtype))


def _has_bias(linear: torch.nn.Module, rank: int) -> bool:
    """Whether ``linear`` maps the zero latent to anything but zero (a bias, wherever a wrapper keeps it)."""
    like = next(linear.parameters(), None)
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    device = like.device if like is not None else torch.device("cpu")
    with torch.no_grad():
        return bool(linear(torch.zeros(1, rank, dtype=dtype, device=device)).abs().max() != 0)


def _up_projection(module: torch.nn.Module, latent: LatentLayout) -> torch.Tensor:
    """``kv_b_proj``'s matrix ``(heads * (nope + v), rank)``: a plain ``nn.Linear``'s weight, else (a PEFT or
    quantized wrapper) the map probed again whenever its weights moved (:class:`~.weights.WeightsWatch`: versions,
    replaced tensors, PEFT adapters switched, merged or disabled). A projection with a bias is refused."""
    linear = getattr(module, "kv_b_proj", None)
    if not isinstance(linear, torch.nn.Module):
        raise UnsupportedModelError(
            f"{type(module).__name__} caches MLA latents but has no kv_b_proj: paged attention cannot attend in its "
            "latent space"
        )
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return linear.weight
    cached = _PROJECTIONS.get(linear)
    if cached is not None:
        watch, epoch, matrix = cached
        watch.check()
        if watch.epoch == epoch:
            return matrix
    else:
        watch = WeightsWatch(linear)
    like = next(linear.parameters(), torch.empty(0))
    dtype = like.dtype if like.is_floating_point() else torch.float32
    if _has_bias(linear, latent.kv_lora_rank):
        raise UnsupportedModelError(
            f"{type(module).__name__}'s kv_b_proj has a bias: paged attention cannot absorb it into the latent"
        )
    with torch.no_grad():
        eye = torch.eye(latent.kv_lora_rank, dtype=dtype, device=like.device)
        matrix = linear(eye).transpose(0, 1).contiguous()
    _PROJECTIONS[linear] = (watch, watch.epoch, matrix)
    return matrix


_VERIFIED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def verify_latent(module: torch.nn.Module, latent: LatentLayout) -> None:
    """Check, once per module, that its ``expand_kv`` computes the per-head keys and values attention in the latent
    space stands for (:meth:`LatentProjection.expand`) on random latents: then the absorbed attention is the model's
    own, whatever MLA family the module is (DeepSeek, Kimi, GLM, LongCat, MiniCPM3, Mistral 4...). Raises
    :class:`~pagedcore.errors.UnsupportedModelError` naming the module when it does not.

    Example:
        >>> from pagedcore.adapters.transformers.spec import LatentLayout
        >>> layout = LatentLayout(kv_lora_rank=4, rope_dim=2, num_heads=2, nope_dim=3, v_head_dim=5)
        >>> module = torch.nn.Module()
        >>> module.kv_b_proj = torch.nn.Linear(4, 2 * (3 + 5), bias=False)
        >>> module.expand_kv = lambda c, rope: LatentProjection(module, layout).expand(c, rope)
        >>> verify_latent(module, layout)   # its own expansion: nothing to refuse
        >>> other = torch.nn.Module()
        >>> other.kv_b_proj = module.kv_b_proj
        >>> other.expand_kv = lambda c, rope: LatentProjection(other, layout).expand(2 * c, rope)
        >>> verify_latent(other, layout)
        Traceback (most recent call last):
        ...
        pagedcore.errors.UnsupportedModelError: Module's expand_kv does not compute the keys and values of its ...
    """
    if module in _VERIFIED:
        return
    expand = getattr(module, "expand_kv", None)
    if expand is None:
        raise UnsupportedModelError(f"{type(module).__name__} caches MLA latents but has no expand_kv")
    projection = LatentProjection(module, latent)
    like = projection.w_uk
    generator = torch.Generator(device="cpu").manual_seed(0)
    c = torch.randn(1, 1, 3, latent.kv_lora_rank, generator=generator).to(like.device, like.dtype)
    rope = torch.randn(1, 1, 3, latent.rope_dim, generator=generator).to(like.device, like.dtype)
    with torch.no_grad():
        got = expand(c, rope)
        want = projection.expand(c, rope)
    if not all(g.shape == w.shape and torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-3 * float(w.abs().max()))
               for g, w in zip(got, want)):  # fmt: skip
        raise UnsupportedModelError(
            f"{type(module).__name__}'s expand_kv does not compute the keys and values of its kv_b_proj as "
            "DeepSeek's MLA does ([c @ W_UK | k_rope], c @ W_UV per head): paged attention cannot attend in its "
            "latent space; use PagedCache with the model's own attention"
        )
    _VERIFIED.add(module)


def check_paged_attention(model: torch.nn.Module, layers: tuple[LayerSpec, ...]) -> None:
    """Raise :class:`~pagedcore.errors.UnsupportedModelError`, before any request, for a layer whose module paged
    attention cannot serve as its description says: an MLA layer without ``kv_b_proj`` / ``expand_kv``, whose
    ``kv_b_proj`` has a bias (it cannot be absorbed into the latent), or whose ``expand_kv`` is not the expansion
    the latent attention stands for (:func:`verify_latent`). The Engine asks when it is built.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers.spec import ModelKVSpec
        >>> model = tiny_llama()
        >>> check_paged_attention(model, ModelKVSpec.from_model(model).layers)   # nothing to refuse
    """
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        latent = layers[index].latent if isinstance(index, int) and 0 <= index < len(layers) else None
        if latent is None:
            continue
        linear = getattr(module, "kv_b_proj", None)
        if not hasattr(module, "expand_kv") and not isinstance(linear, torch.nn.Module):
            continue  # the decoder layer, not its attention
        if not hasattr(module, "expand_kv") or not isinstance(linear, torch.nn.Module):
            raise UnsupportedModelError(
                f"layer {index} ({type(module).__name__}) caches MLA latents but has no kv_b_proj and expand_kv: "
                "paged attention cannot attend in its latent space"
            )
        if _has_bias(linear, latent.kv_lora_rank):
            raise UnsupportedModelError(
                f"layer {index} ({type(module).__name__}): its kv_b_proj has a bias, which paged attention cannot "
                "absorb into the latent; use PagedCache with the model's own attention"
            )
        verify_latent(module, latent)


def sinks_of(layer: LayerSpec, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's sink logits ``(q_heads,)`` from its attention call (``s_aux``), or None.

    Example:
        >>> from pagedcore.adapters.transformers.spec import LayerSpec
        >>> sinks_of(LayerSpec("full_attention", None, 2, 16, 16), {"s_aux": torch.zeros(4)}).shape
        torch.Size([4])
    """
    sinks = kwargs.get("s_aux")
    return sinks if isinstance(sinks, torch.Tensor) else None


def temperature(positions: torch.Tensor, scale: tuple[float, float]) -> torch.Tensor:
    """Llama 4's query temperature at ``positions``: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``.

    Example:
        >>> temperature(torch.tensor([0, 3, 7]), (0.1, 4.0)).tolist()
        [1.0, 1.06931471824646, 1.1098612546920776]
    """
    attn_scale, floor_scale = scale
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def retemper(query: torch.Tensor, layer: LayerSpec, positions: torch.Tensor | None) -> torch.Tensor:
    """``query (1, heads, tokens, dim)`` of a packed forward (the Engine's), its Llama 4 temperature put right: the
    model scaled token ``t`` as if at position ``t`` (a packed cache has no length); ``positions`` are the real ones.
    Unchanged for every other layer, and without positions.

    Example:
        >>> from pagedcore.adapters.transformers.spec import LayerSpec
        >>> nope = LayerSpec("full_attention", None, 2, 16, 16, query_temperature=(0.1, 4.0))
        >>> query = torch.ones(1, 1, 2, 1) * temperature(torch.arange(2), (0.1, 4.0)).view(1, 1, 2, 1)
        >>> fixed = retemper(query, nope, torch.tensor([3, 7]))   # the packed tokens were at positions 3 and 7
        >>> torch.allclose(fixed.flatten(), temperature(torch.tensor([3, 7]), (0.1, 4.0)))
        True
    """
    if layer.query_temperature is None or positions is None:
        return query
    tokens = query.shape[-2]
    packed = torch.arange(tokens, device=query.device)
    real = positions.to(query.device)
    factor = temperature(real, layer.query_temperature) / temperature(packed, layer.query_temperature)
    return (query * factor.view(1, 1, tokens, 1)).to(query.dtype)


def model_space(
    module: torch.nn.Module, layer: LayerSpec, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values gathered from the pool as the layer's attention function takes them: an MLA layer's latents
    ``(batch, 1, kv_len, rank)`` / ``(batch, 1, kv_len, rope)`` expanded by the module's own ``expand_kv``.

    Example:
        >>> from pagedcore.adapters.transformers.spec import LayerSpec
        >>> keys = torch.zeros(1, 2, 3, 16)
        >>> model_space(torch.nn.Module(), LayerSpec("full_attention", None, 2, 16, 16), keys, keys)[0] is keys
        True
    """
    if layer.latent is None:
        return keys, values
    expand = getattr(module, "expand_kv", None)
    if expand is None:
        raise UnsupportedModelError(f"{type(module).__name__} caches MLA latents but has no expand_kv")
    expanded: tuple[torch.Tensor, torch.Tensor] = expand(keys, values)
    return expanded
