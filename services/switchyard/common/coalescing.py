"""The one token-merge rule, and a one-writer, one-reader stream whose reader catches up in one read.

Token streams cross two hops (the dispatcher's GenerateStream, the
orchestrator's RunTask stream), and each message costs a write, a system call
and a read. When a reader falls behind its writer, the tokens waiting for it
are worth one message, not one each: they are handed over merged, as vLLM's
per-request output collector merges delta outputs that its consumer has not
picked up yet. A reader that keeps up gets every item as it was put, with no
added wait.

:func:`merge_tokens` is the rule, for every hop: a run of consecutive tokens
becomes one token whose text is the run's texts joined in order, whose
``index`` is the first one's, and whose ``count`` is the sum of the run's
counts (a count of 0 is one token, as :class:`~agent_pb2.TokenEvent` says).
:func:`coalesce` applies it to a list (the dispatcher's output items, read
per engine step); :class:`CoalescingQueue` applies it as its reader comes
back (the orchestrator's task events).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Generic, Protocol, Sequence, TypeVar

T = TypeVar("T")


class Token(Protocol):
    """What the merge rule reads of a token: ``text``, ``index`` (0-based position of its first
    token in the completion) and ``count`` (tokens in ``text``; 0 means one)."""

    @property
    def text(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def count(self) -> int: ...


def merge_tokens(run: Sequence[Token]) -> tuple[str, int, int]:
    """``(text, index, count)`` of the one token that stands for ``run`` (consecutive tokens, oldest
    first, at least one): the texts joined, the first one's index, the counts summed (0 counts as 1)."""
    return "".join(t.text for t in run), run[0].index, sum(t.count or 1 for t in run)


TokenOf = Callable[[T], "Token | None"]
"""An item's token, or None when the item is not a token (a tool call, the end of the stream)."""

MakeToken = Callable[[str, int, int], T]
"""The item that carries ``(text, index, count)``."""


def coalesce(items: list[T], token_of: TokenOf[T], make_token: MakeToken[T]) -> list[T]:
    """``items`` in order, every run of two or more consecutive tokens merged by :func:`merge_tokens`."""
    if len(items) < 2:
        return items
    out: list[T] = []
    run: list[Token] = []
    first: T | None = None
    for item in items:
        token = token_of(item)
        if token is not None:
            if not run:
                first = item
            run.append(token)
            continue
        if run:
            out.append(first if len(run) == 1 else make_token(*merge_tokens(run)))  # type: ignore[arg-type]
            run = []
        out.append(item)
    if run:
        out.append(first if len(run) == 1 else make_token(*merge_tokens(run)))  # type: ignore[arg-type]
    return out


class CoalescingQueue(Generic[T]):
    """An unbounded FIFO used from the event loop's thread: :meth:`put` never blocks, :meth:`get` waits.

    Args:
        token_of: an item's token, None for other items (see :data:`TokenOf`).
        make_token: the item that carries a merged token (see :data:`MakeToken`).
    """

    __slots__ = ("_items", "_ready", "_closed", "_token_of", "_make_token", "_holding")

    def __init__(self, token_of: TokenOf[T], make_token: MakeToken[T]) -> None:
        self._items: deque[T] = deque()
        self._ready = Wakeup()
        self._closed = False
        self._token_of = token_of
        self._make_token = make_token
        self._holding = False  # get() holds tokens back: only an item that is not a token wakes it

    def put(self, item: T) -> None:
        """Append ``item``."""
        self._items.append(item)
        if not self._holding or self._token_of(item) is None:
            self._ready.notify()

    def close(self) -> None:
        """Nothing follows: :meth:`get` answers None once the items put are read."""
        self._closed = True
        self._ready.notify()

    async def get(self, hold_tokens_until: float | None = None) -> T | None:
        """The next item, waiting until there is one; a run of tokens already waiting comes merged
        (:func:`merge_tokens`). None once the queue is closed and empty.

        Args:
            hold_tokens_until: when the items waiting are all tokens, keep gathering tokens until this
                time (the event loop's clock, seconds), to hand them over merged; an item that is not a
                token, or :meth:`close`, ends the wait. None: hand over at once.
        """
        while not self._items:
            if self._closed:
                return None
            await self._ready.wait()
        items, token_of = self._items, self._token_of
        if hold_tokens_until is not None:
            loop = asyncio.get_running_loop()
            while not self._closed and token_of(items[-1]) is not None and (wait := hold_tokens_until - loop.time()) > 0:
                handle = loop.call_later(wait, self._ready.notify)
                self._holding = True
                try:
                    await self._ready.wait()
                finally:
                    self._holding = False
                    handle.cancel()
        item = items.popleft()
        if not items:
            return item
        token = token_of(item)
        if token is None or token_of(items[0]) is None:
            return item
        run = [token]
        while items and (next_token := token_of(items[0])) is not None:
            items.popleft()
            run.append(next_token)
        return self._make_token(*merge_tokens(run))

    def __len__(self) -> int:
        """Items put and not yet read."""
        return len(self._items)


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
