"""Prometheus metrics of the dispatcher: batching, engine, latency and per-task use.

Names follow Prometheus conventions (``switchyard_`` prefix, base units:
seconds, bytes, ratios 0-1). Queue depth and wait of the inference queue use
the shared ``switchyard_queue_*`` metrics with ``queue="inference"``. The
per-task ``switchyard_task_compute_score_used`` and
``switchyard_task_memory_peak_bytes`` histograms, and the per-class running,
waiting and preemption metrics, are recorded by the scheduler, which does the
accounting (``switchyard.dispatcher.scheduler.metrics``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.metrics import QUEUE_DEPTH, TTFT_BUCKETS
from switchyard.common.priority import LABELS as PRIORITY_LABELS

if TYPE_CHECKING:
    from switchyard.dispatcher.scheduler.base import SchedulerStats

# Batch sizes: powers of two up to the largest flush.max_batch_size worth plotting.
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# TTFT: ~5 ms (sim engine, idle) to ~60 s (long prompts on a loaded remote model); the SLO's
# threshold (switchyard.json slo.ttft.threshold_s) must be one of these bounds.
_TTFT_BUCKETS = TTFT_BUCKETS
# Inter-token latency: sub-millisecond (batched decode) to seconds (stalled stream).
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)

BATCH_SIZE = Histogram(
    "switchyard_batch_size", "Requests per batch flushed from the double buffer.", buckets=_BATCH_BUCKETS
)
FLUSHES = Counter(
    "switchyard_flushes_total", "Double-buffer flushes, by reason (size, interval, drain, idle, step, preempt).", ["reason"]
)
ENGINE_BUSY_RATIO = Gauge(
    "switchyard_engine_busy_ratio", "Fraction of wall time the engine spent in prefill or decode (0-1)."
)
PRIORITY_CLASSES = PRIORITY_LABELS
"""The priority classes: the only ``priority_class`` label values."""
TTFT = Histogram(
    "switchyard_ttft_seconds", "Generate received to first token (or tool call) produced, by priority class.",
    ["priority_class"], buckets=_TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "switchyard_inter_token_latency_seconds", "Time between consecutive tokens of one sequence, by priority class.",
    ["priority_class"], buckets=_ITL_BUCKETS,
)
ENGINE_BUSY_SECONDS = Counter(
    "switchyard_engine_busy_seconds", "Seconds the engine spent in prefill or decode (the busy ratio's numerator)."
)
GENERATED_TOKENS = Counter("switchyard_generated_tokens", "Output tokens the engine produced.")
DECODE_BOUND = Gauge(
    "switchyard_engine_decode_bound_tokens_per_second",
    "The engine model's decode bound at flush.max_batch_size sequences, tokens per second (the roofline: "
    "batch / decode step time); 0 where the engine has no model of its bound (torch, openai). "
    "rate(generated_tokens) / rate(busy_seconds) / this is the roofline efficiency.",
)
RUNNING_SEQUENCES = Gauge("switchyard_running_sequences", "Sequences in the engine's running set.")
WAITING_SEQUENCES = Gauge(
    "switchyard_waiting_sequences", "Sequences flushed to the scheduler and waiting for admission."
)
PREFIX_CACHE_BLOCKS = Counter(
    "switchyard_prefix_cache_blocks_total",
    "Prompt blocks looked up in the engine's prefix cache, by result (hit: its KV was reused; miss: computed).",
    ["result"],
)
for _result in ("hit", "miss"):
    PREFIX_CACHE_BLOCKS.labels(_result)
PREFIX_CACHE_BYTES = Gauge(
    "switchyard_prefix_cache_bytes", "Device memory held by cached prompt blocks (evicted when running work needs it)."
)
# Every class's latency series exist (at 0) before its first request, bound once: the step loop
# observes inter-token latency per token, and a labels() lookup costs more than the observation.
TTFT_BY_CLASS = {_class: TTFT.labels(_class) for _class in PRIORITY_CLASSES}
INTER_TOKEN_LATENCY_BY_CLASS = {_class: INTER_TOKEN_LATENCY.labels(_class) for _class in PRIORITY_CLASSES}


def publish_stats(stats: "SchedulerStats") -> None:
    """Set the scheduler's gauges from ``make_stats()`` (the step loop calls it after each decision and
    whenever requests end): running and waiting requests by priority class and in all, the inference
    queue's depth, and the HBM tier's bytes."""
    from switchyard.dispatcher.scheduler import metrics as scheduler_metrics
    from switchyard.dispatcher.tiers import metrics as tier_metrics

    for name, count in stats.running.items():
        scheduler_metrics.RUNNING_AGENTS.labels(name).set(count)
    for name, count in stats.waiting.items():
        scheduler_metrics.WAITING_AGENTS.labels(name).set(count)
    RUNNING_SEQUENCES.set(stats.num_running)
    WAITING_SEQUENCES.set(stats.num_waiting)
    QUEUE_DEPTH.labels("inference").set(stats.num_queued)
    if stats.hbm_held_bytes is not None:
        tier_metrics.TIER_BYTES.labels("hbm").set(stats.hbm_held_bytes)
