"""The workflows, one plain async function per task type, each read top to bottom.

- ``rag_answer`` (default): retrieve -> render_prompt -> infer; while retrieval
  runs, system prompt + question go ahead as a ``prefill_only`` request
  (:func:`early_prefill`) so the answer's request extends a warm prefix
- ``chat``: render_prompt -> infer
- ``react_loop``: render_prompt -> react (think -> tool call -> observe, up to
  ``orchestrator.react.max_steps``; see react.py)

``render_prompt`` renders the prompt with Jinja2's sandbox and counts its
tokens in one trip to the CPU executor (more where passages are trimmed to the
context window, :func:`_fit_passages`; rag_answer's early prefill renders its
prefix in one more, and a react_loop round's long tool results are counted in one). A task with an
``agent_id`` (and ``[agent_memory] enabled``) also runs ``recall`` (its agent's
memory, beside retrieval, before render_prompt) and ``remember`` (its
question, tool results and answer, last): see agent_memory.py.

A workflow fills the :class:`~switchyard.orchestrator.task.Task` it is given;
the service sends ``accepted`` before it starts and the final event after it
returns, and bounds it by the task's deadline.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Awaitable, Callable, Sequence

from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common.config.limits import ContextWindow, RequestLimitsConfig
from switchyard.common.errors import InvalidArgument
from switchyard.orchestrator import prompts
from switchyard.orchestrator.agent_memory import MemoryMessage
from switchyard.orchestrator.metrics import AGENT_MEMORY_RECALLS, EARLY_PREFILLS
from switchyard.orchestrator.react import react, tools_for
from switchyard.orchestrator.program import Budget
from switchyard.orchestrator.task import Task
from switchyard.orchestrator.tokens import count_messages
from switchyard.orchestrator.tools import Tool
from switchyard.orchestrator.validation import TaskSpec, max_tokens_bound, max_tokens_refusal


async def rag_answer(task: Task) -> None:
    """Answer from passages retrieved for the question.

    Raises:
        TaskRefusedEarly: at its start, before its retrieval and warm-up: its time left is below the
            measured retrieval and model step (:meth:`Task.start_budget`).
    """
    warm_up = early_prefill(task, task.start_budget())
    try:
        if task.uses_memory:
            await asyncio.gather(retrieve(task), recall(task))
        else:
            await retrieve(task)
        await render_prompt(task)
        await infer(task)
    finally:
        if warm_up is not None and not warm_up.done():
            warm_up.cancel()  # the answer is out (or the task ends): warming its prefix serves nothing now
            # ... and what the warm-up used is counted before the task's outcome is recorded: its cancel's answer
            # comes within one round trip (at most CANCEL_ANSWER_WAIT_S; it never raises)
            await asyncio.wait((warm_up,))
    await remember(task)


async def chat(task: Task) -> None:
    """Answer the question directly."""
    await recall(task)
    await render_prompt(task)
    await infer(task)
    await remember(task)


async def react_loop(task: Task) -> None:
    """Think, call tools (search_docs, calculator), observe, until the model answers."""
    await recall(task)
    tools = tools_for(task)
    await render_prompt(task, tools)
    async with task.stage("react"):
        task.output = await react(task, tools)
    task.deps.program.steps.observe_turns(task.generations)
    await remember(task)


WORKFLOWS: dict[str, Callable[[Task], Awaitable[None]]] = {
    "rag_answer": rag_answer,
    "chat": chat,
    "react_loop": react_loop,
}
"""Task type -> workflow; the keys are :data:`switchyard.common.metrics.TASK_TYPES`."""


# ---------------------------------------------------------------------- stages


async def retrieve(task: Task) -> None:
    """Passages for the question from the retrieval service.

    Raises:
        ServiceUnavailable, SwitchyardError: see :meth:`RetrievalClient.retrieve`.
    """
    async with task.stage("retrieve"):
        started = time.monotonic()
        response = await task.deps.retrieval.retrieve(task.spec.payload)  # cut to limits.max_query_chars there
        task.deps.program.steps.observe(task.spec.workflow, "retrieval", time.monotonic() - started)
        task.passages = list(response.passages)
        task.add_wait("retrieval", response.queue_wait_s)


def early_prefill(task: Task, budget: Budget) -> asyncio.Task[None] | None:
    """Start warming the dispatcher's prefix of ``task``'s prompt while its retrieval runs; None when not.

    The prefix is system prompt + question (:func:`prompts.static_prefix`), a true prefix of the prompt the
    answer sends once the passages are in. Sent when ``orchestrator.program.rag_early_prefill`` is on, the
    task recalls no memory (history would sit between the two, and the prompt goes as messages) and the
    dispatcher's engine shares prefixes (``ModelInfo.shares_prefixes``). It runs beside the workflow and never
    fails it (:meth:`Task.prefill`); one still running when the answer is out is cancelled, and the task ends once
    the dispatcher's answer to that cancel is counted (:func:`rag_answer`: one round trip, at most
    ``generate_stream.CANCEL_ANSWER_WAIT_S``). ``budget``: the task's at its start (:meth:`Task.start_budget`).
    """
    if not task.deps.config.orchestrator.program.rag_early_prefill or task.uses_memory:
        return None

    async def warm() -> None:
        spec = task.spec
        try:
            if not (await task.deps.inference.model_info()).shares_prefixes:
                return
            prefix = await task.cpu(prompts.static_prefix, spec.workflow, spec.payload, size_chars=len(spec.payload))
        except Exception:  # noqa: BLE001 - the answer's own request reports a dispatcher down or a full queue
            EARLY_PREFILLS.labels("failed").inc()
            return
        await task.prefill(prefix, budget)

    return asyncio.create_task(warm(), name=f"prefill-{task.spec.task_id}")


async def recall(task: Task) -> None:
    """The agent's memory from earlier tasks (none when the DRAM tier is down); nothing without memory."""
    if not task.uses_memory:
        return
    assert task.deps.memory is not None
    async with task.stage("recall"):
        task.history = await task.deps.memory.recall(task.spec.tenant_id, task.spec.agent_id)
    AGENT_MEMORY_RECALLS.labels("hit" if task.history else "miss").inc()


def render_and_count(
    workflow: str,
    question: str,
    passages: list[prompts.Snippet],
    tools: list[prompts.Snippet],
    history: list[tuple[str, str]],
) -> tuple[prompts.RenderedPrompt, int, int]:
    """The rendered prompt and its tokens with and without its history messages (those after the
    system one). The task's CPU work: it runs in the CPU executor."""
    prompt = prompts.render(workflow, question, passages, tools, history)
    messages = prompt.messages()
    full = count_messages(messages)
    without_history = count_messages([messages[0], *messages[1 + len(history):]]) if history else full
    return prompt, full, without_history


def prompt_over_window(model: str, window: ContextWindow, max_tokens: int, count: int,
                       asked: int | None = None) -> InvalidArgument:
    """The refusal of a prompt of ``count`` tokens that leaves ``max_tokens`` no room in ``model``'s ``window``
    (:meth:`RequestLimitsConfig.context_window`, its source named). ``asked``: the caller's own max_tokens where
    it is more than ``max_tokens`` (the default, the least the prompt is measured against)."""
    takes = f"max_tokens takes {max_tokens}"
    if asked is not None and asked != max_tokens:
        takes = f"max_tokens takes at least {max_tokens} (the default; {asked} asked)"
    return InvalidArgument(
        "payload",
        f"a prompt of at most {window.room(max_tokens)} tokens: the context window of {model} is "
        f"{window.described()} and {takes}",
        window.counted(count),
    )


async def check_question_fits(spec: TaskSpec, model: str, window: ContextWindow, limits: RequestLimitsConfig,
                              asked: int) -> None:
    """Refuse, before the task is accepted, a ``max_tokens`` out of range or a question whose prompt cannot fit
    ``window`` beside it however little is retrieved or recalled (:func:`prompts.bare`: the least prompt of that
    question); otherwise the task would be accepted and fail at :func:`render_prompt`. ``asked``: the
    request's max_tokens as sent (0: the default, ``spec.max_tokens``). Prompt tokens are this orchestrator's
    count taken at ``window.ratio``, the model server's tokens per counted one as the dispatcher measured it
    (:meth:`ContextWindow.room`, :meth:`ContextWindow.left`), as in :func:`render_prompt`.

    One rule: ``max_tokens`` from 0 to the lesser of ``limits.max_tokens`` and the window less the prompt's
    tokens (:func:`validation.max_tokens_bound`). A max_tokens negative or past ``limits.max_tokens`` is
    refused as such; otherwise the payload is what does not fit when its prompt leaves no room for the default
    answer (or for a smaller max_tokens the caller asked), and else max_tokens is.

    A cl100k token is at least one UTF-8 byte, so a prompt of no more bytes than the budget fits uncounted;
    a longer one, or any beside a max_tokens out of range, is counted in a thread (tiktoken releases the GIL),
    off the event loop.

    Raises:
        InvalidArgument: naming ``payload`` (the words :func:`render_prompt` uses) or ``max_tokens``
            (:func:`validation.max_tokens_refusal`, the bound stated).
    """
    in_range = 0 <= asked <= limits.max_tokens
    budget = window.room(spec.max_tokens)
    messages = prompts.bare(spec.workflow, spec.payload).messages()
    if in_range and sum(3 + len(role) + len(content.encode()) for role, content in messages) + 3 <= budget:
        return  # count_messages's own sum, each token taken as one byte or more
    count = await asyncio.to_thread(count_messages, messages)
    if not in_range:  # negative, or past limits.max_tokens: wrong whatever the prompt, and named as such
        raise max_tokens_refusal(asked, limits, model, window, count)
    least = min(spec.max_tokens, limits.default_for(window.tokens))
    if count > window.room(least):  # no room even for the least answer: the question is too long
        raise prompt_over_window(model, window, least, count, spec.max_tokens if asked else None)
    if not 0 <= asked <= max_tokens_bound(limits, window, count):
        raise max_tokens_refusal(asked, limits, model, window, count)


async def render_prompt(task: Task, tools: Sequence[Tool] = ()) -> None:
    """Render the prompt and count its tokens (one CPU trip); prompt + ``max_tokens`` must fit the
    model's context window. Recalled memory that would not fit is left out, never failing the task; then
    retrieved passages that would not fit, the lowest-ranked first, down to the one best-ranked (a window
    too small for the question and one passage still fails the task).

    Raises:
        InvalidArgument: naming ``payload``, when the prompt alone is over the window.
        QueueFullError, QueueTimeoutError: the orchestration queue refused or timed out the trip.
    """
    spec = task.spec
    async with task.stage("render_prompt"):
        passages = [prompts.Snippet(p.title, p.text) for p in task.passages]
        tool_texts = [prompts.Snippet(t.name, t.description) for t in tools]
        history = [m.as_prompt() for m in task.history]
        size = len(spec.payload) + sum(len(p.text) + len(p.title) for p in passages) \
            + sum(len(t.text) + len(t.title) for t in tool_texts) + sum(len(r) + len(c) for r, c in history)
        prompt, count, without_history = await task.cpu(
            render_and_count, spec.workflow, spec.payload, passages, tool_texts, history, size_chars=size)
        model, window = task.target_model, task.context_window()
        budget = window.room(spec.max_tokens)  # the prompt's tokens as counted here, the server's ratio applied
        if count > budget and without_history <= budget:  # memory must never fail a task: leave it out
            AGENT_MEMORY_RECALLS.labels("dropped").inc()
            prompt, count = replace(prompt, history=()), without_history
        if count > budget and spec.workflow == "rag_answer" and len(passages) > 1:  # the best-ranked that fit
            fitted = await _fit_passages(task, passages, tool_texts, budget)
            if isinstance(fitted, int):
                count = fitted  # the refusal names the least prompt it could send: the best passage alone
            else:
                kept, prompt, count = fitted
                trace.get_current_span().add_event("passages trimmed to the context window", {
                    "switchyard.passages.retrieved": len(passages), "switchyard.passages.kept": kept})
                task.passages = task.passages[:kept]
        if count > budget:
            extras = {"rag_answer": "the question with the best-ranked passage",
                      "react_loop": "the question with the tools' descriptions"}.get(spec.workflow)
            if extras is None:  # the payload's own fault
                raise prompt_over_window(model, window, spec.max_tokens, count)
            if window.left(count) < 1:  # no max_tokens makes room: the question with its least extra is too long
                raise InvalidArgument(
                    "payload", f"a task whose least prompt ({extras}) fits the context window of {model}, "
                    f"{window.described()}, with room for max_tokens; that prompt is {window.counted(count)}, "
                    "the question's own included (a shorter question, or a model with a larger window)",
                    f"{len(spec.payload)} characters")
            # The question alone fits beside max_tokens (check_question_fits): what does not is max_tokens beside
            # the least prompt the workflow can send, so the answer names max_tokens, not the payload.
            # A request that left max_tokens 0 was told '(got 128)': a number it never sent.
            got = ("" if spec.max_tokens_asked else
                   f" (got 0, which asks for the default, {spec.max_tokens}: send a max_tokens that fits)")
            raise InvalidArgument(
                "max_tokens",
                f"at most {window.left(count)}: the least prompt this task can send ({extras}) is "
                f"{window.counted(count)} and the context window of {model} is {window.described()}{got}",
                spec.max_tokens if spec.max_tokens_asked else None,
            )
        task.prompt, task.prompt_tokens = prompt, count
        if spec.workflow == "react_loop" or prompt.history:  # history needs its roles: send messages
            task.messages = [agent_pb2.ChatMessage(role=r, content=c) for r, c in prompt.messages()]


async def _fit_passages(task: Task, passages: list[prompts.Snippet], tool_texts: list[prompts.Snippet],
                        budget: int) -> tuple[int, prompts.RenderedPrompt, int] | int:
    """The most best-ranked ``passages`` (a prefix of them, at least one) whose prompt, without recalled
    memory, fits ``budget`` tokens: ``(how many, the prompt, its tokens)``, found by halving (a render and a
    count per step, in the CPU executor); when even the first one does not fit, the tokens of the prompt with
    that one alone (the least this task could send, for the refusal)."""
    spec, best, least = task.spec, None, 0
    low, high = 1, len(passages) - 1  # all of them did not fit
    while low <= high:
        mid = (low + high) // 2
        size = len(spec.payload) + sum(len(p.text) + len(p.title) for p in passages[:mid])
        prompt, count, _ = await task.cpu(render_and_count, spec.workflow, spec.payload, passages[:mid], tool_texts, [],
                                          size_chars=size)
        if count <= budget:
            best, low = (mid, prompt, count), mid + 1
        else:
            high = mid - 1
            if mid == 1:  # halving reaches one passage whenever none fits
                least = count
    return best if best is not None else least


async def infer(task: Task) -> None:
    """The answer, generated by the dispatcher and streamed to the caller token by token.

    Raises:
        ServiceUnavailable, SwitchyardError: see :meth:`InferenceClient.generate`.
    """
    async with task.stage("infer"):
        task.output, _ = await task.generate()


async def remember(task: Task) -> None:
    """Add the task's question, tool results and answer to its agent's memory; nothing without memory."""
    if not task.uses_memory:
        return
    assert task.deps.memory is not None
    task_id = task.spec.task_id
    messages = [MemoryMessage("user", task.spec.payload, task_id=task_id)]
    messages += [MemoryMessage("tool", m.content, name=m.name, task_id=task_id)
                 for m in task.messages if m.role == "tool"]
    messages.append(MemoryMessage("assistant", task.output, task_id=task_id))
    async with task.stage("remember"):
        await task.deps.memory.record(task.spec.tenant_id, task.spec.agent_id, messages)
