"""Benchmark 7: multi-turn chat. Several conversations share a system prompt; each turn's prompt is the previous
turn's prompt, its reply and a new user message, and all conversations of a turn are submitted together. The
:class:`~pagedcore.adapters.transformers.Engine` (one engine for the whole chat, so each turn finds the previous
turns in its prefix cache) vs ``generate`` on the left-padded batch of each turn (which recomputes every prompt).

Every peer continues each conversation with its own replies; the replies are compared reply by reply, so a
divergence shows as the first mismatching (conversation, turn) and everything after it.
"""

from __future__ import annotations

import contextlib
import random
import statistics
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .peers import ENGINE, Batch, EnginePeer, PaddedBatch, Peer
from .report import RATIO_HEADERS, Aim, Header, Reported, Section, Table, aim_status, ratio, sentence
from .roofline import Request, Roofline, machine_limits, roofline
from .runner import Runner, Timed, clock

__all__ = ["KEPT_ENGINE", "ChatResult", "ChatWorkload", "keep_and_warm", "run", "serve_chat"]

PADDED = "generate, padded batch per turn"
AIM_CHAT_SPEEDUP = Aim(3.0, at_most=False, fmt="{:g}x")
AIM_CHAT_PREFILL = Aim(1.00, fmt="{:.2f}")
KEPT_ENGINE = (
    "one Engine for every round and turn, built and warmed on this chat before the first round, its cached prefixes "
    "forgotten before each round (outside the timed run)"
)
PADDED_NOTE = (
    "one `generate` call per turn (a fresh DynamicCache), max_new_tokens = the turn's largest, each reply truncated "
    "to its own length"
)


@dataclass(frozen=True)
class ChatWorkload:
    """The scripted part of a chat: the system prompt, each conversation's user messages and reply lengths.

    Example:
        >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]], [[8], [9]]], replies=[[2, 3], [2, 2]])
        >>> chat.conversations, chat.turns
        (2, 2)
        >>> chat.prompt(0, 0, []), chat.prompt(0, 1, [[40, 41]])   # turn 1: turn 0's prompt, its reply, a message
        ([5, 5, 5, 5, 6], [5, 5, 5, 5, 6, 40, 41, 7, 7])
        >>> chat.unique_prompt_tokens   # the system prompt once, each message, each reply's last token (never fed)
        11
    """

    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn] -> message tokens
    replies: list[list[int]]  # [conversation][turn] -> new tokens

    @property
    def conversations(self) -> int:
        """Conversations."""
        return len(self.users)

    @property
    def turns(self) -> int:
        """Turns per conversation."""
        return len(self.users[0])

    def prompt(self, conversation: int, turn: int, replies: list[list[int]]) -> list[int]:
        """The prompt of ``turn`` given the conversation's earlier ``replies`` (one per earlier turn)."""
        tokens = list(self.system)
        for t in range(turn + 1):
            tokens += self.users[conversation][t]
            if t < turn:
                tokens += replies[t]
        return tokens

    @property
    def unique_prompt_tokens(self) -> int:
        """Prompt tokens no earlier forward computed: the system prompt once, every user message, and the last
        token of every reply that a later turn extends (the reply's other tokens were computed as decode steps)."""
        own = sum(len(m) for conv in self.users for m in conv)
        return len(self.system) + own + self.conversations * (self.turns - 1)

    def partial_block_tokens(self, replies: list[list[list[int]]], block_size: int) -> int:
        """Positions a prefix cache of whole blocks recomputes: per turn after the first, those of the previous
        turn's last, partly filled block (its prompt and reply positions past the last block boundary; the
        reply's last token is counted as unique already). ``replies[conversation][turn]`` as generated.

        Example:
            >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]]], replies=[[3, 2]])
            >>> chat.partial_block_tokens([[[40, 41, 42], [43, 44]]], block_size=4)   # 4 + 1 + 3 - 1 = 7 -> 3
            3
        """
        total = 0
        for c in range(self.conversations):
            for t in range(1, self.turns):
                computed = len(self.prompt(c, t - 1, replies[c])) + len(replies[c][t - 1]) - 1
                total += computed % block_size
        return total

    @property
    def generated_tokens(self) -> int:
        """New tokens over all conversations and turns."""
        return sum(sum(r) for r in self.replies)

    def turn_requests(self, turn: int) -> list[Request]:
        """A turn's requests as the roofline floor counts them: what an earlier forward computed is cached (the
        system prompt after the first conversation of turn 0; the previous turn's prompt and reply but its last token
        later).

        Example:
            >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]], [[8], [9]]], replies=[[2, 3], [2, 2]])
            >>> chat.turn_requests(0)
            [Request(prompt=5, new=2, cached=0), Request(prompt=5, new=2, cached=4)]
            >>> chat.turn_requests(1)[0]
            Request(prompt=9, new=3, cached=6)
        """
        out = []
        for c in range(self.conversations):
            replies = [[0] * n for n in self.replies[c]]
            prompt = len(self.prompt(c, turn, replies))
            if turn:
                cached = len(self.prompt(c, turn - 1, replies)) + self.replies[c][turn - 1] - 1
            else:
                cached = len(self.system) if c else 0
            out.append(Request(prompt, self.replies[c][turn], cached))
        return out


def chat_workload(
    rng: random.Random,
    vocab: int,
    *,
    conversations: int,
    turns: int,
    system: int,
    user: tuple[int, int],
    reply: tuple[int, int],
) -> ChatWorkload:
    """A seeded :class:`ChatWorkload`: user messages of ``user`` (min, max) tokens, replies of ``reply`` tokens."""
    return ChatWorkload(
        system=random_tokens(rng, system, vocab),
        users=[[random_tokens(rng, rng.randint(*user), vocab) for _ in range(turns)] for _ in range(conversations)],
        replies=[[rng.randint(*reply) for _ in range(turns)] for _ in range(conversations)],
    )


@dataclass
class ChatRun:
    """One peer's runs: wall times, the replies of its first run, prefill positions computed per turn."""

    name: str
    walls: list[float] = field(default_factory=list)
    replies: list[list[list[int]]] = field(default_factory=list)  # [conversation][turn]
    prefill_per_turn: list[int] = field(default_factory=list)
    padding: int = 0
    note: str = ""

    @property
    def wall(self) -> float:
        """Median wall time."""
        return statistics.median(self.walls)


@dataclass
class ChatResult(Reported):
    """A multi-turn chat served by the Engine and by the padded batch (see :func:`chat_benchmark`).

    Example:
        >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]], [[8], [9]]], replies=[[2, 3], [2, 2]])
        >>> padded = ChatRun(PADDED, [3.0], [[[1, 2], [3, 4, 5]], [[1, 1], [2, 2]]], [10, 18])
        >>> served = ChatRun(ENGINE, [1.0], [[[1, 2], [3, 4, 6]], [[1, 1], [2, 2]]], [7, 4])
        >>> result = ChatResult(Header(True, "Llama", "laptop"), chat, [padded, served], 2, "")
        >>> result.speedup(), result.prefill_ratio(), result.mismatches()
        (3.0, 1.0, [(0, 1)])
    """

    head: Header
    workload: ChatWorkload
    runs: list[ChatRun]
    repeats: int
    engine_config: str
    block_size: int = BLOCK_SIZE
    floors: list[Roofline] = field(default_factory=list)  # per turn

    def floor_ratio(self, name: str = ENGINE) -> float | None:
        """``name``'s median wall / the turns' roofline floors summed (None without them)."""
        total = sum(f.seconds for f in self.floors)
        return self.run(name).wall / total if total else None

    def run(self, name: str) -> ChatRun:
        """One peer's runs."""
        return next(r for r in self.runs if r.name == name)

    def speedup(self) -> float:
        """Median wall of the padded batch / median wall of the Engine."""
        return self.run(PADDED).wall / self.run(ENGINE).wall

    def prefill_ratio(self) -> float:
        """Prompt positions the Engine computed / unique prompt tokens."""
        return sum(self.run(ENGINE).prefill_per_turn) / self.workload.unique_prompt_tokens

    def mismatches(self) -> list[tuple[int, int]]:
        """(conversation, turn) whose Engine reply differs from the padded batch's."""
        ref, got = self.run(PADDED).replies, self.run(ENGINE).replies
        return [(c, t) for c in range(len(ref)) for t in range(len(ref[c])) if ref[c][t] != got[c][t]]

    def section(self) -> Section:
        """The report: workload, model, machine, per-peer and per-turn figures, the ratios with their aims."""
        w = self.workload
        users = [len(m) for conv in w.users for m in conv]
        replies = [r for conv in w.replies for r in conv]
        workload = (
            f"{w.conversations} conversations x {w.turns} turns, greedy, eos ignored: a shared {len(w.system)}-token "
            f"system prompt; each turn appends a {min(users)}-{max(users)}-token user message to the previous turn's "
            f"prompt and reply, and asks for {min(replies)}-{max(replies)} new tokens (seeded); the conversations of "
            f"a turn are submitted together, a turn starts when the previous one has finished. "
            f"{w.unique_prompt_tokens} unique prompt tokens, {w.generated_tokens} tokens to generate"
        )
        measured = (
            f"wall time of all turns; one untimed warm-up per peer (the Engine's on this chat itself, the padded "
            f"batch's on a 2-conversation chat), then {self.repeats} rounds alternating the peers "
            "(padded batch first in even rounds); median over the rounds. Prefill positions: the padded batch computes "
            "every prompt token of every turn (and its padding); the Engine's `stats().prompt_tokens_computed` per "
            "turn. Unique prompt tokens: the system prompt once, every user message, and the last token of each "
            "reply a later turn extends (the other reply tokens were computed as decode steps)."
        )
        padded, served = self.run(PADDED), self.run(ENGINE)
        turns = Table(["turn", "prefill positions: padded batch", "prefill positions: Engine"],
                      [[t, padded.prefill_per_turn[t], n] for t, n in enumerate(served.prefill_per_turn)])  # fmt: skip
        return Section("7. Multi-turn chat", self.head, workload, measured,
                       body=[self._figures(), turns, self._ratios()], notes=self._notes())  # fmt: skip

    def _figures(self) -> Table:
        mism, generated = self.mismatches(), self.workload.generated_tokens
        rows = []
        for run in self.runs:
            prefill = f"{sum(run.prefill_per_turn)}" + (f" (+{run.padding} padding)" if run.padding else "")
            same = "reference" if run.name == PADDED else ("0" if not mism else f"**{len(mism)}**")
            rows.append([run.name, f"{run.wall:.2f} s", f"{min(run.walls):.2f} / {max(run.walls):.2f} s",
                         f"{generated / run.wall:.1f}", prefill, same])  # fmt: skip
        return Table(["peer", "median wall", "min / max", "gen tokens/s", "prefill positions computed",
                      "replies differing from the padded batch"], rows)  # fmt: skip

    def _partial(self) -> int:
        return self.workload.partial_block_tokens(self.run(ENGINE).replies, self.block_size)

    def _ratios(self) -> Table:
        speedup, reuse, mism = self.speedup(), self.prefill_ratio(), self.mismatches()
        return Table(
            RATIO_HEADERS,
            [
                AIM_CHAT_SPEEDUP.row("Engine speedup vs the padded batch (median wall)", ratio(speedup), speedup),
                AIM_CHAT_PREFILL.row("Engine prefill positions / unique prompt tokens", f"{reuse:.3f}", reuse),
                ["replies identical to the padded batch's", "yes" if not mism else f"no: {len(mism)} differ",
                 "all", aim_status(not mism)],
                *([[f"{name} wall / roofline floor ({sum(f.seconds for f in self.floors):.2f} s)",
                    ratio(self.floor_ratio(name)), "-", "-"] for name in (ENGINE, PADDED)] if self.floors else []),
            ],
        )  # fmt: skip

    def _notes(self) -> list[str]:
        beyond = sum(self.run(ENGINE).prefill_per_turn) - self.workload.unique_prompt_tokens
        notes = [
            f"Engine: {self.engine_config}.",
            f"Prefill beyond the unique tokens: {beyond} positions; the previous turns' last, partly filled blocks "
            f"(blocks of {self.block_size} tokens) hold {self._partial()}. A turn's prompt continues the previous "
            "reply inside a block: the prefix cache matches to the token and reuses that block's cached positions "
            "(copy-on-write), so only what evictions or a cache of whole blocks lose is computed again.",
        ]
        if self.floors:
            notes.append(
                "Roofline floor: each turn's steps as an ideal continuous batcher with a 512-token budget runs them "
                "(the positions no earlier forward computed, then one decode step per generated token after the "
                "first), per step the larger of its FLOPs at the best GEMM rate and its bytes (weights once, the "
                "keys and values read, the logits) at the measured bandwidth, summed over the turns: "
                f"{self.floors[0].limits.describe()}."
            )
        notes += [f"{run.name}: {sentence(run.note)}" for run in self.runs if run.note]
        mism = self.mismatches()
        if mism:
            notes.append(f"First differing reply: conversation {mism[0][0]}, turn {mism[0][1]}.")
        return notes


@dataclass(frozen=True)
class Conversations:
    """What one peer's run of a chat computed: each conversation's replies, the prefill positions per turn, the
    padding positions, and the peer's note."""

    replies: list[list[list[int]]]  # [conversation][turn]
    prefill_per_turn: list[int]
    padding: int
    note: str


def serve_chat(model: PreTrainedModel, peer: Peer, chat: ChatWorkload) -> Timed:
    """Every turn of ``chat`` served by one session of ``peer``: the turns' wall time, from the first turn's serve
    call to the last turn's end. The session opens before the clock starts (a section's kept Engine forgets its cached
    prefixes there: :meth:`~pagedcore.benchmarks.peers.EngineSession.session`).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> chat = ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]]], replies=[[2, 3]])
        >>> timed = serve_chat(bench_model(size="tiny"), EnginePeer(num_blocks=16), chat)
        >>> timed.output.prefill_per_turn   # turn 1: its message and turn 0's last reply token, never fed
        [5, 3]
    """
    replies: list[list[list[int]]] = [[] for _ in range(chat.conversations)]
    prefill, padding, note = [], 0, ""
    with peer.session(model) as serve:
        start = clock(model.device)
        for t in range(chat.turns):
            prompts = [chat.prompt(c, t, replies[c]) for c in range(chat.conversations)]
            served = serve(Batch(prompts, [chat.replies[c][t] for c in range(chat.conversations)]))
            for c, tokens in enumerate(served.tokens):
                replies[c].append(tokens)
            prefill.append(served.prefill or 0)
            padding, note = padding + served.padding, served.note
        wall = clock(model.device) - start
    return Timed(wall, Conversations(replies, prefill, padding, note))


def keep_and_warm(stack: contextlib.ExitStack, runner: Runner, model: PreTrainedModel, peers: dict[str, Peer],
                  chat: ChatWorkload, warm: ChatWorkload) -> None:  # fmt: skip
    """Replace the :class:`~pagedcore.benchmarks.peers.EnginePeer` in ``peers`` by one Engine for every round, open
    until ``stack`` closes, as a server keeps one, then warm each peer once, untimed: the Engine on ``chat`` itself
    (it meets the chat's row counts and table widths: what it measures and compiles there, its row split's and greedy
    head's trials and decode graphs with ``pagedcore bench --engine-compile``, is paid here, not in every timed
    round), the padded batch, which keeps nothing between calls, on the small ``warm`` chat. Each round's session
    forgets the Engine's cached prefixes first, outside the timed run (:func:`serve_chat`).

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> from pagedcore.benchmarks.context import BenchContext
        >>> ctx = BenchContext(BenchOptions(progress=False, model_size="tiny"))
        >>> model, chat = ctx.model(), ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]]], replies=[[2, 3]])
        >>> peers: dict[str, Peer] = {PADDED: PaddedBatch(name=PADDED), ENGINE: EnginePeer(num_blocks=16)}
        >>> with contextlib.ExitStack() as stack, Runner(ctx, "chat", 2) as runner:
        ...     keep_and_warm(stack, runner, model, peers, chat, chat)
        ...     again = serve_chat(model, peers[ENGINE], chat)
        >>> type(peers[ENGINE]).__name__, again.output.prefill_per_turn   # the warm-up's prefixes forgotten
        ('EngineSession', [5, 3])
    """
    engine = peers[ENGINE]
    assert isinstance(engine, EnginePeer)
    peers[ENGINE] = stack.enter_context(engine.kept(model))
    runner.warm_up(list(peers), lambda name: serve_chat(model, peers[name], chat if name == ENGINE else warm))


def section_workload(rng: random.Random, vocab: int, quick: bool) -> ChatWorkload:
    """The section's chat (``scripts/chat_split.py`` times the same one): 8 conversations x 4 turns, a 256-token
    system prompt, 32-96-token user messages, 16-48 new tokens per reply (quick: 4 x 3, 64, 8-24, 4-8)."""
    if quick:
        return chat_workload(rng, vocab, conversations=4, turns=3, system=64, user=(8, 24), reply=(4, 8))
    return chat_workload(rng, vocab, conversations=8, turns=4, system=256, user=(32, 96), reply=(16, 48))


def engine_blocks(chat: ChatWorkload) -> int:
    """The Engine's pool for ``chat``: every turn's blocks twice over, even if nothing were reused."""
    final = [len(chat.prompt(c, chat.turns - 1, [[0] * n for n in chat.replies[c]])) + chat.replies[c][-1]
             for c in range(chat.conversations)]  # fmt: skip
    return sum(blocks_for(n) for n in final) * 2 + 8


def run(ctx: BenchContext, *, repeats: int | None = None) -> ChatResult:
    """8 conversations x 4 turns, a 256-token system prompt, 32-96-token user messages, 16-48 new tokens per reply
    (quick: 4 x 3, 64, 8-24, 4-8): the Engine vs the padded batch per turn, median of ``repeats`` rounds (default 3;
    quick 1) after a warm-up.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> result.mismatches(), result.speedup() > 0  # doctest: +SKIP
        ([], True)
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    repeats = repeats or (1 if quick else 3)
    rng = random.Random(seed + 7)
    vocab = model.config.vocab_size
    chat = section_workload(rng, vocab, quick)
    warm = chat_workload(rng, vocab, conversations=2, turns=2, system=16, user=(4, 8), reply=(2, 2))
    num_blocks = engine_blocks(chat)
    peers: dict[str, Peer] = {
        PADDED: PaddedBatch(name=PADDED),
        ENGINE: EnginePeer(num_blocks=num_blocks, max_seqs=chat.conversations),
    }
    with contextlib.ExitStack() as stack, Runner(ctx, "chat: Engine vs padded batch", 2 * (repeats + 1)) as runner:
        keep_and_warm(stack, runner, model, peers, chat, warm)
        trials = runner.rounds(list(peers), repeats, lambda name, r: serve_chat(model, peers[name], chat))
    runs = []
    for name in peers:
        first: Conversations = trials.outputs(name)[0]
        note = PADDED_NOTE if name == PADDED else first.note
        runs.append(ChatRun(name, trials.seconds(name), first.replies, first.prefill_per_turn, first.padding, note))
    limits = machine_limits(model)
    return ChatResult(
        head=runner.header(),
        workload=chat,
        runs=runs,
        repeats=repeats,
        floors=[roofline(model, chat.turn_requests(t), limits) for t in range(chat.turns)],
        engine_config=(
            f"{KEPT_ENGINE}: block size {BLOCK_SIZE}, {num_blocks} blocks, "
            f"max_num_seqs {chat.conversations}, max_num_batched_tokens 512 (its default), prefix caching on"
        ),
    )
