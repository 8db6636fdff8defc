"""Small pieces tests drive the scheduler with (no benchmark code).

- :func:`accept`: requests through the scheduler's one intake
  (``add_request``), flushed into the waiting set at once.
- :class:`FixedSlots`: a capacity of ``n`` running requests.
"""

from __future__ import annotations

from typing import Any

from switchyard.dispatcher.double_buffer import FlushReason


def accept(sched: Any, reqs: list[Any], now: float) -> None:
    """``sched.add_request`` each of ``reqs`` at ``now``, then flush the double buffer (reason ``step``)."""
    for req in reqs:
        sched.add_request(req, now)
    sched.flush(FlushReason.STEP, now)


class FixedSlots:
    """A scheduler capacity of ``n`` running requests (the product's comes from the hardware)."""

    CLASS_REFUSALS: frozenset[str] = frozenset()

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.running = 0

    def refusal(self, req: Any) -> str | None:
        return None if self.running < self.n else "kv_memory"

    def never_fits(self, req: Any) -> str | None:
        return None

    def take(self, req: Any) -> None:
        self.running += 1

    def give(self, req: Any) -> None:
        self.running -= 1


async def step(sched: Any, engine: Any, prefill: list[Any] = (), decode: list[Any] = (),  # type: ignore[assignment]
               now: float = 0.0) -> list[Any]:
    """One engine step the way the step loop runs it: ``sched.compose_batch`` -> ``engine.execute_model``
    -> ``sched.update_from_output`` at ``now``; the outputs are published to the requests' streams and
    returned."""
    batch = sched.compose_batch(list(prefill), list(decode))
    result = await engine.execute_model(batch)
    outputs = sched.update_from_output(batch, result, now)
    for out in outputs:
        out.publish()
    return outputs


def finish(sched: Any, req: Any, now: float, status: Any = None) -> list[Any]:
    """End ``req`` with ``status`` (default ``FINISHED_STOPPED``) through ``sched.finish_requests``; the
    outputs are published and returned."""
    from switchyard.dispatcher.request import RequestStatus

    outputs = sched.finish_requests([req.request_id], status or RequestStatus.FINISHED_STOPPED, now)
    for out in outputs:
        out.publish()
    return outputs
