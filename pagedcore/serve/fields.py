"""Every request field this server knows, and what it does with each: the one list behind the strict parsing of
:mod:`pagedcore.serve.protocol`, docs/serving.md's field table and ``tests/test_serve_fields.py`` (which checks it
against vLLM's request models and the official ``openai`` client's parameters).

A field is either

- ``implemented``: parsed by the request models and honoured (a test shows its effect);
- ``refused``: accepted only at the values listed in ``no_op`` (absent, null, or a value that asks for what happens
  anyway), else a 400 naming the field;
- ``no effect``: identifiers that by their definition never change an answer (``user``, ``safety_identifier``: end-user
  ids for abuse monitoring, as OpenAI documents them).

A field that neither OpenAI nor vLLM defines is refused with a 400 naming it (vLLM only logs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CHAT", "COMPLETIONS", "FIELDS", "FieldRule", "Status", "rules_for"]

Status = Literal["implemented", "refused", "no effect"]
Endpoint = Literal["completions", "chat"]
COMPLETIONS: Endpoint = "completions"
CHAT: Endpoint = "chat"
_BOTH: tuple[Endpoint, ...] = (COMPLETIONS, CHAT)


@dataclass(frozen=True)
class FieldRule:
    """What the server does with one request field.

    Args:
        status: see the module docstring.
        note: what it does here (implemented) or why it is refused and what to use instead.
        no_op: the values a refused field is accepted at; None is always one.
        endpoints: the endpoints whose requests have this field.

    Example:
        >>> FIELDS["use_beam_search"].accepts(False), FIELDS["use_beam_search"].accepts(True)
        (True, False)
    """

    status: Status
    note: str
    no_op: tuple[Any, ...] = ()
    endpoints: tuple[Endpoint, ...] = _BOTH

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is accepted without implementing the field (implemented fields accept any value)."""
        if self.status in ("implemented", "no effect"):
            return True
        return value is None or any(_same(value, allowed) for allowed in self.no_op)


def _impl(note: str, endpoints: tuple[Endpoint, ...] = _BOTH) -> FieldRule:
    return FieldRule("implemented", note, endpoints=endpoints)


def _refused(note: str, *no_op: Any, endpoints: tuple[Endpoint, ...] = _BOTH) -> FieldRule:
    return FieldRule("refused", note, tuple(no_op), endpoints)


_C = (COMPLETIONS,)
_H = (CHAT,)

FIELDS: dict[str, FieldRule] = {
    # ------------------------------------------------------------------ what to answer
    "model": _impl("the served model's name (or one of the --served-model-name aliases), or a loaded LoRA adapter's"),
    "prompt": _impl("a string, token ids, or a batch of either", _C),
    "messages": _impl("text messages through the chat template; a key a message does not define is refused", _H),
    "max_tokens": _impl("new tokens at most (completions: 16 by default; chat: what the pool and context hold)"),
    "max_completion_tokens": _impl("chat's newer name of max_tokens (wins over it)", _H),
    "n": _impl("parallel samples sharing the prompt's blocks"),
    "stream": _impl("server-sent events in OpenAI's chunk format"),
    "stream_options": _impl(
        "include_usage, continuous_usage_stats (vLLM); include_obfuscation must be false; only with stream: true"
    ),
    "echo": _impl(
        "completions: the prompt before the completion (with logprobs: the prompt's too); chat: the last "
        "assistant message's text before the answer"
    ),
    "suffix": _refused("text after the completion (insertion) is not supported", ""),
    "best_of": _refused("best_of > n (ranking samples) is not supported", 1, endpoints=_C),
    "use_beam_search": _refused("beam search is not supported (the Engine samples or decodes greedily)", False),
    "length_penalty": _refused("only beam search uses it", 1, 1.0),
    "user": FieldRule("no effect", "an end-user id (OpenAI: for abuse monitoring); it never changes the answer"),
    "safety_identifier": FieldRule("no effect", "OpenAI's newer name of user; it never changes the answer"),
    "request_id": _impl("the response id (cmpl-/chatcmpl- + this id)"),
    "session_id": _refused("session routing is not supported"),
    # ------------------------------------------------------------------ sampling
    "temperature": _impl("0 (or below 1e-5) is greedy; default 1"),
    "top_p": _impl("nucleus sampling, in (0, 1]"),
    "top_k": _impl("the k most likely tokens; 0 or -1 keep all (vLLM's -1)"),
    "seed": _impl("seeds the request's draws (vLLM's int64 range)"),
    "min_p": _impl("drop tokens less likely than min_p times the most likely one (sampling only)"),
    "presence_penalty": _impl("subtracted from the logit of every token generated so far, in [-2, 2]"),
    "frequency_penalty": _impl("subtracted once per time a token was generated so far, in [-2, 2]"),
    "repetition_penalty": _impl("divides positive (multiplies negative) logits of prompt and output tokens; > 0"),
    "logit_bias": _impl("token id (as a string key) -> bias in [-100, 100] added to its logit"),
    "allowed_token_ids": _impl("only these token ids may be drawn"),
    "bad_words": _refused("bad_words is not supported", []),
    "logits_processors": _refused("custom logits processors are not loaded by this server", []),
    "watermarking": _refused("watermarking is not supported", False),
    "repetition_detection": _refused("repetition detection is not supported"),
    "max_repetition_pattern_size": _refused("stopping on repeated patterns is not supported", 0),
    "min_repetition_pattern_size": _refused("stopping on repeated patterns is not supported", 0),
    "repetition_min_count": _refused("stopping on repeated patterns is not supported", 0),
    "thinking_token_budget": _refused("reasoning budgets are not supported (use max_tokens)", -1),
    # ------------------------------------------------------------------ stopping
    "stop": _impl("up to 16 stop strings; the text ends before the first one"),
    "stop_token_ids": _impl("stop after any of these token ids (besides eos)"),
    "include_stop_str_in_output": _impl("keep the stop string that ended the text"),
    "ignore_eos": _impl("never stop at eos (benchmarks); stop strings and stop_token_ids still apply"),
    "min_tokens": _impl("nothing stops a sample before this many tokens (at most max_tokens)"),
    # ------------------------------------------------------------------ log-probabilities
    "logprobs": _impl(
        "completions: an int k, each token's log-probability and the k most likely (with echo: the prompt's "
        "too); chat: true for choices[].logprobs.content[]; before any logits processing (vLLM's raw_logprobs)"
    ),
    "top_logprobs": _impl("chat: the most likely alternatives per token, 0..20 (needs logprobs)", _H),
    "prompt_logprobs": _impl("each prompt token's log-probability and the k most likely (vLLM's prompt_logprobs)"),
    "logprob_token_ids": _refused("log-probabilities of chosen token ids are not supported"),
    "return_tokens_as_token_ids": _impl("tokens in logprobs as 'token_id:ID' (text that is no whole character)"),
    # ------------------------------------------------------------------ prompt handling
    "add_special_tokens": _impl(
        "completions: the tokenizer's special tokens (a bos) around a text prompt (default "
        "true); chat: added on top of the template's (default false)"
    ),
    "truncate_prompt_tokens": _impl("keep only this many prompt tokens (-1: the context)"),
    "truncation_side": _impl("which end truncate_prompt_tokens keeps: left (default) keeps the last tokens"),
    "skip_special_tokens": _refused("special tokens are always left out of the text", True),
    "spaces_between_special_tokens": _refused("only slow tokenizers use it", True),
    "prompt_embeds": _refused("prompt embeddings are not accepted over HTTP", endpoints=_C),
    "cache_salt": _impl("narrows prefix-cache sharing to requests with the same salt (within the tenant)"),
    "priority": _refused("priority scheduling is not available in this build", 0),
    # ------------------------------------------------------------------ chat templates
    "add_generation_prompt": _impl("end the prompt where the assistant's answer starts (default true)", _H),
    "continue_final_message": _impl("leave the last message open: the model continues it", _H),
    "documents": _impl("documents for the chat template (RAG templates)", _H),
    "chat_template": _impl("a request's own Jinja chat template (needs --trust-request-chat-template)", _H),
    "chat_template_kwargs": _impl("extra variables for the chat template", _H),
    "include_reasoning": _impl(
        "with --reasoning-parser: false leaves reasoning_content out (the content never holds the reasoning)", _H
    ),
    "reasoning_effort": _refused("reasoning models' effort is not supported", endpoints=_H),
    "media_io_kwargs": _refused("no multimodal input", {}, endpoints=_H),
    "mm_processor_kwargs": _refused("no multimodal input", {}, endpoints=_H),
    "modalities": _refused("text is the only output modality", ["text"], endpoints=_H),
    "audio": _refused("no audio output", endpoints=_H),
    "prediction": _refused("predicted outputs are not supported", endpoints=_H),
    "verbosity": _refused("verbosity is not supported", endpoints=_H),
    "web_search_options": _refused("web search is not supported", endpoints=_H),
    "moderation": _refused("moderation is not supported", endpoints=_H),
    # ------------------------------------------------------------------ answer extras
    "return_token_ids": _impl("the prompt's and each choice's token ids in the answer"),
    "return_prompt_text": _refused("the rendered prompt is not returned", False, endpoints=_H),
    "return_token_offsets": _refused("only vLLM's render endpoints use it", False),
    "return_mm_kwargs": _refused("only vLLM's render endpoints use it", True),
    "routed_experts_prompt_start": _refused("routed-expert data is not returned", 0),
    "stream_interval": _refused("every token is streamed as it comes", 1),
    # ------------------------------------------------------------------ OpenAI's platform features
    "store": _refused("completions are never stored", False, endpoints=_H),
    "metadata": _refused("completions are never stored (metadata goes with store)", {}, endpoints=_H),
    "service_tier": _refused("one service tier", "auto", "default", endpoints=_H),
    "prompt_cache_key": _refused("use cache_salt (isolation) or tenants' API keys", endpoints=_H),
    "prompt_cache_retention": _refused("the prefix cache keeps blocks while the pool has room", endpoints=_H),
    "prompt_cache_options": _refused("the prefix cache keeps blocks while the pool has room", endpoints=_H),
    # ------------------------------------------------------------------ disaggregated serving, extensions
    "kv_transfer_params": _refused("no disaggregated serving"),
    "ec_transfer_params": _refused("no disaggregated serving"),
    "vllm_xargs": _refused("no custom extensions", {}),
    # ------------------------------------------------------------------ structured outputs and tools
    "response_format": _impl("OpenAI's: text, json_object, or json_schema (a grammar constrains every token)"),
    "structured_outputs": _impl("vLLM's: one of json, regex, choice, grammar (Lark or GBNF), json_object"),
    "guided_json": _impl("vLLM's older field: a JSON schema the answer follows"),
    "guided_regex": _impl("vLLM's older field: a regex the answer matches"),
    "guided_choice": _impl("vLLM's older field: the answer is one of these strings"),
    "guided_grammar": _impl("vLLM's older field: a Lark or GBNF grammar the answer follows"),
    "guided_decoding_backend": _refused("one grammar engine (llguidance) serves every structured output"),
    "guided_whitespace_pattern": _refused("JSON answers have at most 8 whitespace characters between tokens"),
    "structural_tag": _refused("structural tags are not supported (use tools or structured_outputs)", endpoints=_H),
    "tools": _impl("function tools: rendered by the chat template, answered as tool_calls", _H),
    "tool_choice": _impl(
        "none, auto (calls parsed in the --tool-call-parser format; a function's `strict: true` is not enforced "
        "there), required or a named function (both enforced by a grammar, `strict` or not)",
        _H,
    ),
    "parallel_tool_calls": _impl("false: tool_choice=required makes exactly one call", _H),
    "functions": _refused("OpenAI's older field: use tools", [], endpoints=_H),
    "function_call": _refused("OpenAI's older field: use tool_choice", "none", endpoints=_H),
}
"""Every known request field, by name (see the module docstring)."""


def rules_for(endpoint: Endpoint) -> dict[str, FieldRule]:
    """The fields of one endpoint's requests.

    Example:
        >>> "messages" in rules_for(CHAT), "messages" in rules_for(COMPLETIONS)
        (True, False)
    """
    return {name: rule for name, rule in FIELDS.items() if endpoint in rule.endpoints}


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``true`` is not 1, ``0`` is not ``false``)."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):
        return isinstance(value, (int, float)) and value == allowed
    return bool(value == allowed)
