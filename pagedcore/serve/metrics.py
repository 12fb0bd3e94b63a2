"""Prometheus metrics of one server, in a registry of its own (never the process-global one): pagedcore's own
series (below) and vLLM's (:mod:`~.vllm_metrics`), side by side.

Engine counters and gauges are read at scrape time from the loop's last published :class:`LoopStats`; the step
time histogram is fed by the loop thread; request outcomes are counted by the HTTP layer; per-request timings are
observed as each request ends.

=========================================  =======  ====================================================
metric                                     type     meaning
=========================================  =======  ====================================================
``pagedcore_requests_total{status}``       counter  HTTP requests by outcome: finished, aborted (the client
                                                    left while its request ran), disconnected (the client
                                                    left while sending its body), failed (the engine or
                                                    the server failed), invalid (400, 404, 413),
                                                    unauthorized, timed_out (408: the body came too
                                                    slowly), overloaded (429), unavailable (shutting down)
``pagedcore_prompt_tokens_total``          counter  prompt tokens of the engine requests that ended
``pagedcore_generation_tokens_total``      counter  tokens the engine sampled
``pagedcore_prefix_cache_queries_total``   counter  prompt tokens looked up in the prefix cache
``pagedcore_prefix_cache_hits_total``      counter  prompt tokens served by the prefix cache (hit rate =
                                                    hits / queries)
``pagedcore_preemptions_total``            counter  sequences preempted (recomputed later)
``pagedcore_failed_steps_total``           counter  engine steps that raised (their requests failed)
``pagedcore_kv_blocks_used``               gauge    KV blocks held by running sequences
``pagedcore_kv_blocks``                    gauge    KV blocks in the pool
``pagedcore_kv_usage``                     gauge    fraction of blocks in use (highest over KV groups)
``pagedcore_requests_waiting``             gauge    requests queued, not yet running
``pagedcore_requests_running``             gauge    sequences running
``pagedcore_step_seconds``                 histo.   duration of one engine step
``pagedcore_kv_store_hits_total{tier}``    counter  blocks loaded from each tier below the pool
``pagedcore_kv_store_bytes{tier}``         gauge    bytes each tier below the pool holds
``pagedcore_kv_store_loaded_tokens_total`` counter  prompt tokens loaded from the tiers (not recomputed)
``pagedcore_kv_store_written_blocks_total`` counter blocks written down by the writer thread
``pagedcore_kv_store_load_seconds_total``  counter  time loading blocks (on the step loop)
``pagedcore_kv_store_write_seconds_total`` counter  time writing blocks (in the writer thread)
``pagedcore_kv_store_skipped_total{why}``  counter  blocks not written: ``queue_full``, ``store_refused``
                                                    (no room, disk full)
``pagedcore_kv_store_refused_total{reason}`` counter stored blocks refused and removed: ``checksum``,
                                                    ``fingerprint``, ``foreign``, ``file`` (not a regular
                                                    file of this user, or over the budget: never read)
=========================================  =======  ====================================================

The ``pagedcore_kv_store_*`` families are exported only when the engine has tiers below its pool (``--kv-store``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.registry import Collector

from pagedcore.adapters.transformers import SamplingParams

from .loop import Finished, RequestLoop
from .vllm_metrics import VllmMetrics

if TYPE_CHECKING:
    from pagedcore.adapters.transformers import EngineStats

__all__ = ["CONTENT_TYPE", "REQUEST_STATUSES", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUEST_STATUSES = (
    "finished",
    "aborted",
    "disconnected",
    "failed",
    "invalid",
    "unauthorized",
    "timed_out",
    "overloaded",
    "unavailable",
)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The metrics of one server (see the module docstring for the list).

    Args:
        loop: the engine loop whose statistics are exported; its steps feed the step time histogram.
        model_name: the ``model_name`` label of the ``vllm:`` series.
        context_length: the model's context (the top of the token-count buckets).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> from pagedcore.serve.loop import EngineLoop
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     metrics = ServeMetrics(EngineLoop(engine))
        ...     metrics.count("invalid")
        ...     text = metrics.render().decode()
        >>> 'pagedcore_requests_total{status="invalid"} 1.0' in text, "pagedcore_kv_blocks 16.0" in text
        (True, True)
    """

    def __init__(self, loop: RequestLoop, *, model_name: str = "model", context_length: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("pagedcore_requests", "HTTP requests by outcome", ["status"], registry=self.registry)
        for status in REQUEST_STATUSES:
            self._requests.labels(status=status)  # every status is exported from the start, at 0
        self._step = Histogram(
            "pagedcore_step_seconds", "Duration of one engine step", buckets=_STEP_BUCKETS, registry=self.registry
        )
        self.registry.register(_LoopCollector(loop))
        GCCollector(registry=self.registry)  # python_gc_*: a full collection stops the step loop (cli/gc_heap.py)
        loop.add_step_listener(self._step.observe)
        self.vllm = VllmMetrics(self.registry, loop, model_name, context_length=context_length)

    def observe_request(self, finished: Finished, params: SamplingParams) -> None:
        """Observe one request that ended (its timings, tokens and parameters; any thread)."""
        self.vllm.observe(finished, params)

    def count(self, status: str) -> None:
        """Count one request with this outcome (one of :data:`REQUEST_STATUSES`)."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"unknown request status {status!r}; expected one of {REQUEST_STATUSES}")
        self._requests.labels(status=status).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _LoopCollector(Collector):
    def __init__(self, loop: RequestLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        stats = self._loop.stats
        engine = stats.engine
        counters = [
            ("pagedcore_prompt_tokens", "Prompt tokens of the engine requests that ended", stats.num_prompt_tokens),
            ("pagedcore_generation_tokens", "Tokens the engine sampled", engine.generated_tokens),
            (
                "pagedcore_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                engine.prefix_query_tokens,
            ),
            ("pagedcore_prefix_cache_hits", "Prompt tokens served by the prefix cache", engine.prefix_hit_tokens),
            ("pagedcore_preemptions", "Sequences preempted (recomputed later)", engine.num_preemptions),
            ("pagedcore_failed_steps", "Engine steps that raised", stats.num_failed_steps),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        gauges = [
            ("pagedcore_kv_blocks_used", "KV blocks held by running sequences", stats.num_used_blocks),
            ("pagedcore_kv_blocks", "KV blocks in the pool", stats.num_blocks),
            ("pagedcore_kv_usage", "Fraction of KV blocks in use (highest over KV groups)", engine.kv_usage),
            ("pagedcore_requests_waiting", "Requests queued, not yet running", stats.num_waiting),
            ("pagedcore_requests_running", "Sequences running", stats.num_running),
        ]
        for name, doc, level in gauges:
            yield GaugeMetricFamily(name, doc, value=level)
        if engine.kv_store_bytes:
            yield from _store_metrics(engine)


def _store_metrics(engine: EngineStats) -> Iterator[Metric]:
    """The ``pagedcore_kv_store_*`` families (see the module docstring)."""
    hits = CounterMetricFamily(
        "pagedcore_kv_store_hits", "Blocks loaded from each tier below the pool", labels=["tier"]
    )
    held = GaugeMetricFamily("pagedcore_kv_store_bytes", "Bytes each tier below the pool holds", labels=["tier"])
    for tier, count in engine.kv_store_hits.items():
        hits.add_metric([tier], count)
    for tier, size in engine.kv_store_bytes.items():
        held.add_metric([tier], size)
    yield hits
    yield held
    for name, doc, value in [
        ("loaded_tokens", "Prompt tokens loaded from the tiers below the pool", engine.kv_store_loaded_tokens),
        ("written_blocks", "Blocks written to the tiers below the pool", engine.kv_store_written_blocks),
        ("load_seconds", "Seconds loading blocks from the tiers (step loop)", engine.kv_store_load_seconds),
        ("write_seconds", "Seconds writing blocks to the tiers (writer thread)", engine.kv_store_write_seconds),
    ]:
        yield CounterMetricFamily(f"pagedcore_kv_store_{name}", doc, value=value)
    skipped = CounterMetricFamily("pagedcore_kv_store_skipped", "Evicted blocks not written", labels=["why"])
    skipped.add_metric(["queue_full"], engine.kv_store_writes_skipped)
    skipped.add_metric(["store_refused"], engine.kv_store_write_failures)
    yield skipped
    refused = CounterMetricFamily("pagedcore_kv_store_refused", "Stored blocks refused and removed", labels=["reason"])
    for reason, count in engine.kv_store_refused.items():
        refused.add_metric([reason], count)
    yield refused
