"""pagedcore's Engine: continuous batching with prefix caching over a model, framework-agnostic.

The Engine, its requests and outputs, sampling and logits processors, log-probabilities, stopping and detokenizing,
and structured outputs. It depends on the core (:mod:`pagedcore`) and drives a model through a framework adapter.
"""
