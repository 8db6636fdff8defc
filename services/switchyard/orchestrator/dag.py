"""Run a task's DAG of steps with graphlib, each step in its resource's queue.

A step is either CPU work (``cpu=True``: a plain function run by an
orchestration-queue worker in the CPU executor, a process pool by default
(``orchestrator.cpu_executor``), so it never stalls the event loop that serves
streams) or a call to another service (an async
function that waits on the network, holding no orchestration worker).
Independent steps run concurrently; a failing step cancels the rest.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from typing import Any, Awaitable, Callable, Protocol

from switchyard.common import telemetry

tracer = telemetry.get_tracer(__name__)


class StepContext(Protocol):
    """What a step runner needs from the task it runs."""

    def stage_done(self, name: str, start: float, end: float) -> None: ...

    async def run_cpu(self, job: Any) -> None: ...


@dataclass(frozen=True)
class Step:
    """One node of a workflow.

    ``fn`` takes the task run; for ``cpu`` steps it returns the step's CPU job, otherwise it is a
    coroutine function.
    """

    name: str
    fn: Callable[[Any], Any]
    after: tuple[str, ...] = ()
    cpu: bool = False
    attributes: dict[str, str] = field(default_factory=dict)


async def run_step(step: Step, run: StepContext) -> None:
    """Run one step inside its span and report its stage timing."""
    with tracer.start_as_current_span(step.name, attributes={"switchyard.stage": step.name, **step.attributes}):
        start = time.monotonic()
        if step.cpu:
            await run.run_cpu(step.fn(run))
        else:
            result: Awaitable[None] = step.fn(run)
            await result
        run.stage_done(step.name, start, time.monotonic())


async def run_dag(steps: list[Step], run: StepContext) -> None:
    """Run ``steps`` in dependency order, independent ones concurrently.

    Raises:
        ValueError: unknown dependency or a cycle (graphlib.CycleError).
        Exception: the first step failure; the other running steps are cancelled.
    """
    by_name = {s.name: s for s in steps}
    for s in steps:
        missing = [d for d in s.after if d not in by_name]
        if missing:
            raise ValueError(f"step {s.name!r} depends on unknown steps {missing}")
    order = TopologicalSorter({s.name: s.after for s in steps})
    order.prepare()
    pending: dict[asyncio.Task[None], str] = {}
    try:
        while order.is_active():
            for name in order.get_ready():
                pending[asyncio.create_task(run_step(by_name[name], run), name=name)] = name
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                name = pending.pop(task)
                task.result()
                order.done(name)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
