"""The step loop keeps decoding its running set while a core request waits for room only that set frees.

Seen under the field's locust mix: the dispatcher's KV budget full, a CORE request refused admission (KV
memory) and no victim to preempt; every turn ended its decode slice before the first step because core work
waited, so nothing decoded, nothing finished, no KV came free and the engine stood idle (busy 0) with the
loop spinning on one core.
"""

from __future__ import annotations

import asyncio
import time

from nvml_fixtures import FakeNvml
from switchyard.common.priority import PriorityClass
from switchyard_harness.testing.capacity import FixedSlots
from switchyard_harness.testing.scheduling import accept

from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engine_loop import StepLoop
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor

CORE, BATCH = agent_pb2.CORE, agent_pb2.BATCH


def _request(priority: int, max_tokens: int) -> Request:
    return Request(request_id=f"progress-{priority}", prompt="How does the with statement work?", priority=PriorityClass.from_proto(priority),
                   task_type="chat", prompt_tokens=16, max_tokens=max_tokens)


async def test_running_work_decodes_while_a_core_request_waits_for_its_room() -> None:
    # One slot, held by a BATCH request; CORE may not preempt it within the test (it waits 60 s first).
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1,
                                                  "scheduler.core_wait_before_preempt_ms": 60000})
    engine = SimEngine(config)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    sched = make_scheduler(config, engine, monitor=monitor, capacity=FixedSlots(1))
    batch, core = _request(BATCH, max_tokens=8), _request(CORE, max_tokens=4)
    now = time.monotonic()
    accept(sched, [batch], now=now)
    assert sched.schedule(now=now).admitted == [batch]
    accept(sched, [core], now=now)
    assert sched.core_waiting  # refused: the one slot is batch's
    loop = StepLoop(config, engine, sched)
    loop.start()
    try:
        for _ in range(500):  # a liveness bound (5 s), not a timing: the sim's steps take ~5 ms each
            if batch.is_finished and core.is_finished:
                break
            await asyncio.sleep(0.01)
        served = (len(batch.output_tokens), len(core.output_tokens))  # before the drain ends what is left
    finally:
        await loop.drain()
    assert served == (8, 4), f"tokens (batch, core) before the drain: {served}, expected (8, 4)"
    assert batch.is_finished and len(batch.output_tokens) == 8, f"batch decoded {len(batch.output_tokens)} of 8"
    assert core.is_finished and len(core.output_tokens) == 4  # admitted once batch's slot came free
