"""Reading token events: one event (TokenEvent, in RunTask or Generate) may carry several tokens.

A stream whose reader falls behind gets the tokens that were ready together in
one event (``count`` tokens, ``index`` of the first), so tests count tokens and
check positions through these helpers rather than counting events.
"""

from __future__ import annotations

from typing import Iterable

from switchyard.api import agent_pb2


def token_count(tokens: Iterable[agent_pb2.TokenEvent]) -> int:
    """Tokens carried by ``tokens`` (``count`` 0 means one, as older senders send)."""
    return sum(max(1, t.count) for t in tokens)


def positions_follow_on(tokens: Iterable[agent_pb2.TokenEvent]) -> bool:
    """True when the events cover positions 0, 1, 2, ... in order, with no gap or repeat."""
    expected = 0
    for t in tokens:
        if t.index != expected:
            return False
        expected += max(1, t.count)
    return True
