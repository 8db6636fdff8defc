"""Agents waiting on a tool: no running slot, prefix state kept warm for a TTL.

A ``react_loop`` agent alternates thinking on the GPU with tool calls that
leave the GPU idle (under 30 % of a 7B agent's task time is GPU time, per the
field report in docs/architecture.md). While it waits on a tool it holds no running slot;
its prefix state (KV cache) stays in engine memory for ``tool_wait_ttl_s`` so
that its next step, which repeats that prefix, skips recomputing it (the
tool-call TTL of Continuum, Li et al. 2025). When the TTL runs out, or the HBM
budget needs the room (lowest value first, :mod:`switchyard.dispatcher.tiers.value`),
the state leaves HBM: to the DRAM tier when a swap is cheaper than recomputing
it (``demote``), else it is dropped and the next step recomputes the prefix.

Expiry is checked at every scheduling decision, before admission, so expired
state is always gone before new work is admitted; on an idle engine it is
released at the next decision.

When the agent's next step arrives and finds its state warm (:meth:`ParkedAgents.take`), the parked step is
handed over to it (:class:`Handover`): out of the parked set, still holding its KV (counted in
:attr:`ParkedAgents.kv_bytes`) until the new step starts or leaves. The parking is the one record of that link,
keyed by the new step (:meth:`ParkedAgents.handover`); the scheduler keeps none of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler.base import SchedulerCounters

COLD_PREFIX_MEMORY = 10_000
"""Agents whose released prefix (length, and whether DRAM holds it) is remembered for their resume."""


@dataclass
class ParkedAgent:
    """One agent waiting on a tool: its last request, since when, and the bytes held."""

    req: Request
    since: float
    bytes_of: Callable[[Request], int] = field(repr=False)
    """The engine's count of a request's KV bytes (``kv.kv_bytes``): the one owner of them."""
    ttl_s: float | None = None
    """This agent's own time-to-live, set by its tool-wait decision (None: the parking's ``ttl_s``)."""

    @property
    def kv_bytes(self) -> int:
        """Bytes the engine holds for its step now, read from the engine (compaction may have cut them since it
        parked; a copy kept here went on counting the bytes freed)."""
        return int(self.bytes_of(self.req))


@dataclass(frozen=True)
class Resumed:
    """How a resuming agent's prefix state was found.

    ``warm``: the state was still held in HBM, now being handed over to the resuming step (:class:`Handover`);
    ``prefix_tokens``: the prefix it covers (warm, or in DRAM) or that must be recomputed (cold, 0 when
    unknown); ``in_dram``: not warm, but a copy went to the DRAM tier.
    """

    warm: bool
    prefix_tokens: int
    in_dram: bool = False


@dataclass
class Handover:
    """A warm parked step being handed over to its agent's next step (:meth:`ParkedAgents.take`): the parked
    step keeps its KV, counted in :attr:`ParkedAgents.kv_bytes`, until the new step starts running or leaves
    (:meth:`ParkedAgents.end_handover`), or the state is moved out for room (:meth:`ParkedAgents.cool_handover`)."""

    entry: ParkedAgent
    held_until: float = 0.0
    """Until when (monotonic seconds) the prefix, held in HBM for this turn by its tool-wait decision (kept, or
    restored ahead of the tool's return), is moved out only for core work or a head with no running work to
    wait for (``scheduler.tool_wait_turn_hold_s`` after the turn; 0: not held)."""

    @property
    def parked(self) -> Request:
        """The parked step whose warm prefix is handed over."""
        return self.entry.req

    @property
    def kv_bytes(self) -> int:
        """Bytes the parked step's state holds, read from the engine."""
        return self.entry.kv_bytes


class ParkedAgents:
    """The parked agents, by their task's ``program_key`` (``Request.program_key``: one agent may run several tasks).

    Args:
        ttl_s: seconds a parked agent's prefix state is kept (``tool_wait_ttl_s``).
        release: drops a request's prefix state in the engine (:func:`.update.release_kv` over the engine's KV
            manager: ``kv.free``).
        kv_bytes: bytes the engine holds for a request (``kv.kv_bytes``).
        demote: called with a request whose state leaves HBM, before it is
            released; True when it copied the state to the DRAM tier.
        counters: where the agents whose state left HBM are counted (``tool_wait_expired``: the TTL ran
            out, ``parked_evicted``: to make room); default counters of its own.
    """

    def __init__(self, ttl_s: float, release: Callable[[Request], None], kv_bytes: Callable[[Request], int],
                 demote: Callable[[Request], bool] = lambda req: False,
                 counters: SchedulerCounters | None = None) -> None:
        self.ttl_s = ttl_s
        self._release = release
        self._kv_bytes = kv_bytes
        self._demote = demote
        self._parked: OrderedDict[str, ParkedAgent] = OrderedDict()
        self._handovers: dict[Request, Handover] = {}
        """Warm parked steps being handed over (:meth:`take`), by the resuming step that takes them over: the one
        record of the link; the parked step holds its KV, counted in :attr:`kv_bytes`, until the resuming step
        starts or leaves (:meth:`end_handover`)."""
        self._cold: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        """Tasks whose parked state left HBM, by ``program_key``: (prefix tokens, whether DRAM holds a copy), what
        their next step finds (:meth:`take`); written by :meth:`_remember_cold` alone."""
        self.counters = counters if counters is not None else SchedulerCounters()

    def park(self, req: Request, now: float) -> None:
        """Keep ``req``'s prefix state warm; an older parked step of the same agent is released."""
        old = self._parked.pop(req.program_key, None)
        if old is not None and old.req is not req:
            self._release(old.req)
        self._cold.pop(req.program_key, None)
        self._parked[req.program_key] = ParkedAgent(req, now, self._kv_bytes)

    def take(self, program_key: str, now: float, taker: Request) -> Resumed:
        """The agent is back with its next step ``taker``: hand its prefix state over (warm) or report it lost (cold).

        A warm agent leaves the parked set, no longer evicted or expired; its old request keeps the state,
        still counted in :attr:`kv_bytes`, until ``taker`` starts running or leaves (:meth:`end_handover`).
        """
        entry = self._parked.pop(program_key, None)
        if entry is not None and now - entry.since > self._ttl(entry):
            self._expire(program_key, entry)
            entry = None
        if entry is None:
            tokens, in_dram = self._cold.pop(program_key, (0, False))
            return Resumed(False, tokens, in_dram=in_dram)
        self._handovers[taker] = Handover(entry)
        return Resumed(True, entry.req.num_computed_tokens)

    def handover(self, taker: Request) -> Handover | None:
        """The warm prefix being handed over to ``taker`` (None: none)."""
        return self._handovers.get(taker)

    def handed_over_bytes(self, taker: Request) -> int:
        """Bytes of the warm prefix being handed over to ``taker`` (its agent's parked step's, read from the engine),
        which become its own when it starts; 0 when it takes none over (the KV budget's ``taken_over``)."""
        handover = self._handovers.get(taker)
        return handover.kv_bytes if handover is not None else 0

    def hold_handover(self, taker: Request, until: float) -> None:
        """The prefix handed over to ``taker`` was held for this turn by its tool-wait decision: keep it for the
        turn until ``until`` (monotonic seconds; :attr:`Handover.held_until`)."""
        self._handovers[taker].held_until = until

    def cool_handover(self, taker: Request) -> bool:
        """The state being handed over to ``taker`` leaves HBM to make room (to DRAM where the ``demote`` callback
        copies it, else dropped; counted as evicted); True when a copy went to DRAM. ``taker`` then has none."""
        handover = self._handovers.pop(taker, None)
        if handover is None:
            return False
        in_dram = self._demote(handover.parked)
        self._release(handover.parked)
        self.counters.parked_evicted += 1
        return in_dram

    def end_handover(self, taker: Request) -> None:
        """``taker``, which took a warm state over (:meth:`take`), started, the state now its own, or left:
        release the parked step that held it (nothing when ``taker`` took none over)."""
        handover = self._handovers.pop(taker, None)
        if handover is not None:
            self._release(handover.parked)

    def expire(self, now: float) -> list[Request]:
        """Release every agent parked longer than the TTL; returns their requests."""
        expired = [(agent, entry) for agent, entry in self._parked.items() if now - entry.since > self._ttl(entry)]
        for agent, entry in expired:
            del self._parked[agent]
            self._expire(agent, entry)
        return [entry.req for _, entry in expired]

    def evict_lowest(self, value: Callable[[ParkedAgent], float], below: float = float("inf")) -> Request | None:
        """Move the lowest-valued parked agent's state out of HBM to make room; returns its request.

        Only an agent valued below ``below`` is taken (None when there is none).
        Its next step restores the prefix from DRAM, or recomputes it.
        """
        scored = [(value(entry), agent) for agent, entry in self._parked.items()]
        if not scored:
            return None
        lowest, agent = min(scored, key=lambda item: item[0])
        if lowest >= below:
            return None
        entry = self._parked.pop(agent)
        self._expire(agent, entry, evicted=True)
        return entry.req

    def entry(self, program_key: str) -> ParkedAgent | None:
        """The agent's parked entry (None when it is not parked)."""
        return self._parked.get(program_key)

    def keep_for(self, program_key: str, ttl_s: float) -> bool:
        """Keep the agent's state warm ``ttl_s`` seconds from when it parked (a tool-wait decision); True when parked."""
        entry = self._parked.get(program_key)
        if entry is None:
            return False
        entry.ttl_s = max(0.0, ttl_s)
        return True

    def move_out(self, program_key: str, demote: bool, copy: Callable[[Request], bool] | None = None) -> bool:
        """Take the agent's state out of HBM now (a tool-wait decision): to DRAM when ``demote`` (and ``copy``,
        default the ``demote`` callback, manages it), else dropped; True when a copy went to DRAM (False:
        dropped, or not parked)."""
        entry = self._parked.pop(program_key, None)
        if entry is None:
            return False
        tokens = entry.req.num_computed_tokens
        in_dram = (copy or self._demote)(entry.req) if demote else False
        self._release(entry.req)
        self._remember_cold(program_key, tokens, in_dram)
        return in_dram

    def forget(self, program_key: str) -> bool:
        """The agent's task ended here (its next step was refused): its parked state is released, not kept
        or demoted for a turn that will not come, and its cold prefix forgotten; True when it was parked."""
        self._cold.pop(program_key, None)
        entry = self._parked.pop(program_key, None)
        if entry is None:
            return False
        self._release(entry.req)
        return True

    def _ttl(self, entry: ParkedAgent) -> float:
        return self.ttl_s if entry.ttl_s is None else entry.ttl_s

    @property
    def entries(self) -> list[ParkedAgent]:
        """Parked agents, oldest first."""
        return list(self._parked.values())

    @property
    def requests(self) -> list[Request]:
        """Parked requests, oldest first."""
        return [entry.req for entry in self._parked.values()]

    @property
    def kv_bytes(self) -> int:
        """Bytes of prefix state held for parked agents, those being handed over to their next step included."""
        return (sum(entry.kv_bytes for entry in self._parked.values())
                + sum(handover.kv_bytes for handover in self._handovers.values()))

    def _expire(self, program_key: str, entry: ParkedAgent, evicted: bool = False) -> None:
        tokens = entry.req.num_computed_tokens
        in_dram = self._demote(entry.req)
        self._release(entry.req)
        if evicted:
            self.counters.parked_evicted += 1
        else:
            self.counters.tool_wait_expired += 1
        self._remember_cold(program_key, tokens, in_dram)

    def _remember_cold(self, program_key: str, tokens: int, in_dram: bool) -> None:
        """The task's state left HBM: remember its prefix length (``tokens``) and whether DRAM holds a copy
        (``in_dram``) for its resume (:meth:`take`), the oldest forgotten past :data:`COLD_PREFIX_MEMORY`."""
        self._cold[program_key] = (tokens, in_dram)
        while len(self._cold) > COLD_PREFIX_MEMORY:
            self._cold.popitem(last=False)

