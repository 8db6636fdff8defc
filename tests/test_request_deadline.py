"""Every request's own deadline, enforced by the dispatcher's scheduler on a step engine.

A request's deadline is its caller's ``timeout_s`` (a GenerateStream start) or gRPC deadline
(Generate). The caller here never cancels: the dispatcher itself must answer DEADLINE_EXCEEDED, within
one step, and free the request's place and KV, whether it waits for admission or runs. Real sim
dispatchers on 127.0.0.1:0, and the scheduler stepped by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc
import pytest
from registry_values import metric

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import RequestDeadlineExceeded
from switchyard.common.server import RunningServer, start_server
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.output import StreamError
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.request import Request, SchedulerOutput
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.service import DispatcherService
from switchyard_harness.testing.scheduling import accept
from switchyard.dispatcher.request import RequestStatus
from fast_sim import FAST

pytestmark = pytest.mark.no_gpu

PROMPT = ("<context>\n[1] The with statement\nThe with statement works " + " ".join(f"step{i}" for i in range(600))
          + ".\n</context>\n<question>How does the with statement work?</question>")
"""The sim answers it with ~600 tokens: a request runs to its max_tokens."""

SLOW = {"sim.decode_base_ms": 20.0}  # a step every ~20 ms: a 500-token request runs ~10 s
ONE_FITS = {"sim.hbm_gb": 17.1}  # a KV budget of ~1,000 tokens: one request of the prompt + 300 tokens at a time


@contextlib.asynccontextmanager
async def dispatcher(**overrides: object) -> AsyncIterator[tuple[DispatcherService, grpc.aio.Channel]]:
    service = DispatcherService(SwitchyardConfig().with_overrides(**{**FAST, **overrides}))
    srv: RunningServer = await start_server([service], "127.0.0.1", 0, service.config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}")
    try:
        yield service, channel
    finally:
        await channel.close()
        await srv.stop(1.0)


def start(request_id: str, timeout_s: float, max_tokens: int) -> agent_pb2.StreamedGenerate:
    return agent_pb2.StreamedGenerate(
        request=agent_pb2.GenerateRequest(request_id=request_id, prompt=PROMPT, max_tokens=max_tokens),
        timeout_s=timeout_s)


async def until_ended(call: grpc.aio.StreamStreamCall, request_ids: set[str]) -> dict[str, tuple[int, object]]:
    """Read ``call`` until each of ``request_ids`` ended: request id -> (tokens received, its error or done)."""
    tokens: dict[str, int] = dict.fromkeys(request_ids, 0)
    ended: dict[str, tuple[int, object]] = {}
    while set(ended) != request_ids:
        message = await asyncio.wait_for(call.read(), 30)
        assert message is not grpc.aio.EOF, "the stream ended first"
        for streamed in message.chunks:
            rid = streamed.request_id
            if streamed.HasField("error"):
                ended[rid] = (tokens[rid], streamed.error)
            elif streamed.chunk.HasField("token"):
                tokens[rid] += max(1, streamed.chunk.token.count)
            elif streamed.chunk.HasField("done"):
                ended[rid] = (tokens[rid], streamed.chunk.done)
    return ended


def kv_held(service: DispatcherService) -> int:
    budget = service.scheduler.capacity
    return budget.reserved_bytes + budget.leaving_bytes + budget.restoring_bytes  # type: ignore[attr-defined]


async def test_a_running_stream_request_past_its_timeout_fails_deadline_exceeded_and_frees_its_kv() -> None:
    async with dispatcher(**SLOW) as (service, channel):
        call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
        failed = metric("switchyard_request_deadline_exceeded_total", priority_class="normal")
        await call.write(agent_pb2.GenerateStreamRequest(start=[start("late", 0.3, 500)]))
        ended = await until_ended(call, {"late"})  # the caller never cancels
        tokens, error = ended["late"]
        assert isinstance(error, agent_pb2.StreamedError), error
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and error.origin == "dispatcher"
        assert "passed its deadline of 0.3 s" in error.details and "KV cache were freed" in error.details
        assert 0 < tokens < 500  # it ran, and was stopped long before its end
        assert metric("switchyard_request_deadline_exceeded_total", priority_class="normal") == failed + 1
        assert service.scheduler.num_running == 0 and kv_held(service) == 0
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK  # one request's deadline ends only that request


async def test_a_waiting_stream_request_past_its_timeout_fails_before_any_token_and_the_other_runs_on() -> None:
    async with dispatcher(**SLOW, **ONE_FITS) as (service, channel):
        call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
        await call.write(agent_pb2.GenerateStreamRequest(start=[start("first", 60, 40)]))
        for _ in range(2000):
            if service.scheduler.num_running:
                break
            await asyncio.sleep(0.005)
        await call.write(agent_pb2.GenerateStreamRequest(start=[start("waits", 0.3, 300)]))
        ended = await until_ended(call, {"first", "waits"})
        tokens, error = ended["waits"]
        assert isinstance(error, agent_pb2.StreamedError), error
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and tokens == 0
        assert "waiting for admission" in error.details
        first_tokens, done = ended["first"]
        assert isinstance(done, agent_pb2.GenerateDone) and first_tokens == 40
        assert service.scheduler.num_queued == 0 and kv_held(service) == 0
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_a_generate_call_past_its_deadline_ends_deadline_exceeded_and_the_dispatcher_lets_go() -> None:
    async with dispatcher(**SLOW) as (service, channel):
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        request = agent_pb2.GenerateRequest(request_id="g", prompt=PROMPT, max_tokens=500)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request, timeout=0.3):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(2000):
            if not service.scheduler.has_work:
                break
            await asyncio.sleep(0.005)
        assert not service.scheduler.has_work and kv_held(service) == 0


def test_the_scheduler_fails_buffered_waiting_and_running_requests_at_their_own_deadline() -> None:
    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(SwitchyardConfig(), engine)
    running = Request("run", prompt="x", prompt_tokens=100, max_tokens=50, arrival=0.0, deadline=1.0)
    accept(sched, [running], 0.0)
    assert sched.schedule(now=0.0).admitted == [running]
    running.num_computed_tokens = 100
    waiting = Request("wait", prompt="x", prompt_tokens=10, max_tokens=5, arrival=0.0, deadline=2.0)
    undated = Request("none", prompt="x", prompt_tokens=10, max_tokens=5, arrival=0.0)
    accept(sched, [waiting, undated], 0.0)  # flushed into the waiting set; no decision admits them here
    buffered = Request("buf", prompt="x", prompt_tokens=10, max_tokens=5, arrival=0.5, deadline=1.5)
    sched.add_request(buffered, now=0.5)
    assert sched.next_deadline == 1.0

    assert sched.expire_deadlines(now=0.9) == []
    assert sched.expire_deadlines(now=1.0) == [running]  # at its deadline, running
    assert running.is_finished and running.num_computed_tokens == 0  # its KV released
    assert sched.capacity.reserved_bytes == sum(r.kv_reserved_bytes for r in sched.running)
    [out] = sched.finish_requests([], RequestStatus.FINISHED_ABORTED, 1.0)  # the outputs of what ended
    out.publish()
    [item] = running.output.drain()
    assert isinstance(item, StreamError) and isinstance(item.error, RequestDeadlineExceeded)
    assert item.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sched.expire_deadlines(now=1.6) == [buffered]  # still in the double buffer
    assert buffered.is_finished and sched.intake.active_size == 0
    assert sched.expire_deadlines(now=2.5) == [waiting]
    assert undated.finish_reason is None and sched.waiting == [undated] and sched.next_deadline == float("inf")
    assert sched.num_queued == 1


@pytest.mark.parametrize("ends_by", ["queue_timeout", "abort"])
@pytest.mark.parametrize("in_dram", [True, False])
def test_a_resumed_step_that_never_ran_ends_alike_however_it_ends(ends_by, in_dram):
    """The queue timeout ends a request the way every other end does (one ``_end``): the agent's DRAM copy it
    will not come back for is discarded, and a step that never reached the engine recomputed nothing."""
    config = SwitchyardConfig()
    sched = make_scheduler(config, SimEngine(config))
    discarded: list[str] = []
    sched.tiers.discard = discarded.append  # the DRAM tier's delete, recorded (no Redis here)
    sched.tiers.parked_key = lambda key: f"kv:agent:{key}"
    sched.parking._cold["agent-1"] = (300, in_dram)  # the agent's last step left HBM during its tool call
    now = 1000.0
    req = Request(request_id="t:1", prompt="x", prompt_tokens=400, max_tokens=16, agent_id="agent-1",
                  task_type="react_loop", resume=True, arrival=now)
    sched.add_request(req, now)
    sched.flush(FlushReason.IDLE, now)  # joins the waiting set as a resumed step (restored / cold)
    later = now + config.queues.inference.timeout_ms / 1000 + 1
    if ends_by == "queue_timeout":
        sched._expire(later, SchedulerOutput())
    else:
        sched.finish_requests([req], RequestStatus.FINISHED_ABORTED, later)
    assert req.is_finished
    assert discarded == (["kv:agent:agent-1"] if in_dram else [])
    assert sched.counters.recomputed_tokens == 0
