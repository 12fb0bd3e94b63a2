"""A second framework adapter, in plain PyTorch: a small Llama on ``torch.nn`` (:class:`TorchLlama`) and its model
runner (:class:`TorchRunner`), driven by the same :class:`pagedcore.engine.Engine` as transformers models.

It is the proof that the Engine's runner protocol (:mod:`pagedcore.engine.runner`) needs no framework: nothing here
imports transformers. It loads a transformers Llama checkpoint (``TorchLlama.from_pretrained(folder)``) and its
greedy tokens equal transformers' ``generate`` on the same weights, with prefix hits and preemption
(tests/test_torch_reference.py).

Example:
    >>> from pagedcore.engine import Engine, SamplingParams
    >>> with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=32, block_size=4)) as engine:
    ...     (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), use_tqdm=False)
    >>> len(out.token_ids)
    3
"""

from .llama import LlamaShape, TorchLlama
from .runner import TorchRunner

__all__ = ["LlamaShape", "TorchLlama", "TorchRunner"]
