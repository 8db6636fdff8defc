"""Prometheus metrics of the dispatcher's scheduler.

Names follow Prometheus conventions (``switchyard_`` prefix, base units,
ratios 0-1). The compute score is the exception to "ratios 0-1": it is
published on the 0-100 scale that ``scheduler_config.json``'s thresholds use,
so dashboards and the HPA target (60) read the same numbers as the config.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.priority import LABELS

RUNNING_AGENTS = Gauge(
    "switchyard_running_agents",
    "Sequences holding a running slot on the engine, by priority class.",
    ["priority_class"],
)
WAITING_AGENTS = Gauge(
    "switchyard_waiting_agents", "Sequences waiting for admission, by priority class.", ["priority_class"]
)
PARKED_AGENTS = Gauge(
    "switchyard_parked_agents", "react_loop agents waiting on a tool: no running slot, prefix state kept warm."
)
PARKED_KV_BYTES = Gauge("switchyard_parked_kv_bytes", "Bytes of prefix state kept warm for agents waiting on a tool.")
ADMISSIONS_REFUSED = Counter(
    "switchyard_admissions_refused_total",
    "Scheduling decisions that left work waiting, by the reason the head of the queue was refused "
    "(admission_wave: max_admitted_per_decision admitted in this decision; compute_score: score + expected score "
    ">= high_load_threshold; kv_memory: its KV does not fit the HBM budget; upstream_concurrency: the "
    "upstream's adaptive concurrency limit is reached; upstream_core_reserve: only the upstream slots held back "
    "for CORE are left, a NORMAL or BATCH head waits).",
    ["reason"],
)
for _reason in ("admission_wave", "compute_score", "kv_memory", "upstream_concurrency", "upstream_core_reserve"):
    ADMISSIONS_REFUSED.labels(_reason)
PREEMPTIONS = Counter(
    "switchyard_preemptions_total", "Running sequences preempted for waiting core work, by the victim's class.",
    ["priority_class"],
)
DEADLINES_EXCEEDED = Counter(
    "switchyard_request_deadline_exceeded_total",
    "Requests failed DEADLINE_EXCEEDED by the scheduler when their own deadline passed (waiting or running), "
    "by priority class.",
    ["priority_class"],
)
RESUMES = Counter(
    "switchyard_resumes_total",
    "Sequences that came back: kind=preempted (re-admitted after preemption), tool_warm / tool_restored / "
    "tool_cold (a react_loop agent back from a tool call with its prefix state warm in HBM, in the DRAM "
    "tier, or lost).",
    ["kind"],
)
TOOL_WAIT_EXPIRED = Counter(
    "switchyard_tool_wait_expired_total", "Parked agents whose prefix state was released when tool_wait_ttl_s ran out."
)
PARKED_EVICTED = Counter(
    "switchyard_parked_evicted_total",
    "Parked agents whose prefix state was released early to make room in the HBM budget for running work.",
)
COMPUTE_SCORE = Gauge(
    "switchyard_compute_score",
    "GPU compute score on a 0-100 scale (not a ratio: the scale of scheduler_config.json's thresholds): "
    "weighted sum of NVML GPU, memory-bandwidth and estimated tensor utilisation in percent.",
)
GPU_UTILIZATION = Gauge("switchyard_gpu_utilization_ratio", "NVML GPU utilisation (share of time a kernel ran), 0-1.")
GPU_MEMORY_UTILIZATION = Gauge(
    "switchyard_gpu_memory_utilization_ratio",
    "NVML memory utilisation (share of time memory was read or written), 0-1.",
)
GPU_AVAILABLE = Gauge(
    "switchyard_gpu_available",
    "1 when NVML reads the GPU; 0 when the compute score falls back to the engine busy ratio.",
)
EXPECTED_SCORE = Gauge(
    "switchyard_expected_compute_score",
    "Learned compute score a task of this type adds while running (0-100 scale), used by admission.",
    ["task_type"],
)
TASK_COMPUTE_SCORE_USED = Histogram(
    "switchyard_task_compute_score_used",
    "Per-task compute score x seconds consumed while running (score-seconds: the task's share of the score).",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 50, 100, 500, 1000),
)
TASK_MEMORY_PEAK_BYTES = Histogram(
    "switchyard_task_memory_peak_bytes",
    "Per-task peak KV/prefix-state bytes.",
    buckets=tuple(float(1 << s) for s in range(20, 37, 2)),  # 1 MiB .. 64 GiB
)

for _class in LABELS:  # counters with a known label set start at 0
    PREEMPTIONS.labels(_class)
    DEADLINES_EXCEEDED.labels(_class)
for _kind in ("preempted", "tool_warm", "tool_restored", "tool_cold"):
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
for _decision in ("keep", "swap", "drop"):
    TOOL_WAIT_DECISIONS.labels(_decision)
