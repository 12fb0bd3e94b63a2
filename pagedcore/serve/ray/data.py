"""Offline batch generation over a Ray Data dataset: one Engine per worker.

:class:`GenerateBatch` is a callable class for ``Dataset.map_batches``. Ray Data starts one actor per worker
(``compute=ray.data.ActorPoolStrategy(size=N)``; ``concurrency=N`` in Rays that still take it), each actor builds
its Engine once, and each batch of prompts goes through :meth:`Engine.generate
<pagedcore.adapters.transformers.Engine.generate>`: continuous batching and prefix caching within the batch and
across the batches one worker sees::

    import ray
    from pagedcore.serve.ray import GenerateBatch, ModelSpec

    ds = ray.data.from_items([{"prompt": p} for p in prompts])
    out = ds.map_batches(
        GenerateBatch,
        fn_constructor_kwargs={"model": ModelSpec("path/to/model"), "max_new_tokens": 64},
        compute=ray.data.ActorPoolStrategy(size=4),
        batch_size=64,
        num_cpus=1,
    )
    for row in out.iter_rows():
        print(row["prompt"], row["generated_text"])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .model_spec import ModelSpec

__all__ = ["GenerateBatch"]


class GenerateBatch:
    """Generates for a batch of prompts with this worker's Engine (a callable class for ``map_batches``).

    Args:
        model: the model each worker loads (default: the built-in model).
        prompt_column: the column of prompts: strings, or token id lists.
        engine_kwargs: keyword arguments of :class:`~pagedcore.adapters.transformers.Engine`.
        params: a :class:`~pagedcore.adapters.transformers.SamplingParams` for every prompt, or instead
        **generate_kwargs: ``model.generate``'s keyword arguments (``max_new_tokens``, ``do_sample``, ``seed``...).

    Each output batch is the input batch plus the columns ``generated_text``, ``generated_token_ids`` (the first
    sample's), ``num_prompt_tokens``, ``num_cached_tokens`` (prefix-cache hits) and ``error`` (why that prompt
    failed: one bad prompt never fails the batch). Text columns hold strings, empty when there is nothing to say
    (no error, no tokenizer), so that every batch format (numpy, pandas, Arrow) reads them alike.

    Example:
        >>> generate = GenerateBatch(ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64,
        ...     "intermediate_size": 128}), max_new_tokens=3)
        >>> out = generate({"prompt": np.array(["Hello", "Hello there"], dtype=object)})
        >>> [len(ids) for ids in out["generated_token_ids"]], list(out["error"])
        ([3, 3], ['', ''])
    """

    def __init__(
        self,
        model: ModelSpec | None = None,
        *,
        prompt_column: str = "prompt",
        engine_kwargs: dict[str, Any] | None = None,
        params: Any = None,
        **generate_kwargs: Any,
    ) -> None:
        from pagedcore.adapters.transformers import Engine

        loaded, tokenizer = (model or ModelSpec()).load()
        self._engine = Engine(loaded, tokenizer, **(engine_kwargs or {}))
        self._prompt_column = prompt_column
        self._params = params
        self._generate_kwargs = generate_kwargs

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch with the generated columns added."""
        prompts = [_prompt(p) for p in batch[self._prompt_column]]
        outputs = self._engine.generate(prompts, self._params, use_tqdm=False, **self._generate_kwargs)
        out = dict(batch)
        out["generated_text"] = _objects([o.text or "" for o in outputs])
        out["generated_token_ids"] = _objects([list(o.token_ids) for o in outputs])
        out["num_prompt_tokens"] = np.array([len(o.prompt_token_ids) for o in outputs], dtype=np.int64)
        out["num_cached_tokens"] = np.array([o.metrics.num_cached_tokens for o in outputs], dtype=np.int64)
        out["error"] = _objects([o.error or "" for o in outputs])
        return out

    @property
    def engine(self) -> Any:
        """This worker's Engine (its ``stats()``: prefix hit rate, throughput)."""
        return self._engine


def _prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):  # a token id list arrives as an array
        return [int(t) for t in value.tolist()]
    return value


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array
