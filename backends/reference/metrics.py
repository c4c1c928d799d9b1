"""vLLM-compatible Prometheus metrics for the reference backend, on a per-app registry.

Names, types and labels follow vLLM (``model_name``, ``engine``), so whatever scrapes vLLM (the
gateway's backend health, dashboards) reads this backend unchanged. The state gauges (running,
waiting, KV-cache usage) are computed from the scheduler at scrape time rather than set on
engine steps: vLLM only refreshes them on steps and kept reporting ~99 % KV usage after a mass
cancel; here they can never be stale (after an abort, or when idle).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest
from backends.engine.scheduler import Scheduler, SchedulerConfig

# The engine's settings as info gauges (value 1, settings in the labels). The cache one is vLLM's
# own name and labels; vLLM exports no scheduler settings, so that one carries tokengate's prefix
# (the gateway reads it to tell which head-of-line controls are in effect).
CACHE_CONFIG_INFO = "vllm:cache_config_info"
SCHEDULER_CONFIG_INFO = "tokengate:scheduler_config_info"
SCHEDULER_CONFIG_LABELS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "max_long_partial_prefills",
    "scheduling_policy",
    "priority_scope",
    "priority_aging_s",
)

_LABELS = ("model_name", "engine")
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _SchedulerGauges(Collector):
    def __init__(self, scheduler: Scheduler, labels: list[str]) -> None:
        self._scheduler = scheduler
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        s = self._scheduler
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.blocks.usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=list(_LABELS))
            g.add_metric(self._labels, float(value))
            yield g


class EngineMetrics:
    """Implements ``backends.engine.engine.EngineObserver``; label children are bound once."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: str = "0") -> None:
        self.registry = registry
        self._label_values = [model_name, engine_index]
        labels = dict(zip(_LABELS, self._label_values, strict=True))

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=registry, buckets=buckets)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*_LABELS, *extra), registry=registry)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(
            **labels
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS).labels(
            **labels
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS
        ).labels(**labels)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time spent waiting before first scheduled.", _REQUEST_BUCKETS
        ).labels(**labels)
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Time from first scheduled to first token.", _REQUEST_BUCKETS
        ).labels(**labels)
        self.decode = hist(
            "vllm:request_decode_time_seconds", "Time from first token to the last.", _REQUEST_BUCKETS
        ).labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(**labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.").labels(
            **labels
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.").labels(
            **labels
        )
        success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self._success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in ("stop", "length")
        }

    def bind_scheduler(self, scheduler: Scheduler) -> None:
        self.registry.register(_SchedulerGauges(scheduler, self._label_values))

    def publish_config(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        """The settings in effect, as vLLM publishes ``cache_config_info`` (str() of each value)."""
        cache = {"block_size": blocks.block_size, "num_gpu_blocks": blocks.num_blocks}
        Gauge(
            CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", list(cache), registry=self.registry
        ).labels(**{k: str(v) for k, v in cache.items()}).set(1)
        sched = {
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": config.max_model_len,
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "long_prefill_token_threshold": config.long_prefill_token_threshold,
            "max_num_partial_prefills": config.max_num_partial_prefills,
            "max_long_partial_prefills": config.max_long_partial_prefills,
            "scheduling_policy": config.policy,
            "priority_scope": config.priority_scope,
            "priority_aging_s": config.priority_aging_s,
        }
        Gauge(
            SCHEDULER_CONFIG_INFO,
            "The reference engine's scheduler settings (the head-of-line controls in effect)",
            list(SCHEDULER_CONFIG_LABELS),
            registry=self.registry,
        ).labels(**{k: str(v) for k, v in sched.items()}).set(1)

    # ---- EngineObserver ------------------------------------------------------------------

    def on_scheduled(self, req: EngineRequest, queue_time_s: float) -> None:
        self.queue.observe(queue_time_s)

    def on_first_token(self, req: EngineRequest, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(req.num_prompt_tokens)
        if req.first_scheduled_time is not None and req.first_token_time is not None:
            self.prefill.observe(req.first_token_time - req.first_scheduled_time)

    def on_tokens(self, num_tokens: int, inter_token_s: list[float]) -> None:
        self.generation_tokens.inc(num_tokens)
        observe = self.itl.observe
        for v in inter_token_s:
            observe(v)

    def on_finished(self, req: EngineRequest, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        if req.first_token_time is not None and req.finish_time is not None:
            self.decode.observe(req.finish_time - req.first_token_time)
        reason = req.status.finish_reason
        if reason in self._success:
            self._success[reason].inc()

    def on_preempted(self, num: int) -> None:
        self.preemptions.inc(num)
