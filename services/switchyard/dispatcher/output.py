"""The output side of one dispatcher request: what its Generate handler streams to the caller.

A :class:`~switchyard.dispatcher.request.Request` is request state: the
scheduler and the engines read and write it. Each request owns one
:class:`OutputStream`; the request pushes onto it as the engine generates
(:meth:`~switchyard.dispatcher.request.Request.append_token`, ``add_tool_call``,
``finish``, ``fail``) and the Generate handler is its one reader. vLLM splits
the same way: its engine-core ``Request`` holds state, and a per-request
``RequestOutputCollector`` carries outputs to the ``generate`` caller.

A stream carries, in order: :class:`StreamToken` and :class:`StreamToolCall`
items, then exactly one :class:`StreamDone` or :class:`StreamError`. Tokens
that are waiting together when the reader comes back are read as one
:class:`StreamToken` (vLLM's collector merges delta outputs the same way): a
handler that falls behind the engine catches up with one message, not one per
token, and a reader that keeps up sees every token alone, with no added wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from switchyard.common.coalescing import CoalescingQueue

if TYPE_CHECKING:
    from switchyard.dispatcher.request import ToolCall


@dataclass(frozen=True)
class StreamToken:
    """Output item: ``count`` completion tokens (their texts joined); ``index`` is the first one's 0-based position."""

    text: str
    index: int
    count: int = 1


@dataclass(frozen=True)
class StreamToolCall:
    """Output item: one tool call."""

    call: ToolCall


@dataclass(frozen=True)
class StreamDone:
    """Output item: the request finished with ``finish_reason``; nothing follows."""

    finish_reason: str


@dataclass(frozen=True)
class StreamError:
    """Output item: the request failed; ``error`` is raised to the caller; nothing follows."""

    error: BaseException


OutputItem = Union[StreamToken, StreamToolCall, StreamDone, StreamError]


def _merge_tokens(run: list[OutputItem]) -> OutputItem:
    first = run[0]
    assert isinstance(first, StreamToken)
    return StreamToken("".join(t.text for t in run), first.index, sum(t.count for t in run))  # type: ignore[union-attr]


def _is_token(item: OutputItem) -> bool:
    return isinstance(item, StreamToken)


def coalesce(items: list[OutputItem]) -> list[OutputItem]:
    """``items`` with every run of consecutive tokens merged into one :class:`StreamToken`."""
    if len(items) < 2:
        return items
    out: list[OutputItem] = []
    run: list[OutputItem] = []
    for item in items:
        if isinstance(item, StreamToken):
            run.append(item)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else _merge_tokens(run))
            run = []
        out.append(item)
    if run:
        out.append(run[0] if len(run) == 1 else _merge_tokens(run))
    return out


class OutputStream:
    """One request's items on their way to its caller: an unbounded FIFO, one writer, one reader.

    Writes never block (the engine loop must not wait on a slow caller). A
    Generate handler awaits :meth:`get`, which merges the tokens waiting
    together (:class:`~switchyard.common.coalescing.CoalescingQueue`); a
    GenerateStream session (:mod:`switchyard.dispatcher.generate_stream`) sets
    :attr:`listener`, called after every push, and takes the items with
    :meth:`drain`. Used from the event loop's thread only.
    """

    __slots__ = ("_items", "listener")

    def __init__(self) -> None:
        self._items: CoalescingQueue[OutputItem] = CoalescingQueue(_is_token, _merge_tokens)
        self.listener: Callable[[], None] | None = None

    def _put(self, item: OutputItem) -> None:
        self._items.put(item)
        if self.listener is not None:
            self.listener()

    def token(self, text: str, index: int) -> None:
        """Push one completion token (``index``: its 0-based position in the completion)."""
        self._put(StreamToken(text, index))

    def tool_call(self, call: ToolCall) -> None:
        """Push one tool call."""
        self._put(StreamToolCall(call))

    def done(self, finish_reason: str) -> None:
        """Close the stream: the request finished with ``finish_reason``."""
        self._put(StreamDone(finish_reason))

    def error(self, error: BaseException) -> None:
        """Close the stream: the request failed with ``error``."""
        self._put(StreamError(error))

    def pending(self) -> bool:
        """Whether items were pushed and not yet read."""
        return bool(self._items)

    async def get(self) -> OutputItem:
        """The next item, waiting until there is one.

        Consecutive tokens already waiting come as one :class:`StreamToken`
        (texts joined, ``count`` tokens, ``index`` of the first); other items
        come one at a time, in order.
        """
        item = await self._items.get()
        assert item is not None  # never closed: the stream ends with StreamDone or StreamError
        return item

    def drain(self) -> list[OutputItem]:
        """Every item pushed and not yet read, oldest first, one per push, without waiting (empty when none)."""
        return self._items.drain()
