"""The Engine's side of structured outputs: each constrained request's grammar, and the requests waiting for theirs.

Who owns what: :class:`EngineGrammars` (one per Engine) owns the compiler (built on the first structured request;
its worker compiles off the step loop), the step's :class:`~.masks.GrammarMasks` and the requests whose grammar is
still compiling; each :class:`RequestGrammar` (one per request, on the Engine's request) owns its samples'
:class:`~.matcher.GrammarState`. The Engine calls in at four points: admission (:meth:`EngineGrammars.request`:
bad specs raise here), submission (a request whose grammar is not built yet is held, not scheduled), packing
(:meth:`RequestGrammar.row_state`: the state a row's mask comes from, in step with the row's tokens) and recording
(:meth:`RequestGrammar.accept`: each sample's new token).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

from pagedcore.errors import GrammarError, GrammarTimeoutError
from pagedcore.sequence import SequenceState

from .compiler import CompiledGrammar, GrammarCompiler
from .masks import GrammarMasks
from .matcher import GrammarState
from .spec import StructuredOutput

__all__ = ["EngineGrammars", "RequestGrammar"]


class RequestGrammar:
    """One request's grammar: what it compiles from, the compilation, and each sample's state once it is built.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> grammars = EngineGrammars(builtin_tokenizer(), vocab_size=99, stop_token_ids=[2])
        >>> grammar = grammars.request(StructuredOutput.choice(["yes", "no"]), num_samples=2)
        >>> _ = grammar.wait(30); grammar.start()
        >>> grammar.accept(0, 82), grammar.accept(0, 2)   # 'n', then eos before 'no' ends
        (True, False)
        >>> grammars.close()
    """

    def __init__(
        self,
        spec: StructuredOutput,
        future: concurrent.futures.Future[CompiledGrammar],
        num_samples: int,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.spec = spec
        self.future = future
        self.stop_token_ids = tuple(stop_token_ids)
        self.submitted = time.monotonic()
        self.states: list[GrammarState | None] = [None] * num_samples

    @property
    def is_ready(self) -> bool:
        """Whether the compilation ended (built or failed)."""
        return self.future.done()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the compilation; whether it ended."""
        try:
            self.future.exception(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def start(self) -> None:
        """Sample 0's state at the start (the compilation has ended well; the others fork from it)."""
        self.states[0] = GrammarState(self.future.result())

    def row_state(self, seq: SequenceState, num_samples: int) -> GrammarState:
        """The state the mask of ``seq``'s next token comes from, made to match ``seq``'s tokens (after a
        preemption or a dropped token they are what counts). At the step that forks the request (``num_samples``
        samples drawn from one row) every other sample gets its own copy of the state."""
        index = seq.sample_index
        state = self.states[index]
        if state is None:
            raise GrammarError(f"sample {index} has no grammar state (the request was not started)")
        if state.num_tokens != seq.num_output_tokens or (state.num_tokens and state.last_token != seq.token_ids[-1]):
            state.sync(seq.output_token_ids)
        if num_samples > 1:
            for k in range(1, num_samples):
                self.states[k] = state.fork()
        return state

    def accept(self, index: int, token: int) -> bool:
        """Sample ``index`` drew ``token``; False when its grammar does not allow it."""
        state = self.states[index]
        return state is not None and state.accept(token)

    def error(self, index: int) -> str | None:
        """Why sample ``index``'s grammar stopped working (a limit of llguidance's exceeded), or None."""
        state = self.states[index]
        return None if state is None else state.error


class EngineGrammars:
    """Structured outputs for one Engine: the compiler, the masks, and the requests waiting for their grammar.

    Args:
        tokenizer: the Engine's tokenizer.
        vocab_size: the model's logits width.
        stop_token_ids: the tokens that end a constrained output (the model's eos, else the tokenizer's).
        compile_timeout: seconds a request may wait for its grammar before it fails.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> grammars = EngineGrammars(builtin_tokenizer(), vocab_size=99, stop_token_ids=[2])
        >>> grammar = grammars.request(StructuredOutput.regex("[0-9]+"), num_samples=1)
        >>> grammars.hold(grammar, "payload"); _ = grammar.wait(30)
        >>> grammars.take_ready()
        [('payload', None)]
        >>> grammars.close()
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None,
        stop_token_ids: Sequence[int],
        compile_timeout: float = 30.0,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.compile_timeout = compile_timeout
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # a server's worker and the step loop may both ask first
        self.masks = GrammarMasks()
        self._held: list[tuple[RequestGrammar, Any]] = []

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (built on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self.stop_token_ids,
                    compile_timeout=self.compile_timeout,
                )
            return self._compiler

    def prepare(self, spec: StructuredOutput) -> StructuredOutput:
        """Parse and compile ``spec`` now, waiting in the calling thread (a server's worker) at most
        ``compile_timeout`` seconds; returns the spec carrying its grammar, whose :meth:`request` then neither parses
        nor waits. Raises :class:`~pagedcore.errors.GrammarError` (or its timeout) for a spec that cannot be served.

        Example:
            >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
            >>> grammars = EngineGrammars(builtin_tokenizer(), vocab_size=99, stop_token_ids=[2])
            >>> prepared = grammars.prepare(StructuredOutput.choice(["yes", "no"]))
            >>> grammars.request(prepared, num_samples=1).is_ready
            True
            >>> grammars.close()
        """
        prepared = self.compiler.prepare(spec)
        self.compiler.compile(prepared)
        return prepared

    def request(self, spec: StructuredOutput, num_samples: int) -> RequestGrammar:
        """Start compiling ``spec`` for a request of ``num_samples`` samples; raises
        :class:`~pagedcore.errors.GrammarError` now for a spec that is invalid, or whose compilation already
        failed."""
        future = self.compiler.submit(spec)
        if future.done() and future.exception() is not None:
            raise GrammarError(str(future.exception()))
        return RequestGrammar(spec, future, num_samples, self.stop_token_ids)

    def hold(self, grammar: RequestGrammar, payload: Any) -> None:
        """Keep ``payload`` (the Engine's request) until its grammar is built: :meth:`take_ready` gives it back."""
        self._held.append((grammar, payload))

    @property
    def num_held(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._held)

    def take_ready(self) -> list[tuple[Any, str | None]]:
        """The held payloads whose grammar is built (None) or failed or ran out of time (the error's message).
        A built grammar's first state is started."""
        ready, kept = [], []
        now = time.monotonic()
        for grammar, payload in self._held:
            if grammar.is_ready:
                error = grammar.future.exception()
                if error is None:
                    grammar.start()
                ready.append((payload, None if error is None else str(error)))
            elif now - grammar.submitted > self.compile_timeout:
                timeout = GrammarTimeoutError(
                    f"{grammar.spec.describe()} did not compile within {self.compile_timeout:g} s (compile_timeout)"
                )
                ready.append((payload, str(timeout)))
            else:
                kept.append((grammar, payload))
        self._held = kept
        return ready

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for any held grammar to be built (when nothing else can run)."""
        futures = [grammar.future for grammar, _ in self._held]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the compiler's workers."""
        if self._compiler is not None:
            self._compiler.close()
