"""The react_loop's loop: think -> tool call -> observe, up to ``orchestrator.react.max_steps``.

Each think is an ``infer`` stage (attribute ``step``); each tool call a
``tool:<name>`` stage between its ``tool_call`` and ``tool_result`` events.
The loop ends when the model answers without calling a tool, or after
``max_steps`` rounds with one last answer offered no tools. A step offered tools that
reaches its ``max_tokens`` inside a tool call (or before any answer) fails the task
INVALID_ARGUMENT naming ``max_tokens``: the cut call's arguments are incomplete, and it
is not run. (It used to end the task "finished" with an empty answer.)

The conversation grows by each round's tool results inside the model's context
window: a round whose results would leave less than the task's ``max_tokens`` for the
next answer has its longest results cut to fit, each marked where it was cut
(:data:`CUT_MARK`), and the next step is the last: offered no tools, it answers with
what it has. Uncut, a step past the window was refused by the dispatcher (and by the
model server) INVALID_ARGUMENT naming ``prompt_tokens`` or ``max_tokens``, fields the
caller never chose, and the task failed after its tools had run.

A tool call that starts is announced to the agent's dispatcher (``ToolWait``:
which agent waits, on which tool, for how long it is expected to take), and
each call's duration feeds that tool's estimate; each round's tool time, each
search's retrieval and the model steps a task took feed the task type's step
times (orchestrator/program.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common.config import ReactConfig
from switchyard.common.config.limits import ContextWindow
from switchyard.common.errors import InvalidArgument
from switchyard.common.metrics import bounded
from switchyard.orchestrator.metrics import TOOL_CALLS
from switchyard.orchestrator.task import Task
from switchyard.orchestrator.tokens import count_added_messages, count_tokens, encoding
from switchyard.orchestrator.tools import CALCULATOR, Tool, call_tool, search_docs_tool


def tools_for(task: Task) -> list[Tool]:
    """The tools a task's model is offered: ``search_docs`` (through retrieval) and ``calculator``;
    none outside react_loop."""
    if task.spec.workflow != "react_loop":
        return []

    async def search(query: str, top_k: int) -> list[agent_pb2.Passage]:
        started = time.monotonic()
        response = await task.deps.retrieval.retrieve(query, top_k)
        task.deps.program.steps.observe(task.spec.workflow, "retrieval", time.monotonic() - started)
        task.add_wait("retrieval", response.queue_wait_s)
        task.passages.extend(response.passages)  # the final event lists what the answer could cite
        return list(response.passages)

    return [search_docs_tool(search), CALCULATOR]


@dataclass
class _Waiting:
    """A tool call announced to the agent's dispatcher (its parked step waits for the next turn)."""

    tool: str
    expected_wait_s: float
    announcement: asyncio.Task[None]


async def react(task: Task, tools: list[Tool]) -> str:
    """Think, call the tools the model asks for, observe; returns the answer.

    A step that ends in tool calls is parked at the agent's dispatcher until the next step takes it over. A
    task that ends before one does (cancelled or past its deadline during the tool round, refused early
    before the next step, or its next step refused or failed) tells the dispatcher, after the round's last
    announcement (:meth:`~switchyard.orchestrator.clients.InferenceClient.end_tool_wait`): the agent's parked
    state and plan are released there at once (where the next step had taken them over, nothing is left to
    release).

    Raises:
        ServiceUnavailable, SwitchyardError: a Generate call failed (tool failures never raise:
            the model observes them).
        InvalidArgument: a step offered tools reached its ``max_tokens`` in a tool call, or before any answer
            (``max_tokens`` named; the cut call is not run).
    """
    policy = task.deps.config.orchestrator.react
    by_name = {t.name: t for t in tools}
    parked: list[_Waiting] | None = None  # a step parked at the dispatcher: its round's announced calls
    last_call = agent_pb2.ToolCall()
    full = False  # a round's results were cut to the window: the next step answers with what it has
    try:
        for step in range(policy.max_steps + 1):
            window = task.context_window()  # each step: with the server's token ratio as last measured
            last = step == policy.max_steps or full  # one last answer, offered no tools
            room = window.left(task.prompt_tokens)  # max_tokens, but where a round's tool calls alone filled it
            max_tokens = max(1, min(task.spec.max_tokens, room))
            async with task.stage("infer", step=str(step)):
                text, calls = await task.generate([] if last else tools, resume=step > 0, max_tokens=max_tokens)
            parked = None  # the step ran: it took the parked one over
            if not last and task.finish_reason == "length" and (calls or not text):
                raise _cut_step(task, step, calls, max_tokens, window)
            if not calls or last:
                return text
            parked, last_call = [], calls[-1]
            counted = len(task.messages)
            task.messages.append(agent_pb2.ChatMessage(role="assistant", content=text, tool_calls=calls))
            round_started = time.monotonic()
            for i, call in enumerate(calls):
                await _observe(task, by_name, call, policy, parked, calls[i + 1:])
            task.deps.program.steps.observe(task.spec.workflow, "tool", time.monotonic() - round_started)
            added = [(m.role, m.content + "".join(c.name + c.arguments_json for c in m.tool_calls))
                     for m in task.messages[counted:]]
            # the next step's prompt is the conversation so far: its count grows by this round's messages (on the
            # loop when short, as Task.cpu would run it, without its trip through the orchestration queue)
            chars = sum(len(text) for _, text in added)
            if chars <= task.deps.config.orchestrator.cpu_inline_max_chars:
                task.prompt_tokens += count_added_messages(added)
            else:
                task.prompt_tokens += await task.cpu(count_added_messages, added, size_chars=chars)
            full = _fit_round(task, task.messages[counted:], window)
        raise AssertionError("unreachable: the last step returns")
    except BaseException:  # the task ends here, with its agent's step perhaps still parked at the dispatcher
        if parked is not None:
            _end_tool_wait(task, parked, bounded(last_call.name, by_name))
        raise


def _cut_step(task: Task, step: int, calls: list[agent_pb2.ToolCall], max_tokens: int,
              window: ContextWindow) -> InvalidArgument:
    """The error of a step offered tools that reached its ``max_tokens`` before a whole tool call or any answer:
    a call cut there has incomplete arguments (a server sends what it generated, finish_reason ``length``), and
    running it would act on half an argument; a step with neither gives the task no answer. Neither is run or
    returned as the task's answer (INVALID_ARGUMENT naming ``max_tokens``, the caller's fix)."""
    what = (f"its call of {', '.join(c.name or 'a tool' for c in calls)} was cut, its arguments incomplete, and "
            "not run" if calls else "it had made neither a whole tool call nor any answer")
    room = "" if max_tokens >= task.spec.max_tokens else (
        f"; the conversation left only {max_tokens} tokens of the model's {window.tokens}-token context window")
    return InvalidArgument("max_tokens", f"room for a react_loop step's whole tool call or answer: step {step} "
                           f"generated all {max_tokens} tokens it was allowed and {what}{room}", task.spec.max_tokens)


CUT_MARK = "\n[{} tokens of this result cut: the conversation reached the model's context window]"
"""What ends a tool result cut to the context window (:func:`_fit_round`): the model reads that it is partial."""


def _fit_round(task: Task, added: list[agent_pb2.ChatMessage], window: ContextWindow) -> bool:
    """Cut this round's tool results (in ``added``, part of ``task.messages``), the longest first, until the
    conversation leaves the task's ``max_tokens`` of ``window`` for the next answer, as the prompt the task
    started with did (:func:`switchyard.orchestrator.workflows.render_prompt`); ``task.prompt_tokens`` follows.
    True when the round left less than that before (the next step is then the last: another round's results could
    not fit). A round whose results cannot be cut far enough (its tool calls alone fill the window) leaves the
    next step what is left."""
    excess = task.prompt_tokens - window.room(task.spec.max_tokens)  # in this orchestrator's count (cl100k)
    if excess <= 0:
        return False
    cl100k, cut_any = encoding(), False
    for message in sorted((m for m in added if m.role == "tool"), key=lambda m: len(m.content), reverse=True):
        if excess <= 0:
            break
        tokens = cl100k.encode_ordinary(message.content)
        dropped = min(len(tokens), excess + count_tokens(CUT_MARK.format(len(tokens))))
        content = cl100k.decode(tokens[:len(tokens) - dropped]) + CUT_MARK.format(dropped)
        saved = len(tokens) - count_tokens(content)
        if saved <= 0:
            continue  # a result shorter than the mark: cutting it would grow it
        message.content, cut_any = content, True
        task.prompt_tokens -= saved
        excess -= saved
    if cut_any:
        trace.get_current_span().add_event("tool results cut to the context window", {
            "switchyard.context_window_tokens": window.tokens, "switchyard.prompt_tokens": task.prompt_tokens})
    return True


def _end_tool_wait(task: Task, announced: list[_Waiting], label: str) -> None:
    """The task ends with its agent's step parked: the dispatcher hears it, after the round's last announcement
    (none: the step's last call, by its label, expected 0 s)."""
    if announced:
        last = announced[-1]
        task.deps.inference.end_tool_wait(task.spec, last.tool, last.expected_wait_s, last.announcement)
    else:
        task.deps.inference.end_tool_wait(task.spec, label, 0.0, None)


async def _observe(task: Task, tools: dict[str, Tool], call: agent_pb2.ToolCall, policy: ReactConfig,
                   announced: list[_Waiting], after: Sequence[agent_pb2.ToolCall] = ()) -> None:
    """Run one tool call; its result joins the conversation (an error result too). Its announcement to the
    dispatcher, made as it starts, is appended to ``announced`` (an unknown tool is not announced).

    ``after``: the calls of its round still to run after it, one after another. The announced wait is the
    agent's wait for its next step, which comes after them all: this call's expected duration plus theirs
    (an unknown tool's is none: it is answered at once). Announced with its own alone, the first call of a
    round of several had its swapped KV planned back in HBM at its own return, seconds before the turn, and
    its tool's measured returns (announcement to turn) counted the calls after it against its own estimate."""
    task.emit(agent_pb2.TaskEvent(tool_call=agent_pb2.ToolCallEvent(
        call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)))
    tool_label = bounded(call.name, tools)  # a model may invent tool names: labels stay a bounded set
    stage = task.stage(f"tool:{call.name}", metric_stage=f"tool:{tool_label}", span_name=f"tool {tool_label}")
    async with stage as span:
        span.set_attribute("gen_ai.tool.name", call.name)
        tool = tools.get(call.name)
        if tool is None:
            content, is_error, attempts = f"unknown tool {call.name!r}; available: {', '.join(tools)}", True, 0
        else:
            durations = task.deps.program.tools
            expected_s = durations.expected_s(call.name) + sum(durations.expected_s(c.name) for c in after
                                                               if c.name in tools)
            announced.append(_Waiting(call.name, expected_s,
                                      task.deps.inference.announce_tool_wait(task.spec, call.name, expected_s)))
            started = time.monotonic()
            outcome = await call_tool(tool, call.arguments_json, policy)
            durations.observe(call.name, time.monotonic() - started)
            content, is_error, attempts = outcome.content, outcome.is_error, outcome.attempts
            if is_error:  # read by the model and streamed to the caller: no internal address (whole on the span)
                content = task.deps.edge.text_kept_on_span(content)
        span.set_attribute("switchyard.tool.attempts", attempts)
        span.set_attribute("switchyard.tool.is_error", is_error)
    TOOL_CALLS.labels(tool_label, "error" if is_error else "ok").inc()
    task.emit(agent_pb2.TaskEvent(tool_result=agent_pb2.ToolResultEvent(
        call_id=call.call_id, name=call.name, content=content, is_error=is_error, attempts=attempts)))
    task.messages.append(agent_pb2.ChatMessage(role="tool", content=content, tool_call_id=call.call_id, name=call.name))
