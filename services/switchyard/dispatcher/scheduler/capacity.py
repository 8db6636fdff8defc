"""What the engine can hold: the running set's limit, read from the hardware.

A scheduler admits a waiting request only when its capacity says it fits.
There are two kinds, one per engine kind:

- :class:`KvBudget` (step engines): the KV cache of the running requests must
  fit the HBM budget, ``memory_policy.toml [hbm] capacity_ratio`` x device
  memory - weight bytes. Each running request reserves the KV of its whole
  possible length, ``(prompt_tokens + max_tokens) x bytes per token``, at
  admission, so a running request never runs out of memory mid-decode and is
  never preempted for memory. That is the reservation rule of Hugging Face
  TGI's router (``max_batch_total_tokens``: prompt plus ``max_new_tokens`` of
  every request in the batch must fit). KV held beside the running set (parked
  agents' prefixes, the prefix cache) counts against the same budget; the
  scheduler moves it out, lowest value first, when a waiting request needs the
  room (``SchedulerCore._make_room``).
- :class:`ConcurrencyCapacity` (stream engines): the number of streams in
  flight to the upstream (:class:`StreamSlots`, their one count) must stay under
  the engine's concurrency limit (:class:`ConcurrencyLimit`: the gateway's pool of
  adaptive limits, :mod:`switchyard.dispatcher.adaptive_limit`, each kept at its
  server's knee), with a few slots NORMAL and BATCH may not take while CORE does
  not use them.

Device memory comes from the engine (:meth:`memory_info`): NVML's total on a
GPU, the modelled 80 GB H100 for the sim engine. Memory *in use*
(:meth:`KvBudget.usage_ratio`, read by the HBM scan against
``emergency_evict_ratio``) is the engine's ``device_used_bytes()`` where it
has one (NVML's ``used`` on a GPU), else the modelled weights plus KV held.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from switchyard.common.config import HbmTierConfig
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.adaptive_limit import UPSTREAM_CORE_RESERVE, UPSTREAM_IN_FLIGHT, refusal_for
from switchyard.dispatcher.request import Request

KV_MEMORY = "kv_memory"
"""Refusal reason: the request's KV reservation does not fit the HBM budget."""


@dataclass(frozen=True)
class MemoryInfo:
    """Memory facts of a step engine, in bytes.

    ``device_bytes``: total memory of the device the KV cache lives on;
    ``weight_bytes``: what the model's weights take of it;
    ``kv_bytes_per_token``: KV cache bytes one token of one request needs.
    """

    device_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int


class Capacity(Protocol):
    """A limit on the running set. The scheduler calls it on the event loop only."""

    CLASS_REFUSALS: frozenset[str]
    """Refusals that depend on the request's class: a higher class behind the refused head may still start."""

    def refusal(self, req: Request) -> str | None:
        """None when ``req`` fits now, else the refusal reason (a metric label)."""

    def never_fits(self, req: Request) -> str | None:
        """Why ``req`` could not run even on an empty engine, or None."""

    def take(self, req: Request) -> None:
        """``req`` entered the running set."""

    def give(self, req: Request) -> None:
        """``req`` left the running set: called once for each :meth:`take` (the scheduler's ``_stop``, beside the
        running set's ``remove``, which fails first for a request not in it). A capacity whose unit outlives the
        request's place (:class:`ConcurrencyCapacity`: an upstream call still closing) gives it back itself."""


class HeldBesideRunning:
    """KV bytes held beside the running set, read where they are kept: the parked agents' prefixes
    (``parking.kv_bytes``, :class:`~switchyard.dispatcher.scheduler.parking.ParkedAgents`) and the engine's
    prefix cache (``kv.prefix_cache_bytes()``, its :class:`~switchyard.dispatcher.engines.base.KVCacheManager`).
    Called with no arguments, it returns that sum in bytes (what :class:`KvBudget`'s ``held_beside_running``
    expects)."""

    __slots__ = ("parking", "kv")

    def __init__(self, parking: Any, kv: Any) -> None:
        self.parking = parking
        self.kv = kv

    def __call__(self) -> int:
        return int(self.parking.kv_bytes) + int(self.kv.prefix_cache_bytes())


class KvBudget:
    """Admission by KV memory within the HBM budget.

    Args:
        hbm: ``memory_policy.toml`` ``[hbm]`` (``capacity_ratio``).
        info: the engine's memory facts.
        held_beside_running: bytes held beside the running set that count against the budget, read at every
            check (:class:`HeldBesideRunning`: the parked agents' prefixes and the prefix cache).
        device_used: reads device memory in use, bytes (None: not readable,
            the modelled usage applies).
        taken_over: bytes of a request's own among ``held_beside_running`` (its agent's warm prefix being handed
            over to it, which becomes its own when it starts; read from their owner, the parking:
            :meth:`~switchyard.dispatcher.scheduler.parking.ParkedAgents.handed_over_bytes`): they count against
            every request but that one.

    Raises:
        ValueError: the weights alone exceed ``capacity_ratio`` x device memory.
    """

    CLASS_REFUSALS: frozenset[str] = frozenset()
    """No KV refusal depends on the class: a request that does not fit blocks every class behind it."""

    def __init__(self, hbm: HbmTierConfig, info: MemoryInfo, held_beside_running: Any = lambda: 0,
                 device_used: Any = None, taken_over: Any = lambda req: 0) -> None:
        self.info = info
        self._device_used = device_used
        self.budget_bytes = int(hbm.capacity_ratio * info.device_bytes) - info.weight_bytes
        if self.budget_bytes <= 0:
            raise ValueError(
                f"memory_policy.toml [hbm] capacity_ratio {hbm.capacity_ratio} x device memory "
                f"{info.device_bytes / 2**30:.1f} GiB leaves no room beside {info.weight_bytes / 2**30:.1f} GiB "
                "of weights; raise capacity_ratio or use a device with more memory"
            )
        self.reserved_bytes = 0
        """Bytes reserved by the running set."""
        self._held_beside_running = held_beside_running
        self._taken_over = taken_over
        self.leaving_bytes = 0
        """Live KV bytes of requests preempted while a step they belong to is in flight (``preempting``): in use
        until it ends (:meth:`hold_leaving`, :meth:`end_leaving`; each request's own in ``req.kv_leaving_bytes``)."""
        self.restoring_bytes = 0
        """KV bytes of planned restores in flight (a swapped agent's parked step coming back from DRAM ahead of
        its tool's return): in use from the restore's start until it lands or misses (:meth:`hold_restore`,
        :meth:`end_restore`; each restore's own in its plan's ``kv_bytes``)."""

    def need(self, req: Request) -> int:
        """Bytes ``req`` reserves while it runs: ``(prompt_tokens + max_tokens) x kv_bytes_per_token``."""
        return (req.prompt_tokens + req.max_tokens) * self.info.kv_bytes_per_token

    @property
    def free_bytes(self) -> int:
        """Budget left for new admissions now: the budget less :attr:`held_bytes`."""
        return self.budget_bytes - self.held_bytes

    @property
    def held_bytes(self) -> int:
        """KV bytes held in HBM, each holder once: the running set's reservations, what is held beside it (parked
        agents' prefixes, the prefix cache), the live KV of the requests leaving a step in flight, and the planned
        restores in flight."""
        return self.reserved_bytes + int(self._held_beside_running()) + self.leaving_bytes + self.restoring_bytes

    def hold_leaving(self, nbytes: int) -> None:
        """A request preempted mid-step keeps ``nbytes`` of live KV in use until the step in flight ends."""
        self.leaving_bytes += max(0, nbytes)

    def end_leaving(self, nbytes: int) -> None:
        """The step a request preempted mid-step belonged to ended (or it did): its ``nbytes`` left."""
        self.leaving_bytes -= max(0, nbytes)

    def hold_restore(self, nbytes: int) -> None:
        """A planned restore of ``nbytes`` started: they are in use until it lands or misses."""
        self.restoring_bytes += max(0, nbytes)

    def end_restore(self, nbytes: int) -> None:
        """A planned restore of ``nbytes`` landed (its step parked again, counted by the parking) or missed."""
        self.restoring_bytes -= max(0, nbytes)

    def usage_ratio(self) -> float:
        """Device memory in use / device memory (0-1): read from the device where possible, else
        weights + :attr:`held_bytes`."""
        used = self._device_used() if self._device_used is not None else None
        if used is None:
            used = self.info.weight_bytes + self.held_bytes
        return used / self.info.device_bytes if self.info.device_bytes else 0.0

    def shortfall(self, req: Request) -> int:
        """Bytes that must leave HBM before ``req`` fits (<= 0: it fits now)."""
        return self.need(req) - int(self._taken_over(req)) - self.free_bytes

    def refusal(self, req: Request) -> str | None:
        return None if self.shortfall(req) <= 0 else KV_MEMORY

    def never_fits(self, req: Request) -> str | None:
        need = self.need(req)
        if need <= self.budget_bytes:
            return None
        return (
            f"prompt_tokens + max_tokens = {req.prompt_tokens + req.max_tokens} tokens need "
            f"{need / 2**30:.2f} GiB of KV cache; the HBM budget is {self.budget_bytes / 2**30:.2f} GiB "
            "(memory_policy.toml [hbm] capacity_ratio x device memory - weights)"
        )

    def take(self, req: Request) -> None:
        if not req.kv_reserved_bytes:
            req.kv_reserved_bytes = self.need(req)
            self.reserved_bytes += req.kv_reserved_bytes

    def give(self, req: Request) -> None:
        self.reserved_bytes -= req.kv_reserved_bytes
        req.kv_reserved_bytes = 0


class Unbounded:
    """No memory limit known (an engine that reports none): compute score alone bounds admission."""

    CLASS_REFUSALS: frozenset[str] = frozenset()

    def refusal(self, req: Request) -> str | None:
        return None

    def never_fits(self, req: Request) -> str | None:
        return None

    def take(self, req: Request) -> None:
        pass

    def give(self, req: Request) -> None:
        pass


class ConcurrencyLimit(Protocol):
    """Where the limit on streams in flight to an upstream comes from: the stream engine's own (the gateway's
    :class:`~switchyard.gateway.pool.PoolLimit`, over one adaptive limit per endpoint, which the gateway measures),
    or an :class:`~switchyard.dispatcher.adaptive_limit.AdaptiveConcurrencyLimit` for an engine that brings none.
    It says how many streams may be in flight and how many of those slots are held back for CORE; it counts no
    stream (:class:`StreamSlots` does)."""

    def admission_limit(self) -> tuple[float, int]:
        """(streams that may be in flight now, ``int()`` of it; slots of them held back for CORE), read once."""

    def note_refused(self) -> None:
        """A stream was refused under this limit: more were wanted than it let through (what its windows measure)."""


class StreamSlots:
    """The streams the dispatcher admitted to its upstream, CORE among them, and the one admission rule over
    them (:func:`~switchyard.dispatcher.adaptive_limit.refusal_for`): the one owner of "may another stream go
    upstream now", whatever the engine.

    A slot is taken when the scheduler admits a request (:meth:`acquire`, through :class:`ConcurrencyCapacity`)
    and given back when the request's upstream call has ended (:meth:`release`, from the stream loop), not when
    the request leaves the running set: a call ended by the scheduler (a deadline, a cancel, another stream's
    item finding it over) still runs until its cancel is delivered and its response is closed, and the endpoint
    it is on counts it until then (:meth:`switchyard.gateway.pool.EndpointPool.finished`). So the streams on the
    endpoints never outnumber the slots taken here, and a slot given back here is free on its endpoint too.

    Args:
        source: the :class:`ConcurrencyLimit` (the limit and CORE's reserve).
        in_flight_gauge: where the streams in flight are published (``switchyard_upstream_in_flight``).
    """

    def __init__(self, source: ConcurrencyLimit, in_flight_gauge: Any = UPSTREAM_IN_FLIGHT) -> None:
        self.source = source
        self.in_flight = 0
        """Streams admitted whose upstream call has not ended."""
        self.core_in_flight = 0
        """CORE streams among them."""
        self._gauge = in_flight_gauge
        self._busy = (0.0, time.monotonic(), 0.0)  # seconds busy until then, then, share of the limit held since
        in_flight_gauge.set(0)

    @property
    def limit(self) -> float:
        """Streams that may be in flight now (``int(limit)`` of them)."""
        return self.source.admission_limit()[0]

    @property
    def busy_seconds(self) -> float:
        """Cumulative seconds of the limit in use: the integral of ``min(1, in_flight / limit)`` over time (a stream
        engine's busy seconds; its busy ratio, and so its compute score, is the share of the upstream's limit its
        streams held, what an autoscaler should read for a model server it does not see). The share is taken when
        a stream starts or ends, so the total never goes back when the limit moves in between; a scrape thread
        reads the one tuple it is kept in."""
        busy, since, share = self._busy
        return busy + (time.monotonic() - since) * share

    def admits(self, priority: PriorityClass) -> bool:
        """Whether a stream of class ``priority`` may start now (the rule alone: nothing is noted)."""
        limit, reserve = self.source.admission_limit()
        return refusal_for(priority, limit, self.in_flight, self.core_in_flight, reserve) is None

    def refusal(self, priority: PriorityClass) -> str | None:
        """None when a stream of class ``priority`` may start now, else the reason (:data:`UPSTREAM_CONCURRENCY`
        or :data:`UPSTREAM_CORE_RESERVE`), which the source is told of (:meth:`ConcurrencyLimit.note_refused`)."""
        limit, reserve = self.source.admission_limit()
        reason = refusal_for(priority, limit, self.in_flight, self.core_in_flight, reserve)
        if reason is not None:
            self.source.note_refused()
        return reason

    def acquire(self, priority: PriorityClass) -> None:
        """A stream of class ``priority`` was admitted."""
        self.in_flight += 1
        self.core_in_flight += priority is PriorityClass.CORE
        self._changed()

    def release(self, priority: PriorityClass) -> None:
        """The upstream call of a stream of class ``priority`` ended."""
        self.in_flight = max(0, self.in_flight - 1)
        if priority is PriorityClass.CORE:
            self.core_in_flight = max(0, self.core_in_flight - 1)
        self._changed()

    def _changed(self) -> None:
        """A stream started or ended: close the busy interval at the old share, open one at the new."""
        now = time.monotonic()
        busy, since, share = self._busy
        held = min(1.0, self.in_flight / self.limit) if self.in_flight else 0.0
        self._busy = (busy + (now - since) * share, now, held)
        self._gauge.set(self.in_flight)


class ConcurrencyCapacity:
    """The scheduler's capacity for a stream engine: admission by :class:`StreamSlots`, with slots held back
    for CORE.

    Args:
        slots: the engine's :class:`StreamSlots`.

    Refusal reasons: ``upstream_concurrency`` (the limit is reached) and
    ``upstream_core_reserve`` (only the slots held back for CORE are left; a NORMAL or
    BATCH request waits while a CORE one may start: :attr:`CLASS_REFUSALS`).

    :meth:`take` takes the request's slot; :meth:`give` gives none back: the slot is the upstream call's, given
    back when that call ends (:meth:`call_ended`, the stream loop's one release point; :class:`StreamSlots`).
    """

    CLASS_REFUSALS = frozenset({UPSTREAM_CORE_RESERVE})
    """Refusals that depend on the request's class: a higher class behind the refused head may still start."""

    def __init__(self, slots: StreamSlots) -> None:
        self.slots = slots

    def refusal(self, req: Request) -> str | None:
        return self.slots.refusal(req.priority)

    def never_fits(self, req: Request) -> str | None:
        return None

    def take(self, req: Request) -> None:
        self.slots.acquire(req.priority)

    def give(self, req: Request) -> None:
        """``req`` left the running set; its upstream call may still run, and keeps its slot (:meth:`call_ended`)."""

    def call_ended(self, req: Request) -> None:
        """``req``'s upstream call ended (its task is done): its slot is free, on the pool and on its endpoint."""
        self.slots.release(req.priority)
