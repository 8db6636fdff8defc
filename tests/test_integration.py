"""The three real services in one process, each on its own port 0 server."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.service import OrchestratorService
from switchyard.retrieval.service import RetrievalService
from switchyard.common.channels import open_channel
from token_events import positions_follow_on, token_count

pytestmark = pytest.mark.slow


ON_THE_LOOP = {"orchestrator.cpu_executor": "loop"}
"""For a test of something other than the stack as shipped: its orchestrator's CPU work on the event loop, as
orchestrator_config's (the shipped spawn pool, which the first two tests here run, costs seconds of every start)."""


@contextlib.asynccontextmanager
async def three_services(index_dir, **overrides):
    cfg = load_config("config").with_overrides(**{"retrieval.index_dir": str(index_dir), **overrides})
    server = cfg.server
    async with running([RetrievalService(cfg)], server) as retrieval, running([DispatcherService(cfg)], server) as disp:
        cfg = cfg.with_overrides(**{
            "orchestrator.retrieval_addr": f"127.0.0.1:{retrieval.port}",
            "orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}",
        })
        async with running([OrchestratorService(cfg)], server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                yield agent_pb2_grpc.AgentServiceStub(channel)


async def test_with_statement_question_is_answered_from_its_passage(pydoc_index_dir):
    async with three_services(pydoc_index_dir) as stub:
        events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="How does the with statement work?"))]
    final = events[-1].final
    assert "with" in [p.title for p in final.passages]
    stages = [e.stage.name for e in events if e.HasField("stage")]
    assert stages == ["retrieve", "render_prompt", "infer"]
    tokens = [e.token for e in events if e.HasField("token")]
    assert tokens and positions_follow_on(tokens)
    assert final.output == "".join(t.text for t in tokens)
    # the sim engine answers extractively from the retrieved context and cites it
    assert "[" in final.output and "with" in final.output.lower()
    assert final.usage.completion_tokens == token_count(tokens) and final.usage.prompt_tokens > 0
    assert final.timings.queue_wait_s["inference"] >= 0 and final.timings.ttft_s > 0


async def test_react_loop_calls_search_docs_and_calculator(pydoc_index_dir):
    question = "What does the with statement do, and what is 12*(3+4)?"
    async with three_services(pydoc_index_dir) as stub:
        events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload=question, task_type="react_loop"))]
    calls = [e.tool_call.name for e in events if e.HasField("tool_call")]
    results = {e.tool_result.name: e.tool_result for e in events if e.HasField("tool_result")}
    assert set(calls) >= {"search_docs", "calculator"}
    assert not results["search_docs"].is_error and "with" in results["search_docs"].content.lower()
    assert "= 84" in results["calculator"].content
    final = events[-1].final
    assert final.output and final.compute_score_used >= 0 and final.memory_peak_bytes > 0


@pytest.mark.parametrize("max_tokens", [3, 1])
async def test_a_react_step_that_spends_max_tokens_inside_its_tool_call_fails_naming_max_tokens(
        pydoc_index_dir, max_tokens):
    """The sim engine generates a tool call as hidden tokens (its arguments) and hands the call over at its end. Cut
    at max_tokens before that end, the step made no call and showed no text, and the task ended "finished" with an
    empty answer and finish_reason length. It fails INVALID_ARGUMENT naming max_tokens, as a cut call does in
    front of a model server (tests/test_openai_engine.py)."""
    events = []
    async with three_services(pydoc_index_dir, **ON_THE_LOOP) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in stub.RunTask(agent_pb2.RunTaskRequest(
                    payload="What is 12*(3+4)?", task_type="react_loop", max_tokens=max_tokens)):
                events.append(event)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert details.startswith("max_tokens: expected room for a react_loop step's whole tool call or answer: step 0 "
                              f"generated all {max_tokens} tokens it was allowed and it had made neither"), details
    assert not [e for e in events if e.HasField("tool_call") or e.HasField("final")]


async def test_a_react_loop_with_room_for_its_calls_still_answers(pydoc_index_dir):
    """The sibling of the cut: the same question with room for its calls is answered."""
    async with three_services(pydoc_index_dir, **ON_THE_LOOP) as stub:
        events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(
            payload="What is 12*(3+4)?", task_type="react_loop", max_tokens=64))]
    assert [e.tool_call.name for e in events if e.HasField("tool_call")] == ["search_docs", "calculator"]
    assert "84" in events[-1].final.output and events[-1].final.finish_reason == "stop"


def _what_it_says(events: list[agent_pb2.TaskEvent]) -> tuple:
    """What a task's events say, however its tokens were grouped into events: the text and token count, the other
    events in order (stages by name, tool calls and results by content), the answer and its usage."""
    tokens = [e.token for e in events if e.HasField("token")]
    others = []
    for e in events:
        kind = e.WhichOneof("event")
        if kind == "stage":
            others.append(("stage", e.stage.name))
        elif kind == "tool_call":
            others.append(("tool_call", e.tool_call.name, e.tool_call.arguments_json))
        elif kind == "tool_result":
            others.append(("tool_result", e.tool_result.name, e.tool_result.content, e.tool_result.is_error))
        elif kind in ("accepted", "final"):
            others.append((kind,))
    final = events[-1].final
    return ("".join(t.text for t in tokens), token_count(tokens), others, final.output,
            final.usage.completion_tokens, final.usage.prompt_tokens)


@pytest.mark.parametrize("task_type, payload", [
    ("rag_answer", "How does the with statement work?"),
    ("react_loop", "What does the with statement do, and what is 12*(3+4)?"),
])
async def test_a_batch_tasks_events_say_the_same_whatever_its_token_hold(pydoc_index_dir, task_type, payload):
    """A BATCH task's model calls carry its RunTask merge interval to the dispatcher (GenerateStream's
    token_hold_s), which holds the calls' tokens as long: the caller reads the same with no interval and with a
    10 s one (first tokens, tool calls and ends never wait it out), in fewer token events."""
    runs = []
    for interval_ms in (0.0, 10_000.0):
        async with three_services(pydoc_index_dir, **ON_THE_LOOP,
                                  **{"orchestrator.batch_token_flush_interval_ms": interval_ms}) as stub:
            runs.append([e async for e in stub.RunTask(agent_pb2.RunTaskRequest(
                task_id="t-batch", payload=payload, task_type=task_type, priority=agent_pb2.BATCH))])
    unheld, held = runs
    assert held[-1].HasField("final") and _what_it_says(held) == _what_it_says(unheld)
    assert (next(e.token for e in held if e.HasField("token")).count or 1) == 1  # the first token is never held
    steps = sum(1 for e in held if e.HasField("stage") and e.stage.name == "infer") or 1
    assert len([e for e in held if e.HasField("token")]) <= 2 * steps < len([e for e in unheld if e.HasField("token")])
