"""What the Engine refuses, checked before anything is queued: a request becomes a :class:`~.request.RequestState`
or raises a typed error and changes nothing.

:class:`Admission` owns the request-side rules the Engine applies (the core owns the rest: token ids and integers in
:mod:`pagedcore.validation`, "could it ever fit the pool" in :meth:`Scheduler.check_admissible
<pagedcore.scheduler.Scheduler.check_admissible>`, "does it fit the context" in :class:`~.context.ContextWindow`):
the prompt encoded (a text through the tokenizer) and checked against the vocabulary, the parameters resolved (a
:class:`~.sampling.SamplingParams`, a dict of its fields, or a front end's own words through
:class:`GenerateArguments`), token ids of the parameters in the vocabulary, log-probabilities within
``max_logprobs``, stop strings (that need the tokenizer) and a structured output's grammar started. It also holds the
Engine's structured-output side (:class:`~.structured.requests.EngineGrammars`, built with the first constrained
request).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import torch

from pagedcore.errors import InvalidRequestError, PagedCoreError
from pagedcore.scheduler import Scheduler
from pagedcore.sequence import FinishReason, SequenceState
from pagedcore.validation import as_integer
from pagedcore.validation import token_ids as valid_token_ids

from .context import ContextWindow
from .detokenizer import IncrementalDetokenizer
from .inputs import token_id_list
from .outputs import RequestMetrics, RequestOutput, SampleOutput
from .request import Request, RequestState
from .runner import ModelInfo
from .sampling import SamplingParams
from .stopping import SampleText, StopStrings, stop_strings
from .structured.requests import EngineGrammars, RequestGrammar
from .structured.spec import StructuredOutput

__all__ = ["Admission", "GenerateArguments", "Params", "PromptParams", "Spec", "structured_kwarg"]

Params = SamplingParams | dict[str, Any]


class PromptParams(Protocol):
    """Parameters whose values depend on the prompt's length (transformers' ``max_length`` counts the prompt):
    what :meth:`GenerateArguments.parse` returns, resolved per prompt.

    Example:
        >>> class ToTheEnd:                       # every prompt runs to the end of the context
        ...     n = 1
        ...     def for_prompt(self, prompt_length, max_positions):
        ...         return SamplingParams(max_new_tokens=max_positions - prompt_length)
        >>> ToTheEnd().for_prompt(10, 32).max_new_tokens
        22
    """

    @property
    def n(self) -> int:
        """Parallel samples (what a refused request's output holds)."""
        ...

    def for_prompt(self, prompt_length: int, max_positions: int | None) -> SamplingParams:
        """The parameters of one prompt of ``prompt_length`` tokens in a context of ``max_positions``."""
        ...


class GenerateArguments(Protocol):
    """A front end's own words for the parameters (``model.generate``'s keyword arguments for the transformers
    adapter: :class:`~pagedcore.adapters.transformers.generate_kwargs.GenerateKwargs`).

    Example:
        >>> class Tokens:                         # generate(prompts, tokens=8)
        ...     def parse(self, kwargs):
        ...         return SamplingParams(max_new_tokens=kwargs.pop("tokens", 16))
        >>> Tokens().parse({"tokens": 8}).max_new_tokens
        8
    """

    def parse(self, kwargs: dict[str, Any]) -> PromptParams:
        """The parameters ``kwargs`` give; raises :class:`~pagedcore.errors.InvalidRequestError` for what is wrong
        whatever the prompt."""
        ...


Spec = Params | PromptParams


class Admission:
    """Validates requests for one Engine (see the module docstring).

    Args:
        info: the model's vocabulary, context, stop tokens and device (:class:`~.runner.ModelInfo`).
        tokenizer: encodes text prompts and decodes outputs (None: token ids only, no text).
        scheduler: asked whether a request could ever fit.
        context: the context served.
        max_logprobs: the most log-probabilities a request may ask for (-1: no limit).
        compile_timeout: seconds a grammar may take to compile.
        arguments: the front end's own parameter words (None: only :class:`~.sampling.SamplingParams` or a dict).

    Example:
        >>> from pagedcore import KVPool
        >>> info = ModelInfo(vocab_size=10, max_positions=32, eos_token_ids=(2,), device=torch.device("cpu"))
        >>> admission = Admission(info, None, Scheduler(KVPool(num_blocks=8, block_size=4)), ContextWindow(32))
        >>> state = admission.validate(Request([5, 6, 7], SamplingParams(max_new_tokens=3), request_id="r"))
        >>> state.sequence.stop_token_ids
        frozenset({2})
        >>> admission.validate(Request([5, 60]))
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids [60] are outside the model's vocabulary [0, 10)
    """

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Any,
        scheduler: Scheduler,
        context: ContextWindow,
        *,
        max_logprobs: int = 20,
        compile_timeout: float = 30.0,
        arguments: GenerateArguments | None = None,
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.context = context
        self.max_logprobs = max_logprobs
        self.arguments = arguments
        self._compile_timeout = compile_timeout
        self._added_vocab = _added_vocab(tokenizer)  # where a stop string that is a special token finds its id
        self._grammars: EngineGrammars | None = None  # built with the first constrained request
        self._grammars_lock = threading.Lock()
        self._ids = itertools.count()

    @property
    def grammars(self) -> EngineGrammars | None:
        """The structured-output side, once a constrained request came (None before)."""
        return self._grammars

    # ------------------------------------------------------------------ parameters
    def specs(self, params: Any, generate_kwargs: dict[str, Any], count: int) -> list[Spec]:
        """One parameter spec per prompt; raises for what is wrong whatever the prompt."""
        if generate_kwargs and params is not None:
            raise InvalidRequestError(
                "pass either params= (SamplingParams, or a dict of its fields) or model.generate's keyword "
                f"arguments, not both: got params= and {', '.join(sorted(generate_kwargs))}"
            )
        if params is None:  # the front end's words (and its defaults), else SamplingParams' defaults
            if self.arguments is not None:
                return [self.arguments.parse(dict(generate_kwargs))] * count
            if generate_kwargs:
                raise InvalidRequestError(
                    f"this Engine takes SamplingParams (or a dict of its fields), not keyword arguments: got "
                    f"{', '.join(sorted(generate_kwargs))}"
                )
            return [SamplingParams()] * count
        if isinstance(params, (SamplingParams, dict)):
            return [params] * count
        if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
            raise InvalidRequestError(f"params must be SamplingParams, a dict or a list of them, got {params!r}")
        items = list(params)
        if len(items) != count:
            raise InvalidRequestError(f"{len(items)} SamplingParams for {count} prompts")
        return items

    def resolve(self, spec: Spec, prompt_length: int) -> SamplingParams:
        """A spec as the :class:`~.sampling.SamplingParams` of a prompt of ``prompt_length`` tokens."""
        if isinstance(spec, SamplingParams):
            return spec
        if isinstance(spec, Mapping):
            return SamplingParams.from_fields(spec)  # this class's names or vLLM's (max_tokens, min_tokens, stop)
        if hasattr(spec, "for_prompt"):
            return spec.for_prompt(prompt_length, self.context.limit)
        raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(spec).__name__}")

    # ------------------------------------------------------------------ one request
    def validate(
        self, request: Request, spec: Spec | None = None, *, fresh_id: Callable[[], str] | None = None
    ) -> RequestState:
        """Everything about one request that can be refused, checked before anything is queued (``spec``: its
        parameters when they are not ``request.params`` yet, e.g. ``generate``'s keyword arguments)."""
        token_ids = self.encode(request.prompt)
        params = self.resolve(request.params if spec is None else spec, len(token_ids))
        self.context.check(len(token_ids), params.max_new_tokens)
        rid = request.request_id
        if rid is not None and (not isinstance(rid, str) or not rid or "#" in rid):
            raise InvalidRequestError(
                f"request ids must be non-empty strings without '#', got {rid!r}", param="request_id"
            )
        stop_ids = self._stop_ids(params)
        self._check_model_fields(params)
        stops = stop_strings(params.stop_strings, params.include_stop_str_in_output, self.tokenizer, self._added_vocab)
        grammar = None
        if params.structured is not None and params.max_new_tokens:
            grammar = self._grammar(StructuredOutput.from_value(params.structured), params.n)
            stop_ids = [*stop_ids, *grammar.stop_token_ids]  # a finished grammar's end stops the sequence
        if rid is None:
            rid = fresh_id() if fresh_id is not None else f"req-{next(self._ids)}"
        seq = self._sequence(
            replace(request, request_id=rid), token_ids, params, frozenset(stop_ids) | stops.by_id.keys()
        )
        samples = [SampleOutput(k, logprobs=None if params.logprobs is None else []) for k in range(params.n)]
        output = RequestOutput(rid, token_ids, samples, RequestMetrics(time.perf_counter()))
        output.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        texts = [self._sample_text(stops, params.min_new_tokens) for _ in range(params.n)]
        generators = params.generators(self.info.device)  # draws happen where the logits are
        return RequestState(rid, params, seq, output, texts, generators, grammar=grammar)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        """The sequence's stop tokens: none with ``ignore_eos``, else ``stop_token_ids`` or the model's eos."""
        stop = () if params.ignore_eos else params.stop_token_ids
        if stop is None:
            stop = self.info.eos_token_ids
        vocab = self.info.vocab_size
        return valid_token_ids(stop, vocab_size=vocab, name="stop_token_ids", allow_empty=True, param="stop_token_ids")

    def _sequence(
        self, request: Request, token_ids: list[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> SequenceState | None:
        """What the scheduler computes (None for ``max_new_tokens=0`` without ``prompt_logprobs``: nothing), checked
        against the scheduler's limits."""
        scoring = params.prompt_logprobs is not None
        if not params.max_new_tokens and not scoring:
            return None
        assert request.request_id is not None
        seq = SequenceState(
            request.request_id,
            token_ids,
            params.max_new_tokens or 1,  # max_new_tokens=0 with prompt_logprobs: the prompt runs, one draw dropped
            stop_ids,  # stop strings that are special tokens stop by id
            request.namespace,
            params.n,
            params.min_new_tokens,
            request.priority,
            read_prefix_cache=not scoring,  # every prompt position's logits are needed
        )
        self.scheduler.check_admissible(seq)  # also checks the namespace
        return seq

    def encode(self, prompt: Any) -> list[int]:
        """A prompt's token ids (a text through the tokenizer), in the vocabulary."""
        vocab = self.info.vocab_size
        if not isinstance(prompt, str):
            return token_id_list(prompt, vocab_size=vocab)
        if self.tokenizer is None:
            raise InvalidRequestError("a string prompt needs a tokenizer: Engine(model, tokenizer=...)", param="prompt")
        try:
            encoded = self.tokenizer(prompt)["input_ids"]
        except Exception as exc:  # the tokenizer is user code: its failure is this request's error
            raise InvalidRequestError(
                f"the tokenizer failed on the prompt {prompt[:40]!r}: {type(exc).__name__}: {exc}", param="prompt"
            ) from exc
        return token_id_list(encoded, vocab_size=vocab)

    def _check_model_fields(self, params: SamplingParams) -> None:
        """What :class:`~.sampling.SamplingParams` cannot check alone: token ids in this model's vocabulary,
        ``logprobs`` and ``prompt_logprobs`` within ``max_logprobs``."""
        vocab = self.info.vocab_size
        if params.logit_bias:
            ids = [t for t, _ in params.bias_items]
            valid_token_ids(ids, vocab_size=vocab, name="logit_bias token ids", param="logit_bias")
        if params.allowed_token_ids:
            allowed = params.allowed_token_ids
            valid_token_ids(allowed, vocab_size=vocab, name="allowed_token_ids", param="allowed_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is None or self.max_logprobs == -1:
                continue
            if (k == -1 and (vocab is None or vocab > self.max_logprobs)) or k > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name}={k} is more than this Engine allows: at most max_logprobs={self.max_logprobs} "
                    "(Engine(max_logprobs=...); -1 asks for the whole vocabulary)",
                    param=name,
                )

    def _sample_text(self, stops: StopStrings, min_new_tokens: int) -> SampleText:
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        return SampleText(detokenizer, stops, min_new_tokens)

    def _grammar(self, spec: StructuredOutput, num_samples: int) -> RequestGrammar:
        """Start compiling a request's grammar (bad specs raise here, at admission, unless it carries its parsed
        grammar: then nothing parses here)."""
        return self.grammar_engine(spec).request(spec, num_samples)

    def grammar_engine(self, spec: StructuredOutput) -> EngineGrammars:
        """The Engine's grammars (compiler, masks, held requests), built with the first structured request."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"structured outputs ({spec.kind}) need the tokenizer: Engine(model, tokenizer=...)", param="structured"
            )
        with self._grammars_lock:
            if self._grammars is None:
                fallback = getattr(self.tokenizer, "eos_token_id", None)  # a grammar's end needs a token
                eos = list(self.info.eos_token_ids) or ([] if fallback is None else [int(fallback)])
                self._grammars = EngineGrammars(
                    self.tokenizer,
                    vocab_size=self.info.vocab_size,
                    stop_token_ids=eos,
                    compile_timeout=self._compile_timeout,
                )
            return self._grammars

    # ------------------------------------------------------------------ refused requests
    def rejected(self, prompt: Any, spec: Spec, exc: PagedCoreError, request_id: str) -> RequestOutput:
        """The output of a request ``generate`` refused: every sample finished with "error", the error in it (one
        sample where ``n`` is not one this engine could run)."""
        n = 1
        if isinstance(spec, SamplingParams):
            n = spec.n
        elif isinstance(spec, Mapping):
            value = spec.get("n")
            n = value if isinstance(value, int) and value >= 1 else 1
        elif hasattr(spec, "n"):
            n = spec.n
        if not isinstance(n, int) or not 1 <= n <= self.scheduler.config.max_num_seqs:
            n = 1  # refused for its n, say: one sample carries the error, not n of them (n=10**9 would not fit)
        samples = [SampleOutput(k, finish_reason=FinishReason.ERROR.value) for k in range(n)]
        tokens = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt if isinstance(prompt, list) else []
        now = time.perf_counter()
        prompt_ids = [t for t in map(as_integer, tokens) if t is not None]
        error = f"{type(exc).__name__}: {exc}"
        return RequestOutput(request_id, prompt_ids, samples, RequestMetrics(now, None, now), error=error)


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (special ones included) by text; empty for tokenizers without them."""
    try:
        return dict(tokenizer.get_added_vocab()) if tokenizer is not None else {}
    except Exception:  # not a transformers tokenizer: stop strings match in the text only
        return {}


def structured_kwarg(kwargs: dict[str, Any]) -> StructuredOutput | None:
    """Take ``structured=`` (a :class:`~.structured.spec.StructuredOutput` or a dict of one) or OpenAI's
    ``response_format=`` out of ``generate``-style keyword arguments, as a spec (checked here: a bad one raises
    whatever the prompt).

    Example:
        >>> kwargs = {"response_format": {"type": "json_object"}, "max_new_tokens": 4}
        >>> structured_kwarg(kwargs).kind, kwargs
        ('json_object', {'max_new_tokens': 4})
    """
    structured, response_format = kwargs.pop("structured", None), kwargs.pop("response_format", None)
    if structured is not None and response_format is not None:
        raise InvalidRequestError("pass structured= or response_format=, not both", param="response_format")
    value = structured if structured is not None else response_format
    return None if value is None else SamplingParams(structured=value).structured  # type: ignore[return-value]
