"""The events of one RunTask on their way to its caller, in the order the task emits them.

The task writes (never blocking: a slow caller must not hold up the workflow)
and the RunTask handler is the one reader. Token events waiting together when
the handler comes back are read as one event (texts joined, ``count`` tokens,
``index`` of the first): see :mod:`switchyard.common.coalescing`.
"""

from __future__ import annotations

from switchyard.api import agent_pb2
from switchyard.common.coalescing import CoalescingQueue


def _is_token(event: agent_pb2.TaskEvent) -> bool:
    return event.HasField("token")


def _merge_tokens(run: list[agent_pb2.TaskEvent]) -> agent_pb2.TaskEvent:
    first = run[0].token
    return agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(
        text="".join(e.token.text for e in run), index=first.index, count=sum(max(1, e.token.count) for e in run)))


def event_stream() -> CoalescingQueue[agent_pb2.TaskEvent]:
    """A task's event stream: ``put`` each event, ``close`` at the end; ``get`` answers None after the last."""
    return CoalescingQueue(_is_token, _merge_tokens)
