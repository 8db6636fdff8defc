"""Scale-out on one machine: `switchyard up --dispatchers 3` spreads calls over three dispatcher processes,
and a dispatcher killed with SIGKILL takes no task down with it (the others serve)."""

from __future__ import annotations

import json
import asyncio
import os
import re
import signal
import urllib.request

import pytest

from stack_fixtures import UpStack, loop_executor_config
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel

pytestmark = pytest.mark.slow

DISPATCHERS = ("dispatcher", "dispatcher-2", "dispatcher-3")


def served(stack: UpStack, name: str) -> float:
    """Generate calls that got a first token on one dispatcher (its switchyard_ttft_seconds_count)."""
    text = urllib.request.urlopen(stack.metrics_url(name), timeout=10).read().decode()
    # Summed over priority classes (the histogram is labelled by priority_class).
    return sum(float(v) for v in re.findall(r"^switchyard_ttft_seconds_count\{[^}]*\} (\S+)$", text, flags=re.M))


def pid(stack: UpStack, name: str) -> int:
    for line in stack.lines:
        if m := re.match(rf"\s+{name}\s+\S+\s+metrics \S+ \(pid (\d+)\)", line):
            return int(m.group(1))
    raise AssertionError(f"no pid printed for {name}")


async def run_tasks(address: str, n: int, concurrency: int = 6) -> list[agent_pb2.FinalEvent]:
    limit = asyncio.Semaphore(concurrency)
    async with open_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)

        async def one(i: int) -> agent_pb2.FinalEvent:
            async with limit:
                request = agent_pb2.RunTaskRequest(task_id=f"spread-{i}", payload="say hello", task_type="chat",
                                                   max_tokens=8)
                events = [e async for e in stub.RunTask(request, timeout=60)]
                return events[-1].final

        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture(scope="module")
def three(pydoc_index_dir, tmp_path_factory):
    config = loop_executor_config(tmp_path_factory.mktemp("scale-out"))  # these test the dispatchers, not the pool
    # the operator's view (switchyard bench fault's): a cut stream's error names the replica's address
    settings = json.loads((config / "switchyard.json").read_text())
    settings["orchestrator"]["show_addresses_to_callers"] = True
    (config / "switchyard.json").write_text(json.dumps(settings))
    stack = UpStack(pydoc_index_dir, args=("--dispatchers", "3", "--config-dir", str(config)))
    stack.wait_ready()
    yield stack
    stack.stop()


async def test_calls_spread_over_three_dispatchers_within_20_percent(three):
    before = {name: served(three, name) for name in DISPATCHERS}
    finals = await run_tasks(three.address("orchestrator"), 60)
    assert all(f.output for f in finals)
    counts = {name: served(three, name) - before[name] for name in DISPATCHERS}
    assert sum(counts.values()) == 60
    mean = 60 / 3
    assert all(abs(c - mean) <= 0.2 * mean for c in counts.values()), counts


async def test_killed_dispatcher_leaves_the_stack_serving(three):
    victim = "dispatcher-2"
    os.kill(pid(three, victim), signal.SIGKILL)
    for _ in range(600):  # the launcher notices within its 0.2 s poll (a hang guard, not a speed test)
        if any(f"{victim} (" in line and "still serve" in line for line in three.lines):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the launcher did not report the killed dispatcher:\n" + "".join(three.lines))
    finals = await run_tasks(three.address("orchestrator"), 30)
    assert len(finals) == 30 and all(f.output for f in finals)
    assert three.proc.poll() is None, "two dispatchers still serve: the stack keeps running"
