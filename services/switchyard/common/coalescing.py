"""A one-writer, one-reader stream whose reader catches up in one read.

Token streams cross two hops (the dispatcher's Generate stream, the
orchestrator's RunTask stream), and each message costs a write, a system call
and a read. When a reader falls behind its writer, the tokens waiting for it
are worth one message, not one each: :class:`CoalescingQueue` hands them over
merged, as vLLM's per-request output collector merges delta outputs that its
consumer has not picked up yet. A reader that keeps up gets every item as it
was put, with no added wait.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class CoalescingQueue(Generic[T]):
    """An unbounded FIFO used from the event loop's thread: :meth:`put` never blocks, :meth:`get` waits.

    Args:
        mergeable: whether an item may be merged with its mergeable neighbours (a token, say).
        merge: the one item that stands for a run of two or more mergeable items, oldest first.
    """

    __slots__ = ("_items", "_ready", "_closed", "_mergeable", "_merge")

    def __init__(self, mergeable: Callable[[T], bool], merge: Callable[[list[T]], T]) -> None:
        self._items: deque[T] = deque()
        self._ready = Wakeup()
        self._closed = False
        self._mergeable = mergeable
        self._merge = merge

    def put(self, item: T) -> None:
        """Append ``item``."""
        self._items.append(item)
        self._ready.notify()

    def close(self) -> None:
        """Nothing follows: :meth:`get` answers None once the items put are read."""
        self._closed = True
        self._ready.notify()

    async def get(self) -> T | None:
        """The next item, waiting until there is one; a run of mergeable items already waiting comes merged.

        None once the queue is closed and empty.
        """
        while not self._items:
            if self._closed:
                return None
            await self._ready.wait()
        item = self._items.popleft()
        if not self._items or not self._mergeable(item) or not self._mergeable(self._items[0]):
            return item
        run = [item]
        while self._items and self._mergeable(self._items[0]):
            run.append(self._items.popleft())
        return self._merge(run)

    def __len__(self) -> int:
        """Items put and not yet read."""
        return len(self._items)

    def drain(self) -> list[T]:
        """Every item put and not yet read, oldest first, one per put, without waiting."""
        items = list(self._items)
        self._items.clear()
        return items


class Wakeup:
    """One task sleeping until another, on the same event loop, says something changed.

    :meth:`notify` wakes the task in :meth:`wait`, if one waits; a notify with no one waiting is not
    kept, so the waiter checks its condition before it waits (a loop: check, wait, check again).
    """

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """Wake the waiting task, if any."""
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        """Sleep until the next :meth:`notify`."""
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None
