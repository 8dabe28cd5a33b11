"""Prometheus metrics of one server: engine gauges and counters read at scrape time, plus latency
histograms. Each app has its own CollectorRegistry, so several apps can live in one process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_GAUGES = {  # Engine.metrics() key -> (metric name, help)
    "num_running": ("engine_requests_running", "Requests holding KV slots in the running batch"),
    "num_waiting": ("engine_requests_waiting", "Requests waiting to be admitted"),
    "kv_slots_used": ("engine_kv_slots_used", "KV cache slots owned by requests"),
    "kv_slots_free": ("engine_kv_slots_free", "KV cache slots free to hand out"),
    "kv_slots_total": ("engine_kv_slots_total", "KV cache slots in the pool (no padding slot)"),
}
_OPTIONAL_GAUGES = {  # read with .get: an engine without a prefix cache has none of them
    "prefix_cache_slots": (
        "engine_prefix_cache_slots",
        "KV slots held by the prefix cache (locked or evictable)",
    ),
    "prefix_cache_locked_slots": (
        "engine_prefix_cache_locked_slots",
        "KV slots of the prefix cache locked by running requests",
    ),
    "prefix_cache_hit_rate": (
        "engine_prefix_cache_hit_rate",
        "Cached / looked-up prompt tokens of the prefix cache since start",
    ),
}
_COUNTERS = {  # Engine.metrics() key -> (metric name without _total, help)
    "generated_tokens": ("engine_generation_tokens", "Tokens generated"),
    "prompt_tokens": ("engine_prompt_tokens", "Prompt tokens submitted"),
    "finished": ("engine_finished_requests", "Requests the engine finished (any reason)"),
    "retractions": ("engine_retractions", "Requests retracted to waiting under KV pressure"),
    "spec_steps_total": ("engine_spec_verify_steps", "Speculative verify steps"),
    "spec_draft_tokens_total": ("engine_spec_draft_tokens", "Speculative draft tokens verified"),
    "spec_accepted_tokens_total": ("engine_spec_accepted_tokens", "Draft tokens accepted"),
    "cached_prompt_tokens": (
        "engine_prefix_cache_hit_tokens",
        "Prompt tokens whose KV came from the prefix cache",
    ),
    "matched_prompt_tokens_queried": (
        "engine_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache at admission",
    ),
    "prefix_cache_evicted_slots": (
        "engine_prefix_cache_evicted_slots",
        "KV slots the prefix cache evicted to make room",
    ),
    "prefix_cache_evictions": (
        "engine_prefix_cache_evictions",
        "Eviction rounds that freed cached slots",
    ),
    "grammar_masks": (
        "engine_grammar_masks",
        "Token masks computed for constrained requests (verify: one per tree node)",
    ),
    "grammar_mask_seconds": (
        "engine_grammar_mask_seconds",
        "Host time spent computing the token masks of constrained requests",
    ),
    "grammar_mask_wait_seconds": (
        "engine_grammar_mask_wait_seconds",
        "Part of the mask time the loop waited for (with a GPU: not hidden behind the forward)",
    ),
    "grammar_tokens_checked": (
        "engine_grammar_tokens_checked",
        "Greedy constrained tokens drawn without a mask and checked against their grammar",
    ),
    "grammar_tokens_redrawn": (
        "engine_grammar_tokens_redrawn",
        "Checked tokens their grammar refused, drawn again under their mask",
    ),
    "grammar_tokens_masked_first": (
        "engine_grammar_tokens_masked_first",
        "Greedy constrained tokens masked first because their grammar refused a recent check",
    ),
    "grammar_drafts_cut": (
        "engine_grammar_drafts_cut",
        "Speculative drafts cut before verify because their grammar rejects them",
    ),
}


class _EngineCollector:
    """Yields the engine's gauges and counters from the last snapshot taken by refresh().

    Counters the engine has not started yet (no retraction, speculation off) and prefix cache
    figures of an engine without one read 0."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self._metrics.snapshot
        for key, (name, help_text) in _GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=snapshot[key])
        for key, (name, help_text) in _OPTIONAL_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=snapshot.get(key, 0))
        for key, (name, help_text) in _COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=snapshot.get(key, 0))
        drafted = snapshot.get("spec_draft_tokens_total", 0)
        rate = snapshot.get("spec_accepted_tokens_total", 0) / drafted if drafted else 0.0
        yield GaugeMetricFamily(
            "engine_spec_acceptance_rate",
            "Accepted / drafted speculative tokens since start",
            value=rate,
        )
        yield GaugeMetricFamily(
            "engine_spec_draft_cost",
            "Time of one draft row in decoded tokens' time, as adaptive drafting last weighed it",
            value=snapshot.get("spec_draft_cost", 0.0),
        )


class ServerMetrics:
    """Everything /metrics shows. Handlers record request latencies; scrapes read the engine."""

    def __init__(self, engine: Any, speculative: bool) -> None:
        self._engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot: dict[str, Any] = engine.metrics()
        self._last_step: object = None
        registry = self.registry
        self.step_seconds = Histogram(
            "engine_step_seconds",
            "Time of one engine step by mode",
            ["mode"],
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            "engine_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.itl_seconds = Histogram(
            "engine_inter_token_latency_seconds",
            "Between two streamed deltas of one request",
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "engine_request_seconds",
            "From arrival to finish",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.requests_finished = Counter(
            "engine_http_requests_finished",
            "HTTP generation requests by finish reason",
            ["endpoint", "finish_reason"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "engine_http_requests_rejected",
            "Requests answered with an error status",
            ["status"],
            registry=registry,
        )
        self.http_in_flight = Gauge(
            "engine_http_requests_in_flight",
            "Generation requests the server is answering",
            registry=registry,
        )  # reads ServerState.in_flight
        self.requests_queued = Gauge(
            "engine_http_requests_queued",
            "Generation requests submitted and not yet admitted (--max-waiting-requests)",
            registry=registry,
        )  # reads AsyncEngine.num_unadmitted
        Gauge(
            "engine_speculative_enabled", "1 when speculative decoding is on", registry=registry
        ).set(1 if speculative else 0)
        registry.register(_EngineCollector(self))

    def _new_steps(self) -> list[tuple[str, float]]:
        """Entries of the engine's recent step-time deque appended since the last scrape, found
        by the identity of the last one observed (the deque drops its oldest entries)."""
        step_times = list(self._engine.step_times)  # one C-level copy: safe beside the loop thread
        for index in range(len(step_times) - 1, -1, -1):
            if step_times[index] is self._last_step:
                return step_times[index + 1 :]
        return step_times

    def refresh(self) -> None:
        """Take a new engine snapshot and observe the steps timed since the previous one."""
        new_steps = self._new_steps()
        for mode, seconds in new_steps:
            self.step_seconds.labels(mode=str(mode)).observe(seconds)
        if new_steps:
            self._last_step = new_steps[-1]
        self.snapshot = self._engine.metrics()

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)
