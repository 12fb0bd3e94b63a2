"""GrammarState: one sample's position in its grammar, kept in step with the sample's tokens.

The sample's generated tokens are the truth; the state follows them. :meth:`GrammarState.sync` makes the tokens
the state has consumed equal a sample's tokens: it accepts the new ones (one per step, normally), rolls back
tokens the sample no longer has, or rebuilds from the start when a rollback cannot reach. So preemption by
recompute (the sample keeps its tokens), a dropped token (abort during a forward) and a fork (``n > 1``: each
sample forks its own state from the parent's) all leave the state exactly where the tokens say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .compiler import CompiledGrammar
from .vocab import SpecialTokens, import_llguidance

__all__ = ["GrammarState"]


class GrammarState:
    """A grammar matcher and the tokens it consumed.

    Args:
        compiled: a :class:`CompiledGrammar` (:meth:`GrammarCompiler.compile`).
        matcher / tokens: start from this llguidance matcher, which consumed ``tokens`` (what :meth:`fork` passes).

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> from pagedcore.engine.structured import GrammarCompiler, StructuredOutput
        >>> tok = builtin_tokenizer()
        >>> compiler = GrammarCompiler(tok, vocab_size=99)
        >>> state = GrammarState(compiler.compile(StructuredOutput.choice(["yes", "no"])))
        >>> ids = tok("no")["input_ids"]
        >>> state.sync(ids), state.is_complete, state.num_tokens
        (True, True, 2)
        >>> other = state.fork(); other.sync(ids[:1]), other.is_complete, state.is_complete
        (True, False, True)
        >>> state.sync(tok("ja")["input_ids"])   # "j" is not in the grammar
        False
        >>> compiler.close()
    """

    def __init__(self, compiled: CompiledGrammar, *, matcher: Any = None, tokens: Sequence[int] = ()) -> None:
        self._compiled = compiled
        self._matcher = matcher if matcher is not None else compiled.matcher.deep_copy()
        self._tokens: list[int] = list(tokens)
        self._ended = bool(tokens) and tokens[-1] in compiled.stop_token_ids
        self._stuck = False  # its last mask allowed no token (GrammarMasks found it so)

    @property
    def vocab_size(self) -> int:
        """The size of the vocabulary its grammar was built for (the mask's width)."""
        return self._compiled.vocab_size

    @property
    def num_tokens(self) -> int:
        """Tokens consumed."""
        return len(self._tokens)

    @property
    def last_token(self) -> int | None:
        """The last token consumed (None before the first)."""
        return self._tokens[-1] if self._tokens else None

    @property
    def is_complete(self) -> bool:
        """Whether the tokens so far form a whole output of the grammar (it may still go on)."""
        return bool(self._matcher.is_accepting())

    @property
    def is_terminated(self) -> bool:
        """Whether a stop token was consumed: the output ended (before that, a complete grammar that cannot go on
        allows only the stop tokens)."""
        return self._ended

    @property
    def special(self) -> SpecialTokens:
        """The vocabulary's special tokens and the stop tokens a mask allows only where the matcher accepts them."""
        return self._compiled.special

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working (a limit of llguidance's exceeded, or no token can go on), or None."""
        if self._matcher.is_error():
            return str(self._matcher.get_error()) or "grammar error"
        if self._stuck:
            return (
                f"no token of the model's vocabulary can continue the output after {len(self._tokens)} tokens (the "
                "grammar needs text the tokenizer cannot spell)"
            )
        return None

    def set_stuck(self) -> None:
        """Record that no token may come next (its mask is empty): :attr:`error` says so until a rollback."""
        self._stuck = True

    def accept(self, token: int) -> bool:
        """Consume one token; False (and no change) when the grammar does not allow it here."""
        token = int(token)
        if self._ended or self._matcher.is_error():
            return False
        if token in self._compiled.stop_token_ids:  # the end: allowed once the grammar is complete
            if not self._matcher.is_accepting():
                return False
            self._ended = True
        elif not self._matcher.validate_tokens([token]) or not self._matcher.consume_token(token):
            return False
        self._tokens.append(token)
        return True

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the consumed tokens equal ``tokens`` (a sample's generated tokens): roll back what differs, accept
        what is new. False when a token of ``tokens`` is not allowed (the state keeps the tokens before it)."""
        mine = self._tokens
        if len(tokens) == len(mine) + 1 and (not mine or tokens[len(mine) - 1] == mine[-1]):
            return self.accept(tokens[-1])  # the common case: one new token
        common = 0
        for a, b in zip(mine, tokens):
            if a != b:
                break
            common += 1
        if common < len(mine):
            self._rollback(len(mine) - common)
        return all(self.accept(token) for token in tokens[common:])

    def _rollback(self, count: int) -> None:
        self._stuck = False
        if self._ended:  # the stop token was never given to the matcher
            self._ended = False
            self._tokens.pop()
            count -= 1
        if count == 0 or (self._matcher.rollback(count) and not self._matcher.is_error()):
            del self._tokens[len(self._tokens) - count :]
            return
        kept = self._tokens[: len(self._tokens) - count]  # past what the matcher can undo: rebuild from the start
        self._matcher = self._compiled.matcher.deep_copy()
        self._tokens = []
        for token in kept:
            self.accept(token)

    def fork(self) -> GrammarState:
        """An independent copy at the same position (a parallel sample's own state)."""
        return GrammarState(self._compiled, matcher=self._matcher.deep_copy(), tokens=self._tokens)

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 bitmask ``(rows, ceil(vocab / 32))``."""
        import_llguidance().torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def matcher(self) -> Any:
        """The llguidance ``LLMatcher`` (for batched fills)."""
        return self._matcher
