"""Benchmark: a hybrid model (recurrent-state layers beside attention) in the Engine: multi-session chat.

The model is built like Qwen3.5 (:func:`hybrid_config`: three Gated DeltaNet linear-attention layers to one
full-attention layer, the run's model size; random weights). Several sessions share the vLLM #40696 case's system
prompt (480 tokens); each turn's prompt is the session's previous prompt, its reply and a new user message, and the
sessions' turns are served round-robin: turn 1 of every session together, then turn 2... The
:class:`~pagedcore.adapters.transformers.Engine` (one for the whole chat: a later turn resumes the state snapshot filed
where the session's previous reply ended, the first turns the system prompt's snapshot) against ``generate`` on the
left-padded batch of each turn (which recomputes every conversation). Replies are compared reply by reply.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from transformers import AutoConfig, PreTrainedModel

from . import chat as chat_section
from .chat import KEPT_ENGINE, PADDED, PADDED_NOTE, ChatResult, ChatRun, ChatWorkload, chat_workload
from .common import BLOCK_SIZE, blocks_for, model_from_config
from .context import BenchContext
from .peers import ENGINE, EnginePeer, PaddedBatch, Peer
from .report import RATIO_HEADERS, Aim, Section, Table, aim_status, ratio
from .runner import Runner, Timed

__all__ = ["HybridChatResult", "HybridEnginePeer", "describe_hybrid", "hybrid_config", "run"]

TITLE = "11. Hybrid model (Qwen3.5-like): multi-session chat"
AIM_SPEEDUP = Aim(3.0, at_most=False, fmt="{:g}x")
AIM_PREFILL = Aim(1.10, fmt="{:.2f}")
SYSTEM = 480  # vLLM issue #40696's system prompt


def hybrid_config(shape: dict[str, int]) -> Any:
    """A Qwen3.5-text config of ``shape`` (:data:`~pagedcore.benchmarks.options.MODEL_SIZES`'s fields): layers linear
    attention, linear, linear, full, repeated (at least 4).

    Example:
        >>> from pagedcore.benchmarks.options import MODEL_SIZES
        >>> config = hybrid_config(MODEL_SIZES["small"])
        >>> config.num_hidden_layers, config.hidden_size, config.layer_types[:4]
        (8, 512, ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention'])
    """
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head = hidden // heads
    layers = max(4, shape["num_hidden_layers"] // 4 * 4)
    return AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=shape["vocab_size"],
        hidden_size=hidden,
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=head,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        max_position_embeddings=8192,
        pad_token_id=0,
    )


def describe_hybrid(model: PreTrainedModel) -> str:
    """One line: the layer pattern, sizes, parameters, dtype.

    Example:
        >>> from pagedcore.benchmarks.options import MODEL_SIZES
        >>> describe_hybrid(model_from_config(hybrid_config(MODEL_SIZES["tiny"])))  # doctest: +ELLIPSIS
        'Qwen3.5-like with random weights: 4 layers (3 Gated DeltaNet linear-attention : 1 full attention), hidden...'
    """
    c = model.config
    linear = sum(kind == "linear_attention" for kind in c.layer_types)
    params = sum(p.numel() for p in model.parameters())
    return (
        f"Qwen3.5-like with random weights: {c.num_hidden_layers} layers ({linear} Gated DeltaNet linear-attention : "
        f"{c.num_hidden_layers - linear} full attention), hidden {c.hidden_size}, {c.num_attention_heads} heads / "
        f"{c.num_key_value_heads} KV heads, linear attention {c.linear_num_key_heads} key / "
        f"{c.linear_num_value_heads} value heads of {c.linear_key_head_dim}, intermediate {c.intermediate_size}, "
        f"vocab {c.vocab_size}; {params / 1e6:.1f}M parameters, {str(model.dtype).removeprefix('torch.')}"
    )


@dataclass(frozen=True)
class HybridEnginePeer(EnginePeer):
    """:class:`~pagedcore.benchmarks.peers.EnginePeer` with ``state_slots`` for the model's recurrent states.

    Example:
        >>> HybridEnginePeer(num_blocks=16, state_slots=32).state_slots
        32
    """

    state_slots: int = 64

    def engine(self, model: PreTrainedModel) -> Any:
        """A new Engine of this configuration."""
        from pagedcore.adapters.transformers import Engine

        return Engine(model, num_blocks=self.num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=self.budget,
                      max_num_seqs=self.max_seqs, state_slots=self.state_slots)  # fmt: skip


@dataclass
class HybridChatResult(ChatResult):
    """The multi-session chat on the hybrid model: :class:`~pagedcore.benchmarks.chat.ChatResult`'s figures, with
    each peer's CPU time (``cpu[name]``: median seconds of the timed thread; torch runs there with one thread, so
    other processes' load does not count) and this benchmark's aims (prefill at most 1.10x the unique tokens).

    Example:
        >>> from pagedcore.benchmarks.report import Header
        >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]]], replies=[[2, 3]])
        >>> replies = [[[1, 2], [3, 4, 5]]]
        >>> runs = [ChatRun(PADDED, [3.0], replies, [5, 9]), ChatRun(ENGINE, [1.0], replies, [5, 3])]
        >>> head = Header(True, "Qwen3.5-like", "laptop")
        >>> result = HybridChatResult(head, chat, runs, 1, "", cpu={PADDED: 2.0, ENGINE: 0.5})
        >>> result.speedup(), result.cpu_speedup(), result.section().title
        (3.0, 4.0, '11. Hybrid model (Qwen3.5-like): multi-session chat')
    """

    cpu: dict[str, float] | None = None

    def cpu_speedup(self) -> float:
        """CPU seconds of the padded batch / CPU seconds of the Engine (medians)."""
        assert self.cpu is not None
        return self.cpu[PADDED] / self.cpu[ENGINE]

    def section(self) -> Section:
        """The chat report under this benchmark's title, with CPU times and its own ratios."""
        base = super().section()
        body = list(base.body)
        body[-1] = self._hybrid_ratios()
        return replace(base, title=TITLE, body=body)

    def _hybrid_ratios(self) -> Table:
        speedup, reuse, mism = self.speedup(), self.prefill_ratio(), self.mismatches()
        rows = [AIM_SPEEDUP.row("Engine speedup vs the padded batch (median wall)", ratio(speedup), speedup)]
        if self.cpu is not None:
            cpu = self.cpu_speedup()
            rows.append(AIM_SPEEDUP.row("Engine speedup vs the padded batch (median CPU time)", ratio(cpu), cpu))
        rows += [
            AIM_PREFILL.row("Engine prefill positions / unique prompt tokens", f"{reuse:.3f}", reuse),
            ["replies identical to the padded batch's", "yes" if not mism else f"no: {len(mism)} differ", "all",
             aim_status(not mism)],
        ]  # fmt: skip
        return Table(RATIO_HEADERS, rows)


def _timed_chat(model: PreTrainedModel, peer: Peer, chat: ChatWorkload) -> Timed:
    """:func:`~pagedcore.benchmarks.chat.serve_chat`, with the CPU seconds of this thread kept in ``first_token`` (the
    slot a chat run does not use)."""
    cpu = time.thread_time()
    out = chat_section.serve_chat(model, peer, chat)
    return Timed(out.seconds, out.output, first_token=time.thread_time() - cpu)


def run(ctx: BenchContext, *, repeats: int | None = None) -> HybridChatResult:
    """8 sessions x 4 turns, a 480-token system prompt, 32-96-token user messages, 16-48 new tokens per reply
    (quick: 4 x 3, 64, 8-24, 4-8), on the Qwen3.5-like model of the run's size: the Engine vs the padded batch per
    turn, median of ``repeats`` rounds (default 3; quick 1) after a warm-up.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> result.mismatches(), result.prefill_ratio() <= 1.10  # doctest: +SKIP
        ([], True)
    """
    import statistics

    quick, seed = ctx.quick, ctx.options.seed
    model = model_from_config(hybrid_config(ctx.options.model_shape), seed, ctx.dtype, ctx.device)
    repeats = repeats or (1 if quick else 3)
    rng = random.Random(seed + 11)
    vocab = model.config.vocab_size
    if quick:
        chat = chat_workload(rng, vocab, conversations=4, turns=3, system=64, user=(8, 24), reply=(4, 8))
    else:
        chat = chat_workload(rng, vocab, conversations=8, turns=4, system=SYSTEM, user=(32, 96), reply=(16, 48))
    warm = chat_workload(rng, vocab, conversations=2, turns=2, system=16, user=(4, 8), reply=(2, 2))
    final = [len(chat.prompt(c, chat.turns - 1, [[0] * n for n in chat.replies[c]])) + chat.replies[c][-1]
             for c in range(chat.conversations)]  # fmt: skip
    num_blocks = sum(blocks_for(n) for n in final) * 2 + 8
    slots = 128
    peers: dict[str, Peer] = {
        PADDED: PaddedBatch(name=PADDED),
        ENGINE: HybridEnginePeer(num_blocks=num_blocks, max_seqs=chat.conversations, state_slots=slots),
    }
    with contextlib.ExitStack() as stack, Runner(ctx, "hybrid chat: Engine vs padded batch", 2 * repeats + 2) as runner:
        chat_section.keep_and_warm(stack, runner, model, peers, chat, warm)
        trials = runner.rounds(list(peers), repeats, lambda name, r: _timed_chat(model, peers[name], chat))
    runs, cpu = [], dict[str, float]()
    for name in peers:
        first = trials.outputs(name)[0]
        note = PADDED_NOTE if name == PADDED else first.note
        runs.append(ChatRun(name, trials.seconds(name), first.replies, first.prefill_per_turn, first.padding, note))
        cpu[name] = statistics.median(t.first_token for t in trials.runs[name] if t.first_token is not None)
    return HybridChatResult(
        head=runner.header(describe_hybrid(model)),
        workload=chat,
        runs=runs,
        repeats=repeats,
        engine_config=(
            f"{KEPT_ENGINE}: block size {BLOCK_SIZE}, {num_blocks} blocks, "
            f"{slots} state slots, a snapshot every block of a prompt computed from its start (the default), "
            f"max_num_seqs {chat.conversations}, max_num_batched_tokens 512 (its default), prefix caching on; "
            f"median CPU seconds: padded batch {cpu[PADDED]:.2f} s, Engine {cpu[ENGINE]:.2f} s"
        ),
        cpu=cpu,
    )
