"""Orchestrator metrics (Prometheus)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.metrics import OTHER, STATUS_CODES, TASK_TYPES, TOOL_NAMES

# Agent tasks run from tens of milliseconds to tens of seconds.
TASK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

TASKS = Counter("switchyard_tasks_total", "Tasks finished, by task type and gRPC status code.", ["task_type", "code"])
TASK_DURATION = Histogram(
    "switchyard_task_duration_seconds",
    "Tasks that succeeded, from their start (a RunTask: its arrival, its validation included; a submitted task: "
    "its first start from the backlog, its wait there not counted) to their final event (timings.total_s).",
    ["task_type"],
    buckets=TASK_BUCKETS,
)
TASK_TTFT = Histogram(
    "switchyard_task_ttft_seconds",
    "Tasks that succeeded with a token, from their start (as switchyard_task_duration_seconds) to their first "
    "token (timings.ttft_s).", ["task_type"],
    buckets=TASK_BUCKETS,
)
STAGE_DURATION = Histogram(
    "switchyard_stage_duration_seconds", "Duration of one stage of a task's workflow.", ["stage"], buckets=STAGE_BUCKETS
)
WORKFLOW_STAGES = ("retrieve", "recall", "render_prompt", "infer", "remember", "react")
"""The stages the workflows run (``task.stage(name)`` in workflows.py and react.py), each a ``stage`` label of
:data:`STAGE_DURATION` from the start; a tool call's stage is ``tool:<tool>``, labelled when the tools are known
(program.py's ToolDurations)."""
AGENTS_CONCURRENT = Gauge(
    "switchyard_agents_concurrent",
    "Tasks running and not yet finished: RunTask calls accepted, submitted tasks started (those waiting in the "
    "backlog are switchyard_submitted_tasks{state=\"queued\"}). Served to the HPA as agent_concurrent_count by prometheus-adapter; "
    "a gauge may not end in _count, a suffix Prometheus reserves for histograms and summaries."
)
CPU_POOL_RESTARTS = Counter(
    "switchyard_cpu_pool_restarts_total",
    "Times the CPU worker pool (orchestrator.cpu_executor = process) was found broken (a worker process died) "
    "and replaced by a fresh one.",
)
TOOL_CALLS = Counter("switchyard_tool_calls_total", "Tool calls by tool and outcome.", ["tool", "outcome"])
AGENT_MEMORY_RECALLS = Counter(
    "switchyard_agent_memory_recalls_total",
    "Tasks with an agent_id by what their memory gave: hit (messages recalled), miss (none, or the DRAM tier was "
    "down), dropped (recalled but left out: the prompt would not fit the context window with it).",
    ["outcome"],
)
for _outcome in ("hit", "miss", "dropped"):
    AGENT_MEMORY_RECALLS.labels(_outcome)
DISPATCHER_RETRIES = Counter(
    "switchyard_dispatcher_retries_total",
    "Dispatcher calls tried again on another replica after failing UNAVAILABLE before their first chunk.",
)
TOOL_WAIT_HINTS = Counter(
    "switchyard_tool_wait_hints_total",
    "ToolWait announcements to the dispatcher at a tool call's start, by outcome: ok (answered), deadline_exceeded "
    "(not within orchestrator.program.tool_wait_hint_timeout_ms), unavailable, unimplemented (a dispatcher without "
    "ToolWait), error.",
    ["outcome"],
)
TOOL_WAIT_HINT_OUTCOMES: tuple[str, ...] = ("ok", "deadline_exceeded", "unavailable", "unimplemented", "error")
"""The ``outcome`` label of :data:`TOOL_WAIT_HINTS`: a gRPC code's lower-case name where it is one of them, else
error."""
for _outcome in TOOL_WAIT_HINT_OUTCOMES:
    TOOL_WAIT_HINTS.labels(_outcome)
EARLY_PREFILLS = Counter(
    "switchyard_early_prefills_total",
    "rag_answer prefill_only warm-ups sent while retrieval ran, by outcome: ok, failed (the answer is sent anyway), "
    "cancelled (the task ended first).",
    ["outcome"],
)
for _outcome in ("ok", "failed", "cancelled"):
    EARLY_PREFILLS.labels(_outcome)
SUBMITTED_QUEUE = "submitted"
"""The backlog of submitted tasks by its queue name: ``switchyard_queue_rejected_total{queue}`` counts the submits
its bound (``orchestrator.max_unfinished_submitted_tasks``) refused, ``switchyard_queue_capacity{queue}`` is that
bound and ``switchyard_queue_depth{queue}`` the tasks it counts (held unfinished: queued and running);
``switchyard_queue_wait_seconds{queue, outcome}`` observes each wait there once, as it ends (submitted.py), and a
task's waits there are ``Timings.queue_wait_s["submitted"]``."""
SUBMITTED_TASKS = Gauge(
    "switchyard_submitted_tasks",
    "SubmitTask tasks this orchestrator holds unfinished, by state: queued (in the backlog, waiting for one of "
    "orchestrator.max_running_submitted_tasks) or running.",
    ["state"],
)
CLIENT_WRITE_TIMEOUTS = Counter(
    "switchyard_client_write_timeouts_total",
    "Answers cut because their client took no bytes for the write timeout (a client that stopped reading without "
    "closing), by edge: http (orchestrator.http.write_timeout_s: the connection closed, a RunTask stream's task "
    "cancelled) or grpc (orchestrator.grpc_stream_write_timeout_s: a RunTask call ended, its task cancelled).",
    ["edge"],
)
EDGES = ("http", "grpc")
"""The ``edge`` label of :data:`CLIENT_WRITE_TIMEOUTS`."""
for _edge in EDGES:
    CLIENT_WRITE_TIMEOUTS.labels(_edge)
for _state in ("queued", "running"):
    SUBMITTED_TASKS.labels(_state)
for _task_type in TASK_TYPES:
    for _code in STATUS_CODES:
        TASKS.labels(_task_type, _code)
    # a histogram's series are counters too: there from the start, so that a rate over them sees the first task
    TASK_DURATION.labels(_task_type)
    TASK_TTFT.labels(_task_type)
for _stage in WORKFLOW_STAGES:
    STAGE_DURATION.labels(_stage)
for _tool in (*TOOL_NAMES, OTHER):
    for _outcome in ("ok", "error"):
        TOOL_CALLS.labels(_tool, _outcome)
