"""The ``vllm:`` metrics a vLLM dashboard or autoscaler reads, beside pagedcore's own (:mod:`~.metrics`).

Names, types, buckets and labels (``model_name``, ``engine``) are vLLM's (``vllm/v1/metrics/loggers.py``), so its
Grafana dashboard (``examples/online_serving/prometheus_grafana/grafana.json``) and KEDA / HPA rules on
``vllm:num_requests_waiting`` work unchanged. Gauges and engine counters are read at scrape time from the loop's
statistics; the per-request series are observed when a request ends (its :class:`~pagedcore.serve.loop.Finished`
carries the engine's timings).

============================================  =======  ==============================================================
metric                                        type     meaning
============================================  =======  ==============================================================
``vllm:num_requests_running``                 gauge    sequences running
``vllm:num_requests_waiting``                 gauge    requests waiting to run
``vllm:kv_cache_usage_perc``                  gauge    fraction of KV blocks in use (1 = full);
                                                       ``vllm:gpu_cache_usage_perc`` too (vLLM's older name)
``vllm:prompt_tokens_total``                  counter  prompt tokens of the requests that ended
``vllm:generation_tokens_total``              counter  tokens generated
``vllm:prefix_cache_queries_total``           counter  prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``              counter  prompt tokens the prefix cache served
``vllm:num_preemptions_total``                counter  sequences preempted
``vllm:request_success_total``                counter  samples that ended, by ``finished_reason`` (stop, length, abort,
                                                       error)
``vllm:time_to_first_token_seconds``          histo.   arrival in the engine to the first token
``vllm:inter_token_latency_seconds``          histo.   between two tokens of a sample; ``vllm:time_per_output_token_
                                                       seconds`` too (vLLM's older name)
``vllm:e2e_request_latency_seconds``          histo.   arrival to the end
``vllm:request_queue_time_seconds``           histo.   arrival to the first admission (waiting)
``vllm:request_prefill_time_seconds``         histo.   first admission to the first token
``vllm:request_decode_time_seconds``          histo.   first token to the end
``vllm:request_inference_time_seconds``       histo.   first admission to the end (running)
``vllm:request_prompt_tokens``                histo.   prompt tokens per request
``vllm:request_generation_tokens``            histo.   generated tokens per request
``vllm:request_params_n``                     histo.   the ``n`` of each request
``vllm:request_params_max_tokens``            histo.   the ``max_tokens`` of each request
``vllm:request_max_num_generation_tokens``    histo.   prompt tokens + ``max_tokens`` of each request
============================================  =======  ==============================================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedcore.adapters.transformers import SamplingParams

from .loop import Finished, RequestLoop

__all__ = ["FINISHED_REASONS", "VllmMetrics", "token_buckets"]

FINISHED_REASONS = ("stop", "length", "abort", "error")
_LABELS = ("model_name", "engine")
_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
_ERROR_KINDS = {"aborted": "abort", "shutdown": "abort", "failed": "error"}  # never ran: invalid, overloaded


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to ``max_value`` (the context) for the token-count histograms.

    Example:
        >>> token_buckets(100)
        (1, 2, 5, 10, 20, 50, 100)
    """
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    """The ``vllm:`` series of one server, in its registry.

    Args:
        registry: the server's registry.
        loop: the loop whose statistics the gauges and engine counters read.
        model_name: the ``model_name`` label.
        context_length: the largest token-count bucket (default 2**16 without a known context).

    Example:
        >>> from pagedcore.serve.loop import RequestTimings
        >>> class Idle:
        ...     stats = None
        >>> registry = CollectorRegistry()
        >>> metrics = VllmMetrics(registry, Idle(), "m", context_length=64, scrape=False)
        >>> timings = RequestTimings(0.01, 0.2, 0.19, 0.3, 0.5, (0.1, 0.1))
        >>> metrics.observe(Finished("r", 4, (3,), ("stop",), timings=timings), SamplingParams(max_new_tokens=8))
        >>> labels = {"model_name": "m", "engine": "0"}
        >>> registry.get_sample_value("vllm:request_success_total", {**labels, "finished_reason": "stop"})
        1.0
        >>> registry.get_sample_value("vllm:inter_token_latency_seconds_count", labels)
        2.0
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        loop: RequestLoop,
        model_name: str,
        *,
        context_length: int | None = None,
        scrape: bool = True,
    ) -> None:
        """``scrape=False`` leaves out the series read from the loop's statistics (for a loop that has none)."""
        self._label = (model_name, "0")
        tokens = token_buckets(context_length or 2**16)
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=registry,
        )
        for reason in FINISHED_REASONS:
            self.success.labels(*self._label, reason)
        hist: dict[str, tuple[str, tuple[float, ...]]] = {
            "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", _TTFT_BUCKETS),
            "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
            "time_per_output_token_seconds": ("Histogram of time per output token in seconds.", _ITL_BUCKETS),
            "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS),
            "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS),
            "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS),
            "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS),
            "request_inference_time_seconds": (
                "Histogram of time spent in RUNNING phase for request.",
                _LATENCY_BUCKETS,
            ),
            "request_prompt_tokens": ("Number of prefill tokens processed.", tokens),
            "request_generation_tokens": ("Number of generation tokens processed.", tokens),
            "request_params_n": ("Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
            "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", tokens),
            "request_max_num_generation_tokens": (
                "Histogram of maximum number of requested generation tokens.",
                tokens,
            ),
        }
        self.histograms = {
            name: Histogram(f"vllm:{name}", doc, list(_LABELS), buckets=buckets, registry=registry).labels(*self._label)
            for name, (doc, buckets) in hist.items()
        }
        if scrape:
            registry.register(_VllmLoopCollector(loop, self._label))

    def observe(self, finished: Finished, params: SamplingParams) -> None:
        """Count one request that ended (any thread)."""
        if finished.error is None:
            for reason in finished.finish_reasons:
                if reason in FINISHED_REASONS:
                    self.success.labels(*self._label, reason).inc()
        else:
            reason = _ERROR_KINDS.get(finished.error_kind or "")
            if reason is None:
                return  # the engine never took it
            self.success.labels(*self._label, reason).inc(max(1, len(finished.finish_reasons)))
        self._observe_timings(finished)
        h = self.histograms
        h["request_prompt_tokens"].observe(finished.prompt_tokens)
        h["request_generation_tokens"].observe(sum(finished.completion_tokens))
        h["request_params_n"].observe(params.n)
        h["request_params_max_tokens"].observe(params.max_new_tokens)
        h["request_max_num_generation_tokens"].observe(finished.prompt_tokens + params.max_new_tokens)

    def _observe_timings(self, finished: Finished) -> None:
        timings = finished.timings
        if timings is None:
            return
        h = self.histograms
        phases = {
            "time_to_first_token_seconds": timings.first_token,
            "e2e_request_latency_seconds": timings.total,
            "request_queue_time_seconds": timings.queued,
            "request_prefill_time_seconds": timings.prefill,
            "request_decode_time_seconds": timings.decode,
            "request_inference_time_seconds": (
                None if timings.prefill is None or timings.decode is None else timings.prefill + timings.decode
            ),
        }
        for name, seconds in phases.items():
            if seconds is not None:
                h[name].observe(seconds)
        for gap in timings.inter_token:
            h["inter_token_latency_seconds"].observe(gap)
            h["time_per_output_token_seconds"].observe(gap)


class _VllmLoopCollector(Collector):
    def __init__(self, loop: RequestLoop, label: tuple[str, str]) -> None:
        self._loop = loop
        self._label = list(label)

    def collect(self) -> Iterator[Metric]:
        stats = self._loop.stats
        engine = stats.engine
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage),
            (
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage (vLLM's older name of kv_cache_usage_perc).",
                engine.kv_usage,
            ),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(self._label, value)
            yield family
        counters = [
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", engine.generated_tokens),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                engine.prefix_query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                engine.prefix_hit_tokens,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", engine.num_preemptions),
        ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(self._label, value)
            yield counter
