"""A cancelled or failed task's status reports what it consumed: the compute score and KV peak of its step cut short.

A model step's usage used to reach the orchestrator only in the step's done chunk, which never came after a
cancel: a task that held 16.6 MB of KV for 2 s read ``compute_score_used`` 0 and ``memory_peak_mb`` 0. The
dispatcher now answers a cancel with the request's done chunk as it stands (``finish_reason`` cancelled), and
the orchestrator counts it before it records the task's outcome. The same held for a step that failed while it
ran, the cancel's siblings: one past the task's time limit (5 s streaming from a model server, then
``compute_score_used`` 0 while the same task cancelled at 3.5 s read 17.6) and one the model server cut after
its first tokens. A failed request's error now carries what it consumed, and a deadline cancels and counts as a
cancel does.

Real servers on 127.0.0.1 port 0: a dispatcher on the sim engine, an orchestrator with its SQLite task store
and its HTTP face; the fixed downstream of test_orchestrator.py where a case needs a downstream that does
something no engine does on cue (a tool call that waits, a dispatcher that stopped answering).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
from fast_sim import FAST
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401
from test_orchestrator import Downstream
from test_submit_backlog import face_stack, final_state, until

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator import generate_stream
from switchyard.orchestrator.service import OrchestratorService
from switchyard_harness.faults import Fault

pytestmark = pytest.mark.no_gpu

SLOW = {**FAST, "sim.decode_base_ms": 20.0}  # a step every ~20 ms: a task stays running while the test acts


@pytest.fixture(autouse=True)
def patient_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer to a cancel is waited for past any pause of this shared machine (behaviour, not speed)."""
    monkeypatch.setattr(generate_stream, "CANCEL_ANSWER_WAIT_S", 60.0)


@contextlib.asynccontextmanager
async def sim_stack(store: Path, **overrides: object) -> AsyncIterator[
        tuple[agent_pb2_grpc.AgentServiceStub, httpx.AsyncClient, DispatcherService]]:
    """(gRPC stub, httpx client on the HTTP face, dispatcher) of an orchestrator in front of a sim dispatcher."""
    base = load_config("config")
    dispatcher = DispatcherService(base.with_overrides(**{**SLOW, "dispatcher.engine": "sim"}))
    async with running([dispatcher], base.server) as disp:
        async with face_stack(base, f"127.0.0.1:{disp.port}", store, **overrides) as (stub, client, _):
            yield stub, client, dispatcher


def generated(dispatcher: DispatcherService) -> int:
    """Tokens the running requests have generated so far."""
    return sum(len(r.output_tokens) for r in dispatcher.scheduler.running)


async def running_with_tokens(stub: agent_pb2_grpc.AgentServiceStub, dispatcher: DispatcherService,
                              task_id: str) -> None:
    """Wait until ``task_id`` runs and its model step has made a few tokens (its KV is held)."""
    await until(lambda: dispatcher.scheduler.num_running == 1 and generated(dispatcher) >= 5)
    status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))
    assert status.state == agent_pb2.RUNNING


async def test_a_running_task_cancelled_over_http_reports_its_compute_score_and_memory_peak(tmp_path):
    """The reported repro: submit a long chat over HTTP, cancel it while it generates, read its status."""
    async with sim_stack(tmp_path / "tasks.sqlite3") as (stub, client, dispatcher):
        submitted = await client.post("/api/v1/agent/submit", json={
            "task_id": "c1", "agent_id": "a1", "payload": "Explain the with statement.", "task_type": "chat",
            "max_tokens": 2000})
        assert submitted.status_code == 200, submitted.text
        await running_with_tokens(stub, dispatcher, "c1")
        cancel = await client.post("/api/v1/tasks/c1/cancel")
        assert cancel.status_code == 200, cancel.text
        status = (await client.get("/api/v1/tasks/c1")).json()
        grpc_status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="c1"))
        assert dispatcher.scheduler.num_running == 0  # the engine let it go
    for answer in (cancel.json(), status):
        assert answer["state"] == "failed" and answer["error"] == "CANCELLED: cancelled by CancelTask while RUNNING"
        assert answer["compute_score_used"] > 0 and answer["memory_peak_mb"] > 0 and answer["memory_peak_bytes"] > 0
    assert status["compute_score_used"] == cancel.json()["compute_score_used"]  # recorded as answered
    assert grpc_status.compute_score_used == status["compute_score_used"]
    assert grpc_status.memory_peak_bytes == status["memory_peak_bytes"]


async def test_a_running_task_cancelled_over_grpc_reports_its_compute_score_and_memory_peak(tmp_path):
    async with sim_stack(tmp_path / "tasks.sqlite3") as (stub, _client, dispatcher):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="g1", payload="Explain the with statement.",
                                                       task_type="chat", max_tokens=2000))
        await running_with_tokens(stub, dispatcher, "g1")
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="g1"))
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="g1"))
    for answer in (cancelled, status):
        assert answer.state == agent_pb2.FAILED and answer.error == "CANCELLED: cancelled by CancelTask while RUNNING"
        assert answer.compute_score_used > 0 and answer.memory_peak_bytes > 0


async def test_a_task_cancelled_while_queued_reports_nothing_consumed(tmp_path):
    """Queued in the backlog (one runs at a time): it never reached the dispatcher, so 0 is right."""
    async with sim_stack(tmp_path / "tasks.sqlite3", **{"orchestrator.max_running_submitted_tasks": 1}) as (
            stub, client, dispatcher):
        for task_id in ("first", "queued"):
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="Explain the with statement.",
                                                           task_type="chat", max_tokens=2000))
        await running_with_tokens(stub, dispatcher, "first")
        cancel = await client.post("/api/v1/tasks/queued/cancel")
        grpc_status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="queued"))
        await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="first"))
    assert cancel.json()["error"] == "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
    assert cancel.json()["compute_score_used"] == 0 and cancel.json()["memory_peak_mb"] == 0
    assert grpc_status.compute_score_used == 0 and grpc_status.memory_peak_bytes == 0


async def test_a_task_whose_model_server_cut_its_step_reports_what_the_step_consumed(tmp_path, clean_proxy_env):
    """The openai engine in front of a model server that closes the stream after three tokens: the task fails
    UNAVAILABLE (no retry after a token), and the compute score and inference wait of that step are in its status."""
    from test_openai_engine import engine_for

    with start_sim(faults={"*": Fault(cut_after=3, slow_ms=20)}) as server:
        base = load_config("config")
        engine = engine_for(server.base_url)
        async with running([DispatcherService(base, engine=engine)], base.server) as disp:
            async with face_stack(base, f"127.0.0.1:{disp.port}", tmp_path / "tasks.sqlite3") as (stub, client, _):
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="cut", payload="Explain the with statement.",
                                                               task_type="chat", max_tokens=64))
                status = await final_state(stub, "cut")
                answer = (await client.get("/api/v1/tasks/cut")).json()
    assert status.state == agent_pb2.FAILED and status.error.startswith("UNAVAILABLE: ")
    assert "closed mid-response" in status.error and "after 3 streamed item(s)" in status.error
    assert status.compute_score_used > 0 and answer["compute_score_used"] == status.compute_score_used
    assert status.timings.queue_wait_s["inference"] > 0  # the step's own accounting came with it


async def test_a_task_past_its_time_limit_in_front_of_a_slow_model_server_reports_what_its_step_consumed(
        tmp_path, clean_proxy_env):
    """The reported repro: a model server streaming a token every 0.3 s, a chat limited to 2 s. The step ends at
    the deadline wherever it is met first (the dispatcher's scheduler, the orchestrator's request, the task: a
    race, read 0.0 through ``switchyard up`` where either of the first two won); each way its compute score is
    counted (test_generate_stream.py holds the first two apart)."""
    from test_openai_engine import engine_for

    limits = {"chat": 2.0, "rag_answer": 180.0, "react_loop": 600.0}
    with start_sim(faults={"*": Fault(slow_ms=300)}) as server:
        base = load_config("config")
        engine = engine_for(server.base_url)
        async with running([DispatcherService(base, engine=engine)], base.server) as disp:
            async with face_stack(base, f"127.0.0.1:{disp.port}", tmp_path / "tasks.sqlite3",
                                  **{"orchestrator.task_time_limit_s": limits}) as (stub, _client, _):
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="slow", payload="Explain the with statement.",
                                                               task_type="chat", max_tokens=64))
                status = await final_state(stub, "slow")
    assert status.state == agent_pb2.FAILED and status.error.startswith("DEADLINE_EXCEEDED: task 'slow' ran out of time")
    assert status.compute_score_used > 0
    assert status.timings.queue_wait_s["inference"] > 0


class ToolWaits(Downstream):
    """The fixed downstream whose search_docs retrieval waits until released: a react_loop cancelled during
    its tool call."""

    def __init__(self) -> None:
        super().__init__()
        self.retrieving = asyncio.Event()
        self.release = asyncio.Event()

    async def Retrieve(self, request, context):  # noqa: N802 - gRPC method name
        self.retrieving.set()
        await self.release.wait()
        return await super().Retrieve(request, context)


class Unanswering(Downstream):
    """A dispatcher that stopped answering cancels (its answer never comes)."""

    answers_cancels = False


@contextlib.asynccontextmanager
async def fake_stack(store: Path, down: Downstream) -> AsyncIterator[agent_pb2_grpc.AgentServiceStub]:
    base = load_config("config", service="orchestrator")
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        cfg = base.with_overrides(**{
            "orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
            "orchestrator.task_store.sqlite_path": str(store), "orchestrator.cpu_executor": "loop"})
        async with running([OrchestratorService(cfg)], cfg.server) as srv:
            channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
            try:
                yield agent_pb2_grpc.AgentServiceStub(channel)
            finally:
                await channel.close()


async def test_a_react_loop_cancelled_during_its_tool_call_keeps_its_earlier_steps_usage(tmp_path):
    down = ToolWaits()
    async with fake_stack(tmp_path / "tasks.sqlite3", down) as stub:
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="rl", payload="What does with do?",
                                                       task_type="react_loop"))
        await asyncio.wait_for(down.retrieving.wait(), 30)  # its first step ended in search_docs, which waits
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="rl"))
        down.release.set()
    assert cancelled.error == "CANCELLED: cancelled by CancelTask while RUNNING"
    assert (cancelled.compute_score_used, cancelled.memory_peak_bytes) == (0.5, 1000)  # the first step's done


async def test_a_dispatcher_that_does_not_answer_the_cancel_leaves_what_was_known(tmp_path, monkeypatch):
    """No answer (a dispatcher stopped, or one of an older protocol): the cancel ends after its bounded wait and
    the status reports what the orchestrator knew."""
    monkeypatch.setattr(generate_stream, "CANCEL_ANSWER_WAIT_S", 0.05)
    down = Unanswering()
    down.words, down.token_gap_s = ["w"] * 400, 0.01
    async with fake_stack(tmp_path / "tasks.sqlite3", down) as stub:
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="quiet", payload="hello", task_type="chat"))
        await until(lambda: bool(down.requests))
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="quiet"))
        status = await final_state(stub, "quiet")
    assert cancelled.error == status.error == "CANCELLED: cancelled by CancelTask while RUNNING"
    assert (status.compute_score_used, status.memory_peak_bytes) == (0.0, 0)
