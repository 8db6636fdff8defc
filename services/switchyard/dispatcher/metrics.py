"""Prometheus metrics of the dispatcher: batching, engine, latency, scheduling and per-task use.

Names follow Prometheus conventions (``switchyard_`` prefix, base units:
seconds, bytes, ratios 0-1). Queue depth and wait of the inference queue use
the shared ``switchyard_queue_*`` metrics with ``queue="inference"``. The
compute score is the exception to "ratios 0-1": it is published on the 0-100
scale that ``scheduler_config.json``'s thresholds use, so dashboards and the HPA
target (60) read the same numbers as the config.

The scheduler (:mod:`switchyard.dispatcher.scheduler`) records no metric: it
counts and observes as plain data, and the engine loop (step or stream) publishes what
``make_stats()`` reports (:func:`publish_stats`): its gauges, the increase of its
counters, its observations. The memory tiers' own metrics are
:mod:`switchyard.dispatcher.tiers.metrics` (the HBM tier's counters among them,
published here from the scheduler's counts).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Iterable

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.metrics import (
    BATCH_SIZE_BUCKETS,
    INTER_TOKEN_BUCKETS,
    OTHER,
    QUEUE_CAPACITY,
    QUEUE_DEPTH,
    QUEUE_REJECT_REASONS,
    QUEUE_REJECTED,
    QUEUE_WAIT,
    QUEUE_WAIT_OUTCOMES,
    TOOL_NAMES,
    TTFT_BUCKETS,
)
from switchyard.common.priority import LABELS
from switchyard.dispatcher.adaptive_limit import UPSTREAM_CONCURRENCY, UPSTREAM_CORE_RESERVE
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.scheduler.admission import ADMISSION_WAVE, COMPUTE_SCORE
from switchyard.dispatcher.scheduler.base import QUEUE_NAME, SEQUENCE_RESUME_KINDS
from switchyard.dispatcher.scheduler.capacity import KV_MEMORY
from switchyard.dispatcher.scheduler.fair import tenant_labels
from switchyard.dispatcher.scheduler.tool_wait import PREFETCH_TIMINGS, RESUME_KINDS, Decision
from switchyard.dispatcher.tiers import metrics as tier_metrics

if TYPE_CHECKING:
    from switchyard.dispatcher.scheduler.base import SchedulerStats
    from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor

_BATCH_BUCKETS = BATCH_SIZE_BUCKETS
# TTFT: ~5 ms (sim engine, idle) to ~60 s (long prompts on a loaded remote model); the SLO's
# threshold (switchyard.json slo.ttft.threshold_s) must be one of these bounds.
_TTFT_BUCKETS = TTFT_BUCKETS
_ITL_BUCKETS = INTER_TOKEN_BUCKETS

BATCH_SIZE = Histogram(
    "switchyard_batch_size", "Requests per batch flushed from the double buffer.", buckets=_BATCH_BUCKETS
)
FLUSHES = Counter(
    "switchyard_flushes_total", "Double-buffer flushes, by reason (size, interval, drain, idle, step, preempt).", ["reason"]
)
STREAM_MESSAGE_CHUNKS = Histogram(
    "switchyard_generate_stream_message_chunks",
    "Chunks (tokens, tool calls, ends, errors, of any of its requests) per GenerateStream message sent; "
    "more per message is fewer writes for the same output (dispatcher.stream_flush_interval_ms).",
    buckets=_BATCH_BUCKETS,
)
ENGINE_BUSY_RATIO = Gauge(
    "switchyard_engine_busy_ratio",
    "Fraction of wall time the engine spent in prefill or decode (0-1); in front of a model server (the openai "
    "engine), the share of the upstream's concurrency limit its streams held.",
)
TTFT = Histogram(
    "switchyard_ttft_seconds", "Generate received to first token (or tool call) produced, by priority class.",
    ["priority_class"], buckets=_TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "switchyard_inter_token_latency_seconds", "Time between consecutive tokens of one sequence, by priority class.",
    ["priority_class"], buckets=_ITL_BUCKETS,
)
ENGINE_BUSY_SECONDS = Counter(
    "switchyard_engine_busy_seconds",
    "Seconds the engine spent in prefill or decode (the busy ratio's numerator); in front of a model server, "
    "seconds of the upstream's concurrency limit in use.",
)
GENERATED_TOKENS = Counter("switchyard_generated_tokens", "Output tokens the engine produced.")
PROMPT_TOKEN_RATIO = Gauge(
    "switchyard_prompt_token_ratio",
    "The model server's prompt tokens per token of Switchyard's count (cl100k_base), per model an openai engine "
    "measured it for on its recent calls (a high quantile; 1 until measured): window checks scale a prompt's "
    "count by it. Models: those the upstream answered with usage (at most 64).",
    ["model"],
)
DECODE_BOUND = Gauge(
    "switchyard_engine_decode_bound_tokens_per_second",
    "The engine model's decode bound at flush.max_batch_size sequences, tokens per second (the roofline: "
    "batch / decode step time); 0 where the engine has no model of its bound (torch, openai). "
    "rate(generated_tokens) / rate(busy_seconds) / this is the roofline efficiency.",
)
RUNNING_SEQUENCES = Gauge("switchyard_running_sequences", "Sequences in the engine's running set.")
WAITING_SEQUENCES = Gauge(
    "switchyard_waiting_sequences",
    "Sequences waiting for admission: in the double buffer and in the waiting queue (the sum of "
    "switchyard_waiting_agents over its priority classes).",
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
TTFT_BY_CLASS = {_class: TTFT.labels(_class) for _class in LABELS}
INTER_TOKEN_LATENCY_BY_CLASS = {_class: INTER_TOKEN_LATENCY.labels(_class) for _class in LABELS}

# --------------------------------------------------------------------------- scheduling

RUNNING_AGENTS = Gauge(
    "switchyard_running_agents",
    "Sequences holding a running slot on the engine, by priority class.",
    ["priority_class"],
)
WAITING_AGENTS = Gauge(
    "switchyard_waiting_agents",
    "Sequences waiting for admission (in the double buffer and in the waiting queue), by priority class.", ["priority_class"]
)
PARKED_AGENTS = Gauge(
    "switchyard_parked_agents", "react_loop agents waiting on a tool: no running slot, prefix state kept warm."
)
PARKED_KV_BYTES = Gauge("switchyard_parked_kv_bytes", "Bytes of prefix state kept warm for agents waiting on a tool.")
ADMISSIONS_REFUSED = Counter(
    "switchyard_admissions_refused_total",
    "Scheduling decisions that left work waiting, by the reason the head of the queue was refused "
    "(admission_wave: max_admitted_per_decision admitted in this decision; compute_score: score + expected score "
    ">= admission_score_limit; kv_memory: its KV does not fit the HBM budget; upstream_concurrency: the "
    "upstream's adaptive concurrency limit is reached; upstream_core_reserve: only the upstream slots held back "
    "for CORE are left, a NORMAL or BATCH head waits).",
    ["reason"],
)
REFUSAL_REASONS: tuple[str, ...] = (ADMISSION_WAVE, COMPUTE_SCORE, KV_MEMORY, UPSTREAM_CONCURRENCY, UPSTREAM_CORE_RESERVE)
"""Every value of ``switchyard_admissions_refused_total``'s ``reason``: the admission rule's
(:mod:`.scheduler.admission`) and the capacities' (:mod:`.scheduler.capacity`), named where they are decided."""
for _reason in REFUSAL_REASONS:
    ADMISSIONS_REFUSED.labels(_reason)
PREEMPTIONS = Counter(
    "switchyard_preemptions_total",
    "Running sequences sent back to the queue, by class: preempted for waiting core work, or refused by their "
    "upstream for load (429) before their first token.",
    ["priority_class"],
)
DEADLINES_EXCEEDED = Counter(
    "switchyard_request_deadline_exceeded_total",
    "Requests failed DEADLINE_EXCEEDED by the scheduler when their own deadline passed (waiting or running), "
    "by priority class.",
    ["priority_class"],
)
REFUSED_EARLY = Counter(
    "switchyard_requests_refused_early_total",
    "Requests refused DEADLINE_EXCEEDED when they arrived because their task could no longer make its deadline "
    "(the fair policy's negative slack: slack.CannotMeetDeadline), instead of being served late, by priority class.",
    ["priority_class"],
)
RESUMES = Counter(
    "switchyard_resumes_total",
    "Sequences that came back, by resume: preempted (re-admitted after preemption), or a react_loop agent back "
    "from a tool call with its prefix state warm (in HBM), restored (from the DRAM tier, at admission) or cold "
    "(recomputed); the tool resumes' values are switchyard_tool_resumes_total's.",
    ["resume"],
)
TOOL_WAIT_EXPIRED = Counter(
    "switchyard_tool_wait_expired_total", "Parked agents whose prefix state left HBM when their time parked ran out (tool_wait_ttl_s, or a KEEP decision's "
    "revisit time: the expected wait and as long again, or the P95 of the tool's measured returns)."
)
PARKED_EVICTED = Counter(
    "switchyard_parked_evicted_total",
    "Parked agents whose prefix state was released early to make room in the HBM budget for running work.",
)
COMPUTE_SCORE = Gauge(
    "switchyard_compute_score",
    "GPU compute score on a 0-100 scale (not a ratio: the scale of scheduler_config.json's thresholds): "
    "weighted sum of NVML GPU, memory-bandwidth and estimated tensor utilisation in percent; without NVML "
    "(switchyard_gpu_available 0) the same sum of the engine's own readings (scheduler_config.json "
    "score_without_nvml: its modelled activity, or its busy ratio alone).",
)
GPU_UTILIZATION = Gauge("switchyard_gpu_utilization_ratio", "NVML GPU utilisation (share of time a kernel ran), 0-1; "
                        "NaN while NVML reads no GPU (switchyard_gpu_available 0).")
GPU_MEMORY_UTILIZATION = Gauge(
    "switchyard_gpu_memory_utilization_ratio",
    "NVML memory utilisation (share of time memory was read or written), 0-1; NaN while NVML reads no GPU.",
)
GPU_AVAILABLE = Gauge(
    "switchyard_gpu_available",
    "1 when NVML reads the GPU; 0 when the compute score comes from the engine instead (score_without_nvml: "
    "its modelled activity, the sim engine's default, or its busy ratio).",
)
EXPECTED_SCORE = Gauge(
    "switchyard_expected_compute_score",
    "Learned compute score a task of this type adds while running (0-100 scale), used by admission.",
    ["task_type"],
)
TASK_COMPUTE_SCORE_USED = Histogram(
    "switchyard_task_compute_score_used",
    "Compute score x seconds one model call (a dispatcher request that ran) consumed while running (score-seconds: "
    "its share of the score); a task's is the sum of its calls' (a react_loop step, a rag_answer warm-up: each "
    "observed alone), GetTaskStatus's compute_score_used.",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 50, 100, 500, 1000),
)
TASK_MEMORY_PEAK_BYTES = Histogram(
    "switchyard_task_memory_peak_bytes",
    "Peak KV/prefix-state bytes of one model call (a dispatcher request that ran); a task's is the largest of its "
    "calls', GetTaskStatus's memory_peak_mb.",
    buckets=tuple(float(1 << s) for s in range(20, 37, 2)),  # 1 MiB .. 64 GiB
)

for _class in LABELS:  # counters with a known label set start at 0
    PREEMPTIONS.labels(_class)
    DEADLINES_EXCEEDED.labels(_class)
    REFUSED_EARLY.labels(_class)
for _kind in SEQUENCE_RESUME_KINDS:
    RESUMES.labels(_kind)

TOOL_WAIT_DECISIONS = Counter(
    "switchyard_tool_wait_decisions_total",
    "Tool-wait decisions at tool start (scheduler.tool_wait): keep the agent's KV in HBM for the expected wait, "
    "swap it to the DRAM tier, or drop it and recompute at resume; by decision.",
    ["decision"],
)
TOOL_WAIT_EXPECTED_SECONDS = Histogram(
    "switchyard_tool_wait_expected_seconds",
    "Expected tool waits the orchestrator reported at tool start, seconds.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
for _decision in Decision:
    TOOL_WAIT_DECISIONS.labels(_decision.value)

TOOL_LABELS: tuple[str, ...] = (*TOOL_NAMES, OTHER)
"""The ``tool`` label values of the per-tool tool-wait metrics (the orchestrator's registered tools, and
``other`` for any other name a ToolWait carries)."""
TOOL_WAIT_DECISIONS_BY_TOOL = Counter(
    "switchyard_tool_wait_decisions_by_tool_total",
    "Tool-wait decisions at tool start, by tool and decision (keep, swap, drop); the tool is one of the "
    "orchestrator's registered tools or other.",
    ["tool", "decision"],
)
TOOL_RESUMES = Counter(
    "switchyard_tool_resumes_total",
    "Agents back from a tool whose wait was decided at tool start, by tool and how the next step found the "
    "prefix: warm (still in HBM, kept or restored ahead of the turn), restored (from the DRAM tier, at "
    "admission) or cold (recomputed).",
    ["tool", "resume"],
)
TOOL_WAIT_PREFETCHES = Counter(
    "switchyard_tool_wait_prefetches_total",
    "Planned restores of swapped agents' KV, by tool and how the tool returned against the plan: early (the "
    "next turn came before the KV was back: restored at admission), on_time (back in HBM before the turn, "
    "the turn by the tool's revisit time: expected wait + grace, or the P95 of its measured returns), late (back, and still unclaimed in HBM at "
    "the revisit time).",
    ["tool", "tool_return"],
)
TENANT_SERVICE = Counter(
    "switchyard_tenant_service_tokens",
    "Tokens of service the fair policy charged each tenant (prompt tokens prefilled, one per decoded token: its "
    "attained service, not decayed; scheduler.policy fair only), by tenant: those scheduler.tenant_weights "
    "names, default, and other for the rest.",
    ["tenant"],
)


def start_tenant_labels(tenant_weights: Iterable[str]) -> None:
    """Start ``switchyard_tenant_service_tokens_total`` at 0 for each of its label values under this config
    (:func:`~switchyard.dispatcher.scheduler.fair.tenant_labels`, and ``other``)."""
    for tenant in (*tenant_labels(tenant_weights), OTHER):
        TENANT_SERVICE.labels(tenant)


for _tool in TOOL_LABELS:
    for _decision in Decision:
        TOOL_WAIT_DECISIONS_BY_TOOL.labels(_tool, _decision.value)
    for _resume in RESUME_KINDS:
        TOOL_RESUMES.labels(_tool, _resume)
    for _timing in PREFETCH_TIMINGS:
        TOOL_WAIT_PREFETCHES.labels(_tool, _timing)

for _reason in FlushReason:
    FLUSHES.labels(_reason.label)
for _reason in QUEUE_REJECT_REASONS:
    QUEUE_REJECTED.labels(QUEUE_NAME, _reason)
QUEUE_DEPTH.labels(QUEUE_NAME).set(0)  # then published from make_stats by the loop
QUEUE_WAIT_INFERENCE = {_outcome: QUEUE_WAIT.labels(QUEUE_NAME, _outcome) for _outcome in QUEUE_WAIT_OUTCOMES}
# publish_stats' gauges bound once (a labels() lookup costs about what the set does)
_QUEUE_DEPTH_INFERENCE = QUEUE_DEPTH.labels(QUEUE_NAME)
_QUEUE_CAPACITY_INFERENCE = QUEUE_CAPACITY.labels(QUEUE_NAME)
_RUNNING_BY_CLASS = {_class: RUNNING_AGENTS.labels(_class) for _class in LABELS}
_WAITING_BY_CLASS = {_class: WAITING_AGENTS.labels(_class) for _class in LABELS}
_EXPECTED_BY_TYPE: dict[str, Gauge] = {}  # bound on first publication; task types are a bounded set

_HBM = "hbm"
_LABELLED = (  # SchedulerCounters field -> the counter family its per-label counts increase
    ("flushes", FLUSHES),
    ("admissions_refused", ADMISSIONS_REFUSED),
    ("preemptions", PREEMPTIONS),
    ("deadlines_exceeded", DEADLINES_EXCEEDED),
    ("refused_early", REFUSED_EARLY),
    ("resumes", RESUMES),
    ("tool_decisions", TOOL_WAIT_DECISIONS_BY_TOOL),  # keyed (tool, decision)
    ("tool_resumes", TOOL_RESUMES),  # keyed (tool, resume)
    ("tool_prefetches", TOOL_WAIT_PREFETCHES),  # keyed (tool, timing)
    ("tenant_service", TENANT_SERVICE),
)
_PLAIN = (  # SchedulerCounters field -> the counter it increases
    ("tool_wait_expired", TOOL_WAIT_EXPIRED),
    ("parked_evicted", PARKED_EVICTED),
    ("hbm_hits", tier_metrics.TIER_HITS.labels(_HBM)),
    ("hbm_misses", tier_metrics.TIER_MISSES.labels(_HBM)),
    ("hbm_evictions", tier_metrics.TIER_EVICTIONS.labels(_HBM)),
    ("hbm_scans", tier_metrics.SCANS.labels(_HBM)),
    ("kv_oom_avoided", tier_metrics.OOM_AVOIDED),
    ("kv_oom", tier_metrics.OOM),
    ("defragmentations", tier_metrics.DEFRAGMENTATIONS),
    ("defrag_freed_bytes", tier_metrics.DEFRAG_FREED_BYTES),
    ("restored_tokens", tier_metrics.RESTORED_TOKENS),
    ("recomputed_tokens", tier_metrics.RECOMPUTED_TOKENS),
)


def publish_stats(stats: "SchedulerStats") -> None:
    """Publish one :meth:`~switchyard.dispatcher.scheduler.base.Scheduler.make_stats` report (the engine loop
    calls it after each scheduler call that changes what it reports).

    Gauges are set to the state reported: running and waiting requests by priority class and in all, the
    inference queue's depth and capacity, parked agents and their bytes, the HBM tier's bytes, the compute
    score (while no monitor is published at scrape time: :func:`publish_compute_score_at_scrape`), the
    GPU readings, the KV fragmentation ratio, the learned expected scores. Counters are increased by what
    the report counted since the previous one (``stats.counters``), histograms observe its events
    (``stats.events``). Spans are the loop's (``dispatcher.batch`` per flushed batch).
    """
    global _published_score, _scraped
    for name, count in stats.running.items():
        _RUNNING_BY_CLASS[name].set(count)
    for name, count in stats.waiting.items():
        _WAITING_BY_CLASS[name].set(count)
    RUNNING_SEQUENCES.set(stats.num_running)
    WAITING_SEQUENCES.set(stats.num_waiting)
    _QUEUE_DEPTH_INFERENCE.set(stats.num_queued)
    _QUEUE_CAPACITY_INFERENCE.set(stats.queue_capacity)
    PARKED_AGENTS.set(stats.parked)
    PARKED_KV_BYTES.set(stats.parked_kv_bytes)
    if stats.hbm_held_bytes is not None:
        tier_metrics.TIER_BYTES.labels(_HBM).set(stats.hbm_held_bytes)
    _published_score = stats.compute_score
    if _scraped is not None and _scraped.closed:  # a closed monitor shows its last score until now
        _scraped = None
    if stats.gpu_available is not None:
        GPU_AVAILABLE.set(1 if stats.gpu_available else 0)
        if not stats.gpu_available:  # not read: NaN, not a 0 that reads as an idle GPU
            GPU_UTILIZATION.set(math.nan)
            GPU_MEMORY_UTILIZATION.set(math.nan)
    if stats.gpu_utilization is not None:
        GPU_UTILIZATION.set(stats.gpu_utilization)
    if stats.gpu_memory_utilization is not None:
        GPU_MEMORY_UTILIZATION.set(stats.gpu_memory_utilization)
    tier_metrics.FRAGMENTATION.set(stats.fragmentation_ratio)
    for task_type, value in stats.expected_scores.items():
        gauge = _EXPECTED_BY_TYPE.get(task_type)
        if gauge is None:
            gauge = _EXPECTED_BY_TYPE[task_type] = EXPECTED_SCORE.labels(task_type)
        gauge.set(value)

    counted = vars(stats.counters)
    for name, family in _LABELLED:
        for label, n in counted[name].items():
            (family.labels(*label) if isinstance(label, tuple) else family.labels(label)).inc(n)
    for label, n in stats.counters.tool_wait_decisions.items():  # the per-tool counts, summed over the tools
        TOOL_WAIT_DECISIONS.labels(label).inc(n)
    for label, n in stats.counters.queue_rejections.items():
        QUEUE_REJECTED.labels(QUEUE_NAME, label).inc(n)
    for name, counter in _PLAIN:
        n = counted[name]
        if n:
            counter.inc(n)

    events = stats.events
    for flush in events.flushed:
        BATCH_SIZE.observe(len(flush.members))
    for outcome, wait in events.queue_waits_s:
        QUEUE_WAIT_INFERENCE[outcome].observe(wait)
    for wait in events.tool_wait_expected_s:
        TOOL_WAIT_EXPECTED_SECONDS.observe(wait)
    for used in events.task_compute_score_used:
        TASK_COMPUTE_SCORE_USED.observe(used)
    for peak in events.task_memory_peak_bytes:
        TASK_MEMORY_PEAK_BYTES.observe(peak)


_scraped: "ComputeScoreMonitor | None" = None
"""The monitor ``switchyard_compute_score`` re-samples at scrape time (:func:`publish_compute_score_at_scrape`)."""
_published_score = 0.0
"""The compute score of the last report published (:func:`publish_stats`)."""


def publish_compute_score_at_scrape(monitor: "ComputeScoreMonitor") -> None:
    """Make ``switchyard_compute_score`` re-sample ``monitor`` (its ``scrape()``) whenever it is collected,
    so an autoscaler reads the load of the last sample interval, not of the scheduler's last decision.

    The gauge is process-wide (one dispatcher per process in production). Once ``monitor`` is closed it
    shows the monitor's last score until the next :func:`publish_stats`, which then shows the reports'
    scores again. The engine loop calls this when it starts; schedulers stepped on a simulated clock are
    never re-sampled on the wall clock.
    """
    global _scraped
    _scraped = monitor


def _compute_score() -> float:
    monitor = _scraped
    if monitor is None:
        return _published_score
    return monitor.score if monitor.closed else monitor.scrape()


COMPUTE_SCORE.set_function(_compute_score)
