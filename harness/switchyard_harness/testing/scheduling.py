"""Small pieces tests drive the scheduler with, through its interface (no benchmark code).

- :func:`accept`: requests through the scheduler's one intake
  (``add_request``), flushed into the waiting set at once.
- :func:`step`: one engine step the way the step loop runs it; :func:`finish`.
- :func:`publish`: the scheduler's report to the metrics, as the step loop
  publishes it after each scheduler call (the helpers above publish too).

A fixed-slots capacity is :class:`switchyard_harness.testing.capacity.FixedSlots`.
"""

from __future__ import annotations

from typing import Any

from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.metrics import publish_stats


def publish(sched: Any) -> None:
    """Publish ``sched.make_stats()`` (gauges, counters' increase, observations) to the Prometheus metrics, as
    the step loop does after each scheduler call."""
    publish_stats(sched.make_stats())


def accept(sched: Any, reqs: list[Any], now: float) -> None:
    """``sched.add_request`` each of ``reqs`` at ``now``, then flush the double buffer (reason ``step``); the
    report is published (:func:`publish`)."""
    for req in reqs:
        sched.add_request(req, now)
    sched.flush(FlushReason.STEP, now)
    publish(sched)


async def step(sched: Any, engine: Any, prefill: list[Any] = (), decode: list[Any] = (),  # type: ignore[assignment]
               now: float = 0.0) -> list[Any]:
    """One engine step the way the step loop runs it: ``sched.compose_batch`` -> ``engine.execute_model``
    -> ``sched.update_from_output`` at ``now``; the outputs are published to the requests' streams and
    returned, the scheduler's report to the metrics."""
    batch = sched.compose_batch(list(prefill), list(decode))
    result = await engine.execute_model(batch)
    outputs = sched.update_from_output(batch, result, now)
    for out in outputs:
        out.publish()
    publish(sched)
    return outputs


def finish(sched: Any, req: Any, now: float, status: Any = None) -> list[Any]:
    """End ``req`` with ``status`` (default ``FINISHED_STOPPED``) through ``sched.finish_requests``; the
    outputs are published and returned, the scheduler's report to the metrics."""
    from switchyard.dispatcher.request import RequestStatus

    outputs = sched.finish_requests([req], status or RequestStatus.FINISHED_STOPPED, now)
    for out in outputs:
        out.publish()
    publish(sched)
    return outputs
