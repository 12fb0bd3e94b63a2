"""LoRA adapters for the tests: made and saved with PEFT (random weights, so each changes the model's answers), and
the reference every served row is held to: ``PeftModel.from_pretrained`` on a fresh base model with that adapter
alone, stock ``generate`` (greedy, fp32, a DynamicCache)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from models import tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import DynamicCache

FAMILY = "llama"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_model() -> torch.nn.Module:
    """The base model every adapter here is made for (the same weights at every call)."""
    return tiny_model(FAMILY)


def make_adapter(
    folder: Path, *, seed: int, r: int = 4, targets: Sequence[str] = ("q_proj", "v_proj"), **extra: Any
) -> str:
    """Save a LoRA adapter of :func:`base_model` with random A and B (``init_lora_weights=False``) in ``folder``."""
    safe = extra.pop("safe_serialization", True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **extra)
        get_peft_model(base_model(), config).save_pretrained(str(folder), safe_serialization=safe)
    return str(folder)


def peft_model(path: str | None) -> torch.nn.Module:
    """A fresh base model with the adapter at ``path`` (None: the base model alone), as PEFT serves it."""
    model = base_model()
    return model if path is None else PeftModel.from_pretrained(model, path).eval()


def reference(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Stock greedy ``generate`` of ``model`` on one prompt: its new tokens and their logits."""
    out = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        cache=DynamicCache(config=model.config),
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0].float()


def assert_reference(output: Any, expected: tuple[list[int], torch.Tensor]) -> None:
    """An Engine output (with ``return_logits``) equals the reference: the same tokens, logits within 1e-4."""
    assert output.error is None, output.error
    tokens, logits = expected
    assert output.token_ids == tokens
    got = torch.stack([torch.as_tensor(row) for row in output.samples[0].logits])
    torch.testing.assert_close(got, logits, atol=1e-4, rtol=0)
