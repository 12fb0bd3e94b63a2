"""The model-runner protocol: what the Engine needs from the side that owns the model and its KV tensors.

The Engine (:mod:`pagedcore.engine.engine`) plans and records; a runner computes. Each step the Engine's scheduler
plans which tokens of which sequences to compute (their block tables already grown), and the runner gets that plan as
a :class:`ForwardBatch`:

1. :meth:`ModelRunner.prepare` (under the Engine's lock, which includes the pool's: it reads the live block tables)
   does the plan's copy-on-write block copies (forks) and packs the step's tokens, positions, block tables and new
   slots into whatever its forward reads (:func:`~pagedcore.engine.packing.pack_tokens` builds the paged-attention
   metadata any torch runner can use);
2. :meth:`ModelRunner.execute` (without the lock) runs the forward with a paged-attention context and returns the
   float32 logits of the rows the batch asked for, in order (or, for a batch whose rows only take their argmax, the
   tokens: :class:`ArgmaxTokens`).

A pool with recurrent-state slots (a model with linear-attention, state-space or short-convolution layers) asks a
little more of ``prepare``: make each scheduled sequence's slot its own before the forward writes it
(:meth:`BlockTables.write_state <pagedcore.block_tables.BlockTables.write_state>`: the scheduler counted the slot it
may take), take the slots of the snapshots the plan names (:attr:`ScheduledSequence.snapshots
<pagedcore.scheduler.ScheduledSequence.snapshots>`, :meth:`BlockTables.take_snapshots
<pagedcore.block_tables.BlockTables.take_snapshots>`) and, in ``execute``, copy the state after each such position
into its slot; the scheduler files them (:mod:`pagedcore.state_planner`; the transformers runner's
:mod:`~pagedcore.adapters.transformers.state_step` does all of it).

Around the step: :meth:`ModelRunner.check_weights` (each step, before planning: the weights epoch; prefixes computed
by weights that changed are forgotten), :meth:`ModelRunner.stats` (memory, kernel fallbacks, compiled steps),
:meth:`ModelRunner.reset_prefix_cache` and :meth:`ModelRunner.close`. A runner owns compilation and its fallback:
the Engine never sees a compiled graph. The runner's :attr:`ModelRunner.kv` is the core's block bookkeeping
(:class:`~pagedcore.kv_pool.KVPool`) the scheduler plans over, :attr:`ModelRunner.lock` the one lock every holder of
that pool takes, :attr:`ModelRunner.plugins` its plugin manager, and :attr:`ModelRunner.info` what the Engine
validates requests against (:class:`ModelInfo`).

Two runners implement it: :class:`~pagedcore.adapters.transformers.runner.TransformersRunner` (any transformers
causal LM, ``attn_implementation="paged"``) and :class:`~pagedcore.adapters.torch_reference.TorchRunner` (a small
Llama written on ``torch.nn``, the proof that the protocol needs no framework).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pagedcore.kv_pool import KVPool
from pagedcore.plugin_manager import PluginManager
from pagedcore.scheduler import ScheduledSequence

__all__ = ["ArgmaxTokens", "CompileCounts", "ForwardBatch", "ModelInfo", "ModelRunner", "RunnerStats"]


@dataclass(frozen=True)
class ModelInfo:
    """What the Engine checks requests against and where it draws.

    Attributes:
        vocab_size: the model's vocabulary (token ids must be below it); None: unknown.
        max_positions: the model's context in positions (prompt + new tokens); None: no fixed limit.
        eos_token_ids: the stop tokens a request stops at by default (``stop_token_ids=None``).
        device: where the logits are (each request's random generators live there).
        limit_note: why ``max_positions`` is less than the model's own context, when it is (said when a longer
            ``max_model_len`` is refused).

    Example:
        >>> ModelInfo(vocab_size=32, max_positions=128, eos_token_ids=(2,), device=torch.device("cpu")).eos_token_ids
        (2,)
    """

    vocab_size: int | None
    max_positions: int | None
    eos_token_ids: tuple[int, ...]
    device: torch.device
    limit_note: str = ""


@dataclass(frozen=True)
class ForwardBatch:
    """One step's work for the runner: every scheduled token of every sequence, packed in plan order.

    Attributes:
        scheduled: the scheduler's plan (each item: its sequence, the positions to compute, its block tables).
        copies: copy-on-write block copies ``(group, source, destination)`` to do before the forward (a forked
            sequence's partly filled block).
        logit_rows: the packed indices whose logits :meth:`ModelRunner.execute` returns, in this order (each
            sampled sequence's last token, then prompt positions kept for ``prompt_logprobs``).
        num_tokens: tokens computed in this step (the sum of the items' ``num_new_tokens``).
        is_decode: every sequence computes one token and samples it, and no other logits are kept (what a
            compiled decode step can run).
        argmax_only: every row's token is its logits' first maximal index and nothing else reads them (greedy,
            no log-probabilities, returned logits, processors, grammar or prompt scores): :meth:`ModelRunner.execute`
            may return the tokens (:class:`ArgmaxTokens`) instead of the logits.

    Example:
        >>> ForwardBatch([], [], [], 0, False).num_rows
        0
    """

    scheduled: Sequence[ScheduledSequence]
    copies: Sequence[tuple[int, int, int]]
    logit_rows: Sequence[int]
    num_tokens: int
    is_decode: bool
    argmax_only: bool = False

    @property
    def num_rows(self) -> int:
        """Logits rows the forward returns."""
        return len(self.logit_rows)


@dataclass(frozen=True, slots=True)
class ArgmaxTokens:
    """What :meth:`ModelRunner.execute` may return for an :attr:`~ForwardBatch.argmax_only` batch: each row's first
    maximal logit index, in row order, every row's maximum finite (else the runner returns the logits).

    Example:
        >>> ArgmaxTokens([4, 1]).tokens
        [4, 1]
    """

    tokens: list[int]


@dataclass(frozen=True)
class CompileCounts:
    """A compiled decode step's counters: ``graphs`` compiled (each bucket's first step compiles one; more would be
    recompilations or graph breaks), distinct ``buckets`` seen, decode ``steps`` run compiled, and ``failures``
    (a compiled step raised and the runner turned compiling off).

    Example:
        >>> CompileCounts(graphs=3, buckets=3, steps=500).recompilations
        0
    """

    graphs: int = 0
    buckets: int = 0
    steps: int = 0
    failures: int = 0

    @property
    def recompilations(self) -> int:
        """Graphs compiled beyond one per bucket."""
        return max(0, self.graphs - self.buckets)


@dataclass(frozen=True)
class RunnerStats:
    """A runner's figures for :meth:`Engine.stats <pagedcore.engine.engine.Engine.stats>`.

    Attributes:
        used_bytes: KV bytes held by running sequences (whole blocks).
        kernel_failures: attention kernel calls that fell back to the reference backend.
        compile: the compiled decode step's counters (zeros when it does not compile).

    Example:
        >>> RunnerStats(used_bytes=4096).compile.steps
        0
    """

    used_bytes: int = 0
    kernel_failures: int = 0
    compile: CompileCounts = CompileCounts()


@runtime_checkable
class ModelRunner(Protocol):
    """The device side of an Engine (see the module docstring). ``prepare`` runs under :attr:`lock`; ``execute``
    without it, reading only what ``prepare`` returned.

    Example:
        >>> sorted(name for name in vars(ModelRunner) if not name.startswith("_"))   # doctest: +NORMALIZE_WHITESPACE
        ['check_weights', 'close', 'execute', 'info', 'kv', 'lock', 'plugins', 'prepare', 'reset_prefix_cache',
         'stats', 'used_bytes', 'weights_version']
    """

    @property
    def info(self) -> ModelInfo: ...

    @property
    def kv(self) -> KVPool: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def plugins(self) -> PluginManager: ...

    def check_weights(self, *, admitting: bool = True) -> int:
        """Before a step is planned (under the lock): notice a change of the model's weights and forget the cached
        prefixes computed before it (a new epoch); returns the blocks forgotten. ``admitting``: the step may admit
        a request (a prefix lookup follows), so what is too costly to check at every step is checked too (the
        transformers runner: each module's settings)."""
        ...

    @property
    def weights_version(self) -> int:
        """The weights' version as of the last :meth:`check_weights` (equal versions: the same weights); each
        output carries the version its request was computed with (``RequestOutput.weights_version``)."""
        ...

    def prepare(self, batch: ForwardBatch) -> Any:
        """Under the lock: the batch's block copies, then its inputs packed for :meth:`execute`."""
        ...

    def execute(self, prepared: Any) -> torch.Tensor | ArgmaxTokens:
        """Without the lock: the forward; float32 logits ``(batch.num_rows, vocab)``, or for an ``argmax_only``
        batch, if the runner can, the rows' tokens."""
        ...

    def used_bytes(self) -> int:
        """KV bytes held by running sequences now (the Engine tracks the peak each step)."""
        ...

    def stats(self) -> RunnerStats:
        """The runner's figures."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now (changes the weights check cannot see); returns the blocks forgotten."""
        ...

    def close(self) -> None:
        """The Engine closes: give back what the runner changed (e.g. the model's attention) and flush what it
        keeps (the tiers below the pool)."""
        ...
