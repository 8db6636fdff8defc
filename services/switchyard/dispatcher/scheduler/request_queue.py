"""The waiting queue of a scheduling policy: requests in the order the policy gives them.

Shape after vLLM's ``vllm/v1/core/sched/request_queue.py`` (a ``RequestQueue``
interface with an FCFS and a priority implementation). Here every queue is one
sorted structure, and a policy is nothing but its ordering key:

The contract, for every policy (the FIFO and priority ones below, and any other
that plugs in, such as fairness by attained service or least slack first):

- :meth:`RequestQueue.order_key` ``(req, now) -> tuple``: the sort key of
  ``req`` when it joins the queue at ``now`` (smallest first). It is computed
  when the request joins (arrival, or again after a preemption) and fixed while
  it waits, so the order is stable; ties keep the order the requests joined in.
  It may read the request (``arrival``, ``priority``, ``resume``, its
  output so far, its ``deadline``...), what its policy keeps (the fair policy's
  attained service per tenant and session, :class:`.fairness.FairnessLedger`)
  and the queue's own entries (:meth:`RequestQueue.keys`), and must not write
  anything.
- A policy whose order moves with time while requests wait (slack, aging
  re-evaluated) calls :meth:`RequestQueue.reorder` ``(now)`` at a decision: every
  key is computed again.

A request waits in at most one queue, at most once; the scheduler adds it
(``add``), takes the head (``peek`` / ``pop``), removes it when it leaves
otherwise (``remove``: ended, expired, admitted out of order for a reserved
slot), and reads it in order (iteration).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Callable, Iterator

from switchyard.dispatcher.request import Request

OrderKey = tuple[float, ...]
"""A waiting request's sort key: smallest first."""


class RequestQueue:
    """Waiting requests sorted by :meth:`order_key` (see the module docstring for the contract).

    Subclasses supply :meth:`order_key`; everything else is shared. Add, pop and remove are O(n) list
    operations on the sorted entries (a queue holds at most ``queues.inference.capacity`` requests).
    """

    name = "queue"

    def __init__(self) -> None:
        self._entries: list[tuple[OrderKey, Request]] = []
        self._seq = itertools.count()

    def order_key(self, req: Request, now: float) -> OrderKey:
        """The sort key of ``req`` joining at ``now`` (smallest first); see the module docstring."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the scheduler's calls

    def add(self, req: Request, now: float) -> None:
        """``req`` joins at its key's place (after every waiting request with the same key)."""
        key = (*self.order_key(req, now), float(next(self._seq)))
        bisect.insort(self._entries, (key, req), key=lambda entry: entry[0])

    def peek(self) -> Request:
        """The head (the next to admit). Raises IndexError when empty."""
        return self._entries[0][1]

    def pop(self) -> Request:
        """Take the head. Raises IndexError when empty."""
        return self._entries.pop(0)[1]

    def remove(self, req: Request) -> bool:
        """Take ``req`` out wherever it is; False when it does not wait here."""
        for i, (_, queued) in enumerate(self._entries):
            if queued is req:
                del self._entries[i]
                return True
        return False

    def remove_where(self, leaves: Callable[[Request], bool]) -> list[Request]:
        """Take out every request for which ``leaves(req)`` is true, in queue order; returns them."""
        gone = [req for _, req in self._entries if leaves(req)]
        if gone:
            out = set(map(id, gone))
            self._entries = [entry for entry in self._entries if id(entry[1]) not in out]
        return gone

    def reorder(self, now: float) -> None:
        """Compute every key again at ``now`` (for a policy whose order moves with time); ties keep the
        current order. One sort: O(n log n) after n :meth:`order_key` calls (an ``order_key`` reading
        :meth:`keys` sees the keys from before this call)."""
        entries = [((*self.order_key(req, now), float(next(self._seq))), req) for _, req in self._entries]
        entries.sort(key=lambda entry: entry[0])
        self._entries = entries

    def keys(self) -> Iterator[tuple[OrderKey, Request]]:
        """(key, request) in queue order: what an :meth:`order_key` may read of the queue."""
        return iter(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)


class FcfsQueue(RequestQueue):
    """First come, first served: ``order_key = (arrival,)``; a preempted request keeps its place."""

    name = "fcfs"

    def order_key(self, req: Request, now: float) -> OrderKey:
        return (req.arrival,)


_RESUMED, _NEW = 0.0, 1.0


class PriorityAgingQueue(RequestQueue):
    """Priority classes with linear aging (the ``priority`` policy's order; see
    :mod:`switchyard.dispatcher.scheduler.priority` for the rule and its bound).

    ``order_key = (virtual_arrival, 1)`` for new work, where ``virtual_arrival = arrival - head_start[class]``;
    a react_loop agent back from a tool (``resume``) gets ``(min(its virtual arrival, the smallest key of
    its class's waiting new work), 0)``: ahead of every waiting non-resumed request of its class.

    Args:
        head_start_s: seconds each class (core, normal, batch) is ordered ahead of its arrival.
    """

    name = "priority"

    def __init__(self, head_start_s: tuple[float, ...]) -> None:
        super().__init__()
        self.head_start_s = head_start_s

    def virtual_arrival(self, req: Request) -> float:
        """``req.arrival`` minus its class's head start (seconds, monotonic clock)."""
        return req.arrival - self.head_start_s[int(req.priority)]

    def order_key(self, req: Request, now: float) -> OrderKey:
        virtual = self.virtual_arrival(req)
        if not req.resume:
            return (virtual, _NEW)
        rank = req.priority
        class_heads = [key[0] for key, queued in self.keys() if queued.priority is rank and key[1] == _NEW]
        return (min([virtual, *class_heads]), _RESUMED)
