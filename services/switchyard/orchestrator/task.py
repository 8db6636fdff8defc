"""One task's state while its workflow runs: its events, its stages and its CPU work.

A workflow (workflows.py) reads and writes a :class:`Task`; everything that
leaves the task goes through it:

- events to the caller, in order, through ``emit`` (``accepted`` once, then
  ``stage``, ``token``, ``tool_call``, ``tool_result``; the final event is
  built by :meth:`Task.final_event` once the workflow returns);
- each stage through :meth:`Task.stage`: its span, its stage event, its timing
  and ``switchyard_stage_duration_seconds``;
- CPU work through :meth:`Task.cpu`: one trip through the orchestration queue
  into the CPU executor;
- generation through :meth:`Task.generate`, which streams tokens on as they
  arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common import telemetry
from switchyard.common.config import SwitchyardConfig
from switchyard.common.config.limits import ContextWindow
from switchyard.common.errors import TaskDeadlineExceeded
from switchyard.common.queues import WorkQueue
from switchyard.orchestrator import prompts
from switchyard.orchestrator.addresses import EdgeText
from switchyard.orchestrator.agent_memory import AgentMemory, MemoryMessage
from switchyard.orchestrator.clients import InferenceClient, RetrievalClient
from switchyard.orchestrator.metrics import CPU_POOL_RESTARTS, EARLY_PREFILLS, STAGE_DURATION
from switchyard.orchestrator.program import Budget, Program
from switchyard.orchestrator.tools import TOOL_NAMES, Tool
from switchyard.orchestrator.validation import TaskSpec

tracer = telemetry.get_tracer(__name__)
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Deps:
    """What every task of one orchestrator shares."""

    config: SwitchyardConfig
    queue: WorkQueue
    """The orchestration queue: CPU work waits here for a worker (``queues.orchestration``)."""
    executor: Executor | None
    """Runs CPU jobs; None runs them on the event loop (orchestrator.cpu_executor = "loop")."""
    retrieval: RetrievalClient
    inference: InferenceClient
    memory: AgentMemory | None = None
    """Agent memory in the DRAM tier; None: tasks run without memory."""
    program: Program = None  # type: ignore[assignment]
    """Step and tool times measured across tasks (orchestrator/program.py); built from ``config`` when not given."""
    new_executor: Callable[[], Awaitable[Executor | None]] | None = None
    """Builds a fresh executor of the same kind, warmed (:meth:`renew_executor`); None: a broken one stays broken."""
    edge: EdgeText = None  # type: ignore[assignment]
    """What callers read of an error a task makes (a tool's error result: react.py), internal addresses hidden
    (orchestrator/addresses.py); the servicer's own, built from ``config`` when not given."""
    _renewing: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        if self.program is None:
            orch = self.config.orchestrator
            self.program = Program(orch.program, TOOL_NAMES, orch.react.max_steps)
        if self.edge is None:
            self.edge = EdgeText.for_config(self.config)

    async def renew_executor(self, broken: Executor) -> Executor:
        """A fresh executor in place of ``broken``, a process pool one of whose workers died (the pool
        refuses every job after that: ``BrokenProcessPool``); the first caller builds it, the others find it.
        Counted in ``switchyard_cpu_pool_restarts_total``.

        Raises:
            BrokenProcessPool: no ``new_executor`` to build one with.
        """
        async with self._renewing:
            if self.executor is broken:
                if self.new_executor is None:
                    raise BrokenProcessPool("the CPU worker pool is broken and cannot be replaced")
                log.warning("orchestrator: a CPU worker process died; replacing the pool (%s)", type(broken).__name__)
                self.executor = await self.new_executor()
                CPU_POOL_RESTARTS.inc()
                broken.shutdown(wait=False, cancel_futures=True)
            assert self.executor is not None
            return self.executor


@dataclass(eq=False)
class Task:
    """The state of one task while its workflow runs. Events go to ``emit`` in order.

    Times are ``time.monotonic()`` seconds; ``t0`` is the task's start, what its timings count from: a RunTask's
    arrival (its validation included); a submitted task's first start from the backlog (its wait there is
    ``timings.queue_wait_s["submitted"]``), over every run of a task started again.
    """

    spec: TaskSpec
    deps: Deps
    emit: Callable[[agent_pb2.TaskEvent], None]
    deadline_s: float
    """``time.monotonic()`` instant by which the task must end."""
    deadline_source: str
    """What set the deadline (a config key or the caller), for the error message."""
    inline: bool = False
    """The whole workflow runs inside one orchestration worker (``orchestrator.inference_mode = inline``)."""
    trace_id: str = ""
    t0: float = field(default_factory=time.monotonic)
    accepted_sent: bool = False
    passages: list[agent_pb2.Passage] = field(default_factory=list)
    """What the answer could cite: retrieved passages and what ``search_docs`` returned."""
    history: list[MemoryMessage] = field(default_factory=list)
    """The agent's recalled memory, oldest first."""
    prompt: prompts.RenderedPrompt | None = None
    prompt_tokens: int = 0
    messages: list[agent_pb2.ChatMessage] = field(default_factory=list)
    """The conversation sent to the dispatcher; empty: the prompt goes as one text."""
    output: str = ""
    token_index: int = 0
    usage: agent_pb2.TokenUsage = field(default_factory=agent_pb2.TokenUsage)
    timings: agent_pb2.Timings = field(default_factory=agent_pb2.Timings)
    compute_score_used: float = 0.0
    memory_peak_bytes: int = 0
    model: str = ""
    """The model that answered, from the dispatcher's done chunk."""
    finish_reason: str = ""
    """Why the last model call ended (stop, length, tool_calls), from the dispatcher's done chunk."""
    waited_on: str = ""
    """What its last model step waited on as it was cut short (cancelled, failed, past its deadline), from the
    dispatcher's answer (``GenerateDone.waited_on``: "the model server at http://host:port (model m) for 4 s"); ""
    when it was not, or waited on nothing. A task that runs out of time names it (:meth:`out_of_time`)."""
    generations: int = 0

    @property
    def uses_memory(self) -> bool:
        """Whether the task recalls and records agent memory: it has an agent_id and memory is on."""
        memory = self.deps.memory
        return bool(self.spec.agent_id) and memory is not None and memory.config.enabled

    # ------------------------------------------------------------------ events and accounting

    def accept(self, position: int) -> None:
        """Send ``accepted`` (once) with the task's place in the orchestration queue."""
        if not self.accepted_sent:
            self.accepted_sent = True
            self.emit(agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(
                task_id=self.spec.task_id, queue_position=position, trace_id=self.trace_id)))

    def add_wait(self, queue: str, seconds: float) -> None:
        """Add ``seconds`` waited in ``queue`` (orchestration, retrieval, inference) to the task's timings (the
        submitted backlog's wait is added by the backlog: ``submitted._left_backlog``)."""
        waits = self.timings.queue_wait_s
        waits[queue] = waits.get(queue, 0.0) + seconds

    @property
    def target_model(self) -> str:
        """The model this task's calls go to: its own, or the dispatcher's default model ("" while unknown)."""
        return self.spec.model or self.deps.inference.known_default_model

    def context_window(self) -> ContextWindow:
        """The context window of :attr:`target_model`: ``limits.context_window`` of it, with the window its
        model server reports and the ratio of the server's prompt tokens to this orchestrator's count the
        dispatcher measured (:meth:`InferenceClient.prompt_token_ratio`): every check of the task's prompt
        against it measures the prompt in the server's tokens."""
        model, inference = self.target_model, self.deps.inference
        return self.deps.config.limits.context_window(model, inference.reported_context_window(model),
                                                      inference.prompt_token_ratio(model))

    def remaining(self) -> float:
        """Seconds left before the task's deadline (at least 1 ms, so a call started now fails by itself)."""
        return max(0.001, self.deadline_s - time.monotonic())

    def stage(self, name: str, *, metric_stage: str = "", span_name: str = "", **attributes: str) -> "Stage":
        """``async with task.stage("retrieve") as span:`` runs the block as one stage of the task.

        The block runs inside the stage's span, named ``span_name`` or ``name``, with
        ``switchyard.stage`` = ``name`` and each of ``attributes`` as ``switchyard.<key>``; ``span``
        is that span (the invalid span while tracing is off). The stage's seconds are added to
        ``timings.stage_s[name]`` however the block ends (a failed task's status shows where its time
        went). When it ends without an exception, they are also observed in
        ``switchyard_stage_duration_seconds{stage}`` (``metric_stage`` when given: a bounded stand-in
        for a name a model chose) and sent as a stage event carrying ``attributes``; an exception
        passes through, recorded on the span.
        """
        return Stage(self, name, metric_stage or name, span_name or name, attributes)

    async def cpu(self, fn: Callable[..., T], *args: Any, size_chars: int | None = None) -> T:
        """Run ``fn(*args)`` in the CPU executor: one trip through the orchestration queue.

        ``fn`` must be a module-level function with picklable arguments and result (the executor may
        be a process pool). The task waits for an orchestration worker first, unless it already holds
        one (inline mode); the wait is added to ``timings.queue_wait_s["orchestration"]`` and traced
        as ``orchestration.queue_wait``. ``size_chars``: the characters of text ``fn`` works on; at
        most ``orchestrator.cpu_inline_max_chars`` runs it on the event loop, where a pool trip
        would cost more than the work.

        Raises:
            QueueFullError: ``queues.orchestration.capacity`` tasks already wait (RESOURCE_EXHAUSTED).
            QueueTimeoutError: no worker took it within ``queues.orchestration.timeout_ms``
                (DEADLINE_EXCEEDED).
            Exception: whatever ``fn`` raised.
        """
        executor = self.deps.executor
        if size_chars is not None and size_chars <= self.deps.config.orchestrator.cpu_inline_max_chars:
            executor = None

        async def execute() -> T:
            if executor is None:
                return fn(*args)
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(executor, fn, *args)
            except BrokenProcessPool:  # a worker died (this job's or another's): once more, on a fresh pool
                return await loop.run_in_executor(await self.deps.renew_executor(executor), fn, *args)

        if self.inline:  # the task holds its worker already
            return await execute()
        queue = self.deps.queue
        enqueued = time.time_ns()
        result, wait = await queue.submit(execute).result()
        telemetry.start_queue_wait_span(tracer, "orchestration.queue_wait", queue.name, enqueued).end(
            end_time=enqueued + int(wait * 1e9))
        self.add_wait(queue.name, wait)
        return result

    # ------------------------------------------------------------------ inference

    async def generate(self, tools: Sequence[Tool] = (), resume: bool = False,
                       max_tokens: int | None = None) -> tuple[str, list[agent_pb2.ToolCall]]:
        """One Generate call on the dispatcher, its tokens sent on to the caller as they arrive.

        Sends the prompt as text, or ``messages`` when the task has them; ``tools`` are offered to the
        model; ``resume`` marks a react_loop turn after a tool call (its prefix may be warm); ``max_tokens``:
        this call's, where it is not the task's (a react_loop step in what its conversation left of the
        window). The
        request carries the step's budget (time left, expected work after it: :meth:`Program.budget`);
        the step's time is measured (``model`` steps of the task type) when it succeeds.

        Returns:
            The text and the tool calls of this turn.

        Raises:
            TaskRefusedEarly: the task's time left is below its expected work (DEADLINE_EXCEEDED).
            ServiceUnavailable, SwitchyardError: see :meth:`InferenceClient.generate`.
        """
        program, workflow = self.deps.program, self.spec.workflow
        budget = program.budget(self.spec.task_id, workflow, self.deadline_s, self.generations,
                                max_tokens=self.spec.max_tokens if max_tokens is None else max_tokens,
                                deadline_source=self.deadline_source)
        started, made = time.monotonic(), 0
        turn, self.generations = self.generations, self.generations + 1
        text: list[str] = []
        calls: list[agent_pb2.ToolCall] = []
        emit, TaskEvent, TokenEvent = self.emit, agent_pb2.TaskEvent, agent_pb2.TokenEvent
        stream = self.deps.inference.generate(
            self.spec, turn,
            prompt=self.prompt.text if self.prompt is not None and not self.messages else "",
            messages=self.messages, prompt_tokens=self.prompt_tokens, tools=tools, resume=resume,
            timeout_s=self.remaining(), budget=budget, max_tokens=max_tokens, on_consumed=self.count_step,
        )
        # closed here, not when collected: a loop left by an error cancels the step now and counts what it used
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                kind = chunk.WhichOneof("chunk")
                if kind == "token":
                    if self.token_index == 0:
                        self.timings.ttft_s = time.monotonic() - self.t0
                    token = chunk.token.text
                    count = max(1, chunk.token.count)  # several tokens when the dispatcher's stream caught up
                    text.append(token)
                    emit(TaskEvent(token=TokenEvent(text=token, index=self.token_index, count=count)))
                    self.token_index += count
                elif kind == "tool_call":
                    calls.append(chunk.tool_call)
                elif kind == "done":
                    made = chunk.done.usage.completion_tokens
                    self.count_step(chunk.done)
        program.steps.observe(workflow, "model", time.monotonic() - started, made)
        return "".join(text), calls

    def count_step(self, done: agent_pb2.GenerateDone) -> None:
        """Count one model step's done in the task: its usage, inference queue wait, compute score (summed), KV
        peak (the largest), model, finish reason and what it waited on when cut short. The one way a step is
        counted: a step that finished, and one that did not (:meth:`InferenceClient.generate`'s ``on_consumed``:
        the dispatcher's answer to its cancel, ``finish_reason`` ``cancelled``, or the ``consumed`` of the error
        it failed with: what it consumed until then)."""
        self.usage.prompt_tokens += done.usage.prompt_tokens
        self.usage.completion_tokens += done.usage.completion_tokens
        self.usage.total_tokens += done.usage.total_tokens
        self.add_wait("inference", done.queue_wait_s)
        self.compute_score_used += done.compute_score_used
        self.memory_peak_bytes = max(self.memory_peak_bytes, done.memory_peak_bytes)
        self.model = done.model or self.model
        self.finish_reason = done.finish_reason
        self.waited_on = done.waited_on

    def count_earlier_run(self, earlier: "Task") -> None:
        """Count in this task what ``earlier``, a run of the same submitted task refused for want of room before
        this one started, consumed: its usage and compute score (summed), its KV peak (the largest). Its
        timings are this task's already (one ``Timings``, :meth:`OrchestratorService._run_submitted`)."""
        self.usage.prompt_tokens += earlier.usage.prompt_tokens
        self.usage.completion_tokens += earlier.usage.completion_tokens
        self.usage.total_tokens += earlier.usage.total_tokens
        self.compute_score_used += earlier.compute_score_used
        self.memory_peak_bytes = max(self.memory_peak_bytes, earlier.memory_peak_bytes)

    def start_budget(self) -> Budget:
        """The budget of a rag_answer task at its start, before its retrieval (and the prefill-only warm-up
        beside it): :meth:`Program.budget` with ``prefill``, the retrieval and the model step ahead.

        Raises:
            TaskRefusedEarly: the task's time left is below that work (DEADLINE_EXCEEDED): refused before
                any of it runs.
        """
        return self.deps.program.budget(self.spec.task_id, self.spec.workflow, self.deadline_s, self.generations,
                                        prefill=True, max_tokens=self.spec.max_tokens,
                                        deadline_source=self.deadline_source)

    async def prefill(self, prefix: str, budget: Budget) -> None:
        """Warm the dispatcher's prefix state with ``prefix`` (a true prefix of the prompt to come): one
        ``prefill_only`` request under a ``prefill`` span, its compute score counted, no tokens expected (any
        are dropped). ``budget`` is the task's at its start (:meth:`start_budget`), its time left as now.
        Outcomes are counted in ``switchyard_early_prefills_total``; a failure never fails the task.
        """
        budget = replace(budget, time_left_s=max(0.0, self.deadline_s - time.monotonic()))
        try:
            with tracer.start_as_current_span("prefill", attributes={"switchyard.stage": "prefill"}):
                async for chunk in self.deps.inference.generate(
                        self.spec, 0, prompt=prefix, timeout_s=self.remaining(), budget=budget, prefill_only=True,
                        on_consumed=self._count_prefill):
                    if chunk.WhichOneof("chunk") == "done":
                        self._count_prefill(chunk.done)
        except asyncio.CancelledError:
            EARLY_PREFILLS.labels("cancelled").inc()
            raise
        except Exception as exc:  # noqa: BLE001 - a warm-up never fails its task
            EARLY_PREFILLS.labels("failed").inc()
            log.debug("task %s: early prefill failed: %s", self.spec.task_id, exc)
            return
        EARLY_PREFILLS.labels("ok").inc()

    def _count_prefill(self, done: agent_pb2.GenerateDone) -> None:
        """Count a warm-up's done (finished, its answer to a cancel, or its error's ``consumed``): its compute
        score and KV peak only (its prompt is the answer's, counted with the answer)."""
        self.compute_score_used += done.compute_score_used
        self.memory_peak_bytes = max(self.memory_peak_bytes, done.memory_peak_bytes)

    # ------------------------------------------------------------------ the end

    def out_of_time(self) -> TaskDeadlineExceeded:
        """The error of this task running out of time now: how long it ran, what set its deadline, and what its
        model step was waiting on as it was cut short (:attr:`waited_on`, when the dispatcher said)."""
        return TaskDeadlineExceeded(self.spec.task_id, time.monotonic() - self.t0, self.deadline_source,
                                    self.waited_on)

    def consumed(self) -> agent_pb2.FinalEvent:
        """What the task has consumed so far, as a FinalEvent without its answer: usage, timings, compute score,
        KV peak, trace id and model (a failed task's record keeps it; see ``taskstore.task_status``)."""
        return agent_pb2.FinalEvent(task_id=self.spec.task_id, usage=self.usage, timings=self.timings,
                                    compute_score_used=self.compute_score_used,
                                    memory_peak_bytes=self.memory_peak_bytes, trace_id=self.trace_id, model=self.model)

    def final_event(self) -> agent_pb2.FinalEvent:
        """The task's final event: output, usage, timings (``total_s`` now), compute score, KV peak,
        trace id, model, the passages it could cite and why its last model call ended (``length``: the output
        is cut short)."""
        self.timings.total_s = time.monotonic() - self.t0
        return agent_pb2.FinalEvent(
            task_id=self.spec.task_id,
            output=self.output,
            usage=self.usage,
            timings=self.timings,
            compute_score_used=self.compute_score_used,
            memory_peak_bytes=self.memory_peak_bytes,
            trace_id=self.trace_id,
            model=self.model or self.target_model,
            passages=self.passages,
            finish_reason=self.finish_reason,
        )


class Stage:
    """One stage of a task (see :meth:`Task.stage`)."""

    __slots__ = ("_task", "_name", "_metric", "_span_name", "_attributes", "_span", "_start")

    def __init__(self, task: Task, name: str, metric: str, span_name: str, attributes: dict[str, str]) -> None:
        self._task = task
        self._name = name
        self._metric = metric
        self._span_name = span_name
        self._attributes = attributes
        self._span: Any = None
        self._start = 0.0

    async def __aenter__(self) -> trace.Span:
        span_attributes = {"switchyard.stage": self._name}
        for key, value in self._attributes.items():
            span_attributes[f"switchyard.{key}"] = value
        self._span = tracer.start_as_current_span(self._span_name, attributes=span_attributes)
        span = self._span.__enter__()
        self._start = time.monotonic()
        return span

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        task, start, end = self._task, self._start, time.monotonic()
        duration = end - start
        stages = task.timings.stage_s
        # A stage that ended in an error (a cancelled task's inference, say) counts its time in the task's
        # timings too, where a failed task's status shows where its time went; only a finished stage is an
        # event and a sample of its histogram.
        stages[self._name] = stages.get(self._name, 0.0) + duration
        if exc_type is None:
            STAGE_DURATION.labels(self._metric).observe(duration)
            task.emit(agent_pb2.TaskEvent(stage=agent_pb2.StageEvent(
                name=self._name, start_s=start - task.t0, end_s=end - task.t0, duration_s=duration,
                attributes=self._attributes)))
        return bool(self._span.__exit__(exc_type, exc, tb))
