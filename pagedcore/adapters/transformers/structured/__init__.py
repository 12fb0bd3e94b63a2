"""Structured outputs for transformers: :class:`StructuredLogitsProcessor` constrains plain
``model.generate(logits_processor=[...])``; everything else is :mod:`pagedcore.engine.structured`, re-exported here
(its old home) with its old submodule paths.

Example:
    >>> from pagedcore.adapters.transformers.structured import StructuredOutput
    >>> StructuredOutput.from_response_format({"type": "json_object"}).kind
    'json_object'
"""

from pagedcore.engine.structured import (
    KINDS,
    CompiledGrammar,
    CompilerStats,
    EngineGrammars,
    GrammarCompiler,
    GrammarMasks,
    GrammarState,
    RequestGrammar,
    StructuredOutput,
)
from pagedcore.lazy_names import keep_old_paths

from .processor import StructuredLogitsProcessor

keep_old_paths(
    __name__,
    {
        name: f"pagedcore.engine.structured.{name}"
        for name in ("compiler", "masks", "matcher", "requests", "spec", "vocab")
    },
)

__all__ = [
    "KINDS",
    "CompiledGrammar",
    "CompilerStats",
    "EngineGrammars",
    "GrammarCompiler",
    "GrammarMasks",
    "GrammarState",
    "RequestGrammar",
    "StructuredLogitsProcessor",
    "StructuredOutput",
]
