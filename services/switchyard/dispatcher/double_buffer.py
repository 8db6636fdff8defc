"""The double buffer: the scheduler's intake, filled while the engine works.

Two lists. Arrivals append to the active one while the engine runs a step (or
an upstream streams the current batch). At the step boundary the scheduler
swaps them: the whole active list joins the waiting set for the next step, and
the other list, now empty, starts filling. Intake therefore overlaps with the
model's work, and every arrival of one step joins the next one together.

When the buffer is swapped, and why (:class:`FlushReason`):

- ``IDLE``: the engine had nothing to do, so the first arrival is taken at
  once; nothing waits for an interval while the engine idles;
- ``STEP``: a step boundary (the batch that formed during the step);
- ``SIZE``: the active list reached ``max_batch_size`` mid-step;
- ``INTERVAL``: the first item has waited ``flush_interval_ms`` (the upper
  bound of the wait for a swap; ``"auto"`` computes it from arrivals);
- ``DRAIN``: the dispatcher is shutting down;
- ``PREEMPT``: mid-step, only the core requests leave the active list, to be
  prefilled at the running step's next layer boundary
  (``scheduler.core_preemption`` ``layer``); the rest stays for the step
  boundary.

The buffer itself is plain bookkeeping: it runs on the event loop thread, so a
swap is atomic without a lock. Its owner
(:class:`switchyard.dispatcher.scheduler.core.SchedulerCore`) decides when to
swap; the engine loop, which owns every timer, arms the interval timer from
:meth:`DoubleBuffer.deadline` (``SchedulerCore.flush_deadline``). Items
leave in exactly the order they were put: nothing is lost, duplicated or
reordered by a swap (nor by :meth:`DoubleBuffer.take`, which keeps the order
of what it takes and of what it leaves).
"""

from __future__ import annotations

import enum
from typing import Callable, Generic, Iterator, TypeVar

from switchyard.api import agent_pb2

T = TypeVar("T")


class FlushReason(enum.IntEnum):
    """Why a batch left the buffer; values match ``agent.FlushReason`` in the proto."""

    SIZE = agent_pb2.SIZE
    INTERVAL = agent_pb2.INTERVAL
    DRAIN = agent_pb2.DRAIN
    IDLE = agent_pb2.IDLE
    STEP = agent_pb2.STEP
    PREEMPT = agent_pb2.PREEMPT

    @property
    def label(self) -> str:
        """Lower-case name for metric labels: size, interval, drain, idle, step, preempt."""
        return self.name.lower()


FLUSH_REASON_LABELS: tuple[str, ...] = tuple(reason.label for reason in FlushReason)
"""Every value the ``reason`` label of ``switchyard_flushes_total`` takes."""


class DoubleBuffer(Generic[T]):
    """Two swapped lists: the active one fills, the swapped-out one is handed over.

    Args:
        max_batch_size: :meth:`put` reports the list full at this many items
            (``queue.json`` ``flush.max_batch_size``); >= 1.
        flush_interval_s: the longest an item waits for a swap, seconds
            (``flush.flush_interval_ms`` / 1000): a number, or a callable
            returning the value in force (read when the first item arrives).

    Raises:
        ValueError: max_batch_size < 1 or a fixed interval <= 0.
    """

    def __init__(self, max_batch_size: int, flush_interval_s: float | Callable[[], float]) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if callable(flush_interval_s):
            self._interval = flush_interval_s
        else:
            if flush_interval_s <= 0:
                raise ValueError(f"flush_interval_s: expected > 0, got {flush_interval_s}")
            fixed = float(flush_interval_s)
            self._interval = lambda: fixed
        self.max_batch_size = max_batch_size
        self._lists: tuple[list[T], list[T]] = ([], [])
        self._active = 0
        self._deadline: float | None = None
        self.closed = False
        """Set by :meth:`close`; the owner refuses new items from then on."""

    @property
    def active_size(self) -> int:
        """Items in the active (filling) list."""
        return len(self._lists[self._active])

    def __iter__(self) -> Iterator[T]:
        """The items of the active list, in put order (read them, do not hold on to the iterator)."""
        return iter(self._lists[self._active])

    def deadline(self) -> float | None:
        """When the oldest buffered item has waited the flush interval (``now`` clock); None when empty."""
        return self._deadline

    def put(self, item: T, now: float) -> bool:
        """Append ``item`` to the active list; True when the list is now full (swap it: SIZE).

        ``now`` is the caller's clock (``time.monotonic()``); the first item of
        a list fixes its :meth:`deadline`.
        """
        active = self._lists[self._active]
        active.append(item)
        if len(active) == 1:
            self._deadline = now + self._interval()
        return len(active) >= self.max_batch_size

    def swap(self) -> list[T]:
        """Hand over the active list (put order) and start filling the other one.

        The returned list is the buffer's own: read it before the next swap,
        which reuses it.
        """
        full = self._lists[self._active]
        self._active ^= 1
        self._lists[self._active].clear()
        self._deadline = None
        return full

    def take(self, wanted: Callable[[T], bool]) -> list[T]:
        """Hand over the items of the active list for which ``wanted`` is true (put order); the others stay,
        in their order, and the list's :meth:`deadline` stays that of its first item."""
        active = self._lists[self._active]
        taken: list[T] = []
        kept: list[T] = []
        for item in active:
            (taken if wanted(item) else kept).append(item)
        if taken:
            active[:] = kept
            if not active:
                self._deadline = None
        return taken

    def remove(self, item: T) -> bool:
        """Take ``item`` out of the active list (its request was cancelled); True when it was there."""
        active = self._lists[self._active]
        try:
            active.remove(item)
        except ValueError:
            return False
        if not active:
            self._deadline = None
        return True

    def close(self) -> None:
        """Mark the buffer closed; what it holds is still handed over by :meth:`swap` (DRAIN)."""
        self.closed = True
