"""Issue 11, target 4: a task accepted by SubmitTask before ``kill -9`` of the orchestrator is answered
by GetTaskStatus after a restart; 0 lost.

Real orchestrator processes (``switchyard serve orchestrator``) against the fixed downstream of
test_orchestrator.py in this process; the task store is the SQLite file, or a real Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from redis_fixtures import free_port, redis_db, redis_server  # noqa: F401
from test_orchestrator import Downstream, final_status

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.launcher import healthy

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]
ROOT = Path(__file__).resolve().parent.parent


def _config_dir(tmp_path: Path, backend: str, dram: dict | None, max_running: int | None = None) -> Path:
    folder = tmp_path / "config"
    shutil.copytree(ROOT / "config", folder)
    path = folder / "switchyard.json"
    data = json.loads(path.read_text())
    data["orchestrator"]["cpu_executor"] = "thread"  # starts faster; the store is what is tested
    if max_running is not None:
        data["orchestrator"]["max_running_submitted_tasks"] = max_running
    data["orchestrator"]["task_store"].update(backend=backend, sqlite_path=str(tmp_path / "tasks.sqlite3"))
    path.write_text(json.dumps(data))
    if dram is not None:
        toml = folder / "memory_policy.toml"
        text = toml.read_text().replace('host = "127.0.0.1"\nport = 6379\n',
                                        f'host = "{dram["host"]}"\nport = {dram["port"]}\n')
        toml.write_text(text.replace("embedded = true", "embedded = false"))
    return folder


class Orchestrator:
    """``switchyard serve orchestrator`` in a child process."""

    def __init__(self, config_dir: Path, downstream: str) -> None:
        self.port = free_port()
        env = {**os.environ, "SWITCHYARD_RETRIEVAL_ADDR": downstream, "SWITCHYARD_DISPATCHER_ADDR": downstream}
        env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.cli", "serve", "orchestrator", "--config-dir", str(config_dir),
             "--port", str(self.port), "--metrics-port", "0", "--http-port", "0"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    async def ready(self) -> str:
        address = f"127.0.0.1:{self.port}"
        for _ in range(600):
            if await asyncio.to_thread(healthy, address, "agent.AgentService"):
                return address
            assert self.proc.poll() is None, f"orchestrator exited with {self.proc.returncode}"
            await asyncio.sleep(0.1)
        raise AssertionError("orchestrator not healthy")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no drain, no clean-up
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_tasks_accepted_before_kill_9_are_answered_after_restart(backend, tmp_path, request):
    dram = None
    if backend == "redis":
        db = request.getfixturevalue("redis_db")
        dram = {"host": db.host, "port": db.port}
    config_dir = _config_dir(tmp_path, backend, dram)
    down = Downstream()
    async with running([down], load_config(config_dir).server) as downstream:
        address = f"127.0.0.1:{downstream.port}"
        first = Orchestrator(config_dir, address)
        try:
            async with open_channel(await first.ready()) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                done = [f"done-{i}" for i in range(5)]
                for task_id in done:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat"))
                for task_id in done:
                    assert (await final_status(stub, task_id)).state == agent_pb2.SUCCEEDED
                down.gate = asyncio.Event()  # the next tasks hang in Generate: RUNNING when the process dies
                running_ids = [f"running-{i}" for i in range(5)]
                for task_id in running_ids:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat"))
                while len(down.requests) < len(done) + len(running_ids):
                    await asyncio.sleep(0.01)
        finally:
            first.kill()
        down.gate.set()

        second = Orchestrator(config_dir, address)
        try:
            async with open_channel(await second.ready()) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                statuses = {}
                for task_id in done + running_ids:
                    statuses[task_id] = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))
                # resubmitting an accepted task after the restart is still the same task
                again = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="done-0", payload="hello",
                                                                       task_type="chat"))
        finally:
            second.stop()
    assert len(statuses) == 10  # 0 lost: every accepted task is answered (no NOT_FOUND raised above)
    for task_id in done:
        assert statuses[task_id].state == agent_pb2.SUCCEEDED
        assert statuses[task_id].result.output == "The answer." and statuses[task_id].memory_peak_bytes == 1000
    for task_id in running_ids:
        status = statuses[task_id]
        assert status.state == agent_pb2.FAILED, status
        # RUNNING is written to the store before the task's first step (a task recorded QUEUED never started,
        # and another orchestrator may adopt it)
        assert "stopped while the task was RUNNING" in status.error, status.error
        assert "resubmit" in status.error
    assert again.task_id == "done-0"


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_tasks_queued_when_the_orchestrator_is_killed_run_once_after_its_restart(backend, tmp_path, request):
    """A task accepted but not started when its orchestrator is killed (``kill -9``) keeps its request in the
    store; the restarted orchestrator adopts it and runs it, once. The one that was running is FAILED as before
    (it may have generated tokens). Before, every one of them was FAILED "stopped while the task was QUEUED"."""
    dram = None
    if backend == "redis":
        db = request.getfixturevalue("redis_db")
        dram = {"host": db.host, "port": db.port}
    config_dir = _config_dir(tmp_path, backend, dram, max_running=1)
    down = Downstream()
    down.gate = asyncio.Event()
    queued = [f"queued-{i}" for i in range(3)]
    async with running([down], load_config(config_dir).server) as downstream:
        address = f"127.0.0.1:{downstream.port}"
        first = Orchestrator(config_dir, address)
        try:
            async with open_channel(await first.ready()) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="running-0", payload="hello", task_type="chat"))
                while not down.requests:  # running-0 runs (the bound is 1); the rest wait in the backlog
                    await asyncio.sleep(0.01)
                for task_id in queued:
                    accepted = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello",
                                                                              task_type="chat"))
                    assert accepted.state == agent_pb2.QUEUED
        finally:
            first.kill()
        down.gate.set()

        second = Orchestrator(config_dir, address)
        try:
            async with open_channel(await second.ready()) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                statuses = {task_id: await final_status(stub, task_id) for task_id in ["running-0", *queued]}
        finally:
            second.stop()
    assert statuses["running-0"].state == agent_pb2.FAILED
    assert "stopped while the task was RUNNING" in statuses["running-0"].error
    for task_id in queued:
        assert statuses[task_id].state == agent_pb2.SUCCEEDED, statuses[task_id]
        assert statuses[task_id].result.output == "The answer."
    started = [r.request_id.split(":")[0] for r in down.requests]
    assert sorted(started) == sorted(["running-0", *queued])  # each once


async def test_tasks_held_when_redis_lost_every_record_are_answered_run_and_recorded_again(redis_db):
    """A Redis restarted without persistence (or flushed) while an orchestrator held a running task and a queued
    one: the running one's outcome was dropped (its write found no record to check the owner of) and the queued
    one was never run, read as adopted by another orchestrator; GetTaskStatus answered both NOT_FOUND "never
    submitted" meanwhile. Now both are answered from the orchestrator, run, and recorded again."""
    from prometheus_client import REGISTRY
    from test_submit_backlog import until

    from switchyard.orchestrator.service import OrchestratorService

    def written_again() -> float:
        return REGISTRY.get_sample_value("switchyard_task_records_written_again_total") or 0.0

    base = load_config("config", service="orchestrator")
    down = Downstream()
    down.gate = asyncio.Event()  # a task that reached Generate runs until it opens
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        cfg = base.with_overrides(**{
            "orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
            "orchestrator.cpu_executor": "loop", "orchestrator.max_running_submitted_tasks": 1,
            "orchestrator.task_store.backend": "redis", **redis_db.overrides})
        service = OrchestratorService(cfg)
        async with running([service], cfg.server) as server:
            channel = open_channel(f"127.0.0.1:{server.port}", cfg.server)
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            try:
                for task_id in ("lost-running", "lost-queued"):
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hello", task_type="chat"))
                await until(lambda: len(down.requests) == 1)  # lost-running runs (the bound is 1), lost-queued waits
                with redis_db.sync_client() as client:
                    client.flushdb()  # every record gone, as from a Redis restarted without persistence
                before = written_again()
                status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="lost-running"))
                assert status.state == agent_pb2.RUNNING, status
                status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="lost-queued"))
                assert status.state == agent_pb2.QUEUED, status
                down.gate.set()
                for task_id in ("lost-running", "lost-queued"):
                    status = await final_status(stub, task_id)
                    assert status.state == agent_pb2.SUCCEEDED, status
                    for _ in range(500):  # the store has it again, with the outcome (written after it is answered)
                        record = await service.tasks.get(task_id)
                        if record is not None and record.finished:
                            break
                        await asyncio.sleep(0.02)
                    assert record is not None and record.state == agent_pb2.SUCCEEDED, record
                assert len(down.requests) == 2  # each ran once
                # lost-running's outcome, lost-queued's start (its outcome then updates that record)
                assert written_again() - before == 2
            finally:
                down.gate.set()
                await channel.close()
