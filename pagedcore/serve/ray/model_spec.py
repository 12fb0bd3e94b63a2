"""ModelSpec: which model every process of a Ray deployment loads, as a small picklable value.

Engine replicas and Ray Data workers load the whole model; the HTTP ingress loads only its tokenizer and reads the
context length from the config, so no weights are held where no forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_NAME", "ModelSpec"]

BUILTIN_NAME = "pagedcore-builtin"


@dataclass(frozen=True)
class ModelSpec:
    """A model to load in a Ray process.

    Args:
        path: a checkpoint folder or hub name; None: the built-in model (random weights, see
            :func:`~pagedcore.adapters.transformers.builtin.builtin_model`).
        builtin_overrides: config overrides of the built-in model (e.g. a tiny one for tests); only without ``path``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: where the model runs (``"cpu"``, ``"cuda"``).
        threads: torch threads of each process that runs the model (default: torch's choice; Ray sets
            ``OMP_NUM_THREADS`` to the CPUs an actor holds).
        seed: seed of the built-in model's random weights.

    Example:
        >>> spec = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128})
        >>> model, tokenizer = spec.load()
        >>> spec.name, model.config.num_hidden_layers, spec.context_length()
        ('pagedcore-builtin', 1, 4096)
    """

    path: str | None = None
    builtin_overrides: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        from pagedcore.errors import ConfigError

        if self.path is not None and self.builtin_overrides:
            raise ConfigError("builtin_overrides configure the built-in model: not with a path")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ConfigError(f"threads must be >= 1, got {self.threads!r}")

    @property
    def name(self) -> str:
        """The model's name: its path, or ``pagedcore-builtin``."""
        return BUILTIN_NAME if self.path is None else self.path

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``, the model in eval mode on its device and dtype."""
        import torch

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        dtype = getattr(torch, self.dtype)
        model: Any
        if self.path is None:
            from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

            model, tokenizer = builtin_model(seed=self.seed, **self.builtin_overrides), builtin_tokenizer()
        else:
            from pagedcore.cli.common import load_model

            model, tokenizer = load_model(self.path, dtype)
        return model.to(device=self.device, dtype=dtype), tokenizer

    def load_tokenizer(self) -> Any:
        """The tokenizer alone."""
        if self.path is None:
            from pagedcore.adapters.transformers.builtin import builtin_tokenizer

            return builtin_tokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def context_length(self) -> int | None:
        """``max_position_embeddings`` of the model's config (no weights loaded), or None when it has none; at most
        where its rotary frequencies change with the forward (the replicas' Engines serve no more:
        :func:`~pagedcore.adapters.transformers.spec.rope_capped`)."""
        from pagedcore.adapters.transformers.spec import rope_capped, text_config

        config: Any
        if self.path is None:  # small: building it is the one place its config is written
            from pagedcore.adapters.transformers.builtin import builtin_model

            config = builtin_model(seed=self.seed, **self.builtin_overrides).config
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.path)
        return rope_capped(getattr(text_config(config), "max_position_embeddings", None), config)[0]
