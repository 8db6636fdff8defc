"""Submitted tasks wait in the orchestrator's backlog and at most ``orchestrator.max_running_submitted_tasks``
run at once; the backlog is served by priority class, then arrival; a queued or running task can be cancelled;
a full backlog is refused (RESOURCE_EXHAUSTED, HTTP 429).

Real gRPC and HTTP servers on 127.0.0.1 port 0 against the fixed downstream of test_orchestrator.py, whose
Generate waits on a gate: a task that reached it is running, and stays so until the gate opens. The
orchestrator's own gauge ``switchyard_submitted_tasks{state}`` and its statuses say what runs and what waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from urllib.parse import quote

import grpc
import httpx
import jsonschema
import pytest
from prometheus_client import REGISTRY
from test_orchestrator import Downstream, collect

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.errors import QueueFullError, abort
from switchyard.common.server import running
from switchyard.orchestrator.http_face import HttpFace
from switchyard.orchestrator.metrics import SUBMITTED_TASKS
from switchyard.orchestrator.service import OrchestratorService
from switchyard.orchestrator.taskstore.sqlite_store import SqliteTaskStore

pytestmark = pytest.mark.no_gpu


class CountingDownstream(Downstream):
    """The fixed downstream, counting the Generate calls in flight and the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.peak = 0

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            async for chunk in super().Generate(request, context):
                yield chunk
        finally:
            self.in_flight -= 1


@contextlib.asynccontextmanager
async def backlog_stack(store: Path, down: Downstream | None = None, **overrides):
    """(gRPC stub, httpx client on the HTTP face, downstream) of one orchestrator with its task store at
    ``store``, in front of ``down`` (a :class:`CountingDownstream` by default); the downstream's gate is closed."""
    base = load_config("config", service="orchestrator")
    down = down if down is not None else CountingDownstream()
    down.gate = asyncio.Event()
    async with running([down], base.server) as downstream:
        async with face_stack(base, f"127.0.0.1:{downstream.port}", store, **overrides) as (stub, client, orch):
            down.orchestrator = orch  # for a test that reaches its task store
            try:
                yield stub, client, down
            finally:
                down.gate.set()


@contextlib.asynccontextmanager
async def face_stack(base, addr: str, store: Path, **overrides):
    """(gRPC stub, httpx client on the HTTP face, the OrchestratorService) of one orchestrator on 127.0.0.1 port 0
    with its HTTP face, in front of ``addr`` (retrieval and dispatcher), its task store at ``store``; ``base``: the
    config, ``overrides`` on it."""
    cfg = base.with_overrides(**{
        "orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
        "orchestrator.task_store.sqlite_path": str(store), "orchestrator.cpu_executor": "loop", **overrides,
    })
    orch = OrchestratorService(cfg)
    face = HttpFace(orch, cfg, port=0)
    async with running([orch, face], cfg.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
        try:
            # connected before the first call: gRPC shares subchannels between channels to one address, and one
            # a finished test left to a server on this same port may still be backing off ("connection refused")
            await asyncio.wait_for(channel.channel_ready(), 30)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
                yield agent_pb2_grpc.AgentServiceStub(channel), client, orch
        finally:
            await channel.close()


def gauge(state: str) -> float:
    return SUBMITTED_TASKS.labels(state)._value.get()


async def until(condition, seconds: float = 30.0) -> None:
    """Poll ``condition`` (behaviour, not speed: the bound is far past the time it should take)."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def final_state(stub, task_id: str) -> agent_pb2.TaskStatus:
    for _ in range(1000):
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))
        if status.state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED):
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"{task_id} never finished: {status}")


def cancelled_tasks() -> float:
    """``switchyard_tasks_total{code="CANCELLED"}`` over every task type."""
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() if metric.name == "switchyard_tasks"
               for sample in metric.samples
               if sample.name == "switchyard_tasks_total" and sample.labels.get("code") == "CANCELLED")


def submit(stub, task_id: str, priority: int):
    return stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat",
                                                    priority=priority))


async def test_at_most_the_bound_run_the_backlog_is_served_by_class_then_arrival_and_cancel_works(tmp_path):
    assert gauge("queued") == 0 and gauge("running") == 0
    cancelled_before = cancelled_tasks()
    overrides = {"orchestrator.max_running_submitted_tasks": 2, "orchestrator.max_unfinished_submitted_tasks": 6}
    async with backlog_stack(tmp_path / "tasks.sqlite3", **overrides) as (stub, _, down):
        assert [(await submit(stub, t, agent_pb2.BATCH)).queue_position for t in ("b1", "b2")] == [0, 0]
        await until(lambda: len(down.requests) == 2)  # both run: inside Generate, behind the gate
        positions = [(await submit(stub, task_id, priority)).queue_position for task_id, priority in (
            ("b3", agent_pb2.BATCH), ("b4", agent_pb2.BATCH), ("n1", agent_pb2.NORMAL), ("c1", agent_pb2.CORE))]
        assert positions == [0, 1, 0, 0]  # a more important class goes ahead of the batch tasks waiting
        assert (gauge("running"), gauge("queued")) == (2, 4)
        queued = {t: await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=t)) for t in ("c1", "n1", "b3", "b4")}
        assert {t: (s.state, s.queue_position) for t, s in queued.items()} == {
            "c1": (agent_pb2.QUEUED, 0), "n1": (agent_pb2.QUEUED, 1), "b3": (agent_pb2.QUEUED, 2),
            "b4": (agent_pb2.QUEUED, 3)}
        running_now = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="b1"))
        assert running_now.state == agent_pb2.RUNNING and running_now.queue_position == 0

        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="b3"))
        assert cancelled.state == agent_pb2.FAILED and cancelled.error.startswith("CANCELLED: cancelled by CancelTask")
        assert "QUEUED" in cancelled.error
        assert (await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="b3"))).error == cancelled.error
        assert (await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="b4"))).queue_position == 2
        assert gauge("queued") == 3

        assert (await submit(stub, "x1", agent_pb2.BATCH)).queue_position == 3  # 6 held: the bound
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await submit(stub, "x2", agent_pb2.CORE)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "orchestrator.max_unfinished_submitted_tasks" in full.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as missing:  # refused: never recorded
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="x2"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        stopped = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="b1"))  # running: its call is cancelled
        assert stopped.state == agent_pb2.FAILED and stopped.error == "CANCELLED: cancelled by CancelTask while RUNNING"
        await until(lambda: "b1:0" in down.cancelled and len(down.requests) == 3)  # its place went to c1
        assert down.requests[2].request_id.startswith("c1:")
        assert (gauge("running"), gauge("queued")) == (2, 3)
        await until(lambda: cancelled_tasks() == cancelled_before + 2)  # b3 from the backlog, b1 running: both

        down.gate.set()
        finals = {t: await final_state(stub, t) for t in ("b2", "c1", "n1", "b4", "x1")}
        assert all(s.state == agent_pb2.SUCCEEDED for s in finals.values()), finals
        assert finals["b4"].timings.queue_wait_s["submitted"] > 0  # its wait in the backlog, reported
        started = [r.request_id.split(":")[0] for r in down.requests]
        assert started == ["b1", "b2", "c1", "n1", "b4", "x1"]  # b3 was cancelled before it started
        assert down.peak == 2  # never more than the bound at once
        again = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="b2"))  # finished: answered unchanged
        assert again.state == agent_pb2.SUCCEEDED and again.result.output == "The answer."
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()
        await until(lambda: gauge("running") == 0)
        assert gauge("queued") == 0


async def test_http_submit_reports_the_backlog_place_status_reads_it_cancel_removes_it_and_a_full_one_is_429(tmp_path):
    overrides = {"orchestrator.max_running_submitted_tasks": 1, "orchestrator.max_unfinished_submitted_tasks": 3}
    body = {"agent_id": "agent-1", "priority": "normal", "task_type": "chat", "max_tokens": 16}
    async with backlog_stack(tmp_path / "tasks.sqlite3", **overrides) as (stub, client, down):
        doc = (await client.get("/openapi.json")).json()

        def check(instance: dict, name: str) -> None:
            jsonschema.validate(instance, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})

        async def post(task_id: str) -> httpx.Response:
            return await client.post("/api/v1/agent/submit", json={**body, "task_id": task_id})

        first = (await post("a")).json()
        check(first, "AcceptedResponse")
        assert (first["queue_position"], first["state"]) == (0, "queued")
        await until(lambda: len(down.requests) == 1)
        assert [(await post(t)).json()["queue_position"] for t in ("b", "c")] == [0, 1]
        again_a = await post("a")
        assert again_a.json()["state"] == "running", again_a.text  # the identical request again: the task as it is
        status = (await client.get("/api/v1/tasks/c")).json()
        check(status, "TaskStatusResponse")
        assert (status["state"], status["queue_position"]) == ("queued", 1)
        cancel = await client.post("/api/v1/tasks/b/cancel")
        assert cancel.status_code == 200, cancel.text
        check(cancel.json(), "TaskStatusResponse")
        assert cancel.json()["state"] == "failed" and cancel.json()["error"].startswith("CANCELLED:")
        again = await post("b")  # answered "accepted" as if queued, for a task that will never run
        assert again.status_code == 200 and again.json()["state"] == "failed", again.text
        check(again.json(), "AcceptedResponse")
        assert (await client.get("/api/v1/tasks/c")).json()["queue_position"] == 0
        assert (await post("d")).status_code == 200  # a, c, d: the bound
        refused = REGISTRY.get_sample_value("switchyard_queue_rejected_total", {"queue": "submitted", "reason": "full"})
        assert refused is not None  # exported at 0 before the first refusal: rate() sees the first one
        full = await post("e")
        assert full.status_code == 429, full.text
        with pytest.raises(grpc.aio.AioRpcError) as over:  # the gRPC edge's refusal is the same one
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="f", payload="q", agent_id="agent-1",
                                                           task_type="chat"))
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # counted where the alert on refusing queues reads (it was counted nowhere)
        assert REGISTRY.get_sample_value("switchyard_queue_rejected_total",
                                         {"queue": "submitted", "reason": "full"}) == refused + 2
        known = await post("a")  # refused 429 too: a full backlog, for a request that adds nothing to it
        assert known.status_code == 200 and known.json()["task_id"] == "a", known.text
        assert full.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert "orchestrator.max_unfinished_submitted_tasks" in full.json()["error"]["message"]
        assert (await client.post("/api/v1/tasks/nope/cancel")).status_code == 404
        down.gate.set()
        for task_id in ("a", "c", "d"):
            for _ in range(1000):
                state = (await client.get(f"/api/v1/tasks/{task_id}")).json()["state"]
                if state in ("finished", "failed"):
                    break
                await asyncio.sleep(0.02)
            assert state == "finished"
        assert down.peak == 1


async def test_a_stopping_orchestrator_records_what_ran_as_failed_and_releases_what_waited(tmp_path):
    """What waited never started: it is released, QUEUED for another orchestrator on the store to run
    (test_adopt_queued.py); it was recorded FAILED "resubmit it"."""
    store = tmp_path / "tasks.sqlite3"
    cancelled_before = cancelled_tasks()
    overrides = {"orchestrator.max_running_submitted_tasks": 1, "server.shutdown_grace_s": 0.2}
    async with backlog_stack(store, **overrides) as (stub, _, down):
        await submit(stub, "ran", agent_pb2.NORMAL)
        await until(lambda: len(down.requests) == 1)
        assert (await submit(stub, "waited", agent_pb2.NORMAL)).queue_position == 0
        down.gate = asyncio.Event()  # the stack's exit opens this one; "ran" waits on the first, never opened
    assert gauge("queued") == 0 and gauge("running") == 0
    assert cancelled_tasks() == cancelled_before + 1  # what ran; what waited ends where it runs
    config = load_config("config", service="orchestrator").with_overrides(
        **{"orchestrator.task_store.sqlite_path": str(store)}).orchestrator.task_store
    reader = SqliteTaskStore(config)
    await reader.open()
    try:
        ran, waited = await reader.get("ran"), await reader.get("waited")
    finally:
        await reader.close()
    assert ran.state == agent_pb2.FAILED and "stopped before the task finished" in ran.error
    assert waited.state == agent_pb2.QUEUED and waited.owner == "" and not waited.error


async def test_a_submit_whose_caller_left_while_the_store_wrote_it_still_runs_and_its_retry_gets_it(tmp_path):
    """A SubmitTask whose caller's deadline passed while the store wrote the record (another writer held the
    SQLite file) was cancelled between the record and the backlog: the task stayed QUEUED with no backlog holding
    it, for good, and the caller's identical retry was answered QUEUED for a task that never ran."""
    store = tmp_path / "tasks.sqlite3"
    async with backlog_stack(store) as (stub, _, down):
        down.gate.set()
        await submit(stub, "first", agent_pb2.NORMAL)
        assert (await final_state(stub, "first")).state == agent_pb2.SUCCEEDED  # the stack serves
        other_writer = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
        try:
            other_writer.execute("BEGIN IMMEDIATE")  # the orchestrator's write waits for the lock (busy timeout)
            with pytest.raises(grpc.aio.AioRpcError) as left:
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="late", payload="hello", task_type="chat"),
                                      timeout=0.5)
            assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.2)  # the handler is cancelled meanwhile; the write still waits on the lock
            other_writer.execute("COMMIT")
        finally:
            other_writer.close()
        again = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="late", payload="hello", task_type="chat"))
        assert again.task_id == "late"
        assert (await final_state(stub, "late")).state == agent_pb2.SUCCEEDED
        assert [r.request_id.split(":")[0] for r in down.requests] == ["first", "late"]


async def test_a_cancel_whose_caller_left_while_the_store_wrote_it_frees_the_tasks_place(tmp_path):
    """A CancelTask of a queued task whose caller's deadline passed while the store wrote the outcome (another
    writer held the SQLite file) was cancelled between the backlog and the record: the entry, out of the backlog,
    was never forgotten, and held one of orchestrator.max_unfinished_submitted_tasks' places for good."""
    from prometheus_client import REGISTRY

    store = tmp_path / "tasks.sqlite3"
    overrides = {"orchestrator.max_running_submitted_tasks": 1, "orchestrator.max_unfinished_submitted_tasks": 2}
    async with backlog_stack(store, **overrides) as (stub, _, down):
        await submit(stub, "runs", agent_pb2.NORMAL)
        await until(lambda: len(down.requests) == 1)
        await submit(stub, "waits", agent_pb2.NORMAL)
        other_writer = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
        try:
            other_writer.execute("BEGIN IMMEDIATE")  # the orchestrator's write waits for the lock (busy timeout)
            with pytest.raises(grpc.aio.AioRpcError) as left:
                await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="waits"), timeout=0.5)
            assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.2)  # the handler is cancelled meanwhile; the write still waits on the lock
            other_writer.execute("COMMIT")
        finally:
            other_writer.close()
        cancelled = await final_state(stub, "waits")
        assert cancelled.error == "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
        down.gate.set()
        assert (await final_state(stub, "runs")).state == agent_pb2.SUCCEEDED
        await until(lambda: REGISTRY.get_sample_value("switchyard_queue_depth", {"queue": "submitted"}) == 0)
        for task_id in ("next-1", "next-2"):  # both places are free again
            await submit(stub, task_id, agent_pb2.NORMAL)
            assert (await final_state(stub, task_id)).state == agent_pb2.SUCCEEDED


@contextlib.asynccontextmanager
async def late_refused_with_its_record_kept(store: Path, monkeypatch):
    """(stub, the downstream): a stack whose backlog holds one task, where "late" was recorded, then refused
    RESOURCE_EXHAUSTED ("first" took the backlog's one place meanwhile), and its record's delete refused (another
    writer held the SQLite file past its busy timeout, 0.5 s here); the downstream's gate closed, "first" held
    at it."""
    from switchyard.orchestrator.taskstore import sqlite_store

    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", 0.5)
    async with backlog_stack(store, **{"orchestrator.max_unfinished_submitted_tasks": 1}) as (stub, _, down):
        orch = down.orchestrator
        create, created, locked = orch.tasks.create, asyncio.Event(), asyncio.Event()

        async def create_then_wait(task_id, *args, **kwargs):  # SubmitTask stopped between its record and backlog
            answer = await create(task_id, *args, **kwargs)
            if task_id == "late" and not created.is_set():
                created.set()
                await locked.wait()  # "first" took the backlog's one place, and another writer holds the file
            return answer

        orch.tasks.create = create_then_wait
        late = asyncio.ensure_future(submit(stub, "late", agent_pb2.NORMAL))
        await created.wait()
        await submit(stub, "first", agent_pb2.NORMAL)
        other_writer = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
        try:
            other_writer.execute("BEGIN IMMEDIATE")  # the delete waits for the lock, past the busy timeout
            locked.set()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await late
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            other_writer.execute("COMMIT")
            other_writer.close()
        yield stub, down


async def test_a_refused_task_whose_record_the_store_did_not_delete_is_deleted_later(tmp_path, monkeypatch):
    """A task recorded, then refused because the backlog filled while it was written, has its record deleted (the
    caller hears RESOURCE_EXHAUSTED, nothing recorded). Where the store refused the delete (another writer held the
    SQLite file past its busy timeout), the record stayed QUEUED for good on a live orchestrator that held no such
    task: GetTaskStatus answered QUEUED for a task that never runs, and its identical retry was answered that."""
    store = tmp_path / "tasks.sqlite3"
    async with late_refused_with_its_record_kept(store, monkeypatch) as (stub, down):
        orch = down.orchestrator
        for _ in range(1000):  # deleted once the store takes it: no such task, and a retry can be accepted
            try:
                await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="late"))
            except grpc.aio.AioRpcError as gone:
                assert gone.code() == grpc.StatusCode.NOT_FOUND
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the refused task's record is still there")
        down.gate.set()
        assert (await final_state(stub, "first")).state == agent_pb2.SUCCEEDED
        await until(lambda: not orch._submitted._tasks)
        await submit(stub, "late", agent_pb2.NORMAL)  # the caller's retry: recorded anew, and it runs
        assert (await final_state(stub, "late")).state == agent_pb2.SUCCEEDED


async def test_the_identical_retry_of_a_refused_task_whose_record_the_store_kept_is_placed_and_runs(
        tmp_path, monkeypatch):
    """A task refused because the backlog filled while it was written, whose delete the store refused, keeps its
    QUEUED record until the delete is tried again. The caller's identical retry meanwhile (the backlog has room
    now) read that record as the task already submitted and was answered QUEUED, for a task no backlog held:
    it never ran, and the later delete took the record away (NOT_FOUND). It is placed and runs now."""
    from switchyard.orchestrator import service as service_module

    monkeypatch.setattr(service_module, "RECORD_AGAIN_S", 600.0)  # the refused delete is tried again only later
    store = tmp_path / "tasks.sqlite3"
    async with late_refused_with_its_record_kept(store, monkeypatch) as (stub, down):
        orch = down.orchestrator
        down.gate.set()
        assert (await final_state(stub, "first")).state == agent_pb2.SUCCEEDED
        await until(lambda: not orch._submitted._tasks)
        again = await submit(stub, "late", agent_pb2.NORMAL)  # the caller's retry, the record still there
        assert again.state == agent_pb2.QUEUED
        assert (await final_state(stub, "late")).state == agent_pb2.SUCCEEDED
        assert [r.request_id.split(":")[0] for r in down.requests] == ["first", "late"]


async def test_a_refused_task_whose_record_the_store_kept_is_no_task_to_the_orchestrator_that_refused_it(
        tmp_path, monkeypatch):
    """Until the store took the refused task's delete, the orchestrator that had answered its submit
    RESOURCE_EXHAUSTED answered GetTaskStatus QUEUED for it, and CancelTask waited out the caller's whole deadline
    to answer UNAVAILABLE: 'task 'late' is held by orchestrator <itself>, which was asked to cancel it and has not
    ended it'. Both answer NOT_FOUND now, saying its submit was refused."""
    from switchyard.orchestrator import service as service_module

    monkeypatch.setattr(service_module, "RECORD_AGAIN_S", 600.0)  # the refused delete is tried again only later
    async with late_refused_with_its_record_kept(tmp_path / "tasks.sqlite3", monkeypatch) as (stub, down):
        for call in (stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="late")),
                     stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="late"), timeout=30)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()
            assert refused.value.details().startswith("task_id: no task 'late' (its SubmitTask was refused")
        down.gate.set()
        assert (await final_state(stub, "first")).state == agent_pb2.SUCCEEDED


async def test_a_long_value_from_a_caller_is_quoted_cut_and_every_call_gets_its_own_status(tmp_path):
    """Errors quoted a caller's value whole: a 20,000-character task_type or task_id made status details past
    gRPC's 16 KiB metadata limit, and the caller got RESOURCE_EXHAUSTED ("received metadata size exceeds hard
    limit") instead of INVALID_ARGUMENT or NOT_FOUND; between 8 and 16 KB it depended on the call. A lookup by an
    id longer than SubmitTask takes is INVALID_ARGUMENT (no task has it); a value is quoted to 100 characters."""
    long = "x" * 20_000
    async with backlog_stack(tmp_path / "tasks.sqlite3") as (stub, client, _):
        calls = [
            (stub.SubmitTask, agent_pb2.RunTaskRequest(payload="hi", task_type=long), "task_type"),
            (stub.GetTaskStatus, agent_pb2.GetTaskStatusRequest(task_id=long), "task_id"),
            (stub.GetTaskStatus, agent_pb2.GetTaskStatusRequest(agent_id=long), "agent_id"),
            (stub.CancelTask, agent_pb2.CancelTaskRequest(task_id=long), "task_id"),
        ]
        for call, request, field in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, refused.value.code())
            assert refused.value.details().startswith(f"{field}: expected") and len(refused.value.details()) < 400
        stream = stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type=long))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stream:
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "20000 characters" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as unknown:  # within the bound: not found, quoted
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="y" * 128))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "(128 characters)" in unknown.value.details()

        # a body of many unknown keys: ten errors listed, the rest counted, each key cut
        body = "{" + ", ".join(f'"{"k" * 300}{i}": 1' for i in range(2000)) + ', "payload": "hi"}'
        answer = await client.post("/api/v1/agent/submit", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and len(answer.content) < 8_000, len(answer.content)
        assert "and 1991 more errors" in answer.json()["error"]["message"]  # 2000 keys and the missing task_type


@pytest.mark.parametrize("store_back", ["while running", "at stop"])
async def test_an_outcome_the_store_refused_is_written_again_until_it_takes_it(tmp_path, monkeypatch, store_back):
    """A finished task whose outcome the store refused (a full disk) was answered "finished" by its
    orchestrator and, after a clean restart, "failed: stopped while RUNNING": its row stayed RUNNING."""
    from switchyard.orchestrator import service as service_module
    from switchyard.orchestrator.taskstore.base import TaskStoreUnavailable

    monkeypatch.setattr(service_module, "RECORD_AGAIN_S", 0.05 if store_back == "while running" else 3600.0)
    monkeypatch.setattr(service_module, "RECORD_TRY_WAIT_S", 0.005)  # its five tries in 0.08 s, not 1.5 s
    store = tmp_path / "tasks.sqlite3"
    refusing = True
    async with backlog_stack(store) as (stub, _, down):
        tasks = down.orchestrator.tasks
        finish = tasks.finish

        async def full_disk_finish(*args, **kwargs):  # the store's own error for a write that failed
            if refusing:
                raise TaskStoreUnavailable("sqlite", "database or disk is full")
            return await finish(*args, **kwargs)

        monkeypatch.setattr(tasks, "finish", full_disk_finish)
        await submit(stub, "kept", agent_pb2.NORMAL)
        down.gate.set()
        status = await final_state(stub, "kept")  # answered by the orchestrator that ran it
        assert status.state == agent_pb2.SUCCEEDED and status.result.output == "The answer."
        await until(lambda: "kept" in down.orchestrator._unrecorded)  # its 5 tries failed: it waits to be written
        assert (await tasks.get("kept")).state == agent_pb2.RUNNING  # the store has not taken it
        refusing = False
        if store_back == "while running":
            await until(lambda: not down.orchestrator._unrecorded)
            assert (await tasks.get("kept")).state == agent_pb2.SUCCEEDED
    config = load_config("config", service="orchestrator").with_overrides(
        **{"orchestrator.task_store.sqlite_path": str(store)}).orchestrator.task_store
    reader = SqliteTaskStore(config)
    await reader.open()
    try:
        assert (await reader.get("kept")).state == agent_pb2.SUCCEEDED  # after the stop too
    finally:
        await reader.close()


class ToolThenGate(Downstream):
    """react_loop's first model step answers a tool call at once; the step after the tool's result waits on
    the gate: a running task that has consumed one model step (its done chunk: compute score 0.5, KV 1000 B)."""

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        if any(m.role == "tool" for m in request.messages):
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
        else:
            yield agent_pb2.GenerateChunk(tool_call=agent_pb2.ToolCall(
                call_id="c1", name="search_docs", arguments_json=json.dumps({"query": "with statement"})))
        yield agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=1, total_tokens=11),
            compute_score_used=0.5, memory_peak_bytes=1000, model="fake"))


async def test_a_task_cancelled_after_a_model_step_reports_what_it_consumed(tmp_path):
    """compute_score_used and memory_peak_bytes came only from a finished task's answer: a running task read 0,
    and so did one cancelled (or failed) after its model steps had consumed the dispatcher's compute."""
    async with backlog_stack(tmp_path / "tasks.sqlite3", ToolThenGate()) as (stub, client, down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="r1", payload="hello", task_type="react_loop"))
        await until(lambda: len(down.requests) == 2)  # the step after the tool waits: one step consumed
        running = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="r1"))
        assert running.state == agent_pb2.RUNNING
        assert (running.compute_score_used, running.memory_peak_bytes) == (0.5, 1000)
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="r1"))
        assert cancelled.state == agent_pb2.FAILED and cancelled.error.startswith("CANCELLED")
        assert (cancelled.compute_score_used, cancelled.memory_peak_bytes) == (0.5, 1000)
        assert not cancelled.HasField("result")  # no answer: only what it consumed
        assert cancelled.timings.stage_s["infer"] > 0 and cancelled.timings.total_s > 0
        stored = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="r1"))  # the store's record
        assert (stored.compute_score_used, stored.memory_peak_bytes, stored.HasField("result")) == (0.5, 1000, False)
        answer = (await client.get("/api/v1/tasks/r1")).json()
        assert (answer["state"], answer["compute_score_used"], answer["result"]) == ("failed", 0.5, None)


@pytest.mark.parametrize("agent_id, shown", [
    ("agent-\u202egnp.exe", "U+202E"), ("a\u2066b\u2069", "U+2066"), ("x\u200fy", "U+200F"),
    # the same kind, accepted until now: each reads as another id ('agent\u200b1' as 'agent1') where it is shown
    ("agent\u200b1", "U+200B"), ("\ufeffagent", "U+FEFF"), ("a\u2060b", "U+2060"), ("soft\xadhyphen", "U+00AD"),
    ("tag\U000e0041", "U+E0041"), ("line\u2028break", "U+2028"), ("para\u2029graph", "U+2029"),
    ("no\xa0break", "U+00A0"), ("ideographic\u3000space", "U+3000"),
    ("cafe\u0301", "NFC"),  # decomposed: reads as the composed 'café', another id
])
async def test_an_id_that_reads_as_another_is_refused_at_both_edges_naming_the_character(tmp_path, agent_id, shown):
    """A bidirectional control reorders what follows it as it is shown: 'agent-\u202egnp.exe' reads as
    'agent-exe.png' in a log, a dashboard or a terminal (CVE-2021-42574); an invisible character, a space that is
    not U+0020 or a decomposed accent makes an id that reads as another. Ids are refused with one, naming it,
    at submit and at a lookup alike."""
    async with backlog_stack(tmp_path / "tasks.sqlite3") as (stub, client, down):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-bidi", agent_id=agent_id, payload="hello",
                                                           task_type="chat"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("agent_id: ") and shown in refused.value.details()
        answer = await client.post("/api/v1/agent/submit", json={"agent_id": agent_id, "task_type": "chat"})
        assert answer.status_code == 400 and shown in answer.json()["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as looked_up:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=agent_id))
        assert looked_up.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert looked_up.value.details().startswith("task_id: ") and shown in looked_up.value.details()
        answer = await client.get("/api/v1/tasks/" + quote(agent_id))
        assert answer.status_code == 400 and shown in answer.json()["error"]["message"]
        assert down.requests == []


async def test_the_backlogs_fill_is_exported_as_every_queues_depth_and_capacity(tmp_path):
    """The saturation rule and top read depth / capacity per queue; the backlog exported neither, so a stack
    about to answer every submit 429 read as unsaturated until it did."""
    from prometheus_client import REGISTRY

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"queue": "submitted"})

    overrides = {"orchestrator.max_running_submitted_tasks": 1, "orchestrator.max_unfinished_submitted_tasks": 4}
    async with backlog_stack(tmp_path / "tasks.sqlite3", **overrides) as (stub, _, down):
        assert (sample("switchyard_queue_depth"), sample("switchyard_queue_capacity")) == (0, 4)
        for task_id in ("f1", "f2", "f3"):
            await submit(stub, task_id, agent_pb2.BATCH)
        await until(lambda: len(down.requests) == 1)
        assert sample("switchyard_queue_depth") == 3  # one running, two queued: what the bound counts
        down.gate.set()
        await until(lambda: sample("switchyard_queue_depth") == 0)


async def test_metadata_goes_on_the_span_of_a_task_not_of_a_refused_request_on_both_calls(tmp_path, monkeypatch):
    """RunTask and SubmitTask record the allow-listed metadata on their span for a task they take; a refused
    request is no task. SubmitTask recorded it before validation, so a refused submit's span carried it and a
    refused RunTask's did not."""
    recorded: list[dict[str, str]] = []
    monkeypatch.setattr(OrchestratorService, "_record_metadata", lambda self, metadata: recorded.append(dict(metadata)))
    async with backlog_stack(tmp_path / "tasks.sqlite3") as (stub, _, down):
        refused = agent_pb2.RunTaskRequest(task_id="m0", payload="", task_type="chat", metadata={"user": "u0"})
        with pytest.raises(grpc.aio.AioRpcError) as submit_refused:
            await stub.SubmitTask(refused)
        with pytest.raises(grpc.aio.AioRpcError) as run_refused:
            async for _ in stub.RunTask(refused):
                pass
        assert submit_refused.value.code() == run_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert recorded == []
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="m1", payload="p", task_type="chat",
                                                       metadata={"user": "u1"}))
        assert recorded == [{"user": "u1"}]


async def test_run_task_and_submit_task_take_the_edge_headers_alike(tmp_path):
    """One edge path for a new task (OrchestratorService._new_task_spec): the x-agent-id and x-priority headers
    fill what the request left unset, and a bad x-priority is refused naming the header, on both calls."""
    headers = (("x-agent-id", "agent-h"), ("x-priority", "Core"))
    async with backlog_stack(tmp_path / "tasks.sqlite3") as (stub, _, down):
        down.gate.set()
        async for _ in stub.RunTask(agent_pb2.RunTaskRequest(task_id="h-run", payload="p", task_type="chat"),
                                    metadata=headers):
            pass
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="h-sub", payload="p", task_type="chat"),
                              metadata=headers)
        assert (await final_state(stub, "h-sub")).state == agent_pb2.SUCCEEDED
        sent = {r.request_id.split(":")[0]: (r.agent_id, r.priority) for r in down.requests}
        assert sent == {"h-run": ("agent-h", agent_pb2.CORE), "h-sub": ("agent-h", agent_pb2.CORE)}
        bad = (("x-priority", "urgent"),)
        with pytest.raises(grpc.aio.AioRpcError) as submit_refused:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="h-bad", payload="p", task_type="chat"),
                                  metadata=bad)
        with pytest.raises(grpc.aio.AioRpcError) as run_refused:
            async for _ in stub.RunTask(agent_pb2.RunTaskRequest(task_id="h-bad", payload="p", task_type="chat"),
                                        metadata=bad):
                pass
        assert submit_refused.value.code() == run_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert submit_refused.value.details() == run_refused.value.details()
        assert "x-priority" in run_refused.value.details()


class FullQueueDownstream(CountingDownstream):
    """The fixed downstream with an inference queue of ``capacity`` places: a Generate past them is refused at
    once, RESOURCE_EXHAUSTED naming the queue, as the dispatcher refuses it."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.refused: list[str] = []  # the request ids refused, in order

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        if self.in_flight >= self.capacity:
            self.refused.append(request.request_id)
            await abort(context, QueueFullError("inference", self.capacity), "dispatcher")
        async for chunk in super().Generate(request, context):
            yield chunk


def refused_tasks() -> float:
    """``switchyard_tasks_total{task_type="chat", code="RESOURCE_EXHAUSTED"}``: chat tasks ended refused."""
    return REGISTRY.get_sample_value("switchyard_tasks_total",
                                     {"task_type": "chat", "code": "RESOURCE_EXHAUSTED"}) or 0.0


async def test_a_submitted_task_refused_by_a_full_queue_waits_again_in_the_backlog_and_runs(tmp_path):
    overrides = {"orchestrator.max_running_submitted_tasks": 4, "orchestrator.max_unfinished_submitted_tasks": 8}
    down = FullQueueDownstream(capacity=2)
    refused_before = refused_tasks()
    async with backlog_stack(tmp_path / "tasks.sqlite3", down, **overrides) as (stub, _, down):
        for task_id in ("t1", "t2", "t3", "t4"):
            await submit(stub, task_id, agent_pb2.NORMAL)
        # the two past the queue's places go back to the backlog (a submit in between may start them once more)
        await until(lambda: (gauge("queued"), gauge("running")) == (2, 2))
        assert {r.split(":")[0] for r in down.refused} == {"t3", "t4"}
        assert (gauge("running"), down.in_flight) == (2, 2)
        waiting = {t: await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=t)) for t in ("t3", "t4")}
        assert all(s.state == agent_pb2.QUEUED and not s.error for s in waiting.values()), waiting
        assert sorted(s.queue_position for s in waiting.values()) == [0, 1]
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="t4"))  # back in the backlog: taken out
        assert cancelled.state == agent_pb2.FAILED and "while QUEUED" in cancelled.error

        down.gate.set()
        finals = {t: await final_state(stub, t) for t in ("t1", "t2", "t3")}
        assert {t: (s.state, s.error) for t, s in finals.items()} == {
            t: (agent_pb2.SUCCEEDED, "") for t in finals}
        assert (await final_state(stub, "t4")).error == cancelled.error
        assert finals["t3"].result.output == "The answer."
        assert finals["t3"].timings.queue_wait_s["submitted"] > 0
        assert finals["t3"].timings.total_s >= sum(finals["t3"].timings.stage_s.values())  # over both runs
        assert down.peak == 2
        await until(lambda: gauge("running") == 0)
        assert gauge("queued") == 0
    assert refused_tasks() == refused_before  # a run sent back to the backlog is no task ended


async def test_a_submitted_task_refused_with_nothing_else_running_starts_again_until_its_time_limit(tmp_path):
    """No other submitted task runs whose end would start it again: it starts again after a pause that doubles
    (0.05, 0.1, 0.2, 0.4 s), and fails naming the queue once the next pause would pass its time limit (1 s)."""
    refused_before = refused_tasks()
    overrides = {"orchestrator.max_running_submitted_tasks": 4, "orchestrator.task_time_limit_s": {"chat": 1.0, "rag_answer": 1.0, "react_loop": 1.0}}
    async with backlog_stack(tmp_path / "tasks.sqlite3", FullQueueDownstream(capacity=0),
                             **overrides) as (stub, _, down):
        await submit(stub, "alone", agent_pb2.NORMAL)
        status = await final_state(stub, "alone")
        assert status.state == agent_pb2.FAILED
        assert status.error.startswith("RESOURCE_EXHAUSTED: ") and "queues.inference.capacity" in status.error
        assert len(down.refused) >= 3 and set(down.refused) == {"alone:0"}, down.refused
        # its timings span every run, from its first start: they read the last run alone (3 ms for a task that
        # tried for 5 s), less than the stages of its runs added up
        assert status.timings.total_s >= sum(status.timings.stage_s.values()) > 0, status.timings
    assert refused_tasks() == refused_before + 1  # its one end, not each refusal


async def test_a_submitted_task_refused_while_run_task_calls_fill_the_queue_runs_once_they_end(tmp_path):
    """The inference queue's one place held by a RunTask call, and no other submitted task running: the submitted
    task failed RESOURCE_EXHAUSTED "queue full", although its caller chose SubmitTask to leave the waiting to the
    gateway (3 of 6 submits failed so beside RunTask load). It waits in the backlog and runs once the call ends."""
    overrides = {"orchestrator.max_running_submitted_tasks": 4}
    async with backlog_stack(tmp_path / "tasks.sqlite3", FullQueueDownstream(capacity=1),
                             **overrides) as (stub, _, down):
        holder = asyncio.ensure_future(collect(stub, task_id="held", payload="p", task_type="chat"))
        await until(lambda: down.in_flight == 1)
        await submit(stub, "beside", agent_pb2.NORMAL)
        await until(lambda: len(down.refused) >= 2)  # refused, started again after a pause, refused again
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="beside"))
        assert status.state in (agent_pb2.QUEUED, agent_pb2.RUNNING) and not status.error, status
        down.gate.set()
        assert (await holder)[-1].HasField("final")
        done = await final_state(stub, "beside")
    assert (done.state, done.error, done.result.output) == (agent_pb2.SUCCEEDED, "", "The answer.")


def backlog_waits(stat: str = "count") -> dict[str, float]:
    """``switchyard_queue_wait_seconds_<stat>{queue="submitted"}`` by outcome (None where a series is missing)."""
    return {outcome: REGISTRY.get_sample_value(f"switchyard_queue_wait_seconds_{stat}",
                                               {"queue": "submitted", "outcome": outcome})
            for outcome in ("admitted", "expired", "cancelled")}


def grown(before: dict[str, float]) -> dict[str, float]:
    return {outcome: value - before[outcome] for outcome, value in backlog_waits().items()}


async def test_every_wait_in_the_backlog_is_observed_once_by_how_it_ended(tmp_path):
    """switchyard_queue_wait_seconds covered the orchestration, retrieval and inference queues; a submitted task's
    wait in the backlog, often the longest, was observed nowhere. Each wait is observed once as it ends: started
    (admitted), taken out by CancelTask or a stopping orchestrator (cancelled); each series at 0 from start-up."""
    assert None not in backlog_waits().values()  # every outcome's series exists before the first task
    before = backlog_waits()
    overrides = {"orchestrator.max_running_submitted_tasks": 1, "server.shutdown_grace_s": 0.2}
    async with backlog_stack(tmp_path / "tasks.sqlite3", **overrides) as (stub, _, down):
        await submit(stub, "w1", agent_pb2.NORMAL)
        await until(lambda: len(down.requests) == 1)  # w1 runs: its wait ended admitted
        for task_id in ("w2", "w3", "w4"):
            await submit(stub, task_id, agent_pb2.NORMAL)
        assert grown(before) == {"admitted": 1, "expired": 0, "cancelled": 0}
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="w3"))
        assert "while QUEUED" in cancelled.error and cancelled.timings.queue_wait_s["submitted"] > 0
        assert grown(before) == {"admitted": 1, "expired": 0, "cancelled": 1}
        gate, down.gate = down.gate, asyncio.Event()  # w2 waits on the next gate, never opened
        gate.set()  # w1 ends: w2 starts
        done = await final_state(stub, "w1")
        await until(lambda: len(down.requests) == 2)
        down.gate = asyncio.Event()  # the one the stack's exit opens: w2 runs on until the stop, w4 waits
        assert done.state == agent_pb2.SUCCEEDED and grown(before)["admitted"] == 2
        waited = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="w2"))
        assert waited.state == agent_pb2.RUNNING and waited.timings.queue_wait_s["submitted"] > 0
    # the stop took w4 out of the backlog unstarted; w2 was running and is no wait
    assert grown(before) == {"admitted": 2, "expired": 0, "cancelled": 2}


async def test_a_task_whose_time_limit_passes_while_it_waits_again_is_observed_expired(tmp_path):
    """A run refused for want of room sends its task back to the backlog, where it waits against the time limit of
    its first start: started after that limit passed, its run fails DEADLINE_EXCEEDED at once and its wait is
    observed expired, not admitted."""
    overrides = {"orchestrator.max_running_submitted_tasks": 4,
                 "orchestrator.task_time_limit_s": {"chat": 60.0, "rag_answer": 0.5, "react_loop": 60.0}}
    before, sums = backlog_waits(), backlog_waits("sum")
    async with backlog_stack(tmp_path / "tasks.sqlite3", FullQueueDownstream(capacity=1),
                             **overrides) as (stub, _, down):
        await submit(stub, "holder", agent_pb2.NORMAL)  # chat: holds the inference queue's one place
        await until(lambda: down.in_flight == 1)
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="late", payload="How does the with statement work?",
                                                       task_type="rag_answer", priority=agent_pb2.NORMAL))
        await until(lambda: any(r.startswith("late:") for r in down.refused) and gauge("queued") == 1)
        assert grown(before) == {"admitted": 2, "expired": 0, "cancelled": 0}
        await asyncio.sleep(0.6)  # past its 0.5 s limit, counted from its first start, while it waits again
        down.gate.set()  # the holder ends and starts it
        late = await final_state(stub, "late")
        assert late.state == agent_pb2.FAILED and late.error.startswith("DEADLINE_EXCEEDED"), late.error
        assert (await final_state(stub, "holder")).state == agent_pb2.SUCCEEDED
    assert grown(before) == {"admitted": 2, "expired": 1, "cancelled": 0}
    assert backlog_waits("sum")["expired"] - sums["expired"] >= 0.5  # its second wait, past the limit


async def test_a_task_cancelled_while_it_waits_again_reads_its_time_since_its_first_start(tmp_path):
    """A task whose run was refused for want of room waits again in the backlog; cancelled there, its status read
    total_s 0 (below the stages its run took) and 'before it started', of a task that had run."""
    overrides = {"orchestrator.max_running_submitted_tasks": 4}
    async with backlog_stack(tmp_path / "tasks.sqlite3", FullQueueDownstream(capacity=1),
                             **overrides) as (stub, _, down):
        await submit(stub, "holder", agent_pb2.NORMAL)  # holds the inference queue's one place
        await until(lambda: down.in_flight == 1)
        await submit(stub, "again", agent_pb2.NORMAL)
        await until(lambda: any(r.startswith("again:") for r in down.refused) and gauge("queued") == 1)
        cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="again"))
        assert cancelled.state == agent_pb2.FAILED and "while QUEUED" in cancelled.error, cancelled
        assert "before it started" not in cancelled.error and "waiting to start again" in cancelled.error
        assert cancelled.timings.total_s >= sum(cancelled.timings.stage_s.values()) > 0, cancelled.timings
        assert (await final_state(stub, "again")).timings.total_s == cancelled.timings.total_s  # as recorded
        down.gate.set()
        assert (await final_state(stub, "holder")).state == agent_pb2.SUCCEEDED


class StepThenRefused(ToolThenGate):
    """react_loop's first model step answers a tool call (compute score 0.5, KV 1000 B); the step after the tool's
    result is refused once, RESOURCE_EXHAUSTED naming the inference queue, then answers (compute score 0.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        if any(m.role == "tool" for m in request.messages) and not self.refused:
            self.requests.append(request)
            self.refused.append(request.request_id)
            await abort(context, QueueFullError("inference", 1), "dispatcher")
        if any(m.role == "tool" for m in request.messages):
            self.requests.append(request)
            yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text="Done.", index=0))
            yield agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(
                usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=1, total_tokens=11),
                compute_score_used=0.5, memory_peak_bytes=1000, model="fake"))
            return
        async for chunk in super().Generate(request, context):
            yield chunk


async def test_what_a_run_refused_for_want_of_room_consumed_counts_in_the_tasks_outcome(tmp_path):
    """A submitted task whose run was refused for want of room runs again from its start; what its refused run's
    model steps consumed was dropped with that run: its outcome counted its last run's steps alone (1.0 of the
    1.5 the dispatcher computed for it here), and its status read 0 while it waited to start again."""
    async with backlog_stack(tmp_path / "tasks.sqlite3", StepThenRefused()) as (stub, _, down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="again", payload="hello", task_type="react_loop"))
        done = await final_state(stub, "again")
        assert done.state == agent_pb2.SUCCEEDED and down.refused, (done, down.refused)
        assert len(down.requests) == 4  # step 0, its refused step 1; then step 0 and step 1 again
        assert (done.compute_score_used, done.memory_peak_bytes) == (1.5, 1000), done
        assert done.result.usage.total_tokens == 3 * 11, done.result.usage


async def test_a_submit_refused_by_a_full_backlog_or_a_taken_task_id_records_no_metadata(tmp_path, monkeypatch):
    """A submit refused after validation (the backlog full, its task_id another request's) is no task either: its
    span carried the task's metadata, which RunTask records only for a task it takes."""
    recorded: list[dict[str, str]] = []
    monkeypatch.setattr(OrchestratorService, "_record_metadata", lambda self, metadata: recorded.append(dict(metadata)))
    overrides = {"orchestrator.max_unfinished_submitted_tasks": 1}
    async with backlog_stack(tmp_path / "tasks.sqlite3", **overrides) as (stub, _, down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="m1", payload="p", task_type="chat",
                                                       metadata={"user": "u1"}))
        assert recorded == [{"user": "u1"}]
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="p", task_type="chat", metadata={"user": "u2"}))
        with pytest.raises(grpc.aio.AioRpcError) as taken:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="m1", payload="other", task_type="chat",
                                                           metadata={"user": "u3"}))
        assert (full.value.code(), taken.value.code()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                           grpc.StatusCode.ALREADY_EXISTS)
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="m1", payload="p", task_type="chat",
                                                       metadata={"user": "u1"}))  # the same task, answered again
        assert recorded == [{"user": "u1"}, {"user": "u1"}]
