"""End to end: `switchyard up` starts three separate processes; tasks stream through them."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import json_format

from stack_fixtures import UpStack
from switchyard.api import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.slow

GHZ_JSON = '{"task_id":"bench-001","payload":"summarize this doc"}'


@pytest.fixture(scope="module")
def up(pydoc_index_dir):
    """One stack for the module; the SIGTERM test, last, stops it."""
    stack = UpStack(pydoc_index_dir)
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
