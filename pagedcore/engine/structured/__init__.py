"""Structured outputs: generation constrained by a JSON schema, a regex, a list of choices or a grammar.

- :class:`StructuredOutput`: what a request asks for (plain Python, no grammar engine needed to build one).
- :class:`GrammarCompiler`: spec -> grammar, parsed at once (bad input raises :class:`~pagedcore.errors.GrammarError`)
  and compiled in a worker thread with a bounded time, cached by spec.
- :class:`GrammarState`: one sample's position in its grammar, kept in step with its tokens (fork, rollback).
- :class:`GrammarMasks`: one batched mask application per step, on the constrained rows only.
- :class:`EngineGrammars` / :class:`RequestGrammar`: the Engine's side (its requests' grammars, those waiting).
- ``StructuredLogitsProcessor`` (``pagedcore.adapters.transformers.structured``): the same constraint for plain
  ``model.generate(logits_processor=[...])``.

The grammar engine is llguidance (the ``structured`` extra), chosen by measurement against
xgrammar and outlines-core (docs/structured.md): valid outputs on every schema feature tested, a typical schema
compiled in milliseconds (xgrammar ~9x and outlines-core ~270x slower there), JSON Schema keywords it does not
implement refused with a message (``uniqueItems``), and Lark grammars that embed JSON schemas.

Example:
    >>> from pagedcore.engine.structured import StructuredOutput
    >>> StructuredOutput.from_response_format({"type": "json_object"}).kind
    'json_object'
"""

from .compiler import CompiledGrammar, CompilerStats, GrammarCompiler
from .masks import GrammarMasks
from .matcher import GrammarState
from .requests import EngineGrammars, RequestGrammar
from .spec import KINDS, StructuredOutput

__all__ = [
    "KINDS",
    "CompiledGrammar",
    "CompilerStats",
    "EngineGrammars",
    "GrammarCompiler",
    "GrammarMasks",
    "GrammarState",
    "RequestGrammar",
    "StructuredOutput",
]
