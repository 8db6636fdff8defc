"""Agent affinity: consistent hashing with bounded loads.

An agent's requests should reach the dispatcher replica that holds its warm
state (the KV of its earlier turns, kept while it waits on a tool). Plain
consistent hashing sends an agent to the first replica clockwise from its hash
on a ring of virtual nodes, which keeps agents in place when replicas come and
go (only the agents of a replica that leaves move) but balances load only as
well as the hash spreads it. Consistent hashing with bounded loads (Mirrokni,
Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018)
caps every replica at ``ceil(balance * (m + 1) / n)`` agents, for m agents
placed and n replicas: an agent whose replica is full walks on clockwise to the
first one that is not, so no replica holds more than ``balance`` times the
mean. Here the cap is rounded down where that still leaves room for every
agent (``max(ceil(x), floor(balance * x))`` with ``x = (m + 1) / n``), so that
max/mean stays within ``balance`` itself once the mean is a few agents.

Placement is sticky: an agent placed on a replica stays there while it is
active (``assign`` returns the same replica until ``release``, or until it has
been idle ``idle_s`` seconds under :meth:`BoundedLoadRing.expire`). It moves
only when its replica leaves. The same class routes the orchestrator's
dispatcher calls (:mod:`switchyard.orchestrator.clients`) and runs in
``switchyard bench route`` (:mod:`switchyard.bench.route`).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from typing import Iterable

DEFAULT_VNODES = 100
"""Virtual nodes per replica: the spread of ring arcs shrinks as 1/sqrt(vnodes)."""
DEFAULT_BALANCE = 1.2
"""The bound on max/mean load at placement (the paper's 1 + epsilon). Agents that leave unevenly lift the
measured max/mean a little above it (``switchyard bench route``: 1.217 on average, 1.245 at worst, for 100
replicas and 10,000 agents), so 1.2 keeps it within the 1.25 target."""


def hash64(text: str) -> int:
    """A stable 64-bit hash of ``text`` (BLAKE2b; the same in every process, unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class BoundedLoadRing:
    """Consistent hashing with bounded loads over named replicas.

    Args:
        replicas: replica names (addresses), any order.
        vnodes: points per replica on the ring.
        balance: the load bound, > 1 (max agents on one replica <= ceil(balance x mean)).

    Raises:
        ValueError: ``vnodes`` < 1 or ``balance`` <= 1.
    """

    def __init__(self, replicas: Iterable[str] = (), vnodes: int = DEFAULT_VNODES,
                 balance: float = DEFAULT_BALANCE) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes: expected >= 1, got {vnodes}")
        if balance <= 1:
            raise ValueError(f"balance: expected > 1 (the bound on max/mean load), got {balance}")
        self.vnodes, self.balance = vnodes, balance
        self._points: list[int] = []
        self._owners: list[str] = []
        self.loads: dict[str, int] = {}
        """Agents placed on each replica."""
        self.placed: OrderedDict[str, str] = OrderedDict()
        """Agent -> replica, least recently used first."""
        self._last_used: dict[str, float] = {}
        for replica in replicas:
            self.add(replica)

    # ------------------------------------------------------------------ replicas

    @property
    def replicas(self) -> list[str]:
        """The replicas on the ring, sorted."""
        return sorted(self.loads)

    def _rebuild(self) -> None:
        points = sorted((hash64(f"{replica}#{i}"), replica) for replica in self.loads for i in range(self.vnodes))
        self._points = [p for p, _ in points]
        self._owners = [r for _, r in points]

    def add(self, replica: str) -> None:
        """Put ``replica`` on the ring (no agent moves: placement is sticky; new agents fill it first)."""
        if replica in self.loads:
            return
        self.loads[replica] = 0
        self._rebuild()

    def remove(self, replica: str) -> list[str]:
        """Take ``replica`` off the ring; returns its agents, which are unplaced (their next ``assign`` places them)."""
        if replica not in self.loads:
            return []
        moved = [agent for agent, where in self.placed.items() if where == replica]
        for agent in moved:
            self._forget(agent)
        del self.loads[replica]
        self._rebuild()
        return moved

    # ------------------------------------------------------------------ agents

    def capacity(self) -> int:
        """Most agents one replica may hold when one more is placed: ``max(ceil(x), floor(balance x x))``
        for ``x = (m + 1) / n`` (the paper's ``ceil(balance x x)``, rounded down where that leaves room)."""
        if not self.loads:
            return 0
        x = (len(self.placed) + 1) / len(self.loads)
        return max(math.ceil(x), math.floor(self.balance * x))

    def preferred(self, agent: str) -> str:
        """The replica plain consistent hashing gives ``agent`` (first point clockwise), loads ignored.

        Raises:
            LookupError: no replica on the ring.
        """
        if not self._points:
            raise LookupError("no replica on the ring")
        i = bisect.bisect(self._points, hash64(agent)) % len(self._points)
        return self._owners[i]

    def assign(self, agent: str, now: float = 0.0, exclude: frozenset[str] = frozenset()) -> str:
        """The replica for ``agent``'s next request: where it is placed, else the first replica clockwise
        from its hash with room under :meth:`capacity` (not in ``exclude``), where it is then placed.

        ``now`` (seconds, any clock) marks the agent used, for :meth:`expire`. An agent placed on an
        excluded replica is moved.

        Raises:
            LookupError: no replica on the ring, or all are excluded.
        """
        where = self.placed.get(agent)
        if where is not None and where not in exclude:
            self.placed.move_to_end(agent)
            self._last_used[agent] = now
            return where
        if where is not None:
            self._forget(agent)
        if not self._points:
            raise LookupError("no replica on the ring")
        cap = self.capacity()
        n = len(self._points)
        start = bisect.bisect(self._points, hash64(agent))
        fallback = None
        for step in range(n):
            replica = self._owners[(start + step) % n]
            if replica in exclude:
                continue
            if self.loads[replica] < cap:
                return self._place(agent, replica, now)
            fallback = fallback or replica
        if fallback is None:
            raise LookupError(f"every replica is excluded ({len(exclude)})")
        return self._place(agent, fallback, now)  # only when exclusions leave no room under the cap

    def release(self, agent: str) -> None:
        """``agent`` is done (its session ended): it no longer counts on its replica."""
        if agent in self.placed:
            self._forget(agent)

    def expire(self, now: float, idle_s: float) -> int:
        """Release agents not used for ``idle_s`` seconds before ``now``; returns how many."""
        released = 0
        while self.placed:
            agent = next(iter(self.placed))
            if now - self._last_used.get(agent, now) < idle_s:
                break
            self._forget(agent)
            released += 1
        return released

    def _place(self, agent: str, replica: str, now: float) -> str:
        self.placed[agent] = replica
        self._last_used[agent] = now
        self.loads[replica] += 1
        return replica

    def _forget(self, agent: str) -> None:
        replica = self.placed.pop(agent)
        self._last_used.pop(agent, None)
        if replica in self.loads:
            self.loads[replica] -= 1
