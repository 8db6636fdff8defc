"""The output side of one dispatcher request: what its Generate handler streams to the caller.

A :class:`~switchyard.dispatcher.request.Request` is request state: the
scheduler and the engines read and write it. Each request owns one
:class:`OutputStream`; the request pushes onto it as the engine generates
(:meth:`~switchyard.dispatcher.request.Request.append_token`, ``add_tool_call``,
``finish``, ``fail``) and the Generate handler is its one reader. vLLM splits
the same way: its engine-core ``Request`` holds state, and a per-request
``RequestOutputCollector`` carries outputs to the ``generate`` caller.

A stream carries, in order: :class:`StreamToken` and :class:`StreamToolCall`
items, then exactly one :class:`StreamDone` or :class:`StreamError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from switchyard.dispatcher.request import ToolCall


@dataclass(frozen=True)
class StreamToken:
    """Output item: one completion token. ``index`` is its 0-based position."""

    text: str
    index: int


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


class OutputStream:
    """One request's items on their way to its Generate handler: an unbounded FIFO, one writer, one reader.

    Writes never block (the engine loop must not wait on a slow caller); the
    reader awaits :meth:`get`. Made without an event loop; the first
    :meth:`get` binds it to the running one.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: asyncio.Queue[OutputItem] = asyncio.Queue()

    def token(self, text: str, index: int) -> None:
        """Push one completion token (``index``: its 0-based position in the completion)."""
        self._items.put_nowait(StreamToken(text, index))

    def tool_call(self, call: ToolCall) -> None:
        """Push one tool call."""
        self._items.put_nowait(StreamToolCall(call))

    def done(self, finish_reason: str) -> None:
        """Close the stream: the request finished with ``finish_reason``."""
        self._items.put_nowait(StreamDone(finish_reason))

    def error(self, error: BaseException) -> None:
        """Close the stream: the request failed with ``error``."""
        self._items.put_nowait(StreamError(error))

    async def get(self) -> OutputItem:
        """The next item, waiting until there is one."""
        return await self._items.get()

    def drain(self) -> list[OutputItem]:
        """Every item pushed and not yet read, oldest first, without waiting (empty when none)."""
        items: list[OutputItem] = []
        while not self._items.empty():
            items.append(self._items.get_nowait())
        return items
