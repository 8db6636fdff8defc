"""Issue 11, target 4: a task accepted by SubmitTask before ``kill -9`` of the orchestrator is answered
by GetTaskStatus after a restart; 0 lost.

Real orchestrator processes (``switchyard serve orchestrator``) against the fixed downstream of
test_orchestrator.py in this process; the task store is the SQLite file, or a real Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from redis_fixtures import free_port, redis_db, redis_server  # noqa: F401
from test_orchestrator import Downstream

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.launcher import healthy

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]
ROOT = Path(__file__).resolve().parent.parent


def _config_dir(tmp_path: Path, backend: str, dram: dict | None) -> Path:
    folder = tmp_path / "config"
    shutil.copytree(ROOT / "config", folder)
    path = folder / "switchyard.json"
    data = json.loads(path.read_text())
    data["orchestrator"]["cpu_executor"] = "thread"  # starts faster; the store is what is tested
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


async def _final_status(stub, task_id: str) -> agent_pb2.TaskStatus:
    for _ in range(500):
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))
        if status.state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED):
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"{task_id} never finished: {status}")


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
                    assert (await _final_status(stub, task_id)).state == agent_pb2.SUCCEEDED
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
        # RUNNING is written to the store beside the task's first step, not before it (no store write on the
        # task's path): a kill that lands between the two leaves the QUEUED it was accepted as
        assert re.search(r"stopped while the task was (RUNNING|QUEUED)", status.error), status.error
        assert "resubmit" in status.error
    assert again.task_id == "done-0"
