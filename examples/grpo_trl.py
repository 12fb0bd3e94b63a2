"""TRL's GRPOTrainer, unmodified, generating through pagedcore: a tiny Llama built from a config, a local dataset, a
rule-based reward, offline (nothing is downloaded).
Needs: the `rl` extra (TRL and datasets: `pip install -e '.[rl]'`).

GRPO repeats each prompt ``num_generations`` times in one ``model.generate`` call (TRL's default generation path).
With ``enable(model)`` that call computes each prompt once and forks its blocks to the group's rows, computes a
prefix that several prompts share (a system prompt) once, and never serves keys and values of older weights: every
optimizer step moves the model's weights, the pool sees it at the next call and forgets its prefixes. With
``sleep_when_training=True`` the pool also gives its memory back for the training step.

    python examples/grpo_trl.py                      # pagedcore, 2 steps: completions, loss, stale hits
    python examples/grpo_trl.py --mode trl           # TRL's default generate, for comparison
    python examples/grpo_trl.py --mode paged         # TRL's use_transformers_paged (transformers' continuous batching)
    python examples/grpo_trl.py --quick              # a smoke run: 1 step, 4 completion tokens

The building blocks (:func:`word_tokenizer`, :func:`tiny_model`, :func:`prompt_dataset`, :func:`train`) are reused by
``examples/bench_grpo.py`` and the test suite (``tests/test_grpo.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from pagedcore import PluginManager, StaleHitAudit
from pagedcore.adapters import transformers as pc

MODES = ("pagedcore", "trl", "paged")
PAD, BOS, EOS = 0, 1, 2
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline: token ``i >= 3`` is the word ``t<i>``; pad, bos and eos are 0, 1, 2."""
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_model(vocab_size: int, seed: int = 0, **sizes: int) -> LlamaForCausalLM:
    """A Llama with random weights from a config (``sizes`` override :data:`TINY`; two KV heads)."""
    shape = {**TINY, **sizes}
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_key_value_heads=max(1, shape["num_attention_heads"] // 2),
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def prompt_dataset(
    num_prompts: int, prompt_tokens: int, vocab_size: int, *, system_tokens: int = 0, seed: int = 0
) -> Dataset:
    """``num_prompts`` prompts of ``prompt_tokens`` random words, the first ``system_tokens`` of them the same in
    every prompt (a system prompt), as a local ``datasets.Dataset`` with a ``prompt`` column."""
    generator = torch.Generator().manual_seed(seed)
    words = lambda n: [f"t{int(i)}" for i in torch.randint(3, vocab_size, (n,), generator=generator)]  # noqa: E731
    system = words(system_tokens)
    return Dataset.from_dict(
        {"prompt": [" ".join(system + words(prompt_tokens - system_tokens)) for _ in range(num_prompts)]}
    )


def even_words(completions: list[str], **kwargs: Any) -> list[float]:
    """A rule-based reward: the fraction of a completion's words whose token id is even."""
    rewards = []
    for text in completions:
        ids = [int(word[1:]) for word in text.split() if word.startswith("t") and word[1:].isdigit()]
        rewards.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return rewards


@dataclass
class Rollout:
    """One generation call of the trainer.

    Attributes:
        seconds: wall time of the call.
        positions: token positions the model computed in it (every forward's batch x length, padding included).
        prompt_positions: those spent on prompts: ``positions`` less one per generated token but each row's last.
        completions: the generated token ids per row (cut after the first eos, as TRL cuts them).
        weights_version: the pool's weights version after the call (pagedcore only).
        forward_seconds: time in the model's forwards of one new position per row (``"decode"``) and of more
            (``"prompt"``; all of them for transformers' continuous batching, which packs both in one row).
    """

    seconds: float
    positions: int
    prompt_positions: int
    completions: list[list[int]]
    weights_version: int | None = None
    forward_seconds: dict[str, float] = field(default_factory=dict)


class RolloutProbe:
    """Times the trainer's generation calls and counts the positions the model computes in them (a forward pre-hook,
    counting only during a call). Wraps the model's ``generate`` and ``generate_batch`` on the instance."""

    def __init__(self, model: torch.nn.Module, pool: pc.PagedKVPool | None = None) -> None:
        self.rollouts: list[Rollout] = []
        self._model, self._pool, self._active, self._positions = model, pool, False, 0
        self._started: list[tuple[float, str]] = []
        self._seconds = {"prompt": 0.0, "decode": 0.0}
        model.register_forward_pre_hook(self._count, with_kwargs=True)
        model.register_forward_hook(self._timed_forward, with_kwargs=True)
        for name in ("generate", "generate_batch"):
            setattr(model, name, self._wrap(getattr(model, name), name == "generate_batch"))

    def _count(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._active and isinstance(ids, torch.Tensor):
            self._positions += ids.numel()
            self._started.append((time.perf_counter(), "decode" if ids.shape[-1] == 1 else "prompt"))

    def _timed_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._active and self._started:
            started, kind = self._started.pop()
            self._seconds[kind] += time.perf_counter() - started

    def _wrap(self, method: Callable[..., Any], batched: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._active, self._positions, self._seconds = True, 0, {"prompt": 0.0, "decode": 0.0}
            started = time.perf_counter()
            try:
                out = method(*args, **kwargs)
            finally:
                self._active = False
            seconds = time.perf_counter() - started
            completions = _completions(out, args, kwargs, batched)
            decode = sum(max(n - 1, 0) for n in _generated_lengths(out, args, kwargs, batched))
            version = self._pool.weights_version if self._pool is not None else None
            rollout = Rollout(seconds, self._positions, self._positions - decode, completions, version, self._seconds)
            self.rollouts.append(rollout)
            return out

        return timed


def _generated_lengths(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], batched: bool) -> list[int]:
    """Tokens each row generated (a rectangular batch: every row runs as long as the longest)."""
    if batched:
        return [len(o.generated_tokens) for o in out.values()]
    width = kwargs.get("input_ids", args[0] if args else None).shape[1]
    return [out.shape[1] - width] * out.shape[0]


def _completions(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], batched: bool) -> list[list[int]]:
    if batched:
        rows = [list(o.generated_tokens) for o in out.values()]
    else:
        rows = out[:, kwargs.get("input_ids", args[0] if args else None).shape[1] :].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]


class TrainingSteps(TrainerCallback):
    """Tells the audit about every optimizer step and keeps, per step, the stale hits the audit counted by then."""

    def __init__(self, audit: StaleHitAudit | None) -> None:
        self.audit = audit
        self.stale_after_step: list[int] = []
        self.hits_after_step: list[int] = []

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.audit is not None:
            self.audit.weights_changed()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.audit is not None:
            self.stale_after_step.append(self.audit.num_stale_hits)
            self.hits_after_step.append(self.audit.num_hits)


@dataclass
class Run:
    """What :func:`train` measured.

    Attributes:
        mode: ``"pagedcore"``, ``"trl"`` or ``"paged"``.
        rollouts: one per generation call, in order.
        losses: the logged training loss of each step.
        stale_after_step: stale prefix hits counted after each step (pagedcore).
        hits_after_step: prefix hits counted after each step (pagedcore).
        audit: the audit's counters (pagedcore).
        pool: the pool (pagedcore).
        trainer: the trainer.
    """

    mode: str
    rollouts: list[Rollout]
    losses: list[float]
    stale_after_step: list[int] = field(default_factory=list)
    hits_after_step: list[int] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    pool: pc.PagedKVPool | None = None
    trainer: GRPOTrainer | None = None


def train(
    mode: str,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    dataset: Dataset,
    *,
    steps: int = 2,
    num_generations: int = 4,
    prompts_per_step: int = 2,
    completion_tokens: int = 8,
    greedy: bool = False,
    seed: int = 0,
    learning_rate: float = 1e-3,
    sleep: bool = False,
    pool_tokens: int = 8192,
    block_size: int = 16,
    before_train: Callable[[GRPOTrainer, pc.PagedKVPool | None], None] | None = None,
    **config: Any,
) -> Run:
    """Train ``model`` with TRL's GRPOTrainer for ``steps`` steps, generating with ``mode``; see :class:`Run`.

    ``pagedcore``: the model is ``enable()``d with a pool of ``pool_tokens`` on a plugin manager of its own, audited by
    a :class:`~pagedcore.stale_hits.StaleHitAudit` told of every optimizer step. ``paged``: TRL's
    ``use_transformers_paged`` (transformers' continuous batching). ``config``: more ``GRPOConfig`` fields.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    pool = audit = None
    if mode == "pagedcore":
        pool = pc.PagedKVPool(
            model, num_blocks=-(-pool_tokens // block_size), block_size=block_size, plugins=PluginManager()
        )
        audit = StaleHitAudit(pool.kv)
        pool.plugins.register(audit)
        pc.enable(model, pool=pool, sleep_when_training=sleep)
    probe = RolloutProbe(model, pool)
    steps_seen = TrainingSteps(audit)
    with tempfile.TemporaryDirectory(prefix="grpo-") as output_dir, _quiet():
        args = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=prompts_per_step * num_generations,
            num_generations=num_generations,
            max_completion_length=completion_tokens,
            max_steps=steps,
            learning_rate=learning_rate,
            seed=seed,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,  # fp32: the completions and the loss are compared with TRL's own generate
            disable_tqdm=True,
            generation_kwargs={"do_sample": False} if greedy else None,
            use_transformers_continuous_batching=mode == "paged",
            **config,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=even_words, args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[steps_seen],
        )  # fmt: skip
        if before_train is not None:
            before_train(trainer, pool)
        trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    run = Run(mode, probe.rollouts, losses, steps_seen.stale_after_step, steps_seen.hits_after_step, pool=pool)
    run.audit = audit.summary() if audit is not None else {}
    run.trainer = trainer
    return run


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without the deprecation warnings transformers and TRL print at every step (gradient_checkpointing's names)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="pagedcore")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4, help="GRPO's group size G (num_generations)")
    parser.add_argument("--prompts", type=int, default=2, help="distinct prompts per step")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=32, help="leading tokens every prompt shares")
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--greedy", action="store_true", help="greedy completions (TRL samples by default)")
    parser.add_argument("--sleep", action="store_true", help="the pool sleeps while the model trains")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 step, 4 completion tokens")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.completion_tokens = 1, 4
    torch.set_num_threads(max(1, torch.get_num_threads()))
    vocab = 256
    dataset = prompt_dataset(options.prompts, options.prompt_tokens, vocab, system_tokens=options.system_tokens)
    run = train(
        options.mode,
        tiny_model(vocab),
        word_tokenizer(vocab),
        dataset,
        steps=options.steps,
        num_generations=options.generations,
        prompts_per_step=options.prompts,
        completion_tokens=options.completion_tokens,
        greedy=options.greedy,
        sleep=options.sleep,
    )
    for step, rollout in enumerate(run.rollouts, 1):
        print(
            f"step {step}: rollout {rollout.seconds:.3f} s, {rollout.prompt_positions} prompt positions computed "
            f"for {len(rollout.completions)} rows, first completion {rollout.completions[0]}"
        )
    print(f"losses per step: {[round(loss, 6) for loss in run.losses]}")
    if run.pool is not None:
        print(f"stale prefix hits after each step: {run.stale_after_step} (prefix hits: {run.hits_after_step})")
        print(f"weights version per rollout: {[r.weights_version for r in run.rollouts]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
