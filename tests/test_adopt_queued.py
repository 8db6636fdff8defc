"""A task accepted but not started when its orchestrator stops is run once elsewhere, not lost: the stopping
orchestrator releases it (QUEUED in the store, its owner given up) and a live one on the same store adopts it,
claimed with a compare-and-set on its owner, into its own backlog (orchestrator/service.py ``_release``,
``_adopt_queued``; taskstore ``release``, ``claim``). A task that was RUNNING is failed as before: it may have
generated tokens, and never runs twice.

Real orchestrators on 127.0.0.1 port 0 share one task store (a SQLite file, or a real Redis) and the gated fixed
downstream of test_orchestrator.py: a task that reached Generate runs until the gate opens. Before this, the stop
recorded every waiting task FAILED "CANCELLED: the orchestrator stopped before the task started ...; resubmit it".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json

import pytest
from prometheus_client import REGISTRY
from redis_fixtures import redis_db, redis_server  # noqa: F401
from test_cancel_across_replicas import gated, replica_config, store_settings
from test_submit_backlog import final_state, until

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.orchestrator.service import OrchestratorService
from switchyard.orchestrator.taskstore import make_task_store
from switchyard.orchestrator.validation import TaskSpec

pytestmark = pytest.mark.no_gpu


def adopted_total() -> float:
    return REGISTRY.get_sample_value("switchyard_tasks_adopted_total")


class Replica:
    """One orchestrator on the shared store, started and stopped on its own (``stop``: a graceful stop)."""

    def __init__(self, cfg) -> None:
        self.service = OrchestratorService(cfg)
        self.cfg = cfg
        self._stack = contextlib.AsyncExitStack()
        self.stub: agent_pb2_grpc.AgentServiceStub | None = None

    async def start(self) -> "Replica":
        srv = await self._stack.enter_async_context(running([self.service], self.cfg.server))
        channel = open_channel(f"127.0.0.1:{srv.port}", self.cfg.server)
        self._stack.push_async_callback(channel.close)
        await asyncio.wait_for(channel.channel_ready(), 30)
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)
        return self

    async def stop(self) -> None:
        await self._stack.aclose()


@contextlib.asynccontextmanager
async def shared_store(settings: dict):
    """(downstream, make): the gated downstream and a factory of started replicas on one store, each made with
    ``settings`` then its own overrides; every replica is stopped at exit."""
    base = load_config("config", service="orchestrator")
    down = gated()
    replicas: list[Replica] = []
    async with running([down], base.server) as downstream:

        async def make(**overrides) -> Replica:
            cfg = replica_config(base, downstream.port, **{
                "orchestrator.max_running_submitted_tasks": 1, "server.shutdown_grace_s": 0.2,
                "orchestrator.task_store.lease_s": 1.0, "orchestrator.task_store.cancel_poll_s": 0.05,
                **settings, **overrides})
            replica = await Replica(cfg).start()
            replicas.append(replica)
            return replica

        try:
            yield down, make
        finally:
            down.gate.set()
            for replica in reversed(replicas):
                await replica.stop()


def starts(down) -> collections.Counter:
    """How many times each task reached Generate (its request ids are ``task_id:step``)."""
    return collections.Counter(r.request_id.split(":")[0] for r in down.requests)


def task(task_id: str, priority: int = agent_pb2.NORMAL) -> agent_pb2.RunTaskRequest:
    return agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat", priority=priority)


async def status(replica: Replica, task_id: str) -> agent_pb2.TaskStatus:
    return await replica.stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))


WAITING = {"w-batch": agent_pb2.BATCH, "w-normal": agent_pb2.NORMAL, "w-core": agent_pb2.CORE,
           "w-normal-2": agent_pb2.NORMAL}


async def submit_and_stop(down, a: Replica) -> None:
    """On ``a``: "ran" runs (the bound is 1) and the tasks of WAITING wait; then ``a`` stops gracefully."""
    await a.stub.SubmitTask(task("ran"))
    await until(lambda: starts(down)["ran"] == 1)
    for task_id, priority in WAITING.items():
        assert (await a.stub.SubmitTask(task(task_id, priority))).state == agent_pb2.QUEUED
    await a.stop()  # "ran" gets its grace, then is cancelled; the waiting ones are released


async def check_ran_once(down, reader: Replica) -> None:
    """Every task of WAITING SUCCEEDED, each started once; "ran" (RUNNING when its orchestrator stopped) FAILED."""
    for task_id in WAITING:
        done = await final_state(reader.stub, task_id)
        assert done.state == agent_pb2.SUCCEEDED and done.result.output == "The answer.", done
        assert done.timings.queue_wait_s["submitted"] > 0
    ran = await final_state(reader.stub, "ran")
    assert ran.state == agent_pb2.FAILED and "stopped before the task finished" in ran.error, ran
    assert starts(down) == {"ran": 1, **{task_id: 1 for task_id in WAITING}}  # each exactly once


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_tasks_waiting_on_a_stopped_orchestrator_are_run_once_by_one_on_the_same_store_in_class_order(
        backend, tmp_path, request):
    adopted_before = adopted_total()
    async with shared_store(store_settings(backend, tmp_path, request)) as (down, make):
        a = await make()
        await submit_and_stop(down, a)
        store = make_task_store(a.cfg)  # what the store holds now: each released, QUEUED (it had been FAILED)
        await store.open()
        try:
            for task_id in WAITING:
                record = await store.get(task_id)
                assert record.state == agent_pb2.QUEUED and record.owner == "" and record.spec, record
        finally:
            await store.close()
        b = await make()  # the restarted orchestrator: it adopts at its start
        down.gate.set()
        await check_ran_once(down, b)
        assert adopted_total() == adopted_before + len(WAITING)
    order = [r.request_id.split(":")[0] for r in down.requests[1:]]
    assert order == ["w-core", "w-normal", "w-normal-2", "w-batch"]  # b's backlog: class, then submit order


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_two_replicas_sweeping_one_store_run_each_released_task_once(backend, tmp_path, request):
    adopted_before = adopted_total()
    async with shared_store(store_settings(backend, tmp_path, request)) as (down, make):
        a = await make()
        b = await make(**{"orchestrator.max_running_submitted_tasks": 8})
        c = await make(**{"orchestrator.max_running_submitted_tasks": 8})
        await submit_and_stop(down, a)  # b and c both sweep every lease_s
        await until(lambda: sum(starts(down).values()) == 1 + len(WAITING))
        held = {task_id: [r for r in (b, c) if r.service._submitted.get(task_id) is not None] for task_id in WAITING}
        assert all(len(holders) == 1 for holders in held.values()), held
        down.gate.set()
        await check_ran_once(down, c)
        # each adopted once, unless a replica's event loop stalled past its lease on a busy machine: another then
        # adopts its task too, and the first, whose RUNNING write finds the record taken, does not run it
        assert adopted_total() >= adopted_before + len(WAITING)


async def test_an_adopter_takes_only_what_its_backlog_has_room_for_and_the_rest_later(tmp_path):
    settings = store_settings("sqlite", tmp_path, None)
    async with shared_store(settings) as (down, make):
        await submit_and_stop(down, await make())
        b = await make(**{"orchestrator.max_unfinished_submitted_tasks": 2})
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(b.service._submitted))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            assert len(b.service._submitted) == 2  # adopted at its start: the bound
            left = [t for t in WAITING if b.service._submitted.get(t) is None]
            assert len(left) == 2
            for task_id in left:  # left in the store for a later sweep (or another replica), released
                assert (await status(b, task_id)).state == agent_pb2.QUEUED
            down.gate.set()  # b's tasks end, its next sweeps adopt the rest
            await check_ran_once(down, b)
        finally:
            watcher.cancel()
        assert peak <= 2


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_released_or_adopted_task_is_answered_and_cancelled_from_any_replica(backend, tmp_path, request):
    async with shared_store(store_settings(backend, tmp_path, request)) as (down, make):
        # c sweeps only every minute: what it is asked of released tasks, it answers from the store
        a, c = await make(), await make(**{"orchestrator.task_store.lease_s": 60})
        await submit_and_stop(down, a)
        assert (await status(c, "w-batch")).state == agent_pb2.QUEUED
        cancelled = await c.stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="w-batch"))
        assert cancelled.state == agent_pb2.FAILED
        assert cancelled.error == "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
        b = await make()  # adopts the other three; w-core runs there (the bound 1), the other two wait
        await until(lambda: starts(down)["w-core"] == 1)
        assert b.service._submitted.get("w-normal-2") is not None
        queued = await c.stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="w-normal-2"))  # routed to b, its holder
        assert queued.error == "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
        assert (await status(b, "w-normal-2")).error == queued.error
        stopped = await c.stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="w-core"))
        assert stopped.error == "CANCELLED: cancelled by CancelTask while RUNNING"
        down.gate.set()
        assert (await final_state(c.stub, "w-normal")).state == agent_pb2.SUCCEEDED
        assert starts(down) == {"ran": 1, "w-core": 1, "w-normal": 1}  # the cancelled queued ones never started


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_queued_tasks_of_an_orchestrator_whose_lease_ran_out_are_adopted_by_a_live_one(backend, tmp_path,
                                                                                              request):
    """An orchestrator that died without a word (another host's, or hung: no process to find gone) leaves its
    QUEUED records; once its lease runs out a live orchestrator adopts them at its next sweep. Before, the sweep
    failed them "stopped while the task was QUEUED"."""
    adopted_before = adopted_total()
    settings = {**store_settings(backend, tmp_path, request), "orchestrator.task_store.lease_s": 0.3}
    async with shared_store(settings) as (down, make):
        b = await make(**{"orchestrator.max_running_submitted_tasks": 4})
        gone = make_task_store(b.cfg)  # the dead orchestrator's store: it records tasks, then stops renewing
        await gone.open()
        gone._maintenance.cancel()
        ids = ["lost-0", "lost-1", "lost-2"]
        for task_id in ids:
            spec = TaskSpec(task_id=task_id, payload="hello", workflow="chat", priority=agent_pb2.NORMAL,
                            max_tokens=16, model="", agent_id="")
            await gone.create(task_id, "fp", "", spec=json.dumps(dataclasses.asdict(spec)))
        down.gate.set()
        for task_id in ids:
            done = await final_state(b.stub, task_id)
            assert done.state == agent_pb2.SUCCEEDED and done.result.output == "The answer.", done
        assert starts(down) == {task_id: 1 for task_id in ids}
        assert adopted_total() == adopted_before + len(ids)
        await gone.close()


async def test_a_draining_orchestrator_adopts_no_task(tmp_path, request):
    """A replica draining (SIGTERM) adopted the QUEUED tasks other orchestrators released at its sweeps: it
    started them beside its drain, where its stop could cut them (a started task fails, never runs twice), or
    released them again at its stop, a lease later for the replica that then adopts them. It adopts none; a
    live replica does."""
    async with shared_store(store_settings("sqlite", tmp_path, request)) as (down, make):
        a = await make()
        draining = await make(**{"orchestrator.max_running_submitted_tasks": 8})
        await draining.service.begin_drain()
        await submit_and_stop(down, a)
        await draining.service._adopt_queued()  # its sweep (every lease_s), now
        assert not any(draining.service._submitted.get(task_id) for task_id in WAITING)
        live = await make(**{"orchestrator.max_running_submitted_tasks": 8})  # adopts them at its start
        down.gate.set()
        await check_ran_once(down, live)
