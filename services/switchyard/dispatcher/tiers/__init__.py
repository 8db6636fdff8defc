"""Memory tiers of the dispatcher: KV state in HBM, swapped to DRAM (Redis) and back.

The scheduler (:class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`)
stays the one owner of requests and KV: it decides *when* state leaves HBM
(preemption, a parked agent's eviction or tool-wait TTL, the emergency scan)
and writes where a request's copy lives on the request itself
(``req.swap_key``, ``req.swap_tokens``). This package does the moving and the
pricing:

- :class:`MemoryTiers` chooses swap or recompute: a swap costs the transfer
  out and back, ``2 x (bytes / [dram] transfer_gb_per_s + transfer_latency_ms)``,
  plus the delay its copy puts on waiting higher-class work (the caller says
  how much: a copy at export runs in front of the next step);
  a recompute costs the engine's prefill of the same tokens
  (``kv.recompute_seconds``). The cheaper one wins (vLLM's preemption
  offers the same two modes, swap and recompute, Kwon et al., SOSP 2023, 4.5).
- :mod:`.dram`: KV entries in the DRAM tier's Redis (:mod:`switchyard.common.dram`,
  redis-py's asyncio client); an outage is a miss.
- :mod:`.cold`: the cold tier, files through fsspec at ``[oss] path``: the
  DRAM scan archives there what is worth little (below ``demote_threshold``)
  and has sat in DRAM for ``archive_after_s``; a restore that misses in
  DRAM looks there and promotes what it finds back to HBM.
- :mod:`.value`: the value score that orders eviction and drives promotion and demotion.
- :mod:`.blob`: the sealed form of a stored entry (key, lengths, digest); an
  entry that does not prove itself is a miss, never handed to the engine.
- :mod:`.metrics`: bytes, hits, misses, evictions, promotions and demotions per tier.

An engine takes part through its KV cache manager
(:class:`~switchyard.dispatcher.engines.base.KVCacheManager`): ``export(req) ->
bytes | None`` (its KV state as bytes, before it is freed), ``load(req,
payload, tokens) -> int`` (tokens restored) and ``recompute_seconds(tokens)``.
A manager whose ``models_transfers`` is true (the sim's) has no real bytes to
move: a restore's modelled transfer time is owed and the step loop sleeps it
before the restored request's step (:meth:`MemoryTiers.take_owed_seconds`); a
swap-out's copy runs in the background, beside the steps (a copy engine beside
the compute): nothing is owed for it, and the KV budget frees the victim's
reservation at once. That is an approximation (a block is reusable once its
copy ends): a request admitted meanwhile writes its prompt's blocks first, and
the reservation rule keeps each request's unwritten output blocks free.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from switchyard.common import telemetry
from switchyard.common.config import MemoryTiersConfig, PriorityBoost
from switchyard.dispatcher.engines.base import KVCacheManager, NullKVCacheManager
from switchyard.dispatcher.request import Request, RequestStatus, request_links
from switchyard.dispatcher.tiers import metrics
from switchyard.dispatcher.tiers.cold import ColdStore
from switchyard.dispatcher.tiers.dram import KvStore
from switchyard.dispatcher.tiers.value import ValueScore

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)

__all__ = ["ColdStore", "KvStore", "MemoryTiers", "ValueScore"]


class MemoryTiers:
    """Swap-or-recompute decisions and the moves between HBM and DRAM.

    Args:
        memory: ``memory_policy.toml``.
        boost: ``scheduler_config.json`` ``priority_boost`` (the value score's priority weights).
        kv: the engine's KV cache manager (``export``, ``load``, ``recompute_seconds``, ``kv_bytes``); None:
            one without KV (nothing is swapped).
        store: the DRAM store; None: no DRAM tier (every eviction recomputes).
        cold: the cold store; None: what the DRAM scan demotes is dropped.
    """

    def __init__(self, memory: MemoryTiersConfig, boost: PriorityBoost, kv: KVCacheManager | None,
                 store: KvStore | None = None, cold: ColdStore | None = None) -> None:
        self.memory = memory
        self.kv: KVCacheManager = kv if kv is not None else NullKVCacheManager()
        self.store = store
        self.cold = cold
        self.value = ValueScore(memory.value, boost)
        self._writes: dict[str, asyncio.Task[bool]] = {}
        self._deletes: set[asyncio.Task[Any]] = set()
        """Deletes under way (:meth:`discard`): held so none is collected mid-flight, and awaited by :meth:`aclose`
        (closing the Redis client under one made it log a false "DRAM tier unavailable" at every shutdown)."""
        self._owed_s = 0.0
        self._scan_task: asyncio.Task[None] | None = None
        self.models_transfers = self.kv.models_transfers
        self._instance = uuid.uuid4().hex[:12]
        """This dispatcher's own id in the keys of its preempted requests' copies (:meth:`request_key`): replicas
        may share the DRAM tier, and each counts ``Request.seq_id`` from 1."""

    def request_key(self, req: Request) -> str:
        """DRAM key of a preempted request's KV state ("" without a DRAM tier): the request's own
        (``seq_id``, under this dispatcher's id), never its caller's ``request_id``, which two requests held at
        once may share (their copies then replaced each other's)."""
        return self.store.key("seq", f"{self._instance}-{req.seq_id}") if self.store is not None else ""

    def parked_key(self, program_key: str) -> str:
        """DRAM key of a parked step's prefix state, by its task's ``program_key`` (``Request.program_key``, what
        the parking and the tool-wait plans are keyed by; the stored key keeps its ``agent`` kind): the same on
        every replica that shares the store ("" without a DRAM tier)."""
        return self.store.key("agent", program_key) if self.store is not None else ""

    # ------------------------------------------------------------------ pricing

    def recompute_seconds(self, tokens: int) -> float:
        """Engine seconds to recompute ``tokens`` prefix tokens (0 when the engine cannot say)."""
        return float(self.kv.recompute_seconds(tokens)) if tokens > 0 else 0.0

    def transfer_seconds(self, nbytes: int) -> float:
        """One-way seconds to move ``nbytes`` between HBM and DRAM: bytes / bandwidth + fixed latency."""
        dram = self.memory.dram
        return nbytes / (dram.transfer_gb_per_s * 1e9) + dram.transfer_latency_ms / 1000

    def can_swap(self) -> bool:
        """A DRAM tier is configured, reachable (not within an outage's retry window) and the engine can export."""
        if self.store is None or not self.memory.dram.kv_swap or not self.store.available():
            return False
        if not self.kv.can_export():
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop: nothing could write to Redis
            return False
        return True

    def worth_swapping(self, tokens: int, nbytes: int, delay_s: float = 0.0) -> bool:
        """True when swapping out and back is cheaper than recomputing ``tokens`` (and a swap is possible).

        ``delay_s``: seconds the copy out would make waiting higher-class work wait, summed over the
        requests it delays (0: none waits for it); counted on the swap's side.
        """
        if tokens <= 0 or not self.can_swap():
            return False
        return 2 * self.transfer_seconds(nbytes) + max(0.0, delay_s) < self.recompute_seconds(tokens)

    def score(self, req: Request, *, tokens: int, nbytes: int, idle_s: float, pinned: bool = False) -> float:
        """The value score of ``req``'s state (see :mod:`.value`)."""
        return self.value.score(priority_class=req.priority.label, hits=req.kv_hits,
                                reuse_seconds=self.recompute_seconds(tokens), nbytes=nbytes, idle_s=idle_s,
                                pinned=pinned)

    # ------------------------------------------------------------------ moves

    def swap_out(self, req: Request, key: str, tokens: int) -> bool:
        """Copy ``req``'s KV state (``tokens`` prefix tokens) to DRAM under ``key``, before the caller releases it.

        The engine's bytes are taken now; the Redis write runs in the background
        (a restore of ``key`` waits for it), and so does the modelled copy of an
        engine that ``models_transfers``: nothing is owed to the step loop for it.
        Returns False when nothing could be exported (the caller then recomputes).
        """
        nbytes = self.kv.kv_bytes(req)
        payload = self.kv.export(req)
        if payload is None:
            return False
        old = self._writes.pop(key, None)
        if old is not None:
            old.cancel()
        cost_us = self.recompute_seconds(tokens) * 1e6
        assert self.store is not None
        self._writes[key] = asyncio.get_running_loop().create_task(self.store.put(
            key, payload, tokens=tokens, nbytes=nbytes, priority=req.priority.label, hits=req.kv_hits,
            cost_us=cost_us))
        metrics.TIER_DEMOTIONS.labels("hbm").inc()  # its eviction from HBM is the scheduler's count (hbm_evictions)
        return True

    async def restore(self, req: Request) -> int:
        """Bring ``req``'s DRAM copy (``req.swap_key``) back into the engine; returns tokens restored.

        0 on a miss (evicted, expired, Redis down): the engine then recomputes
        the prefix. Either way ``req.swap_key`` is cleared. Traced as a
        ``dispatcher.kv_restore`` span linked to the request.
        """
        with tracer.start_as_current_span("dispatcher.kv_restore", links=request_links([req])) as span:
            restored = await self._restore(req)
            span.set_attribute("switchyard.restored_tokens", restored)
            return restored

    async def _restore(self, req: Request) -> int:
        key, tokens = req.swap_key, req.swap_tokens
        req.swap_key, req.swap_tokens = "", 0
        if not key or self.store is None:
            return 0
        write = self._writes.pop(key, None)
        written = await write if write is not None else self.store.available()
        entry = await self.store.get(key) if written else None
        tier = "dram"
        if entry is None:
            metrics.TIER_MISSES.labels("dram").inc()
            if written and self.cold is not None:  # archived by the DRAM scan: promote it back on access
                entry = await self.cold.take(key)
                tier = "cold"
                if entry is None:
                    metrics.TIER_MISSES.labels("cold").inc()
        if entry is None:
            if not req.output_tokens:  # a resumed agent's prefix: its prefill recomputes it
                req.recomputed_tokens += min(tokens, req.prompt_tokens)
            return 0
        metrics.TIER_HITS.labels(tier).inc()
        if req.status is not RequestStatus.RUNNING:  # it left while the copy was read
            self.discard(key)
            return 0
        # tokens 0: the copy was found by its agent's key alone (parked by another replica), take all it holds
        wanted = min(tokens, entry.tokens) if tokens else min(entry.tokens, max(0, req.prompt_tokens - 1))
        restored = int(self.kv.load(req, entry.payload, wanted))
        self.discard(key)
        if restored <= 0:
            return 0
        req.num_computed_tokens = restored
        if self.models_transfers:
            self._owed_s += self.transfer_seconds(entry.nbytes)
        req.restored_tokens += restored
        req.kv_hits += 1
        metrics.TIER_PROMOTIONS.labels(tier).inc()
        return restored

    async def prefetch(self, req: Request) -> int:
        """Load the DRAM copy under ``req.swap_key`` (at most ``req.swap_tokens`` tokens) back into ``req``,
        a swapped agent's parked step, ahead of its tool's expected return; returns tokens loaded (0: a
        miss: not in DRAM, Redis down, or the engine took none).

        Unlike :meth:`restore`, the copy stays in DRAM (the scheduler discards it once the step is parked
        again, or leaves it for the agent's turn when that came first) and ``req`` need not be running. A
        copy the DRAM scan archived to the cold tier is not looked for here (the turn's restore finds it).
        An engine that ``models_transfers`` spends the copy's modelled transfer time here, in the
        background beside the steps (a copy engine), not in front of a step. Traced as a
        ``dispatcher.kv_prefetch`` span linked to the request. :meth:`load_prefetch` is the same load
        without the transfer's wait (for a loop on a simulated clock).
        """
        if not req.swap_key or self.store is None:
            return 0
        with tracer.start_as_current_span("dispatcher.kv_prefetch", links=request_links([req])) as span:
            restored, transfer_s = await self.load_prefetch(req)
            if transfer_s > 0:
                await asyncio.sleep(transfer_s)
            span.set_attribute("switchyard.restored_tokens", restored)
            return restored

    async def load_prefetch(self, req: Request) -> tuple[int, float]:
        """:meth:`prefetch`'s load without its wait: the DRAM copy under ``req.swap_key`` loaded into ``req``
        now; returns (tokens loaded, 0 on a miss; the copy's modelled transfer seconds that the caller
        spends in the background before the load counts as done: > 0 only for an engine that
        ``models_transfers`` and a load that took tokens). It awaits the swap-out's write of the same key
        still in flight (never cancelling it)."""
        key, tokens = req.swap_key, req.swap_tokens
        if not key or self.store is None:
            return 0, 0.0
        write = self._writes.get(key)
        if write is not None:
            await asyncio.wait({write})  # never cancelled from here: a restore of the same key may await it
            written = not write.cancelled() and write.exception() is None and bool(write.result())
        else:
            written = self.store.available()
        entry = await self.store.get(key) if written else None
        if entry is None:
            metrics.TIER_MISSES.labels("dram").inc()
            return 0, 0.0
        metrics.TIER_HITS.labels("dram").inc()
        restored = max(0, int(self.kv.load(req, entry.payload, min(tokens, entry.tokens) if tokens else entry.tokens)))
        if restored == 0:
            return 0, 0.0
        metrics.TIER_PROMOTIONS.labels("dram").inc()
        return restored, self.transfer_seconds(entry.nbytes) if self.models_transfers else 0.0

    def discard(self, key: str) -> None:
        """Drop the DRAM copy under ``key`` (its request ended or took it back); runs in the background."""
        if self.store is None or not key:
            return
        write = self._writes.pop(key, None)
        if write is not None:
            write.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delete = loop.create_task(self.store.delete(key))
        self._deletes.add(delete)
        delete.add_done_callback(self._deletes.discard)

    def take_owed_seconds(self) -> float:
        """Modelled transfer seconds accumulated since the last call (sim engine only; else 0)."""
        owed, self._owed_s = self._owed_s, 0.0
        return owed

    # ------------------------------------------------------------------ scans

    async def scan_dram(self, now: float | None = None) -> tuple[int, int]:
        """One DRAM scan (``now``: Unix seconds, default the clock's).

        Entries valued at or above ``renew_ttl_threshold`` stay hot (TTL
        renewed). Entries valued below ``demote_threshold`` that have sat in
        DRAM for ``[oss] archive_after_s`` leave it: archived to the cold
        tier, and deleted from DRAM only once the cold copy is whole (an
        archive that fails leaves the DRAM copy, and the scan archives
        nothing more until the next one; with no cold tier the entry is
        dropped). Returns (kept hot, moved out).
        """
        if self.store is None or not self.store.available():
            return 0, 0
        dram, archive_after = self.memory.dram, self.memory.oss.archive_after_s
        hot = moved = 0
        archiving = self.cold is not None  # off for the rest of the scan after a failed archive (the tier backs off)
        now = time.time() if now is None else now
        async for entry in self.store.scan():
            age = now - entry.stored_at
            value = self.value.score(priority_class=entry.priority, hits=entry.hits,
                                     reuse_seconds=entry.cost_us / 1e6, nbytes=entry.nbytes, idle_s=age)
            if value >= dram.renew_ttl_threshold:
                await self.store.touch(entry.key)
                hot += 1
            elif value < dram.demote_threshold and age >= archive_after:
                if self.cold is not None:
                    if not archiving:
                        continue
                    whole = await self.store.get(entry.key)  # None: gone, refused (and deleted), or Redis failed
                    if whole is None:
                        continue
                    if not await self.cold.put(whole):
                        archiving = False  # the DRAM copies stay (until their TTL); the next scan tries again
                        continue
                    metrics.TIER_DEMOTIONS.labels("dram").inc()
                await self.store.delete(entry.key)  # only now: the cold copy is whole
                metrics.TIER_EVICTIONS.labels("dram").inc()
                moved += 1
        metrics.SCANS.labels("dram").inc()
        return hot, moved

    def start_scans(self) -> None:
        """Run :meth:`scan_dram` every ``[scan] dram_scan_interval_s`` on the running loop (idempotent)."""
        if self.store is None or self._scan_task is not None:
            return

        async def every() -> None:
            while True:
                await asyncio.sleep(self.memory.scan.dram_scan_interval_s)
                try:
                    await self.scan_dram()
                except Exception:  # noqa: BLE001 - a scan must never end the loop
                    log.exception("DRAM tier scan failed")

        self._scan_task = asyncio.get_running_loop().create_task(every(), name="dram-scan")

    async def aclose(self) -> None:
        """Stop the scans, let pending writes and deletes end, close the Redis client."""
        if self._scan_task is not None:
            self._scan_task.cancel()
            await asyncio.gather(self._scan_task, return_exceptions=True)
            self._scan_task = None
        if self._writes:
            await asyncio.gather(*self._writes.values(), return_exceptions=True)
            self._writes.clear()
        if self._deletes:
            await asyncio.gather(*self._deletes, return_exceptions=True)
        if self.store is not None:
            await self.store.aclose()
