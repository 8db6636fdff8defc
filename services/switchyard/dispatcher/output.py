"""The output side of one dispatcher request: what its GenerateStream session sends to the caller.

A :class:`~switchyard.dispatcher.request.Request` is request state: the
scheduler writes it from each engine step's result (engines only read it).
Each request owns one :class:`OutputStream`; the engine loop (step or stream) pushes onto it the
outputs the scheduler reports after each step
(:meth:`~switchyard.dispatcher.request.RequestOutput.publish`: tokens, tool
calls, then ``done`` or ``error``) and the session that carries the request
(:mod:`switchyard.dispatcher.generate_stream`, which serves Generate too) is
its one reader. vLLM splits the same way: its engine-core ``Request`` holds
state, and a per-request ``RequestOutputCollector`` carries outputs to the
``generate`` caller.

A stream carries, in order: :class:`StreamToken` and :class:`StreamToolCall`
items, then exactly one :class:`StreamDone` or :class:`StreamError`. The reader
takes what is waiting with :meth:`OutputStream.drain` when :attr:`~OutputStream.listener`
says something came (and what); tokens waiting together are merged by :func:`coalesce`
(the one rule, :func:`switchyard.common.coalescing.merge_tokens`): a reader that
falls behind the engine catches up with one message, not one per token, and a
reader that keeps up sees every token alone, with no added wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from switchyard.common import coalescing

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


def _token_of(item: OutputItem) -> StreamToken | None:
    return item if isinstance(item, StreamToken) else None


def coalesce(items: list[OutputItem]) -> list[OutputItem]:
    """``items`` with every run of consecutive tokens merged into one :class:`StreamToken`
    (:func:`switchyard.common.coalescing.merge_tokens`)."""
    return coalescing.coalesce(items, _token_of, StreamToken)


class OutputStream:
    """One request's items on their way to its caller: an unbounded FIFO, one writer, one reader.

    Writes never block (the engine loop must not wait on a slow caller). The
    reader sets :attr:`listener`, called after every push with the item pushed,
    and takes the items with :meth:`drain`. Used from the event loop's thread only.
    """

    __slots__ = ("_items", "listener")

    def __init__(self) -> None:
        self._items: list[OutputItem] = []
        self.listener: Callable[[OutputItem], None] | None = None

    def _put(self, item: OutputItem) -> None:
        self._items.append(item)
        if self.listener is not None:
            self.listener(item)

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

    def drain(self) -> list[OutputItem]:
        """Every item pushed and not yet read, oldest first, one per push, without waiting (empty when none)."""
        items = self._items
        self._items = []
        return items
