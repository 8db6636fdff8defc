"""CancelTask answered by any orchestrator replica: only the one that holds a task can end it, so another replica
asked to cancel it records a cancel request in the shared task store and answers the outcome once the holder has
carried it out (orchestrator/service.py ``_cancel_elsewhere``, ``_carry_out_cancels``).

Two real orchestrators on 127.0.0.1 port 0 share one task store (a SQLite file, or a real Redis) and the gated
fixed downstream of test_orchestrator.py: a task that reached Generate is running until the gate opens. A load
balancer in front of the replicas sends a cancel to either; here it goes to the one that does not hold the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest
from redis_fixtures import redis_db, redis_server  # noqa: F401
from test_orchestrator import Downstream
from test_submit_backlog import final_state, until

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running, start_server
from switchyard.orchestrator.service import OrchestratorService

pytestmark = pytest.mark.no_gpu


def gated() -> Downstream:
    """The fixed downstream with its gate closed: a task that reached Generate runs until the gate opens."""
    down = Downstream()
    down.gate = asyncio.Event()
    return down


def replica_config(base, downstream_port: int, **overrides):
    """An orchestrator's config in front of the downstream on ``downstream_port``, then ``overrides``."""
    addr = f"127.0.0.1:{downstream_port}"
    return base.with_overrides(**{"orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
                                  "orchestrator.cpu_executor": "loop", **overrides})


@contextlib.asynccontextmanager
async def two_replicas(store_overrides: dict, **overrides):
    """(holder stub, other stub, downstream, holder service): two orchestrators on one task store; the
    downstream's gate closed."""
    base = load_config("config", service="orchestrator")
    down = gated()
    async with running([down], base.server) as downstream:
        cfg = replica_config(base, downstream.port, **{"orchestrator.max_running_submitted_tasks": 1,
                                                       **store_overrides, **overrides})
        holder, other = OrchestratorService(cfg), OrchestratorService(cfg)
        async with running([holder], cfg.server) as first, running([other], cfg.server) as second:
            channels = [open_channel(f"127.0.0.1:{srv.port}", cfg.server) for srv in (first, second)]
            try:
                yield (*(agent_pb2_grpc.AgentServiceStub(c) for c in channels), down, holder)
            finally:
                down.gate.set()
                for channel in channels:
                    await channel.close()


def store_settings(backend: str, tmp_path, request) -> dict:
    if backend == "sqlite":
        return {"orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")}
    db = request.getfixturevalue("redis_db")
    return {"orchestrator.task_store.backend": "redis", "memory.dram.host": db.host, "memory.dram.port": db.port,
            "memory.dram.db": db.db}


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_replica_that_does_not_hold_a_task_cancels_it_through_its_holder(backend, tmp_path, request):
    async with two_replicas(store_settings(backend, tmp_path, request)) as (holder, other, down, _):
        for task_id in ("run-1", "wait-1", "done-1"):
            await holder.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat"))
        await until(lambda: len(down.requests) == 1)  # run-1 runs (the bound is 1); wait-1 and done-1 are queued
        assert (await other.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="wait-1"))).state == agent_pb2.QUEUED

        queued = await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="wait-1"))
        assert queued.state == agent_pb2.FAILED
        assert queued.error == "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
        stopped = await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="run-1"))
        assert stopped.state == agent_pb2.FAILED and stopped.error == "CANCELLED: cancelled by CancelTask while RUNNING"
        await until(lambda: "run-1:0" in down.cancelled)  # the holder cancelled its downstream call

        down.gate.set()  # done-1 took run-1's place and finishes; a cancel after it answers it unchanged
        assert (await final_state(holder, "done-1")).state == agent_pb2.SUCCEEDED
        after = await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="done-1"))
        assert after.state == agent_pb2.SUCCEEDED and after.result.output == "The answer."
        started = [r.request_id.split(":")[0] for r in down.requests]
        assert started == ["run-1", "done-1"]  # wait-1 never started
        for task_id, error in (("wait-1", queued.error), ("run-1", stopped.error)):  # the holder's records agree
            assert (await holder.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))).error == error

        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="never"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "never" in unknown.value.details()


async def test_a_cancel_the_holder_does_not_carry_out_is_unavailable_naming_it(tmp_path, caplog):
    # A holder that stopped reading its cancel requests (a hung loop would, until its lease ran out) but whose lease
    # is still renewed: its task is no orphan, and the asker's wait (lease_s plus two polls) runs out. The holder is
    # named by its instance's tag: its id's host and pid (hostname:pid:tag) are internal, and the caller read them;
    # the operator's log keeps the whole id.
    caplog.set_level(logging.INFO, logger="switchyard.orchestrator.service")
    settings = {**store_settings("sqlite", tmp_path, None), "orchestrator.task_store.lease_s": 0.3}
    async with two_replicas(settings) as (holder, other, down, holder_service):
        holder_service._cancels.cancel()
        await holder.SubmitTask(agent_pb2.RunTaskRequest(task_id="slow-1", payload="hello", task_type="chat"))
        await until(lambda: len(down.requests) == 1)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="slow-1"))
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        details = late.value.details()
        assert "slow-1" in details and "asked to cancel it" in details and "task_store.lease_s" in details
        owner = holder_service.tasks.owner
        host, pid, tag = owner.split(":")
        assert f"is held by orchestrator instance {tag}, which was asked to cancel it" in details, details
        assert f"{host}:{pid}" not in details and f":{pid}:" not in details
        assert f"held by orchestrator {owner}" in caplog.text  # the operator's view: whole
        assert (await holder.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="slow-1"))).state == agent_pb2.RUNNING


async def test_a_cancel_asked_while_the_holder_stops_is_carried_out_by_it(tmp_path):
    # A stopping holder gives its running tasks server.shutdown_grace_s to finish; its gRPC server is closed by then,
    # so the task store is the only way a CancelTask reaches it. It stopped reading its cancel requests first: the
    # task ran on through the grace (it may even succeed) and ended 'the orchestrator stopped', not cancelled.
    base = load_config("config", service="orchestrator")
    down = gated()
    async with running([down], base.server) as downstream:
        cfg = replica_config(base, downstream.port, **{"server.shutdown_grace_s": 8.0,
                                                       **store_settings("sqlite", tmp_path, None)})
        holder_service = OrchestratorService(cfg)
        holder_server = await start_server([holder_service], "127.0.0.1", 0, cfg.server)
        stopping = None
        try:
            async with running([OrchestratorService(cfg)], cfg.server) as second:
                channels = [open_channel(f"127.0.0.1:{srv.port}", cfg.server) for srv in (holder_server, second)]
                holder, other = (agent_pb2_grpc.AgentServiceStub(c) for c in channels)
                try:
                    await holder.SubmitTask(agent_pb2.RunTaskRequest(task_id="stop-1", payload="hi", task_type="chat"))
                    await until(lambda: len(down.requests) == 1)
                    stopping = asyncio.create_task(holder_server.stop(0.1))
                    await until(lambda: holder_service._stopping)  # in its grace: the task runs on
                    status = await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="stop-1"))
                    assert status.state == agent_pb2.FAILED
                    assert status.error == "CANCELLED: cancelled by CancelTask while RUNNING"
                    await until(lambda: "stop-1:0" in down.cancelled)
                finally:
                    for channel in channels:
                        await channel.close()
        finally:
            down.gate.set()
            await (stopping if stopping is not None else holder_server.stop(0.1))


async def test_a_cancel_whose_caller_has_less_time_than_the_wait_is_answered_before_its_deadline(tmp_path):
    # The asker waited lease_s plus two polls (10.5 s by default) whatever the caller's deadline: a caller with less
    # heard a bare DEADLINE_EXCEEDED, nothing of the holder or of the request it left recorded.
    async with two_replicas(store_settings("sqlite", tmp_path, None)) as (holder, other, down, holder_service):
        holder_service._cancels.cancel()  # the holder does not act on it within the caller's time
        await holder.SubmitTask(agent_pb2.RunTaskRequest(task_id="short-1", payload="hello", task_type="chat"))
        await until(lambda: len(down.requests) == 1)
        with pytest.raises(grpc.aio.AioRpcError) as late:  # answered before the deadline, or it would read so
            await other.CancelTask(agent_pb2.CancelTaskRequest(task_id="short-1"), timeout=3)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE, late.value.details()
        details = late.value.details()
        assert "short-1" in details and "asked to cancel it" in details
        assert "this CancelTask's gRPC deadline (its caller's)" in details, details  # whose deadline
        assert "stays recorded" in details


@pytest.mark.parametrize("asked", ["other", "holder"])
async def test_a_cancel_taken_while_its_task_is_being_submitted_is_not_lost(asked, tmp_path):
    # The holder records a task before it holds it (SubmitTask's create, then its backlog): a cancel request it took
    # in between found no task held and was dropped, and the task ran on while the asker waited out the lease.
    settings = {**store_settings("sqlite", tmp_path, None), "orchestrator.task_store.lease_s": 2.0}
    async with two_replicas(settings) as (holder, other, down, holder_service):
        create, created = holder_service.tasks.create, asyncio.Event()
        take_cancels, taken = holder_service.tasks.take_cancels, asyncio.Event()

        async def create_then_wait(*args, **kwargs):  # the holder's SubmitTask, stopped between its two steps
            answer = await create(*args, **kwargs)
            created.set()
            # the holder's poll took the request meanwhile (a fixed 0.8 s stood for it); 30 s: a bound, not a timing
            await asyncio.wait_for(taken.wait(), 30)
            return answer

        async def take_cancels_seen():
            task_ids = await take_cancels()
            if "new-1" in task_ids:
                taken.set()
            return task_ids

        holder_service.tasks.create = create_then_wait
        holder_service.tasks.take_cancels = take_cancels_seen
        submit = asyncio.ensure_future(holder.SubmitTask(
            agent_pb2.RunTaskRequest(task_id="new-1", payload="hello", task_type="chat")))
        await created.wait()
        # asked of the holder itself, the task was answered QUEUED, as it stood, and not cancelled
        status = await (other if asked == "other" else holder).CancelTask(agent_pb2.CancelTaskRequest(task_id="new-1"))
        await submit
        assert status.state == agent_pb2.FAILED and status.error.startswith("CANCELLED: cancelled by CancelTask"), \
            status


async def test_a_cancel_of_a_task_refused_while_it_waits_is_not_found(tmp_path):
    # A task recorded, then refused (its backlog filled meanwhile: its record is deleted): the asker answered the
    # record it had read before, QUEUED, for a task that no longer exists.
    settings = {**store_settings("sqlite", tmp_path, None), "orchestrator.max_unfinished_submitted_tasks": 1}
    async with two_replicas(settings) as (holder, other, down, holder_service):
        create, created, first_taken = holder_service.tasks.create, asyncio.Event(), asyncio.Event()

        async def create_then_wait(task_id, *args, **kwargs):
            answer = await create(task_id, *args, **kwargs)
            if task_id == "late-1":
                created.set()
                # "first-1" takes the backlog's one place meanwhile (a fixed 0.8 s here let a loaded machine's
                # slower SubmitTask of first-1 lose the place to late-1), and the cancel, asked of the other
                # replica, reads late-1's record while it is still there
                await first_taken.wait()
                await asyncio.sleep(0.5)
            return answer

        holder_service.tasks.create = create_then_wait
        late = asyncio.ensure_future(holder.SubmitTask(
            agent_pb2.RunTaskRequest(task_id="late-1", payload="hello", task_type="chat")))
        await created.wait()
        await holder.SubmitTask(agent_pb2.RunTaskRequest(task_id="first-1", payload="hello", task_type="chat"))
        cancel = asyncio.ensure_future(other.CancelTask(agent_pb2.CancelTaskRequest(task_id="late-1")))
        first_taken.set()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await late
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await cancel
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "late-1" in gone.value.details()
