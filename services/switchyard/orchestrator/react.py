"""The react_loop's loop: think -> tool call -> observe, up to ``orchestrator.react.max_steps``.

Each think is an ``infer`` stage (attribute ``step``); each tool call a
``tool:<name>`` stage between its ``tool_call`` and ``tool_result`` events.
The loop ends when the model answers without calling a tool, or after
``max_steps`` rounds with one last answer offered no tools.

A tool call that starts is announced to the agent's dispatcher (``ToolWait``:
which agent waits, on which tool, for how long it is expected to take), and
each call's duration feeds that tool's estimate; each round's tool time, each
search's retrieval and the model steps a task took feed the task type's step
times (orchestrator/program.py).
"""

from __future__ import annotations

import time

from switchyard.api import agent_pb2
from switchyard.common.config import ReactConfig
from switchyard.common.metrics import bounded
from switchyard.orchestrator.metrics import TOOL_CALLS
from switchyard.orchestrator.task import Task
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


async def react(task: Task, tools: list[Tool]) -> str:
    """Think, call the tools the model asks for, observe; returns the answer.

    Raises:
        ServiceUnavailable, SwitchyardError: a Generate call failed (tool failures never raise:
            the model observes them).
    """
    policy = task.deps.config.orchestrator.react
    by_name = {t.name: t for t in tools}
    for step in range(policy.max_steps):
        async with task.stage("infer", step=str(step)):
            text, calls = await task.generate(tools, resume=step > 0)
        if not calls:
            return text
        task.messages.append(agent_pb2.ChatMessage(role="assistant", content=text, tool_calls=calls))
        round_started = time.monotonic()
        for call in calls:
            await _observe(task, by_name, call, policy)
        task.deps.program.steps.observe(task.spec.workflow, "tool", time.monotonic() - round_started)
    async with task.stage("infer", step=str(policy.max_steps)):
        text, _ = await task.generate(resume=policy.max_steps > 0)
    return text


async def _observe(task: Task, tools: dict[str, Tool], call: agent_pb2.ToolCall, policy: ReactConfig) -> None:
    """Run one tool call; its result joins the conversation (an error result too)."""
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
            task.deps.inference.announce_tool_wait(task.spec, call.name, durations.expected_s(call.name))
            started = time.monotonic()
            outcome = await call_tool(tool, call.arguments_json, policy)
            durations.observe(call.name, time.monotonic() - started)
            content, is_error, attempts = outcome.content, outcome.is_error, outcome.attempts
        span.set_attribute("switchyard.tool.attempts", attempts)
        span.set_attribute("switchyard.tool.is_error", is_error)
    TOOL_CALLS.labels(tool_label, "error" if is_error else "ok").inc()
    task.emit(agent_pb2.TaskEvent(tool_result=agent_pb2.ToolResultEvent(
        call_id=call.call_id, name=call.name, content=content, is_error=is_error, attempts=attempts)))
    task.messages.append(agent_pb2.ChatMessage(role="tool", content=content, tool_call_id=call.call_id, name=call.name))
