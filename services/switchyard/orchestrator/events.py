"""The events of one RunTask on their way to its caller, in the order the task emits them.

The task writes (never blocking: a slow caller must not hold up the workflow)
and the RunTask handler is the one reader. Token events waiting together when
the handler comes back are read as one event, by the one merge rule of
:func:`switchyard.common.coalescing.merge_tokens` (texts joined, ``count``
tokens, ``index`` of the first).
"""

from __future__ import annotations

from switchyard.api import agent_pb2
from switchyard.common.coalescing import CoalescingQueue


def _token_of(event: agent_pb2.TaskEvent) -> agent_pb2.TokenEvent | None:
    return event.token if event.HasField("token") else None


def _token_event(text: str, index: int, count: int) -> agent_pb2.TaskEvent:
    return agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=text, index=index, count=count))


def event_stream() -> CoalescingQueue[agent_pb2.TaskEvent]:
    """A task's event stream: ``put`` each event, ``close`` at the end; ``get`` answers None after the last."""
    return CoalescingQueue(_token_of, _token_event)
