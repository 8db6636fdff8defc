"""KV memory across an agent program's tool waits, and room for waiting work: the scheduler's memory half.

:class:`KvMemory` is a part of :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore` (its base class), kept
in its own module so that ``core.py`` reads as the request path (intake, decisions, preemption, the engine's
output, the end) in one pass, and this one as what happens to a request's KV state when it is not running:

- **tool waits** (:meth:`KvMemory.tool_wait`): at each tool start the orchestrator announces the expected wait,
  and the agent's parked KV is kept in HBM, swapped to the DRAM tier or dropped (:func:`.tool_wait.decide`);
  a swap plans the KV's return ahead of the tool's expected return (:meth:`KvMemory._prefetches`,
  :meth:`KvMemory.prefetched`, :meth:`KvMemory.until_prefetch`);
- **hand-over**: an agent's next step takes over its parked prefix (:meth:`KvMemory._resume_prefix`,
  :meth:`KvMemory._end_handover`), held for it against waiting work for ``tool_wait_turn_hold_s``
  (:meth:`KvMemory._cool_handovers`);
- **room**: before a waiting request is refused for KV memory, parked agents' state leaves HBM for it, lowest
  value first (:meth:`KvMemory._make_room`), to DRAM where a swap is cheaper than recomputing
  (:meth:`KvMemory._swap_out`); the periodic HBM scan evicts past ``emergency_evict_ratio`` and defragments
  (:meth:`KvMemory.hbm_scan`).

It keeps no state of its own: it reads and writes the core's (``parking``, ``tiers``, ``tool_waits``,
``kv_budget``, ``kv``, ``counters``, the running set and the waiting queue), declared below for the reader.
All times are ``time.monotonic()`` seconds, passed in as ``now``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.scheduler.parking import ParkedAgent
from switchyard.dispatcher.scheduler.tool_wait import (
    Decision,
    ToolWaitDecision,
    ToolWaitInputs,
    ToolWaitPlan,
    decide,
)
from switchyard.dispatcher.request import Request, RequestStatus, SchedulerOutput

if TYPE_CHECKING:
    from switchyard.common.config import MemoryTiersConfig, SchedulerConfig
    from switchyard.dispatcher.engines.base import KVCacheManager
    from switchyard.dispatcher.scheduler.base import SchedulerCounters, SchedulerEvents
    from switchyard.dispatcher.scheduler.capacity import Capacity, KvBudget
    from switchyard.dispatcher.scheduler.parking import ParkedAgents
    from switchyard.dispatcher.scheduler.request_queue import RequestQueue
    from switchyard.dispatcher.scheduler.tool_wait import ToolWaitPlans
    from switchyard.dispatcher.tiers import MemoryTiers

log = logging.getLogger(__name__)

PARKED = RequestStatus.PARKED


class KvMemory:
    """The memory half of :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore` (see the module
    docstring); the core's attributes it reads are declared here, set by the core's ``__init__``."""

    scheduler_config: SchedulerConfig  # the core's ``config.scheduler``
    memory: MemoryTiersConfig  # the core's ``config.memory``
    kv: KVCacheManager
    capacity: Capacity
    kv_budget: KvBudget | None  # a property of the core, read from capacity
    parking: ParkedAgents
    tiers: MemoryTiers
    tool_waits: ToolWaitPlans
    counters: SchedulerCounters
    queue: RequestQueue
    score: float
    _running: list[Request]
    _leaving: list[Request]
    _events: SchedulerEvents
    _now: float
    _next_hbm_scan: float
    _room_for: Request | None
    _announced: bool

    def tool_wait(self, program_key: str, expected_wait_s: float, now: float,
                  tool: str = "other") -> ToolWaitDecision | None:
        """The agent's tool call on ``tool`` starts: keep its parked KV in HBM, swap it to DRAM, or drop it, now.

        The choice is :func:`switchyard.dispatcher.scheduler.tool_wait.decide`'s, on the KV's bytes and
        tokens, the KV budget's use (running reservations and parked state), the DRAM tier's transfer
        seconds and the engine's recompute seconds (:class:`~switchyard.dispatcher.tiers.MemoryTiers`).
        KEEP holds the state until the decision's revisit time (``expected_wait_s`` plus as long again, a
        late tool's residual wait; with the tool's returns measured, their P95:
        :attr:`~switchyard.dispatcher.scheduler.tool_wait.ToolWaitDecision.revisit_at_s`); then the TTL's
        usual expiry moves it out. SWAP copies it to DRAM at once whenever a copy can be made (the decision
        priced it against recomputing; the eviction's own swap rule is not asked again; a copy that cannot be
        made drops the state, and the decision is then DROP, answered and counted as such) and plans its
        restore: due ``restore_at_s`` after now (``expected_wait_s - transfer - margin``;
        with the tool's returns measured, where the cost model lands it, or none ahead of the turn),
        handed to the loop by the decision at that time (``SchedulerOutput.prefetch``,
        :meth:`on_idle`), so it is back in HBM ``margin`` ahead of the tool's expected return; an agent
        back earlier has its copy restored at its admission. DROP releases it; the next step recomputes
        the prefix. Counted in ``switchyard_tool_wait_decisions_total{decision}`` and, by ``tool``'s bounded
        label (its returns measured under its own name), in :attr:`tool_waits`
        (:class:`~switchyard.dispatcher.scheduler.tool_wait.ToolWaitPlans`: decisions, warm and cold
        resumes, prefetch timings).

        Returns:
            the decision, or None when the agent has no parked step here (nothing to decide).

        Raises:
            ValueError: ``expected_wait_s`` < 0.
        """
        if expected_wait_s < 0:
            raise ValueError(f"expected_wait_s: expected seconds >= 0, got {expected_wait_s!r}")
        self._announced = True
        entry = self.parking.entry(program_key)
        if entry is None:
            return None
        budget = self.kv_budget.budget_bytes if self.kv_budget is not None else 0
        if budget <= 0:  # no HBM budget to price (an upstream engine): the server keeps its own cache
            budget = max(1, entry.kv_bytes)
        used = (self.kv_budget.reserved_bytes if self.kv_budget is not None else 0) + self.parking.kv_bytes
        tokens = entry.req.num_computed_tokens
        returns = self.tool_waits.return_times(tool, expected_wait_s, now)
        decision = decide(ToolWaitInputs(
            expected_wait_s=expected_wait_s, kv_bytes=entry.kv_bytes, budget_bytes=budget,
            pressure=min(1.0, used / budget), transfer_s=self.tiers.transfer_seconds(entry.kv_bytes),
            recompute_s=self.tiers.recompute_seconds(tokens), can_swap=self.tiers.can_swap(),
            returns_s=returns.times, return_weights=returns.weights,
            cold_resume_weight=self.scheduler_config.tool_wait_cold_resume_weight,
            idle_price_floor=self.scheduler_config.tool_wait_idle_price_floor,
            outlasted_s=0.0 if returns.times else self.tool_waits.longest_running_s(tool, now, expected_wait_s)),
            grace_s=expected_wait_s)
        self._now = now
        plan = ToolWaitPlan(program_key, tool, decision.decision, now, now + expected_wait_s,
                            now + decision.revisit_at_s, transfer_s=decision.transfer_s)
        if decision.decision is Decision.KEEP:
            self.parking.keep_for(program_key, now - entry.since + decision.revisit_at_s)
        elif decision.decision is Decision.SWAP:
            parked, nbytes = entry.req, entry.kv_bytes
            if not self.parking.move_out(program_key, demote=True, copy=self._copy_decided):
                # no copy could be made: the state was dropped, and that is what is answered and counted
                decision = dataclasses.replace(decision, decision=Decision.DROP, restore_at_s=None)
                plan.decision = Decision.DROP
            elif decision.restore_at_s is not None:  # a copy went to DRAM and its return is planned ahead of the turn
                plan.restore_at = now + decision.restore_at_s
                plan.req, plan.key, plan.tokens, plan.kv_bytes = parked, self.tiers.parked_key(program_key), tokens, nbytes
        else:
            self.parking.move_out(program_key, demote=False)
            self.counters.hbm_evictions += 1
        self.tool_waits.add(plan)  # counted there, by tool (``counters.tool_decisions``)
        self._events.tool_wait_expected_s.append(expected_wait_s)
        return decision

    def forget_agent(self, program_key: str) -> None:
        """``program_key``'s task ended between two steps (its next step refused here by name, as one that cannot
        make its deadline; or the orchestrator's word that it was cancelled, ran past its deadline or was
        refused during its tool wait): its parked KV leaves HBM now instead of at the parking's TTL, its DRAM
        copy is dropped, and its tool-wait plan ends (no restore for a turn that will not come, no running call
        left to skew its tool's measured returns)."""
        self.parking.forget(program_key)
        self.tool_waits.abandon(program_key)
        self.tiers.discard(self.tiers.parked_key(program_key))

    def until_prefetch(self, timeout: float, now: float) -> float:
        """How long a loop that would wait ``timeout`` seconds from ``now`` may wait: ``timeout``, or less
        when a planned restore falls due sooner (seconds, >= 0). A restore already due that waits for room
        in the KV budget does not shorten it (the loop would spin; the decision that finds the room hands
        it over), nor does it hide the due time of the next one
        (:meth:`~switchyard.dispatcher.scheduler.tool_wait.ToolWaitPlans.next_restore_after`)."""
        return max(0.0, min(timeout, self.tool_waits.next_restore_after(now) - now))

    def _prefetches(self, now: float, head: Request | None = None) -> list[Request]:
        """The swapped agents' parked steps whose restore is due at ``now`` and fits the KV budget's free
        room (one that does not waits for room, or for its turn); each gets its copy's key and tokens
        (``swap_key``, ``swap_tokens``) for the loop's restore, and its bytes are held in the budget while
        the copy is in flight (:meth:`prefetched` ends the hold). ``head``: the waiting head, when called
        before admission: only restores of agents of its class or a higher one start then."""
        due = self.tool_waits.due(now)
        if not due:
            return []
        budget = self.kv_budget
        started = []
        for plan in due:
            req = plan.req
            assert req is not None
            if head is not None and req.priority > head.priority:
                continue
            if budget is not None:
                if plan.kv_bytes > budget.free_bytes:
                    continue
                budget.hold_restore(plan.kv_bytes)
            req.swap_key, req.swap_tokens = plan.key, plan.tokens
            self.tool_waits.started(plan)
            started.append(req)
        return started

    def prefetched(self, req: Request, restored: int, now: float) -> bool:
        """A planned restore into the swapped agent's parked step ``req`` ended with ``restored`` tokens
        loaded (0: a miss). True when it landed: ``req`` is parked again with its prefix, warm (held under
        the parking's rules, at least until the tool's revisit time) and the DRAM copy is discarded. A
        restore whose agent's turn came meanwhile (or that missed) does not land: what it loaded is
        released and the DRAM copy is left for that turn's own restore."""
        plan = self.tool_waits.in_flight(req)
        key, req.swap_key, req.swap_tokens = req.swap_key, "", 0
        if plan is not None and self.kv_budget is not None:
            self.kv_budget.end_restore(plan.kv_bytes)  # held since its restore started (_prefetches)
        if plan is None:
            if restored > 0:
                self.kv.free(req)
            return False
        current = self.tool_waits.get(plan.program_key) is plan and self.parking.entry(plan.program_key) is None
        landed = restored > 0 and current and not plan.claimed
        self.tool_waits.finished(plan, landed)
        if not landed:
            if restored > 0:
                self.kv.free(req)
            req.num_computed_tokens = 0
            return False
        self._now = now
        req.num_computed_tokens = restored
        req.status = PARKED
        self.parking.park(req, now)
        self.parking.keep_for(plan.program_key, max(0.0, plan.revisit_at - now))
        self.tiers.discard(key)
        self.counters.restored_tokens += restored
        return True

    def hbm_scan(self, now: float, out: SchedulerOutput) -> None:
        """The periodic HBM scan (``[scan] hbm_scan_interval_s``), also run after a real OOM.

        - Device memory in use at or above ``emergency_evict_ratio`` (the
          device's reading on a GPU, the modelled usage otherwise): evict,
          whatever the value, until the bytes freed cover the excess: parked
          agents' state, lowest value first (to DRAM where cheaper), then the
          prefix cache, then running requests, lowest value first (preempted;
          their KV to DRAM where cheaper). The excess is counted in bytes freed,
          not re-read, because a caching allocator keeps freed memory reserved.
        - Compute score below ``defrag_below_score``: compact the engine's KV
          block table (``kv.compact``) while the GPU has time for it.
        """
        self._next_hbm_scan = now + self.memory.scan.hbm_scan_interval_s
        self.counters.hbm_scans += 1
        limit = self.memory.hbm.emergency_evict_ratio
        if (budget := self.kv_budget) is not None and (ratio := budget.usage_ratio()) >= limit:
            excess = int((ratio - limit) * budget.info.device_bytes) + 1
            log.warning("HBM usage %.3f >= emergency_evict_ratio %.3f: evicting %d bytes of the lowest-value KV state",
                        ratio, limit, excess)
            freed = 0
            while freed < excess and self.parking.requests:
                held = budget.held_bytes
                self.parking.evict_lowest(lambda entry: self._parked_value(entry, now))
                freed += held - budget.held_bytes
            if freed < excess:
                freed += self.kv.evict_prefix_cache(excess - freed)
            while freed < excess:
                victim = self._lowest_value_running(now, out)
                if victim is None:
                    break
                freed += max(victim.kv_reserved_bytes, self.kv.kv_bytes(victim))
                self._preempt_one(victim, now, out)
        if self.score < self.memory.hbm.defrag_below_score:
            freed = self.kv.compact([*self._running, *self._leaving, *self.parking.requests, *self.queue])
            self.counters.defragmentations += 1
            self.counters.defrag_freed_bytes += freed

    def _make_room(self, req: Request) -> str | None:
        """Free KV until ``req`` fits, so that runnable work never waits behind parked state (but an agent's
        KV restored or kept for its turn, until its tool's revisit time, and a step parked undecided, for
        ``tool_wait_announce_hold_s`` while its tool's announcement comes: :mod:`.tool_wait`): parked
        agents' state valued below ``[hbm] evict_first_below`` (lowest value first), then the prefix cache
        (least recently used blocks), then the rest of the parked state, lowest value first whatever its
        value (a core agent's included). Parked state goes to DRAM where a swap is cheaper
        (:meth:`_demote_parked`), else it is dropped. None when ``req`` fits now, else the capacity's refusal."""
        reason = self.capacity.refusal(req)
        if reason is None or self.kv_budget is None:  # parked state holds none of another capacity
            return reason
        now = self._now

        hold = self.scheduler_config.tool_wait_announce_hold_s if self._announced else 0.0

        def value(entry: ParkedAgent) -> float:
            until = self.tool_waits.protected_until(entry.req.program_key, entry.req)
            if until is not None and now <= until:
                return math.inf  # restored for its turn, expected by then: not evicted for waiting work
            if entry.ttl_s is None and now - entry.since < hold:
                return math.inf  # its tool's announcement decides where it goes, not this eviction
            return self._parked_value(entry, now)

        self._room_for = req
        try:
            below = self.memory.hbm.evict_first_below
            while self._shortfall(req) > 0 and self.parking.evict_lowest(value, below=below) is not None:
                pass
            if (short := self._shortfall(req)) > 0:
                self.kv.evict_prefix_cache(short)
            while self._shortfall(req) > 0 and self.parking.evict_lowest(value) is not None:
                pass
            if self._shortfall(req) > 0:
                self._cool_handovers(req)
        finally:
            self._room_for = None
        return self.capacity.refusal(req)

    def _shortfall(self, req: Request) -> int:
        """Bytes that must leave HBM before ``req`` fits (0 for a capacity that does not count bytes)."""
        return self.kv_budget.shortfall(req) if self.kv_budget is not None else 0

    def _cool_handovers(self, head: Request) -> None:
        """The last resort of :meth:`_make_room`: warm prefixes being handed over to steps waiting behind ``head``
        leave HBM as an evicted parked agent's would; each such step then restores its prefix from DRAM (where
        it went) or recomputes it. Without it a head that fits only without them would wait for its deadline
        while the steps holding them wait behind it. Nothing is moved when moving them all would not let the
        head start (it waits for running work to end, and the prefixes stay warm).

        A prefix its tool-wait decision held for the turn (kept, or restored ahead) is moved, for
        ``scheduler.tool_wait_turn_hold_s`` after the turn (:attr:`.parking.Handover.held_until`), only for a core
        head (its TTFT objective does not wait for a decode to end) or when no running work is there to end and
        free room: moving it turns the warm resume the plan paid HBM for into a cold one, where a head of
        another class waits only for running work to end. Past the hold it is moved as any other (a step that
        waits that long behind the head holds idle HBM, and holds back the room the head waits for)."""
        now = self._now
        held_too = head.priority is PriorityClass.CORE or not (self._running or self._leaving)
        behind = [w for w in self.queue if w is not head and (handover := self.parking.handover(w)) is not None
                  and (held_too or handover.held_until <= now)]
        if sum(self.parking.handed_over_bytes(w) for w in behind) < self._shortfall(head):
            return
        for waiting in behind:
            handover = self.parking.handover(waiting)
            if self._shortfall(head) <= 0 or handover is None:
                return
            tokens = handover.parked.num_computed_tokens
            waiting.num_computed_tokens = 0
            if self.parking.cool_handover(waiting):
                waiting.swap_key, waiting.swap_tokens = self.tiers.parked_key(waiting.program_key), tokens
            else:
                waiting.recomputed_tokens += min(tokens, waiting.prompt_tokens)

    def _copy_delays(self) -> int:
        """1 when copying a victim's KV out of HBM would make the core request it is preempted for wait,
        else 0. An engine that models its transfers (the sim) copies in the background, beside the steps;
        any other engine copies at export (``kv.export``), in front of the next step: core waits for it."""
        return 0 if self.tiers.models_transfers else 1

    def _parked_value(self, entry: ParkedAgent, now: float) -> float:
        """Value score of a parked agent's state; its recency holds while its tool-wait TTL runs."""
        req = entry.req
        idle = max(0.0, now - entry.since)
        return self.tiers.score(req, tokens=req.num_computed_tokens, nbytes=entry.kv_bytes, idle_s=idle,
                                pinned=idle <= self.parking.ttl_s)

    def _lowest_value_running(self, now: float, out: SchedulerOutput) -> Request | None:
        """The running request whose state is worth least, not admitted in this decision; None if none."""
        fresh = set(out.admitted)
        candidates = [s for s in self._running if s not in fresh]
        if not candidates:
            return None

        def value(req: Request) -> float:
            idle = now - (req.last_token_at or req.admitted_at or now)
            return self.tiers.score(req, tokens=req.num_computed_tokens, nbytes=self.kv.kv_bytes(req), idle_s=idle)

        return min(candidates, key=value)

    def _swap_out(self, req: Request, key: str, delays: int = 0, decided: bool = False) -> bool:
        """Copy ``req``'s KV state to DRAM under ``key`` when a swap is cheaper than recomputing it; True
        when it was copied.

        ``delays``: waiting requests of a higher class than ``req`` that would wait for this copy
        (:meth:`_copy_delays`); each adds the copy's one-way transfer time to the swap's cost
        (:meth:`~switchyard.dispatcher.tiers.MemoryTiers.worth_swapping`), so a victim whose move would
        delay core work is dropped instead when recomputing it is cheaper than that.
        ``decided``: the swap was already priced against recomputing (a tool wait's SWAP, :func:`.tool_wait.decide`):
        copied whenever a copy can be made.
        """
        tokens = req.num_computed_tokens
        nbytes = self.kv.kv_bytes(req)
        copy_s = self.tiers.transfer_seconds(nbytes)
        if decided:
            if tokens <= 0 or not self.tiers.can_swap():
                return False
        elif not self.tiers.worth_swapping(tokens, nbytes, delays * copy_s):
            return False
        if not self.tiers.swap_out(req, key, tokens):
            return False
        req.swap_key, req.swap_tokens = key, tokens
        self.counters.hbm_evictions += 1  # moved out (a state not copied is counted where it is dropped)
        return True

    def _copy_decided(self, parked: Request) -> bool:
        """A tool wait's SWAP: the parked agent's state goes to DRAM (under its task's key) whenever a copy can
        be made; the decision priced it against recomputing (:func:`.tool_wait.decide`, the one rule of a tool
        wait's swap or drop). True when it was copied."""
        return self._copy_parked(parked, decided=True)

    def _demote_parked(self, parked: Request) -> bool:
        """A parked agent's state leaves HBM: True when a copy went to DRAM (under its task's key).

        When it leaves to make room for a waiting request of a higher class (:meth:`_make_room`), that
        request would wait for the copy: the swap-or-recompute choice counts it.
        """
        head = self._room_for
        delays = self._copy_delays() if head is not None and head.priority < parked.priority else 0
        return self._copy_parked(parked, delays=delays)

    def _copy_parked(self, parked: Request, delays: int = 0, decided: bool = False) -> bool:
        """Copy the parked step's state to DRAM under its task's key (:meth:`_swap_out`, ``delays`` and
        ``decided`` as there); True when copied. The copy is found by that key (the agent's next step, or a
        planned restore), not by the parked step's own ``swap_key``; a state not copied is counted as
        dropped (``hbm_evictions``): its next step recomputes."""
        if self._swap_out(parked, self.tiers.parked_key(parked.program_key), delays, decided=decided):
            parked.swap_key, parked.swap_tokens = "", 0
            return True
        self.counters.hbm_evictions += 1
        return False

    def _resume_prefix(self, req: Request, now: float) -> None:
        """``req``, an agent task's next step (``resume``), joins the waiting set: it takes over its parked
        step's warm prefix (``num_computed_tokens``; the parking records the hand-over), or is pointed at its
        DRAM copy (``swap_key``, restored at its admission; ``swap_tokens`` 0: a copy another replica parked,
        whatever it holds), or recomputes its prefix (``recomputed_tokens``); counted as a warm, restored or
        cold resume, and its tool-wait plan learns that its turn came (:meth:`.tool_wait.ToolWaitPlans.on_turn`)."""
        found = self.parking.take(req.program_key, now, req)
        resume = "warm" if found.warm else "restored" if found.in_dram and found.prefix_tokens else "cold"
        plan = self.tool_waits.on_turn(req.program_key, now, resume)
        self.counters.resumes[resume] += 1
        if found.warm and plan is not None:  # kept, or restored ahead, for this turn
            self.parking.hold_handover(req, now + self.scheduler_config.tool_wait_turn_hold_s)
        if found.warm:
            # The new step repeats the parked prefix: keep it, compute only the rest (at least one token).
            req.num_computed_tokens = max(0, min(found.prefix_tokens, req.prompt_tokens - 1))
            req.kv_hits += 1
            self.counters.hbm_hits += 1
        elif resume == "restored":
            # Its prefix went to DRAM: brought back at admission (a miss there recomputes it).
            req.swap_key, req.swap_tokens = self.tiers.parked_key(req.program_key), found.prefix_tokens
            self.counters.hbm_misses += 1
        else:
            self.counters.hbm_misses += 1
            req.recomputed_tokens += min(found.prefix_tokens, req.prompt_tokens)
            if not found.prefix_tokens and self.tiers.store is not None:
                # No record here: the agent's last step ran on another replica (affinity spilled it). The
                # DRAM tier is shared and keyed by agent, so a copy that replica parked there is found
                # under the same key; swap_tokens 0 takes whatever the copy holds (a miss recomputes).
                req.swap_key, req.swap_tokens = self.tiers.parked_key(req.program_key), 0

    def _end_handover(self, req: Request) -> None:
        """``req`` started (its prefix state is now its own) or left: release its agent's parked step."""
        self.parking.end_handover(req)
