"""The dispatcher's bounded inference queue.

A Generate request holds one of ``queues.inference.capacity`` places from the
moment it is accepted until it reaches the engine (admitted into the running
set, or handed to a stream worker): the places cover the wait for the double
buffer's flush and for the scheduler's admission, so a saturated engine
pushes back on callers instead of growing an unbounded waiting list.

Entering waits at most the caller's deadline, capped by
``queues.inference.timeout_ms``; a request that cannot get a place in that
time fails with RESOURCE_EXHAUSTED naming the queue and its capacity. A full
queue rejects; it never drops a request silently.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc

from switchyard.common.config import QueueConfig
from switchyard.common.errors import SwitchyardError
from switchyard.common.metrics import QUEUE_DEPTH, QUEUE_REJECTED, QUEUE_WAIT
from switchyard.dispatcher.sequence import Sequence

QUEUE_NAME = "inference"

REPLY_MARGIN_S = 0.05
"""Part of the caller's deadline kept for sending RESOURCE_EXHAUSTED before the caller gives up."""


class InferenceQueueSaturated(SwitchyardError):
    """No place freed up within the caller's deadline (RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, capacity: int, waited_s: float) -> None:
        super().__init__(
            f"inference queue saturated (capacity {capacity}, queues.inference.capacity): "
            f"no place freed within {waited_s * 1000:.0f} ms; retry later or raise the capacity"
        )


class InferenceQueueTimeout(SwitchyardError):
    """The request waited longer than timeout_ms before reaching the engine (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, waited_s: float, timeout_ms: int) -> None:
        super().__init__(
            f"waited {waited_s * 1000:.0f} ms in the inference queue before reaching the engine "
            f"(queues.inference.timeout_ms = {timeout_ms})"
        )


class InferenceQueue:
    """Counts places held by requests on their way to the engine.

    Args:
        config: ``queues.inference`` (capacity, timeout_ms; workers is used by
            the engine loop for stream engines).
    """

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self._holders: set[Sequence] = set()
        self._waiters: deque[tuple[Sequence, asyncio.Future[None]]] = deque()  # FIFO hand-off of freed places

    @property
    def depth(self) -> int:
        """Requests holding a place (accepted, not yet at the engine)."""
        return len(self._holders)

    def holds(self, seq: Sequence) -> bool:
        """True while ``seq`` holds a place (accepted, not yet at the engine)."""
        return seq in self._holders

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_ms / 1000

    async def enter(self, seq: Sequence, deadline_s: float | None) -> None:
        """Take a place for ``seq``, waiting at most ``min(deadline_s - REPLY_MARGIN_S, timeout_ms)``.

        Args:
            deadline_s: seconds the caller has left (``context.time_remaining()``),
                None when it set no deadline.

        Raises:
            InferenceQueueSaturated: no place within the wait.
        """
        wait = self.timeout_s
        if deadline_s is not None:  # leave time for the status to reach the caller before its deadline
            wait = max(0.0, min(deadline_s - REPLY_MARGIN_S, self.timeout_s))
        if len(self._holders) < self.config.capacity and not self._waiters:
            self._take(seq)
            return
        start = time.monotonic()
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, granted))
        try:
            await asyncio.wait_for(asyncio.shield(granted), wait)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if granted.done():  # handed a place just as the wait ended
                if isinstance(exc, asyncio.CancelledError):
                    self.leave(seq)
                    raise
                return
            granted.cancel()
            self._waiters.remove((seq, granted))
            if isinstance(exc, asyncio.CancelledError):
                raise
            QUEUE_REJECTED.labels(QUEUE_NAME, "full").inc()
            raise InferenceQueueSaturated(self.config.capacity, time.monotonic() - start) from None

    def _take(self, seq: Sequence) -> None:
        self._holders.add(seq)
        QUEUE_DEPTH.labels(QUEUE_NAME).set(len(self._holders))

    def leave(self, seq: Sequence, now: float | None = None) -> None:
        """``seq`` reached the engine (or ended): free its place. Idempotent.

        Records the inference-queue wait (arrival to now) when it reached the engine.
        """
        if seq not in self._holders:
            return
        self._holders.discard(seq)
        while self._waiters and len(self._holders) < self.config.capacity:
            waiter, granted = self._waiters.popleft()
            if not granted.done():
                self._holders.add(waiter)
                granted.set_result(None)
        QUEUE_DEPTH.labels(QUEUE_NAME).set(len(self._holders))
        if now is not None:
            QUEUE_WAIT.labels(QUEUE_NAME).observe(max(0.0, now - seq.arrival))

    def check_deadline(self, seq: Sequence, now: float) -> None:
        """Raise if ``seq`` has waited longer than timeout_ms without reaching the engine.

        Raises:
            InferenceQueueTimeout: it did.
        """
        waited = now - seq.arrival
        if seq in self._holders and waited > self.timeout_s:
            QUEUE_REJECTED.labels(QUEUE_NAME, "timeout").inc()
            raise InferenceQueueTimeout(waited, self.config.timeout_ms)
