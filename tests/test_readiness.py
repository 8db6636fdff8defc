"""Readiness that tells the truth: the orchestrator's named health follows its downstream services.

Real servers on 127.0.0.1: a sim dispatcher in this process (stopped and
started again) and one in its own process (SIGSTOP, SIGCONT); the
orchestrator's health is observed through the standard ``Health.Watch`` stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from typing import AsyncIterator

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig
from switchyard.common.server import running, start_server
from switchyard.dispatcher.service import DispatcherService
from switchyard.launcher import free_port, healthy
from switchyard.orchestrator.http_face import HttpFace
from switchyard.orchestrator.readiness import address_count
from switchyard.orchestrator.addresses import HIDDEN
from switchyard.orchestrator.service import OrchestratorService
from test_orchestrator import Downstream

pytestmark = pytest.mark.no_gpu

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NOTHING_THERE = "127.0.0.1:1"  # a closed port: retrieval is down in these tests


def orchestrator_config(dispatcher_addr: str, **overrides: object) -> SwitchyardConfig:
    return SwitchyardConfig().with_overrides(**{
        "orchestrator.dispatcher_addr": dispatcher_addr,
        "orchestrator.retrieval_addr": NOTHING_THERE,
        "orchestrator.default_task_type": "chat",
        "orchestrator.cpu_executor": "loop",
        "orchestrator.health_check_interval_s": 0.1,
        "orchestrator.health_check_timeout_s": 0.5,
        **overrides,
    })


class HealthWatch:
    """``Health.Watch`` of one service name on the orchestrator: each status as it changes."""

    def __init__(self, channel, service: str) -> None:
        self.call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))

    async def until(self, status: int) -> None:
        """Read updates until ``status`` arrives (a hang guard of 60 s, not a speed requirement)."""

        async def read() -> None:
            async for reply in self.call:
                if reply.status == status:
                    return
            raise AssertionError("the Watch stream ended")

        await asyncio.wait_for(read(), 60)


async def check(channel, service: str) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


@contextlib.asynccontextmanager
async def orchestrator(cfg: SwitchyardConfig) -> AsyncIterator:
    async with running([OrchestratorService(cfg)], cfg.server) as orch:
        async with open_channel(f"127.0.0.1:{orch.port}") as channel:
            yield channel


async def test_not_serving_while_the_dispatcher_is_stopped_serving_once_it_is_back():
    dispatcher_cfg = SwitchyardConfig()
    first = await start_server([DispatcherService(dispatcher_cfg)], "127.0.0.1", 0, dispatcher_cfg.server)
    port = first.port
    second = None
    try:
        async with orchestrator(orchestrator_config(f"127.0.0.1:{port}")) as channel:
            watch = HealthWatch(channel, "agent.AgentService")
            await watch.until(SERVING)
            # chat needs only the dispatcher; rag_answer and react_loop need retrieval too, which is down
            assert await check(channel, "workflow.chat") == SERVING
            assert await check(channel, "workflow.rag_answer") == NOT_SERVING
            assert await check(channel, "workflow.react_loop") == NOT_SERVING

            await first.stop(0)
            await watch.until(NOT_SERVING)
            assert await check(channel, "workflow.chat") == NOT_SERVING
            assert await check(channel, "") == SERVING, "liveness does not depend on the dispatcher"

            second = await start_server([DispatcherService(dispatcher_cfg)], "127.0.0.1", port,
                                        dispatcher_cfg.server)
            await watch.until(SERVING)
            watch.call.cancel()
    finally:
        if second is not None:
            await second.stop(0)


class OneModel(Downstream):
    """A dispatcher whose engine serves one model alone (as sim and torch do): another is NOT_FOUND at the edge."""

    async def DescribeModel(self, request, context):
        self.described += 1
        return agent_pb2.ModelInfo(model=self.model, engine="sim", serves_only_model=True)


async def test_a_dispatcher_back_with_another_model_is_asked_again_what_it_serves():
    """A dispatcher restarted at its address with another engine or model (SWITCHYARD_ENGINE=openai, a new
    model's rollout) is asked DescribeModel again once readiness finds it back: the orchestrator kept the first
    answer, and refused the new model NOT_FOUND ('the dispatcher's engine serves old-model') while it validated
    every request against the old model's context window."""
    first_down, second_down = OneModel(), OneModel()
    first_down.model, second_down.model = "old-model", "new-model"
    cfg = SwitchyardConfig()
    first = await start_server([first_down], "127.0.0.1", 0, cfg.server)
    port = first.port
    second = None
    try:
        async with orchestrator(orchestrator_config(f"127.0.0.1:{port}")) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            watch = HealthWatch(channel, "agent.AgentService")
            await watch.until(SERVING)
            events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"))]
            assert events[-1].HasField("final") and first_down.described == 1

            await first.stop(0)
            await watch.until(NOT_SERVING)
            second = await start_server([second_down], "127.0.0.1", port, cfg.server)
            await watch.until(SERVING)
            watch.call.cancel()
            events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(
                payload="hi", task_type="chat", model="new-model"))]
            assert events[-1].HasField("final") and second_down.described == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat",
                                                                     model="old-model")):
                    pass
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "serves 'new-model'" in refused.value.details(), refused.value.details()
    finally:
        if second is not None:
            await second.stop(0)


def serving(service: str) -> float | None:
    return REGISTRY.get_sample_value("switchyard_serving", {"service": service})


async def test_default_workflow_needing_retrieval_keeps_the_service_not_serving():
    """switchyard_serving tells what the readiness probes read: the orchestrator's gRPC health name, and its HTTP
    face's /readyz (orchestrator-http read 1 from start-up to the drain while /readyz answered 503)."""
    dispatcher_cfg = SwitchyardConfig()
    async with running([DispatcherService(dispatcher_cfg)], dispatcher_cfg.server) as disp:
        cfg = orchestrator_config(f"127.0.0.1:{disp.port}", **{"orchestrator.default_task_type": "rag_answer"})
        orchestrator = OrchestratorService(cfg)
        async with running([orchestrator, HttpFace(orchestrator, cfg, port=0)], cfg.server) as orch:
            readiness = orch.services[0].readiness
            await readiness.check_once()
            assert readiness.ready == {"dispatcher": True, "retrieval": False}
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                assert await check(channel, "workflow.chat") == SERVING
                assert await check(channel, "agent.AgentService") == NOT_SERVING
            # switchyard_serving tells what the readiness probe reads (it was never 1 for the orchestrator)
            assert serving("orchestrator") == 0
            face = orch.services[1]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}") as client:
                assert (await client.get("/readyz")).status_code == 503
            assert serving("orchestrator-http") == 0
    async with running([DispatcherService(dispatcher_cfg)], dispatcher_cfg.server) as disp:
        cfg = orchestrator_config(f"127.0.0.1:{disp.port}", **{"orchestrator.default_task_type": "chat"})
        orchestrator = OrchestratorService(cfg)
        async with running([orchestrator, HttpFace(orchestrator, cfg, port=0)], cfg.server) as orch:
            await orch.services[0].readiness.check_once()
            assert serving("orchestrator") == 1
            face = orch.services[1]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}") as client:
                assert (await client.get("/readyz")).status_code == 200
            assert serving("orchestrator-http") == 1
            await orch.services[0].begin_drain()  # the drain's first step (RunningServer.stop), ahead of the rest
            assert serving("orchestrator-http") == 0


async def dispatcher_process() -> tuple[subprocess.Popen, int]:
    """``switchyard serve dispatcher`` in its own process, once it serves: (process, port)."""
    port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--port", str(port),
         "--metrics-port", str(metrics_port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(1200):  # start-up: imports and the engine (a hang guard of 120 s)
        if await asyncio.to_thread(healthy, f"127.0.0.1:{port}", "agent.InferenceService"):
            return proc, port
        assert proc.poll() is None, "the dispatcher exited during start-up"
        await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError("the dispatcher process did not become healthy")


def end(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(60)


async def test_a_stopped_dispatcher_process_answers_nothing_and_counts_as_not_ready():
    """SIGSTOP: the connection stays open but nothing answers, the case the issue measured."""
    proc, port = await dispatcher_process()
    try:
        async with orchestrator(orchestrator_config(f"127.0.0.1:{port}")) as channel:
            watch = HealthWatch(channel, "agent.AgentService")
            await watch.until(SERVING)
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            task = agent_pb2.RunTaskRequest(payload="hi", task_type="chat", max_tokens=2)
            assert [e async for e in stub.RunTask(task)][-1].HasField("final")
            proc.send_signal(signal.SIGSTOP)
            await watch.until(NOT_SERVING)
            assert await check(channel, "") == SERVING
            # a task is refused at once, naming the dispatcher, not left to wait for it until its deadline
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [e async for e in stub.RunTask(task, timeout=60)]
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # named, its address hidden from the caller (orchestrator.show_addresses_to_callers)
            assert (refused.value.details() or "").startswith(f"dispatcher service unavailable at {HIDDEN}: ")
            assert "did not answer its last health check" in (refused.value.details() or "")
            proc.send_signal(signal.SIGCONT)
            await watch.until(SERVING)
            watch.call.cancel()
    finally:
        end(proc)


async def test_tasks_avoid_a_stopped_replica_while_another_serves():
    """Two replicas, one SIGSTOPped: the orchestrator stays SERVING, marks that replica unhealthy, and tasks
    (with agents, whichever replica the ring gave them) all complete on the other one."""
    proc, port = await dispatcher_process()
    dispatcher_cfg = SwitchyardConfig()
    try:
        async with running([DispatcherService(dispatcher_cfg)], dispatcher_cfg.server) as live:
            stopped_address = f"127.0.0.1:{port}"
            target = f"ipv4:{stopped_address},127.0.0.1:{live.port}"
            cfg = orchestrator_config(target)
            async with running([OrchestratorService(cfg)], cfg.server) as orch:
                replicas = orch.services[0]._deps.inference.replicas
                proc.send_signal(signal.SIGSTOP)
                for _ in range(600):  # the next health round marks it (a hang guard of 60 s)
                    if stopped_address in replicas.unhealthy:
                        break
                    await asyncio.sleep(0.1)
                assert replicas.unhealthy == {stopped_address}
                async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                    assert await check(channel, "agent.AgentService") == SERVING
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    for i in range(8):
                        request = agent_pb2.RunTaskRequest(task_id=f"t{i}", agent_id=f"agent-{i}", payload="hi",
                                                           task_type="chat", max_tokens=4)
                        events = [e async for e in stub.RunTask(request, timeout=30)]
                        assert events[-1].final.output
                proc.send_signal(signal.SIGCONT)
                for _ in range(600):
                    if not replicas.unhealthy:
                        break
                    await asyncio.sleep(0.1)
                assert not replicas.unhealthy
    finally:
        end(proc)


def test_address_count_of_targets():
    assert address_count("127.0.0.1:50053") == 1
    assert address_count("ipv4:127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003") == 3
    assert address_count("dns:///dispatcher.default.svc.cluster.local:50053") == 3
    assert address_count("ipv6:[::1]:5001,[::1]:5002") == 2
    # A unix: target is one socket, whose path may hold a comma (gRPC lists addresses for ipv4:/ipv6: only).
    assert address_count("unix:/run/switchyard/dispatcher,a.sock") == 1


def test_nothing_is_called_unready_before_the_first_round_has_ended():
    """The orchestrator serves before its readiness's first round ends: every RunTask in that window was refused
    as 'did not answer its last health check', of a service never checked."""
    from switchyard.orchestrator.readiness import Readiness

    async def set_status(name: str, status: int) -> None:
        pass

    readiness = Readiness(set_status, {"dispatcher": (None, "127.0.0.1:1"), "retrieval": (None, "127.0.0.1:2")},
                          "chat", 1.0, 1.0)
    assert readiness.unready("rag_answer") == []
    readiness.checked = True  # a round found both down
    assert readiness.unready("rag_answer") == [("dispatcher", "127.0.0.1:1"), ("retrieval", "127.0.0.1:2")]
    assert readiness.unready("react_loop") == [("dispatcher", "127.0.0.1:1")]  # its search tool's failure is read


async def _status_of(stub, task_id: str) -> agent_pb2.TaskStatus:
    return await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))


async def _until_state(stub, task_id: str, state: int) -> agent_pb2.TaskStatus:
    for _ in range(1200):  # a hang guard (60 s), not a speed requirement
        status = await _status_of(stub, task_id)
        if status.state == state:
            return status
        assert status.state in (agent_pb2.QUEUED, agent_pb2.RUNNING), (task_id, status.state, status.error)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{task_id} never reached {state}: {status}")


async def test_a_submitted_task_waits_in_the_backlog_while_a_service_its_workflow_needs_is_down(tmp_path):
    """A task queue holds its tasks while a worker restarts: a task submitted while the dispatcher was down
    (restarting) started at once and failed 'UNAVAILABLE: dispatcher service unavailable ... Connection refused',
    and its caller had to resubmit it under a new task_id. It waits QUEUED until readiness finds the dispatcher
    back, then runs. A rag_answer waits while retrieval is down without holding back a chat submitted after it."""
    down = Downstream()
    cfg = SwitchyardConfig()
    first = await start_server([down], "127.0.0.1", 0, cfg.server)
    port = first.port
    second = None
    try:
        async with orchestrator(orchestrator_config(
                f"127.0.0.1:{port}", **{"orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")})) \
                as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            watch = HealthWatch(channel, "agent.AgentService")
            await watch.until(SERVING)
            # retrieval (NOTHING_THERE) is down: a rag_answer waits, a chat behind it runs
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="rag-held", payload="hi", task_type="rag_answer"))
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="chat-runs", payload="hi", task_type="chat"))
            await _until_state(stub, "chat-runs", agent_pb2.SUCCEEDED)
            held = await _status_of(stub, "rag-held")
            assert held.state == agent_pb2.QUEUED and not held.error, held

            await first.stop(0)
            await watch.until(NOT_SERVING)
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="chat-held", payload="hi", task_type="chat"))
            for _ in range(10):  # readiness rounds (0.1 s each) pass: it is not started to fail
                status = await _status_of(stub, "chat-held")
                assert status.state == agent_pb2.QUEUED and not status.error, status
                await asyncio.sleep(0.05)
            second = await start_server([down], "127.0.0.1", port, cfg.server)
            await watch.until(SERVING)
            watch.call.cancel()
            done = await _until_state(stub, "chat-held", agent_pb2.SUCCEEDED)
            assert done.result.output == "The answer."
            assert (await _status_of(stub, "rag-held")).state == agent_pb2.QUEUED  # retrieval is still down
    finally:
        if second is not None:
            await second.stop(0)


async def test_a_refused_task_and_readyz_say_what_the_dispatchers_health_check_found():
    """A task refused for a dispatcher not ready read 'it did not answer its last health check (within
    orchestrator.health_check_timeout_s = 1 s)' whatever the check had found: a dispatcher draining after SIGTERM,
    which answers NOT_SERVING at once, or a closed port, sent an operator looking for a hang (a SIGSTOPped
    process's words: test_a_stopped_dispatcher_process_answers_nothing_and_counts_as_not_ready)."""
    down = Downstream()
    cfg = orchestrator_config("127.0.0.1:1")
    dispatcher = await start_server([down], "127.0.0.1", 0, cfg.server)
    cfg = orchestrator_config(f"127.0.0.1:{dispatcher.port}")
    orch = OrchestratorService(cfg)
    face = HttpFace(orch, cfg, port=0)
    task = agent_pb2.RunTaskRequest(payload="hi", task_type="chat", max_tokens=2)

    async def refused_and_readyz() -> tuple[str, httpx.Response]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [e async for e in stub.RunTask(task, timeout=60)]
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        return refused.value.details() or "", await client.get("/readyz")

    try:
        async with running([orch, face], cfg.server) as srv:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                watch = HealthWatch(channel, "agent.AgentService")
                await watch.until(SERVING)
                assert [e async for e in stub.RunTask(task)][-1].HasField("final")

                await dispatcher.health.enter_graceful_shutdown()  # a drain's first step: NOT_SERVING, port open
                await watch.until(NOT_SERVING)
                details, readyz = await refused_and_readyz()
                says = "its last health check answered NOT_SERVING (draining after SIGTERM, or not ready yet)"
                assert details == f"dispatcher service unavailable at {HIDDEN}: {says}; is it running (switchyard up)?"
                assert readyz.status_code == 503 and says in readyz.text, readyz.text

                await dispatcher.stop(0)  # the port closed: refused, not silent
                while orch.readiness.why["dispatcher"].startswith("its last health check answered NOT_SERVING"):
                    await asyncio.sleep(0.05)
                details, readyz = await refused_and_readyz()
                says = "its last health check failed (UNAVAILABLE: "
                assert details.startswith(f"dispatcher service unavailable at {HIDDEN}: {says}"), details
                assert readyz.status_code == 503 and says in readyz.text, readyz.text
                assert "did not answer" not in details + readyz.text
                watch.call.cancel()
    finally:
        await dispatcher.stop(0)
