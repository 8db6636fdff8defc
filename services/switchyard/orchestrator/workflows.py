"""Workflows: the DAG of steps each task_type runs, and the per-task state.

- ``rag_answer`` (default): plan -> retrieve -> render_prompt -> count_tokens -> infer -> finalize
- ``chat``: plan -> render_prompt -> count_tokens -> infer -> finalize
- ``react_loop``: plan -> render_prompt -> count_tokens -> react (think -> tool call -> observe,
  up to ``orchestrator.react.max_steps``) -> finalize

A task with an ``agent_id`` (and ``[agent_memory] enabled``) also runs ``recall``
(its agent's memory, beside plan, before render_prompt) and ``remember`` (its
question, tool results and answer, before finalize): see agent_memory.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from switchyard.api import agent_pb2
from switchyard.common import telemetry
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import InvalidArgument
from switchyard.common.metrics import TASK_TYPES, bounded
from switchyard.common.queues import WorkQueue
from switchyard.orchestrator import prompts
from switchyard.orchestrator.agent_memory import AgentMemory, MemoryMessage
from switchyard.orchestrator.clients import InferenceClient, RetrievalClient
from switchyard.orchestrator.dag import Step
from switchyard.orchestrator.metrics import AGENT_MEMORY_RECALLS, STAGE_DURATION, TOOL_CALLS
from switchyard.orchestrator.tokens import count_messages
from switchyard.orchestrator.tools import CALCULATOR, Tool, call_tool, search_docs_tool

tracer = telemetry.get_tracer(__name__)

WORKFLOWS = TASK_TYPES


@dataclass
class Deps:
    """What every task of one orchestrator shares."""

    config: SwitchyardConfig
    queue: WorkQueue
    executor: Executor | None
    """Runs CPU jobs; None runs them on the event loop (orchestrator.cpu_executor = "loop")."""
    retrieval: RetrievalClient
    inference: InferenceClient
    memory: AgentMemory | None = None
    """Agent memory in the DRAM tier; None: tasks run without memory."""


@dataclass
class TaskSpec:
    """A validated RunTaskRequest."""

    task_id: str
    payload: str
    workflow: str
    priority: int
    max_tokens: int
    model: str
    agent_id: str


def validate(request: agent_pb2.RunTaskRequest, config: SwitchyardConfig, default_model: str) -> TaskSpec:
    """Check a request and fill defaults; ``default_model`` is the dispatcher's, for a request naming none.

    Raises:
        InvalidArgument: naming the field and what was expected.
    """
    orch, limits = config.orchestrator, config.limits
    if not request.payload.strip():
        raise InvalidArgument("payload", "a non-empty string (the question or instruction)")
    if len(request.payload) > limits.max_payload_chars:
        raise InvalidArgument("payload", f"at most {limits.max_payload_chars} characters (limits.max_payload_chars)",
                              f"{len(request.payload)} chars")
    if len(request.task_id) > limits.max_task_id_chars:
        raise InvalidArgument("task_id", f"at most {limits.max_task_id_chars} characters (limits.max_task_id_chars)",
                              f"{len(request.task_id)} chars")
    for name in ("agent_id", "model"):
        if len(getattr(request, name)) > limits.max_id_chars:
            raise InvalidArgument(name, f"at most {limits.max_id_chars} characters (limits.max_id_chars)",
                                  f"{len(getattr(request, name))} chars")
    workflow = request.task_type or orch.default_task_type
    if workflow not in WORKFLOWS:
        raise InvalidArgument("task_type", f"one of {', '.join(WORKFLOWS)} (empty = {orch.default_task_type})", workflow)
    if request.priority not in agent_pb2.Priority.values():
        raise InvalidArgument("priority", "CORE, NORMAL or BATCH (unset = NORMAL)", request.priority)
    model = request.model or default_model
    window = limits.context_window(model)
    limit = min(limits.max_tokens, window - 1)  # the prompt takes at least one token of the window
    if not 0 <= request.max_tokens <= limit:
        raise InvalidArgument(
            "max_tokens",
            f"0 (the default, {orch.default_max_tokens}) to {limit} (limits.max_tokens {limits.max_tokens}; "
            f"context window of {model}: {window} tokens, prompt included)",
            request.max_tokens,
        )
    check_metadata(request.metadata, limits)
    return TaskSpec(
        task_id=request.task_id or f"task-{uuid.uuid4().hex[:16]}",
        payload=request.payload,
        workflow=workflow,
        priority=request.priority or agent_pb2.NORMAL,
        max_tokens=request.max_tokens or orch.default_max_tokens,
        model=request.model,
        agent_id=request.agent_id,
    )


def check_metadata(metadata: Any, limits: Any) -> None:
    """Bound the ``metadata`` map: entries and bytes (UTF-8 keys plus values).

    Raises:
        InvalidArgument: naming ``metadata`` and the bound it broke.
    """
    if len(metadata) > limits.max_metadata_entries:
        raise InvalidArgument("metadata", f"at most {limits.max_metadata_entries} entries (limits.max_metadata_entries)",
                              f"{len(metadata)} entries")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if size > limits.max_metadata_bytes:
        raise InvalidArgument("metadata", f"at most {limits.max_metadata_bytes} bytes of keys and values "
                              "(limits.max_metadata_bytes)", f"{size} bytes")


@dataclass
class TaskRun:
    """The state of one task while its DAG runs. Events go to ``emit`` in order."""

    spec: TaskSpec
    deps: Deps
    emit: Callable[[agent_pb2.TaskEvent], None]
    deadline_s: float | None = None
    """``time.monotonic()`` instant by which the task must end."""
    deadline_source: str = ""
    """What set the deadline (a config key or the caller), for the error message."""
    t0: float = field(default_factory=time.monotonic)
    inline: bool = False
    accepted_sent: bool = False
    passages: list[agent_pb2.Passage] = field(default_factory=list)
    history: list[MemoryMessage] = field(default_factory=list)
    prompt: prompts.RenderedPrompt | None = None
    prompt_tokens: int = 0
    messages: list[agent_pb2.ChatMessage] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    token_index: int = 0
    usage: agent_pb2.TokenUsage = field(default_factory=agent_pb2.TokenUsage)
    timings: agent_pb2.Timings = field(default_factory=agent_pb2.Timings)
    compute_score_used: float = 0.0
    memory_peak_bytes: int = 0
    model: str = ""
    trace_id: str = ""
    generations: int = 0
    final: agent_pb2.FinalEvent | None = None

    # ------------------------------------------------------------------ events and accounting

    def accept(self, position: int) -> None:
        if not self.accepted_sent:
            self.accepted_sent = True
            self.emit(
                agent_pb2.TaskEvent(
                    accepted=agent_pb2.Accepted(
                        task_id=self.spec.task_id, queue_position=position, trace_id=self.trace_id
                    )
                )
            )

    def add_wait(self, queue: str, seconds: float) -> None:
        self.timings.queue_wait_s[queue] = self.timings.queue_wait_s.get(queue, 0.0) + seconds

    def stage_done(self, name: str, start: float, end: float, metric_stage: str = "", **attributes: str) -> None:
        """Record a finished stage: its timing, its stage event and ``switchyard_stage_duration_seconds``
        (labelled ``metric_stage`` when given: a bounded stand-in for a name a model chose)."""
        self.timings.stage_s[name] = self.timings.stage_s.get(name, 0.0) + (end - start)
        STAGE_DURATION.labels(metric_stage or name).observe(end - start)
        self.emit(
            agent_pb2.TaskEvent(
                stage=agent_pb2.StageEvent(
                    name=name,
                    start_s=start - self.t0,
                    end_s=end - self.t0,
                    duration_s=end - start,
                    attributes=attributes,
                )
            )
        )

    async def run_cpu(self, job: "CpuJob") -> None:
        """Run a CPU step: wait for an orchestration worker (split mode), run ``job.fn`` in the
        CPU executor, then ``job.apply`` its result here on the loop."""
        loop = asyncio.get_running_loop()
        executor = self.deps.executor

        async def execute() -> Any:
            if job.fn is None:
                return None
            if executor is None:
                return job.fn(*job.args)
            return await loop.run_in_executor(executor, job.fn, *job.args)

        if self.inline:
            job.apply(await execute())
            return
        queue = self.deps.queue
        ticket = queue.submit(execute)
        self.accept(ticket.position)
        enqueued = time.time_ns()
        result, wait = await ticket.result()
        tracer.start_span("orchestration.queue_wait", start_time=enqueued).end(end_time=enqueued + int(wait * 1e9))
        self.add_wait(queue.name, wait)
        job.apply(result)

    def remaining(self) -> float | None:
        return None if self.deadline_s is None else max(0.001, self.deadline_s - time.monotonic())

    # ------------------------------------------------------------------ inference

    async def generate(self, tools: list[Tool] = (), resume: bool = False) -> tuple[str, list[agent_pb2.ToolCall]]:
        """One Generate call on the dispatcher, streaming tokens to the caller.

        Returns the text and the tool calls of this turn.
        """
        spec = self.spec
        request = agent_pb2.GenerateRequest(
            request_id=f"{spec.task_id}:{self.generations}",
            prompt=self.prompt.text if self.prompt and not self.messages else "",
            messages=self.messages,
            prompt_tokens=self.prompt_tokens,
            max_tokens=spec.max_tokens,
            model=spec.model,
            priority=spec.priority,
            task_type=spec.workflow,
            agent_id=spec.agent_id or spec.task_id,
            tools=[agent_pb2.ToolSpec(name=t.name, description=t.description, parameters_json=t.parameters_json)
                   for t in tools],
            resume=resume,
        )
        self.generations += 1
        text: list[str] = []
        calls: list[agent_pb2.ToolCall] = []
        # Affinity: an agent's calls go to the dispatcher replica holding its warm state; a react_loop
        # task without an agent id is an agent of its own (its steps share the KV of one conversation).
        affinity_key = spec.agent_id or (spec.task_id if spec.workflow == "react_loop" else None)
        async for chunk in self.deps.inference.generate(request, self.remaining(), affinity_key):
            kind = chunk.WhichOneof("chunk")
            if kind == "token":
                if self.token_index == 0:
                    self.timings.ttft_s = time.monotonic() - self.t0
                count = max(1, chunk.token.count)  # several tokens when the dispatcher's stream caught up
                text.append(chunk.token.text)
                self.emit(agent_pb2.TaskEvent(
                    token=agent_pb2.TokenEvent(text=chunk.token.text, index=self.token_index, count=count)))
                self.token_index += count
            elif kind == "tool_call":
                calls.append(chunk.tool_call)
            elif kind == "done":
                done = chunk.done
                self.usage.prompt_tokens += done.usage.prompt_tokens
                self.usage.completion_tokens += done.usage.completion_tokens
                self.usage.total_tokens += done.usage.total_tokens
                self.add_wait("inference", done.queue_wait_s)
                self.compute_score_used += done.compute_score_used
                self.memory_peak_bytes = max(self.memory_peak_bytes, done.memory_peak_bytes)
                self.model = done.model or self.model
        return "".join(text), calls


# ---------------------------------------------------------------------- steps


@dataclass(frozen=True)
class CpuJob:
    """The CPU work of a step.

    ``fn(*args)`` runs in the CPU executor (so it must be a module-level function
    with picklable arguments: the executor may be a process pool); ``apply(result)``
    then runs on the event loop and updates the task. ``fn=None`` is bookkeeping
    too small to ship anywhere: only ``apply`` runs, inside an orchestration worker.
    """

    fn: Callable[..., Any] | None
    args: tuple = ()
    apply: Callable[[Any], None] = lambda _result: None


def _plan(run: TaskRun) -> CpuJob:
    """Resolve defaults the later steps read; the task enters the orchestration queue here."""

    def apply(_: None) -> None:
        run.model = run.spec.model or run.deps.inference.known_default_model

    return CpuJob(None, apply=apply)


async def _retrieve(run: TaskRun) -> None:
    response = await run.deps.retrieval.retrieve(run.spec.payload)
    run.passages = list(response.passages)
    run.add_wait("retrieval", response.queue_wait_s)


def _tools(run: TaskRun) -> list[Tool]:
    if run.spec.workflow != "react_loop":
        return []

    async def search(query: str, top_k: int) -> list[agent_pb2.Passage]:
        response = await run.deps.retrieval.retrieve(query, top_k)
        run.add_wait("retrieval", response.queue_wait_s)
        run.passages.extend(response.passages)  # the final event lists what the answer could cite
        return list(response.passages)

    return [search_docs_tool(search), CALCULATOR]


async def _recall(run: TaskRun) -> None:
    """The agent's memory from earlier tasks (none when the DRAM tier is down)."""
    assert run.deps.memory is not None
    run.history = await run.deps.memory.recall(run.spec.agent_id)
    AGENT_MEMORY_RECALLS.labels("hit" if run.history else "miss").inc()


def _set_prompt(run: TaskRun, prompt: prompts.RenderedPrompt) -> None:
    run.prompt = prompt
    if run.spec.workflow == "react_loop" or prompt.history:  # history needs its roles: send messages
        run.messages = [agent_pb2.ChatMessage(role=r, content=c) for r, c in prompt.messages()]
    else:
        run.messages = []


def _render_prompt(run: TaskRun) -> CpuJob:
    passages = [prompts.Snippet(p.title, p.text) for p in run.passages]
    tools = [prompts.Snippet(t.name, t.description) for t in _tools(run)]
    history = [m.as_prompt() for m in run.history]
    return CpuJob(prompts.render, (run.spec.workflow, run.spec.payload, passages, tools, history),
                  lambda prompt: _set_prompt(run, prompt))


def count_prompt(messages: list[tuple[str, str]], history: int) -> tuple[int, int]:
    """Tokens of the prompt ``messages``, with and without its ``history`` messages (those after the system one)."""
    full = count_messages(messages)
    return full, (count_messages([messages[0], *messages[1 + history:]]) if history else full)


def _count_tokens(run: TaskRun) -> CpuJob:
    assert run.prompt is not None
    prompt = run.prompt
    config = run.deps.config
    model = run.spec.model or run.deps.inference.known_default_model
    window = config.limits.context_window(model)
    budget = window - run.spec.max_tokens

    def apply(counts: tuple[int, int]) -> None:
        count, without_history = counts
        if count > budget and without_history <= budget:  # memory must never fail a task: leave it out
            AGENT_MEMORY_RECALLS.labels("dropped").inc()
            _set_prompt(run, replace(prompt, history=()))
            count = without_history
        run.prompt_tokens = count
        if count > budget:
            raise InvalidArgument(
                "payload",
                f"a prompt of at most {budget} tokens: the context window of {model} is {window} tokens "
                f"(limits.context_window_tokens) and max_tokens takes {run.spec.max_tokens}",
                f"{count} tokens",
            )

    return CpuJob(count_prompt, (prompt.messages(), len(prompt.history)), apply)


async def _infer(run: TaskRun) -> None:
    text, _ = await run.generate()
    run.output = [text]


async def _think(run: TaskRun, step: int, tools: list[Tool]) -> tuple[str, list[agent_pb2.ToolCall]]:
    """One react_loop inference round, as an ``infer`` stage; rounds after the first resume warm."""
    start = time.monotonic()
    with tracer.start_as_current_span("infer", attributes={"switchyard.react.step": step}):
        text, calls = await run.generate(tools, resume=step > 0)
    run.stage_done("infer", start, time.monotonic(), step=str(step))
    return text, calls


async def _react(run: TaskRun) -> None:
    """think -> tool call -> observe, up to max_steps; then one last answer without tools."""
    policy = run.deps.config.orchestrator.react
    tools = {t.name: t for t in _tools(run)}
    for step in range(policy.max_steps):
        text, calls = await _think(run, step, list(tools.values()))
        if not calls:
            run.output = [text]
            return
        run.messages.append(agent_pb2.ChatMessage(role="assistant", content=text, tool_calls=calls))
        for call in calls:
            await _observe(run, tools, call, policy)
    text, _ = await _think(run, policy.max_steps, [])
    run.output = [text]


async def _observe(run: TaskRun, tools: dict[str, Tool], call: agent_pb2.ToolCall, policy: Any) -> None:
    run.emit(agent_pb2.TaskEvent(tool_call=agent_pb2.ToolCallEvent(
        call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)))
    start = time.monotonic()
    with tracer.start_as_current_span(f"tool {call.name}", attributes={"gen_ai.tool.name": call.name}) as span:
        tool = tools.get(call.name)
        if tool is None:
            content, is_error, attempts = f"unknown tool {call.name!r}; available: {', '.join(tools)}", True, 0
        else:
            outcome = await call_tool(tool, call.arguments_json, policy)
            content, is_error, attempts = outcome.content, outcome.is_error, outcome.attempts
        span.set_attribute("switchyard.tool.attempts", attempts)
        span.set_attribute("switchyard.tool.is_error", is_error)
    tool_label = bounded(call.name, tools)  # a model may invent tool names: labels stay a bounded set
    TOOL_CALLS.labels(tool_label, "error" if is_error else "ok").inc()
    run.stage_done(f"tool:{call.name}", start, time.monotonic(), metric_stage=f"tool:{tool_label}")
    run.emit(agent_pb2.TaskEvent(tool_result=agent_pb2.ToolResultEvent(
        call_id=call.call_id, name=call.name, content=content, is_error=is_error, attempts=attempts)))
    run.messages.append(agent_pb2.ChatMessage(role="tool", content=content, tool_call_id=call.call_id, name=call.name))


async def _remember(run: TaskRun) -> None:
    """Add this task's question, tool results and answer to the agent's memory."""
    assert run.deps.memory is not None
    task_id = run.spec.task_id
    messages = [MemoryMessage("user", run.spec.payload, task_id=task_id)]
    messages += [MemoryMessage("tool", m.content, name=m.name, task_id=task_id) for m in run.messages if m.role == "tool"]
    messages.append(MemoryMessage("assistant", "".join(run.output), task_id=task_id))
    await run.deps.memory.record(run.spec.agent_id, messages)


def _finalize(run: TaskRun) -> CpuJob:
    def apply(_: None) -> None:
        run.timings.total_s = time.monotonic() - run.t0
        run.final = agent_pb2.FinalEvent(
            task_id=run.spec.task_id,
            output="".join(run.output),
            usage=run.usage,
            timings=run.timings,
            compute_score_used=run.compute_score_used,
            memory_peak_bytes=run.memory_peak_bytes,
            trace_id=run.trace_id,
            model=run.model,
            passages=run.passages,
        )

    return CpuJob(None, apply=apply)


def build(workflow: str, memory: bool = False) -> list[Step]:
    """The steps of ``workflow`` (one of :data:`WORKFLOWS`); ``memory`` adds recall and remember."""
    head = [Step("plan", _plan, cpu=True)]
    if workflow == "rag_answer":
        head.append(Step("retrieve", _retrieve, after=("plan",)))
    prompt_after: tuple[str, ...] = (head[-1].name,)
    if memory:
        head.append(Step("recall", _recall))
        prompt_after += ("recall",)
    middle = [
        Step("render_prompt", _render_prompt, after=prompt_after, cpu=True),
        Step("count_tokens", _count_tokens, after=("render_prompt",), cpu=True),
    ]
    answer = "react" if workflow == "react_loop" else "infer"
    tail = [Step(answer, _react if answer == "react" else _infer, after=("count_tokens",))]
    if memory:
        tail.append(Step("remember", _remember, after=(answer,)))
    tail.append(Step("finalize", _finalize, after=(tail[-1].name,), cpu=True))
    return head + middle + tail


def uses_memory(spec: TaskSpec, deps: Deps) -> bool:
    """Whether a task recalls and records agent memory: it has an agent_id and memory is on."""
    return bool(spec.agent_id) and deps.memory is not None and deps.memory.config.enabled
