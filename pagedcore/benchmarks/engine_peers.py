"""The four ways the engine benchmark serves its requests, each timed the same way: :class:`PeerResult`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from pagedcore.adapters.transformers import Engine, SamplingParams

from .common import (
    BLOCK_SIZE,
    PAD,
    attn,
    cache_tensor_bytes,
    check_outputs,
    clock,
    counting,
    generate,
    greedy,
    left_padded,
    progress_bar,
)

__all__ = ["PeerResult", "finished_results"]

ONE_AT_A_TIME = "generate, one at a time"
PADDED_BATCH = "generate, padded batch"
HF_CONTINUOUS = "transformers continuous batching"
ENGINE = "pagedcore Engine"


@dataclass
class PeerResult:
    """One way of serving the engine benchmark's requests.

    Attributes:
        name: the peer.
        wall: seconds from the start to the last request's completion (None when the peer could not run).
        latencies: per request, seconds from the start (all requests arrive at once) to its completion.
        generated_tokens: useful generated tokens (each request's own ``max_new_tokens``).
        prefill_computed: prompt positions computed (real tokens; see ``padding_computed``).
        padding_computed: padding positions computed besides (padded batch).
        peak_kv_bytes: KV memory at the peak; ``kv_how`` says how it was obtained.
        mismatches: requests whose greedy tokens differ from the one-at-a-time reference.
        error: why the peer could not run ("n/a (reason)").
        note: anything the reader needs to interpret the row.
        tokens: per request, its greedy tokens.
        counted_positions: positions the model computed, counted by a forward hook.
        decode_positions: of those, the decode positions (one per generated token after the first, per row run).

    Example:
        >>> PeerResult("pagedcore Engine", wall=2.0, latencies=[1.25, 2.0], generated_tokens=96).tokens_per_second
        48.0
        >>> PeerResult("transformers continuous batching", error="n/a (ImportError: ...)").tokens_per_second is None
        True
    """

    name: str
    wall: float | None = None
    latencies: list[float] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_computed: int | None = None
    padding_computed: int = 0
    peak_kv_bytes: int | None = None
    kv_how: str = ""
    mismatches: list[int] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    tokens: list[list[int]] | None = field(default=None, repr=False)
    counted_positions: int | None = None
    decode_positions: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        """Useful generated tokens per second of wall time."""
        return self.generated_tokens / self.wall if self.wall else None


def one_at_a_time(
    model: PreTrainedModel, prompts: list[list[int]], news: list[int], warm: list[list[int]], progress: bool
) -> PeerResult:
    """``generate`` on each request in turn, a fresh ``DynamicCache`` each (the reference tokens)."""
    with torch.inference_mode():
        greedy(model, warm[0], 2, cache=DynamicCache(config=model.config))
    peer = PeerResult(ONE_AT_A_TIME, kv_how="measured: largest DynamicCache, tensor bytes")
    tokens: list[list[int]] = []
    peak = 0
    bar = progress_bar(len(prompts), ONE_AT_A_TIME, progress)
    with counting(model) as counter, torch.inference_mode():
        start = clock(model.device)
        for prompt, new in zip(prompts, news):
            cache = DynamicCache(config=model.config)
            tokens.append(greedy(model, prompt, new, cache=cache))
            peer.latencies.append(clock(model.device) - start)
            peak = max(peak, cache_tensor_bytes(cache))
            bar.update(1)
        peer.wall = clock(model.device) - start
    bar.close()
    peer.generated_tokens = sum(len(t) for t in tokens)
    peer.peak_kv_bytes = peak
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


def padded_batch(
    model: PreTrainedModel, prompts: list[list[int]], news: list[int], warm: list[list[int]]
) -> PeerResult:
    """One ``generate`` call on the left-padded batch, run to the largest ``max_new_tokens``."""
    width = max(len(p) for p in prompts)
    ids, mask = left_padded(prompts, model.device)
    longest = max(news)
    with torch.inference_mode():
        w, m = left_padded([warm[0], warm[1][8:]], model.device)  # 24 tokens and 16 after 8 padding positions
        generate(model, w, attention_mask=m, max_new_tokens=2, do_sample=False)
    cache = DynamicCache(config=model.config)
    with counting(model) as counter, torch.inference_mode():
        start = clock(model.device)
        out = generate(model, ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, cache=cache)
        wall = clock(model.device) - start
    tokens = [out[i, width : width + n].tolist() for i, n in enumerate(news)]
    peer = PeerResult(
        PADDED_BATCH,
        wall=wall,
        latencies=[wall] * len(prompts),
        generated_tokens=sum(news),
        prefill_computed=sum(len(p) for p in prompts),
        padding_computed=sum(width - len(p) for p in prompts),
        peak_kv_bytes=cache_tensor_bytes(cache),
        kv_how="measured: DynamicCache tensor bytes at the end",
        note=(
            f"one `generate` call with max_new_tokens={longest} (the largest), each request's output truncated to its "
            f"own max_new_tokens; it computes {len(prompts) * longest} tokens for {sum(news)} useful ones, and every "
            "request completes at the end"
        ),
    )
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = len(prompts) * (longest - 1)  # every row runs `longest` steps
    return peer


def hf_continuous(
    model: PreTrainedModel,
    prompts: list[list[int]],
    news: list[int],
    warm: list[list[int]],
    num_blocks: int,
    budget: int,
    progress: bool,
) -> PeerResult:
    """transformers' continuous batching (the manager ``generate_batch`` wraps), one request per prompt."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=PAD, max_new_tokens=max(news), bos_token_id=1
    )

    def config() -> Any:
        return ContinuousBatchingConfig(
            page_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_batch_tokens=budget,
            max_requests_per_batch=len(prompts),
            allow_block_sharing=True,
        )

    def serve(batch: list[list[int]], limits: list[int], bar: Any) -> tuple[dict[int, Any], int | None]:
        results: dict[int, Any] = {}
        reserved = None
        with model.continuous_batching_context_manager(  # type: ignore[operator]
            generation_config=generation_config,
            continuous_batching_config=config(),
            block=True,
            timeout=30,
            warmup=False,
        ) as manager:
            order = sorted(range(len(batch)), key=lambda i: batch[i], reverse=True)
            ids = {}
            for i in order:
                rid = manager.add_request(batch[i], request_id=f"r{i}", max_new_tokens=limits[i], eos_token_id=-1)
                if rid is None:
                    raise RuntimeError(f"the continuous batching manager refused request {i}")
                ids[rid] = i
            for result in finished_results(manager, len(batch)):
                done = result.lifespan[1] if result.lifespan[1] > 0 else time.perf_counter()
                results[ids[result.request_id]] = (result, done)
                bar.update(1)
            processor = getattr(manager, "batch_processor", None)
            tensor = getattr(getattr(processor, "cache", None), "cache_tensor", None)
            if isinstance(tensor, torch.Tensor):
                reserved = tensor.numel() * tensor.element_size()
        return results, reserved

    with attn(model, "sdpa"):
        serve(warm, [2, 2], progress_bar(0, "", False))
    bar = progress_bar(len(prompts), HF_CONTINUOUS, progress)
    with attn(model, "sdpa"), counting(model) as counter:
        start = clock(model.device)
        results, reserved = serve(prompts, news, bar)
        stopped = clock(model.device)
    bar.close()
    tokens = [list(results[i][0].generated_tokens) for i in range(len(prompts))]
    latencies = [results[i][1] - start for i in range(len(prompts))]
    wall = max(latencies)
    peer = PeerResult(
        HF_CONTINUOUS,
        wall=wall,
        latencies=latencies,
        generated_tokens=sum(len(t) for t in tokens),
        peak_kv_bytes=reserved,
        kv_how="reserved: preallocated cache tensor",
        note=(
            "prefill tokens computed counted with a forward hook (it reports no counter of its own); wall time ends "
            "at the last request's completion: stopping the manager's thread afterwards took "
            f"{stopped - start - wall:.2f} s more, which `generate_batch` also waits for but is not counted here."
        ),
    )
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


def engine(
    model: PreTrainedModel,
    prompts: list[list[int]],
    news: list[int],
    warm: list[list[int]],
    num_blocks: int,
    budget: int,
    progress: bool,
) -> PeerResult:
    """pagedcore's :class:`~pagedcore.adapters.transformers.Engine`, created inside the timed run."""
    with Engine(model, num_blocks=64, block_size=BLOCK_SIZE) as warm_engine:
        warm_engine.generate(warm, SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    with counting(model) as counter:
        start = clock(model.device)
        with Engine(
            model,
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=budget,
            max_num_seqs=len(prompts),
        ) as served:
            outputs = served.generate(prompts, params, use_tqdm=progress)
            wall = clock(model.device) - start
            stats = served.stats()
    check_outputs(outputs)
    peer = PeerResult(
        ENGINE,
        wall=wall,
        latencies=[(o.metrics.finish_time or start) - start for o in outputs],
        generated_tokens=stats.generated_tokens,
        prefill_computed=stats.prompt_tokens_computed,
        peak_kv_bytes=stats.kv_peak_used_bytes,
        kv_how="measured: blocks held at the peak",
        note=(
            f"{stats.num_steps} steps, {stats.num_preemptions} preemptions, prefix hits {stats.prefix_hit_tokens} of "
            f"{stats.prefix_query_tokens} looked-up prompt tokens."
        ),
    )
    peer.tokens = [o.token_ids for o in outputs]
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


def finished_results(manager: Any, count: int) -> Iterator[Any]:
    """The next ``count`` finished results of transformers' continuous batching ``manager``, as they come; a request
    that failed, or the manager's thread stopping first, raises :class:`RuntimeError`.

    Example:
        >>> class Finished:
        ...     request_id, error = "r0", None
        ...     def is_finished(self) -> bool:
        ...         return True
        >>> class Manager:
        ...     def get_result(self, timeout: float) -> Finished:
        ...         return Finished()
        ...     def is_running(self) -> bool:
        ...         return True
        >>> [result.request_id for result in finished_results(Manager(), 2)]
        ['r0', 'r0']
    """
    seen = 0
    while seen < count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before every request finished")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            seen += 1
            yield result
