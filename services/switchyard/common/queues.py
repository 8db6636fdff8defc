"""A bounded work queue with a fixed pool of asyncio workers.

Each of Switchyard's queue groups (orchestration, retrieval, inference; see
``config/queue.json``) is one :class:`WorkQueue`: at most ``capacity`` items
wait, ``workers`` run at once, and an item that waits longer than
``timeout_ms`` fails instead of running late. A full queue rejects at once; it
never drops an item silently.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

from switchyard.common.config import QueueConfig
from switchyard.common.errors import QueueFullError, QueueTimeoutError
from switchyard.common.metrics import (QUEUE_BUSY_WORKERS, QUEUE_CAPACITY, QUEUE_DEPTH, QUEUE_REJECT_REASONS,
                                       QUEUE_REJECTED, QUEUE_WAIT, QUEUE_WAIT_OUTCOMES)

T = TypeVar("T")


@dataclass(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], Awaitable[T]]
    enqueued_at: float
    started: asyncio.Future[float]
    done: asyncio.Future[T]
    abandoned: bool = False
    waited: bool = False
    """Its wait was observed (:meth:`WorkQueue._waited`): once, whichever way it ended."""
    task: asyncio.Task[T] | None = field(default=None, repr=False)


class WorkQueue:
    """Bounded FIFO of coroutine factories served by ``workers`` tasks.

    Args:
        name: queue name used in errors and the ``queue`` metric label.
        config: capacity, workers and timeout_ms.
    """

    def __init__(self, name: str, config: QueueConfig) -> None:
        self.name = name
        self.config = config
        self._items: deque[_Job] = deque()
        """The items waiting, oldest first: at most ``capacity``. One whose wait ends before a worker takes it (its
        timeout, its caller gone) leaves at once (:meth:`_leave`): it held a place, refusing new items 'full' while
        none of them waited, until a worker came to skip it."""
        self._arrived = asyncio.Event()
        """Set when an item joins; a worker finding none waiting clears it and waits."""
        self._workers: list[asyncio.Task[None]] = []
        self._busy = 0
        # this queue's series, looked up once: an item's trip through the queue sets or observes five of them
        QUEUE_CAPACITY.labels(name).set(config.capacity)
        self._depth_gauge = QUEUE_DEPTH.labels(name)
        self._depth_gauge.set(0)  # exported, at 0, before the first item
        self._busy_gauge = QUEUE_BUSY_WORKERS.labels(name)
        self._busy_gauge.set(0)
        # each outcome's series exists (at 0) before the first item: rate() sees it grow
        self._wait_histograms = {outcome: QUEUE_WAIT.labels(name, outcome) for outcome in QUEUE_WAIT_OUTCOMES}
        self.rejected = {reason: QUEUE_REJECTED.labels(name, reason) for reason in QUEUE_REJECT_REASONS}
        """``switchyard_queue_rejected_total`` of this queue, per reason."""

    @property
    def depth(self) -> int:
        """Items waiting (not yet taken by a worker)."""
        return len(self._items)

    @property
    def busy(self) -> int:
        """Workers running an item now."""
        return self._busy

    def start(self) -> None:
        """Start the worker tasks on the running loop (idempotent)."""
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(), name=f"{self.name}-worker-{i}") for i in range(self.config.workers)
            ]

    async def stop(self) -> None:
        """Cancel the workers; items still waiting fail with CancelledError."""
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while self._items:
            job = self._items.popleft()
            self._depth_gauge.set(len(self._items))
            self._waited(job, "cancelled")
            for fut in (job.started, job.done):
                if not fut.done():
                    fut.cancel()

    def submit(self, fn: Callable[[], Awaitable[T]]) -> "Ticket[T]":
        """Enqueue ``fn`` without waiting; returns a ticket to await.

        Raises:
            QueueFullError: ``capacity`` items already wait.
        """
        loop = asyncio.get_running_loop()
        job: _Job[T] = _Job(fn, time.monotonic(), loop.create_future(), loop.create_future())
        position = len(self._items)
        if position >= self.config.capacity:
            self.rejected["full"].inc()
            raise QueueFullError(self.name, self.config.capacity)
        self._items.append(job)
        self._arrived.set()
        self._depth_gauge.set(len(self._items))
        return Ticket(self, job, position)

    def place(self) -> int:
        """The place an item submitted now would take (the items waiting ahead of it), without
        submitting one: for work that joins the queue later but is admitted now.

        Raises:
            QueueFullError: ``capacity`` items already wait (counted as a ``full`` rejection).
        """
        waiting = len(self._items)
        if waiting >= self.config.capacity:
            self.rejected["full"].inc()
            raise QueueFullError(self.name, self.config.capacity)
        return waiting

    async def run(self, fn: Callable[[], Awaitable[T]]) -> tuple[T, float]:
        """Enqueue ``fn``, wait for a worker to run it, and return (result, queue wait in s).

        Raises:
            QueueFullError: the queue is full.
            QueueTimeoutError: no worker took it within ``timeout_ms``.
            Exception: whatever ``fn`` raised.
        """
        return await self.submit(fn).result()

    async def _work(self) -> None:
        while True:
            while not self._items:
                self._arrived.clear()
                await self._arrived.wait()
            job = self._items.popleft()
            self._depth_gauge.set(len(self._items))
            if job.abandoned or job.started.done():
                continue
            wait = self._waited(job, "admitted")
            job.started.set_result(wait)
            self._busy += 1
            self._busy_gauge.set(self._busy)
            try:
                job.task = asyncio.ensure_future(job.fn())
                result = await asyncio.shield(job.task)
            except asyncio.CancelledError:
                if job.task is not None and not job.task.done():
                    job.task.cancel()  # the worker itself is being stopped
                    if not job.done.done():
                        job.done.cancel()
                    raise
                if not job.done.done():
                    job.done.cancel()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if not job.done.done():
                    job.done.set_exception(exc)
            else:
                if not job.done.done():
                    job.done.set_result(result)
            finally:
                self._busy -= 1
                self._busy_gauge.set(self._busy)

    def _leave(self, job: _Job) -> None:
        """``job``'s wait ended before a worker took it (its timeout, its caller gone): out of the queue now, its
        place free for the next item."""
        job.abandoned = True
        try:
            self._items.remove(job)
        except ValueError:  # a worker took it, or stop() emptied the queue
            return
        self._depth_gauge.set(len(self._items))

    def _waited(self, job: _Job, outcome: str) -> float:
        """``job``'s wait ended with ``outcome`` (one of ``QUEUE_WAIT_OUTCOMES``): observed in
        ``switchyard_queue_wait_seconds`` unless an outcome was already observed for it; returns the wait, s."""
        wait = time.monotonic() - job.enqueued_at
        if not job.waited:
            job.waited = True
            self._wait_histograms[outcome].observe(wait)
        return wait


class Ticket(Generic[T]):
    """A submitted item: its queue position at submit time, and its result."""

    def __init__(self, queue: WorkQueue, job: _Job[T], position: int) -> None:
        self.queue = queue
        self.position = position
        self._job = job

    async def result(self) -> tuple[T, float]:
        """Wait for the item to start (at most timeout_ms) and finish.

        Returns (result, seconds waited in the queue). Cancelling the caller
        cancels the item's coroutine.
        """
        job, queue = self._job, self.queue
        timeout = queue.config.timeout_ms / 1000
        try:
            wait = await asyncio.wait_for(asyncio.shield(job.started), timeout)
        except asyncio.TimeoutError:
            queue._leave(job)
            queue.rejected["timeout"].inc()
            raise QueueTimeoutError(queue.name, queue._waited(job, "expired"), queue.config.timeout_ms) from None
        except asyncio.CancelledError:
            queue._leave(job)
            queue._waited(job, "cancelled")  # its caller left while it waited (or the queue stopped: observed there)
            raise
        try:
            return await asyncio.shield(job.done), wait
        except asyncio.CancelledError:
            if job.task is not None and not job.task.done():
                job.task.cancel()
            raise
