"""End to end: `switchyard up` starts three separate processes; tasks stream through them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.protobuf import json_format

from switchyard.api import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.slow

GHZ_JSON = '{"task_id":"bench-001","payload":"summarize this doc"}'


class Up:
    """A running `switchyard up --free-ports` whose output is collected on a thread."""

    def __init__(self, index_dir) -> None:
        env = dict(os.environ, SWITCHYARD_INDEX_DIR=str(index_dir), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.cli", "up", "--free-ports"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Try: switchyard run"):
                self.ready.set()

    def address(self, name: str) -> str:
        for line in self.lines:
            if m := re.match(rf"\s+{name}\s+(\S+:\d+)", line):
                return m.group(1)
        raise AssertionError(f"{name} endpoint not printed:\n{''.join(self.lines)}")

    def wait_ready(self, timeout: float = 180) -> None:
        if not self.ready.wait(timeout):
            self.stop()
            raise AssertionError("switchyard up did not become healthy:\n" + "".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def up(pydoc_index_dir):
    """One stack for the module; the SIGTERM test, last, stops it."""
    stack = Up(pydoc_index_dir)
    stack.wait_ready()
    yield stack
    stack.stop()


async def test_ghz_json_streams_through_three_processes(up):
    pids = [int(m.group(1)) for line in up.lines if (m := re.search(r"\(pid (\d+)\)", line))]
    assert len(set(pids)) == 3 and up.proc.pid not in pids
    request = json_format.Parse(GHZ_JSON, agent_pb2.RunTaskRequest())
    async with grpc.aio.insecure_channel(up.address("orchestrator")) as channel:
        events = [e async for e in agent_pb2_grpc.AgentServiceStub(channel).RunTask(request, timeout=60)]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "accepted" and events[0].accepted.task_id == "bench-001"
    stages = {e.stage.name for e in events if e.HasField("stage")}
    assert {"retrieve", "render_prompt", "count_tokens", "infer"} <= stages
    assert kinds.count("token") >= 1
    final = events[-1].final
    assert kinds[-1] == "final" and final.task_id == "bench-001"
    assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0


def test_cli_run_prints_stages_and_answer(up):
    out = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "run", "--addr", up.address("orchestrator"),
         "How does the with statement work?"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for stage in ("retrieve", "render_prompt", "count_tokens", "infer"):
        assert f"stage {stage}" in out.stdout
    assert "final:" in out.stdout and "(pydoc_data.topics:with)" in out.stdout


async def test_sigterm_drains_in_flight_stream_then_exits_zero(up):
    request = agent_pb2.RunTaskRequest(payload="Explain the with statement in detail.", task_type="chat",
                                       max_tokens=300)
    async with grpc.aio.insecure_channel(up.address("orchestrator")) as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).RunTask(request, timeout=60)
        events = []
        async for event in call:
            events.append(event)
            if event.HasField("token") and event.token.index == 2:
                up.proc.send_signal(signal.SIGTERM)  # mid-stream
        stopped_at = time.monotonic()
    assert events[-1].HasField("final"), "stream cut by shutdown"
    tokens = [e for e in events if e.HasField("token")]
    assert len(tokens) == events[-1].final.usage.completion_tokens
    code = await asyncio.to_thread(up.proc.wait, 60)
    assert code == 0, "".join(up.lines)
    assert "stopping" in "".join(up.lines)
    assert time.monotonic() - stopped_at < 60
