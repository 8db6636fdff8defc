"""An adaptive concurrency limit for upstream (stream) engines: admission at the knee.

A continuous-batching model server (vLLM, SGLang, TGI, ``transformers serve``)
takes every stream it is sent and serves them first come, first served. Past
its *knee*, the concurrency where more streams stop buying throughput, each
extra stream only adds queueing inside the server, where the dispatcher's
priority order cannot reach it: a CORE task then waits behind BATCH work like
everyone else. So the dispatcher keeps the upstream at its knee, not past it,
and lower classes wait in the dispatcher's own queue, where CORE goes first.
Few servers refuse load (429/503) before they slow down, so the limit finds the
knee from what it measures.

**What is measured.** Time is cut into windows of ``window_s``. Per window:
the mean streams in flight ``c`` (time-weighted), the tokens (content chunks)
received per second ``X``, and the mean TTFT of the streams that got their
first token in it. By Little's law ``X / c`` is one stream's token rate, the
inverse of its inter-token latency, so ``X`` against ``c`` is the inter-token
latency against streams in flight, and its flat top is the server's throughput
plateau. Each window updates the *level* ``round(c)``: the mean of its first windows'
``X`` and TTFT, then an EWMA, stamped with the time; a level not measured for
``memory_s`` is forgotten (the server, or what it is asked, may have changed;
``memory_s`` holds at least ten windows, see the config's ``MEMORY_WINDOWS``).
A window whose ``c`` is more than a quarter away from the streams in flight
when it opened measured a ramp (a burst starting, a probe, the limit coming
down), not a level: the streams it added were still in their prefill, and it
updates no level. Levels do not age in a window whose level is above the limit
(streams admitted under a higher limit still draining: no level under it can
be measured until they end; with streams as long as ``memory_s`` the knee's
level aged out while a probe's streams drained, and the limit walked up probe
after probe).

**The knee** over the levels remembered and measured in at least two windows
(all levels while none is, at start-up: one window of a shared machine's CPU
is 10-20 % off): the throughput envelope ``E(c) = max X(c' <= c)``, and
``knee = lowest c with E(c) >= knee_fraction x P(c)``, where the plateau
``P(c)`` is the mean throughput of the levels from ``c`` up (exported as
``switchyard_upstream_concurrency_knee``). A mean, not the highest level: the
highest of many noisy levels is a lucky window (the winner's curse), and a
plateau set by it moved the knee up to that window's level, window after
window, until the limit ran to 82-88 streams in front of a server whose
throughput was flat from 4. The knee is *confirmed* when a level
at least ``2 x knee`` (and one stream more) was measured, or a level above the
knee that is as much as the load offers (measured while fewer streams were
wanted than the limit allowed: no probe can go higher; a saturated window in
which the limit refused streams with that many or more in flight clears the
mark, since the load then offers more), or when the server refused a stream
for load (429/503) with others in flight at or below the level that would
confirm it (no probe can measure past what the server takes; remembered for
``memory_s``, as a level is: before, every window probed up to the refusals,
and the server refused the streams past them window after window), or when
``max_limit`` is below the limit at that level and the highest level it lets
NORMAL and BATCH fill was measured (before, the knee was never confirmed, never
probed below, and the limit sat at ``max_limit``: 32 in front of a server flat
from 8): twice the streams
were seen to buy no more than ``1 / knee_fraction`` as much throughput (a level
only a little higher would confirm a knee that is not one: on a linear curve
25 % more streams give 25 % more throughput, within a noisy machine's spread).

**The rule**, once per window (``limit`` is the current limit; the limit "at"
a concurrency ``c`` is the least one under which NORMAL and BATCH fill ``c``,
the CORE headroom below on top):

- *saturated* (the limit is used: mean in flight at least 90 % of what NORMAL
  and BATCH may fill, and at least half the limit) and the knee not confirmed:
  probe upwards, before any knee is known by ``sqrt(limit)`` (the growth term
  of Netflix concurrency-limits' ``Gradient2Limit``), then to the limit at the
  level that would confirm the knee (``2 x knee``, so the limit doubles while
  throughput keeps rising, as TCP slow start does), holding there until it is
  measured;
- knee confirmed, saturated, and no level below the knee remembered: probe
  downwards, to the limit at ``0.7 x knee`` (never below 4 streams, or
  ``initial_limit`` where lower: a knee lower than that is the TTFT brake's,
  the server queue's or a 429's to find, not a few noisy windows'), holding
  there until a level below
  the knee is measured (BBR's ProbeRTT drains the same way to see whether less
  in flight does as well; Cardwell et al., "BBR: Congestion-Based Congestion
  Control", ACM Queue 14(5), 2016). Without it the knee could only move up: the
  levels below it age out while the limit holds at it, and a knee above the
  server's was never found too high again. Once per ``memory_s``, at most one
  window's throughput at 0.7 of the knee is what it costs;
- knee confirmed: after a probe, the limit goes back to the limit at the knee
  at once; else ``limit += smoothing x (at the knee - limit)``, never upwards
  unless saturated; a knee confirmed by the load alone with no level counted
  above it (a load of one stream at a time: its only level is its knee; a level
  a burst measured once does not count) says
  nothing of the server's knee, so it counts as at least ``initial_limit``,
  the limit with nothing measured. The probes find the knee within a factor
  of two upwards and of ``1 / 0.7`` downwards;
- not saturated (app-limited, fewer in flight than half the limit, a test):
  the limit never grows;
- the window's TTFT above ``ttft_tolerance`` x the TTFT remembered at the same level
  (the server got slower at the same load: other tenants, longer prompts):
  ``limit *= max(0.5, ttft_tolerance x remembered / measured)``, the gradient of
  ``Gradient2Limit`` against a baseline per concurrency level instead of one
  long EWMA (which follows the loaded TTFT within seconds and lets the limit
  run away, as TCP Vegas' ``baseRTT`` would without its minimum);
- a 429, 503 or 529: each refusal costs one bounded step, AIMD's
  multiplicative decrease: the limit comes down to the other streams in flight
  (the server took those, and runs them), but never below ``backoff_ratio x``
  itself (nor ``min_limit``), so refusals in a row bring it down geometrically
  (0.5: 16, 8, 4, 2, 1) and a burst of them to what the server took. A refusal
  with no other stream in flight (no word on how many it takes: a rate limit),
  or one asking a wait (Retry-After: the cooldown sends nothing before it, and
  the server said when, not how many), costs the step once per burst: the
  largest TTFT remembered after the first (0.1 s with none), or the wait it asked
  where longer, so one burst counts once. A refusal with others in flight at
  least that step (one asking no wait) caps the limit for ``memory_s`` under the
  streams then in flight (the CORE headroom comes out of what the server takes:
  above it, each CORE stream taken into a reserved slot was the one refused), and
  a knee with nothing counted above it counts as what the server takes. Before, a
  refusal dropped the limit to the others in flight and then multiplied it, and
  capped it there for ``memory_s``: a single 503 with one other stream in flight
  (a light load, an ingress's blip) left the endpoint's limit at 1 stream for
  30 s. The step is Netflix concurrency-limits' ``AIMDLimit`` (``limit x
  backoffRatio`` per drop) floored at what is in flight, as TCP's ``ssthresh =
  max(FlightSize / 2, 2 x SMSS)`` (RFC 5681, section 3.1) halves what is in
  flight, not below two segments.

**The server's own queue** (vLLM's and SGLang's ``num_requests_waiting``, TGI's
and llama.cpp's likewise, read from the server's ``/metrics`` by the gateway: for
each endpoint of a pool, and for the one endpoint while its server reports one;
:meth:`on_server_queue`):
a server that reports requests waiting inside it while streams of this limit are
in flight runs fewer at once than it was sent, so the limit is past its knee
whatever the throughput curve says (sooner than the downward probe, which runs
once per ``memory_s``). The limit is then capped at the streams it runs plus one
ready to start (in flight minus waiting plus ``SERVER_QUEUE_ALLOWED``, at least
``min_limit``); the cap rises by one stream at a read that finds no more than that
waiting while the limit is used (another client's request in the server's queue
must not hold the cap at its floor), so a server that
got faster is found again, one stream at a time (TCP Vegas keeps its window
by the queue it measures the same way).

Levels above the knee age out after ``memory_s`` while the limit holds at the
knee; the knee is then no longer confirmed and the next saturated windows probe
upwards again, as TCP Vegas and BBR probe for bandwidth: a server that got
faster is found within a few windows, one that got slower by the TTFT brake.

**Reserved headroom for CORE** (the reserved slots of the SGLang Model
Gateway's priority scheduler, lightseekorg/smg
``docs/concepts/reliability/priority-scheduling.md``): ``reserve =
min(core_reserved_slots, limit // 4)`` slots are held back from NORMAL and
BATCH while CORE does not use them; a CORE stream in flight collapses the hold
one for one. NORMAL and BATCH may start while ``in_flight < limit - max(0,
reserve - core_in_flight)``, CORE while ``in_flight < limit`` or while fewer than
``reserve`` CORE streams are in flight: the reserved slots are CORE's even when the
limit has come down below the lower-class streams admitted under it (a CORE request
waited seconds for BATCH streams to end there). A limit under 4 reserves none: a
server that takes 2 streams is not sent 4 (its 429s would requeue CORE until it failed).
The rule is :func:`refusal_for`; the limit only says what it is (``limit``, ``reserve``). The
dispatcher applies it over the streams it admitted
(:class:`switchyard.dispatcher.scheduler.capacity.StreamSlots`, their one count), against a
pool's sum of these limits (:class:`switchyard.gateway.pool.PoolLimit`).

Bounds: ``[min_limit, max_limit]`` from ``queue.json``
``model_gateway.concurrency``. The class is self-contained (one instance per
upstream endpoint): its gauges are arguments, the module's unlabeled ones by
default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import Gauge

from switchyard.common.config import AdaptiveConcurrencyConfig
from switchyard.common.priority import PriorityClass

UPSTREAM_LIMIT = Gauge(
    "switchyard_upstream_concurrency_limit",
    "Streams the dispatcher may have in flight to the upstream model now (adaptive concurrency limit).",
)
UPSTREAM_KNEE = Gauge(
    "switchyard_upstream_concurrency_knee",
    "Estimated knee of the upstream, streams: the lowest concurrency measured to reach knee_fraction of the "
    "throughput plateau (0 until measured).",
)
UPSTREAM_IN_FLIGHT = Gauge("switchyard_upstream_in_flight", "Streams in flight to the upstream model.")

UPSTREAM_CONCURRENCY = "upstream_concurrency"
"""Refusal reason: the limit is reached."""
UPSTREAM_CORE_RESERVE = "upstream_core_reserve"
"""Refusal reason: only the slots held back for CORE are left (a NORMAL or BATCH stream waits)."""

SHORT_ALPHA = 0.1
"""Weight of a new TTFT sample in :attr:`AdaptiveConcurrencyLimit.short_s` (about the last 10)."""
LEVEL_ALPHA = 0.1
"""Weight of a new window in a level's throughput and TTFT EWMA (about the last 10 windows: one window on a shared
CPU is 10-20 % off, and a level held at the knee must not drift by a few unlucky windows below a probe's)."""
CONFIRM_RATIO = 2.0
"""A knee is confirmed once a level this many times higher (and one stream more) was measured."""
TOP_BAND = 0.85
"""Levels at least this fraction of the highest one confirm a knee by the load together (see ``_estimate``)."""
SATURATED_FILL = 0.9
"""A window is saturated when its mean in flight reaches this fraction of the NORMAL/BATCH ceiling."""
BRAKE_MIN_WINDOWS = 3
"""The TTFT brake compares against a level measured in at least this many windows."""
BRAKE_MIN_SAMPLES = 3
"""... with a window mean over at least this many TTFTs (one slow first token is not a slower server)."""
SERVER_QUEUE_ALLOWED = 1
"""Requests a server may hold waiting for this limit (:meth:`AdaptiveConcurrencyLimit.on_server_queue`): one
stream ready to start the moment a running one ends, so that the server does not idle for the dispatcher's
round trip (capping at the running streams alone cost 23 % of calls/s in front of two ``sim-openai
--max-running 2``); one waiting request is all a CORE stream can find ahead of it there."""
RAMP_FRACTION = 0.25
"""A window whose mean in flight is more than this fraction (and one stream) away from the streams in flight when
it opened measured a ramp, not a level (:meth:`AdaptiveConcurrencyLimit.observe_window`)."""
PROBE_WINDOWS = 2
"""A level counts in the knee once measured in this many windows (one window may be 10-20 % off); a probe holds
until its level has."""
DOWN_PROBE = 0.7
"""The downward probe measures ``DOWN_PROBE x knee`` streams: below the knee's 90 % point on a linear curve
(so a knee that is right stays), above half of it (so a knee too high comes down by at most 1 / 0.7)."""
DOWN_PROBE_FLOOR = 4
"""The downward probe goes no lower than this many streams (or ``initial_limit`` where that is lower, or
``min_limit`` where that is higher): a continuous-batching server batches at least a few, and on a few noisy
windows the probes walked the limit from 8 to 2 within two seconds through a stack whose own CPU flattened the
curve. A knee lower than that is the TTFT brake's, the server queue's or a 429's to find."""
BRAKE_FLOOR = 0.5
"""The TTFT brake shrinks the limit by at most this factor per window (Gradient2Limit's floor)."""


def core_reserve(limit: float, core_reserved_slots: int) -> int:
    """Slots of ``limit`` held back for CORE: ``min(core_reserved_slots, int(limit) // 4)``."""
    return min(core_reserved_slots, int(limit) // 4)


def refusal_for(priority: PriorityClass, limit: float, in_flight: int, core_in_flight: int,
                reserve: int) -> str | None:
    """The admission rule with CORE headroom (see the module docstring): None when a stream of class
    ``priority`` may start with ``in_flight`` streams (``core_in_flight`` of them CORE) under ``limit``, of
    which ``reserve`` slots are held back for CORE, else :data:`UPSTREAM_CONCURRENCY` or
    :data:`UPSTREAM_CORE_RESERVE`. Applied by one owner, the dispatcher's
    :class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`, under a pool's sum of the endpoints' limits
    (:class:`switchyard.gateway.pool.PoolLimit`, one reserve for the pool) or one limit's own."""
    whole = int(limit)
    if priority is PriorityClass.CORE:
        return None if in_flight < whole or core_in_flight < reserve else UPSTREAM_CONCURRENCY
    if in_flight >= whole:
        return UPSTREAM_CONCURRENCY
    hold = max(0, reserve - core_in_flight)
    return UPSTREAM_CORE_RESERVE if in_flight >= whole - hold else None


@dataclass
class Level:
    """What was measured at one concurrency level (streams in flight, rounded)."""

    tokens_per_s: float
    ttft_s: float | None
    seen_at: float
    windows: int = 1
    demand_limited: bool = False
    """Measured, since it was last forgotten, while the limit was not what bounded it (fewer streams were
    wanted than it allowed): the load offers no more than this level."""


class AdaptiveConcurrencyLimit:
    """The limit, the knee it is kept at, and the CORE headroom (see the module docstring).

    Args:
        config: ``model_gateway.concurrency``.
        limit_gauge, knee_gauge, in_flight_gauge: where the limit, the knee
            estimate and the streams in flight are published (default the
            module's unlabeled gauges; a pool of endpoints passes labeled children).
        clock: monotonic seconds, read when a caller passes no ``now``.

    Interface: :meth:`admission_limit` (the limit and CORE's reserve, for an admission that
    counts its own streams: :class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`),
    :meth:`note_refused` (that admission refused a stream), :meth:`started` / :meth:`ended`
    (a stream was sent / ended), :meth:`on_sample` (a TTFT), :meth:`on_tokens` (tokens
    received), :meth:`on_overload` (a 429/503), :meth:`on_server_queue`. ``limit`` is a
    float; ``int(limit)`` streams may be in flight. ``knee`` is the estimate in streams, None
    until measured. It admits nothing itself. All methods run on one event loop; none blocks.
    """

    def __init__(self, config: AdaptiveConcurrencyConfig, *, limit_gauge: Any = UPSTREAM_LIMIT,
                 knee_gauge: Any = UPSTREAM_KNEE, in_flight_gauge: Any = UPSTREAM_IN_FLIGHT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limit = float(config.initial_limit)
        self.in_flight = 0
        """Streams in flight to this upstream now, what its windows measure (kept by :meth:`started` /
        :meth:`ended`)."""
        self.knee: float | None = None
        """Estimated knee, streams; None until a window was measured."""
        self.short_s: float | None = None
        """Recent TTFT, seconds: a fast EWMA of the samples (about the last 10); None before the first."""
        self.levels: dict[int, Level] = {}
        """Concurrency level (streams) -> what was measured there, for ``memory_s``."""
        self._clock = clock
        self._limit_gauge, self._knee_gauge, self._in_flight_gauge = limit_gauge, knee_gauge, in_flight_gauge
        self._burst_until = -math.inf  # monotonic seconds: refusals before it are one burst (:meth:`on_overload`)
        self._window_start: float | None = None
        self._last_event = 0.0
        self._area = 0.0  # integral of in_flight over the window, stream-seconds
        self._tokens = 0
        self._ttft_sum = 0.0
        self._ttft_n = 0
        self._window_ttfts = 0  # TTFT samples in the window being applied
        self._opened_with = 0  # streams in flight when the window being measured opened
        self._probing = False  # the limit is at a probe's level (up or down), not at the knee
        self._refused = False  # a stream was refused in the window: more were wanted than the limit let through
        self._counted_top = 0  # the highest level the knee estimate counted (streams; 0 before the first)
        self._by_ceiling = False  # the knee is confirmed by a ceiling no probe can pass (a refusal, max_limit)
        self.refused_at: tuple[int, float] | None = None
        """(streams in flight, the refused one included, monotonic seconds) when the server last refused a stream
        for load with others in flight, at least one step of the limit (:meth:`on_overload`): no level from there up
        can be measured, and the limit stays under it; forgotten after ``memory_s`` like a level."""
        self.server_cap: float | None = None
        """Streams the server was last seen to run at once (in flight minus its own queue), the limit's cap;
        None until the server reported a queue (:meth:`on_server_queue`)."""
        limit_gauge.set(self.streams)
        knee_gauge.set(0)
        in_flight_gauge.set(0)

    @property
    def streams(self) -> int:
        """Streams the limit lets in flight now: ``int(limit)``, what admission goes by and its gauge shows (the
        float's fraction is the rule's progress between whole streams, never a stream admitted)."""
        return int(self.limit)

    # ------------------------------------------------------------------ admission

    @property
    def reserve(self) -> int:
        """Slots held back for CORE: ``min(core_reserved_slots, int(limit) // 4)``."""
        return core_reserve(self.limit, self.config.core_reserved_slots)

    @property
    def lower_class_ceiling(self) -> int:
        """Streams NORMAL and BATCH may fill while no CORE stream is in flight: ``int(limit) - reserve``."""
        return int(self.limit) - self.reserve

    def admission_limit(self) -> tuple[float, int]:
        """(:attr:`limit`, :attr:`reserve`): this limit as the source of an admission
        (:class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`, which counts the streams it admits)."""
        return self.limit, self.reserve

    def note_refused(self) -> None:
        """A stream was refused under this limit (or a pool's sum of it, :class:`switchyard.gateway.pool.PoolLimit`):
        the window being measured wanted more streams than were let through."""
        self._refused = True

    def started(self, now: float | None = None) -> None:
        """A stream (one attempt of a call) was sent to the upstream at ``now`` (monotonic seconds)."""
        self._advance(self._clock() if now is None else now)
        self.in_flight += 1
        self._in_flight_gauge.set(self.in_flight)

    def ended(self, now: float | None = None) -> None:
        """A stream sent to the upstream ended at ``now`` (finished, failed or cancelled)."""
        self._advance(self._clock() if now is None else now)
        self.in_flight = max(0, self.in_flight - 1)
        self._in_flight_gauge.set(self.in_flight)

    # ------------------------------------------------------------------ measurements

    def on_sample(self, ttft_s: float, now: float | None = None) -> None:
        """One stream's TTFT in seconds (request sent -> first token), at ``now``."""
        self._advance(self._clock() if now is None else now)
        if ttft_s > 0:
            self._ttft_sum += ttft_s
            self._ttft_n += 1
            self.short_s = ttft_s if self.short_s is None else self.short_s + SHORT_ALPHA * (ttft_s - self.short_s)

    def on_tokens(self, count: int, now: float | None = None) -> None:
        """``count`` tokens (content chunks) arrived from the upstream at ``now``."""
        self._advance(self._clock() if now is None else now)
        self._tokens += count

    def on_overload(self, now: float, retry_after_s: float | None = None) -> None:
        """The upstream refused load (a 429, 503 or 529) at ``now`` (monotonic seconds), to a stream still counted
        in flight; ``retry_after_s``: the wait it asked for (Retry-After), None or 0 where it asked none.

        One bounded step (the module docstring): with others in flight and no wait asked, the limit comes down to
        them but to no less than ``backoff_ratio x`` itself, and where they are at least that, they cap it for
        ``memory_s`` (:attr:`refused_at`); else ``limit x backoff_ratio`` once per burst (the largest TTFT
        remembered, 0.1 s with none, or the asked wait where longer)."""
        others = self.in_flight - 1  # the streams the server took beside the refused one
        step = max(float(self.config.min_limit), self.limit * self.config.backoff_ratio)
        wait = retry_after_s or 0.0
        if others > 0 and wait <= 0:
            if others >= step:  # the server was seen to take this many and refuse one more: its ceiling
                self._forget_stale_refusal(now)
                self.refused_at = (min(self.in_flight, self.refused_at[0]) if self.refused_at else self.in_flight,
                                   now)
            self._set(min(self.limit, max(step, float(others))))
            return
        if now >= self._burst_until:  # a new burst: its one step
            ttfts = [level.ttft_s for level in self.levels.values() if level.ttft_s]
            self._burst_until = now + (max(ttfts) if ttfts else 0.1)
            self._set(min(self.limit, step))
        if wait > 0:  # nothing is sent before then (the cooldown): a refusal meanwhile answers a stream sent before
            self._burst_until = max(self._burst_until, now + wait)

    def _forget_stale_refusal(self, now: float) -> None:
        """Forget :attr:`refused_at` once it is older than ``memory_s`` at ``now``, as a level is forgotten."""
        if self.refused_at is not None and now - self.refused_at[1] > self.config.memory_s:
            self.refused_at = None

    def on_server_queue(self, waiting: int) -> None:
        """The server reports ``waiting`` requests queued inside it (not running), read now: more than
        :data:`SERVER_QUEUE_ALLOWED` with streams of this limit in flight caps the limit at the streams it runs
        plus that many (``in_flight - waiting + SERVER_QUEUE_ALLOWED``, at least ``min_limit``); no more than that
        while the limit is used raises the cap by one (the module docstring).
        ``waiting`` counts every client's requests, so with several dispatchers in front of one server each
        caps itself at its share or below."""
        if waiting > SERVER_QUEUE_ALLOWED and self.in_flight > 0:
            self.server_cap = float(max(self.config.min_limit, self.in_flight - waiting + SERVER_QUEUE_ALLOWED))
            self._set(self.limit)
        elif waiting <= SERVER_QUEUE_ALLOWED and self.server_cap is not None \
                and self.in_flight >= int(self.limit) - self.reserve:
            self.server_cap += 1
            self._set(self.limit + 1)

    # ------------------------------------------------------------------ the rule

    def _advance(self, now: float) -> None:
        if self._window_start is None:
            self._window_start = self._last_event = now
            return
        if now > self._last_event:
            self._area += self.in_flight * (now - self._last_event)
            self._last_event = now
        if now - self._window_start >= self.config.window_s:
            self._close_window(now)

    def _close_window(self, now: float) -> None:
        assert self._window_start is not None
        span = now - self._window_start
        mean, tokens = self._area / span, self._tokens
        ttft = self._ttft_sum / self._ttft_n if self._ttft_n else None
        self._window_ttfts = self._ttft_n
        refused, self._refused = self._refused, False
        opened_with, self._opened_with = self._opened_with, self.in_flight
        self._window_start, self._area, self._tokens, self._ttft_sum, self._ttft_n = now, 0.0, 0, 0.0, 0
        if mean < 0.5 or tokens == 0:
            return  # idle: nothing learnt
        self.observe_window(mean, tokens / span, ttft, now, refused=refused, opened_with=opened_with)

    def observe_window(self, mean_in_flight: float, tokens_per_s: float, ttft_s: float | None, now: float, *,
                       refused: bool = False, opened_with: int | None = None) -> None:
        """Apply one window's measurement (see the module docstring); called by the window clock.

        Args:
            mean_in_flight: time-weighted mean streams in flight over the window.
            tokens_per_s: tokens received per second over the window.
            ttft_s: mean TTFT of the streams whose first token came in the window, seconds (None: none did).
            now: end of the window, monotonic seconds.
            refused: a stream was refused under this limit in the window (:meth:`note_refused`: more were wanted
                than the limit let through).
            opened_with: streams in flight when the window opened (None: as many as its mean). A window whose
                mean is more than :data:`RAMP_FRACTION` (and one stream) away from it measured a ramp, not a
                level: the streams it added were still in their prefill, the ones it lost had ended. It updates
                no level; the TTFT brake and the rule still read it.
        """
        level_key = max(1, round(mean_in_flight))
        if level_key > self.streams:
            self._hold_ages(level_key, now)
        level = self.levels.get(level_key)
        if level is not None and now - level.seen_at > self.config.memory_s:
            level = None
        ramp = opened_with is not None and abs(mean_in_flight - opened_with) > max(1.0, RAMP_FRACTION * mean_in_flight)
        saturated = (mean_in_flight >= SATURATED_FILL * self.lower_class_ceiling
                     and mean_in_flight >= self.limit / 2 and self.in_flight >= self.limit / 2)
        braked = self._brake(level, ttft_s)
        if not ramp:
            level = self._record(level, level_key, tokens_per_s, ttft_s, now)
            level.demand_limited = level.demand_limited or not saturated  # kept while the level is remembered
        if saturated and refused:
            self._offered_more(level_key)
        confirmed = self._estimate(now)
        if not braked:
            self._decide(confirmed, saturated)

    def _hold_ages(self, level_key: int, now: float) -> None:
        """A window measured at ``level_key``, more in flight than the limit lets in now: streams admitted under a
        higher limit (a probe's, before a brake or a 429) that have not ended. No level at or under the limit can
        be measured until they do, so none ages meanwhile: with streams as long as memory_s, the knee's level aged
        out while the probe's was measured, became the knee, and the limit walked up probe after probe."""
        for key, other in self.levels.items():
            if key != level_key:
                other.seen_at = min(now, other.seen_at + self.config.window_s)

    def _brake(self, level: Level | None, ttft_s: float | None) -> bool:
        """The TTFT brake: the window's TTFT above ``ttft_tolerance`` x the TTFT remembered at its level (measured
        in at least BRAKE_MIN_WINDOWS windows, the window's mean over at least BRAKE_MIN_SAMPLES TTFTs) shrinks the
        limit by the gradient, at most by BRAKE_FLOOR, and ends a probe. True when it braked."""
        if (level is None or ttft_s is None or level.ttft_s is None or level.windows < BRAKE_MIN_WINDOWS
                or self._window_ttfts < BRAKE_MIN_SAMPLES or ttft_s <= self.config.ttft_tolerance * level.ttft_s):
            return False
        self._probing = False  # a probe's way back to the knee would undo the brake
        self._set(self.limit * max(BRAKE_FLOOR, self.config.ttft_tolerance * level.ttft_s / ttft_s))
        return True

    def _record(self, level: Level | None, level_key: int, tokens_per_s: float, ttft_s: float | None,
                now: float) -> Level:
        """Fold one window's throughput and TTFT into the level ``level_key`` (``level``: it as remembered, None
        when new or forgotten): the mean of its first windows, then an EWMA."""
        if level is None:
            level = self.levels[level_key] = Level(tokens_per_s, ttft_s, now)
            return level
        level.windows += 1
        # the mean of the first windows, then an EWMA: a level's first window must not weigh 90 % of it
        alpha = max(LEVEL_ALPHA, 1 / level.windows)
        level.tokens_per_s += alpha * (tokens_per_s - level.tokens_per_s)
        if ttft_s is not None:
            level.ttft_s = ttft_s if level.ttft_s is None else level.ttft_s + alpha * (ttft_s - level.ttft_s)
        level.seen_at = now
        return level

    def _offered_more(self, level_key: int) -> None:
        """A saturated window in which the limit refused streams: the load now wants more than the limit lets
        through, so a level up to the limit, marked as all that a lighter load offered, no longer is (it would
        confirm a knee the load now asks past). Up to the limit, not only to what is in flight: NORMAL and BATCH
        fill the limit less its CORE headroom, so a level between the two can be measured again only by a probe,
        which the mark would forbid."""
        reach = max(level_key, int(self.limit))
        for key, other in self.levels.items():
            if key <= reach:
                other.demand_limited = False

    def _decide(self, confirmed: bool, saturated: bool) -> None:
        """The rule, once per window that did not brake (the module docstring): probe upwards while the knee is
        not confirmed; else probe downwards where nothing below the knee is remembered; else back to the knee at
        once after a probe, or a step of ``smoothing`` towards it (upwards only while saturated)."""
        if not confirmed:
            if saturated:
                self._probing = True
                self._set(max(self.limit, self._probe_goal()))
            return
        assert self.knee is not None
        knee = self.knee
        if knee >= self._counted_top and not self._by_ceiling:
            # Confirmed by the load alone with nothing counted past the knee (one stream at a time, say):
            # the load offers no more, which says nothing of where the server's throughput flattens, as at
            # start-up. Not taken below the start-up limit (a limit of 1 would queue the next burst, CORE
            # too, behind one stream until the probes climb back). Counted, not merely measured: the levels
            # a one-window burst measured once above a lull's level do not count in the knee, and they had
            # let the return from the burst's probe take the limit to the lull's one stream.
            knee = max(knee, float(self.config.initial_limit))
        elif knee >= self._counted_top and self.refused_at is not None:
            # Confirmed by the server's refusal with nothing counted past the knee: throughput may rise up to
            # what the server takes (the CORE headroom kept NORMAL and BATCH from measuring its last stream).
            knee = max(knee, float(self.refused_at[0] - 1))
        floor = max(self.config.min_limit, min(self.config.initial_limit, DOWN_PROBE_FLOOR))
        below = max(math.floor(DOWN_PROBE * knee), floor)
        if saturated and below < knee and self._unsupported_below(knee):
            self._probing = True
            self._set(min(self.limit, self._limit_for(below)))
            return
        goal = self._limit_for(knee)
        if self._probing:  # a probe's level was measured: back to the knee at once
            self._probing = False
            self._set(goal)
            return
        target = self.limit + self.config.smoothing * (goal - self.limit)
        if target < self.limit or saturated:
            self._set(target)

    def _limit_for(self, streams: float) -> int:
        """The least limit under which NORMAL and BATCH may fill ``streams`` (rounded up), its CORE headroom on
        top."""
        limit = math.ceil(streams)
        while limit - core_reserve(limit, self.config.core_reserved_slots) < math.ceil(streams):
            limit += 1
        return limit

    def _unsupported_below(self, knee: float) -> bool:
        """True when no level below ``knee`` measured in at least PROBE_WINDOWS windows is remembered."""
        return not any(key < knee and level.windows >= PROBE_WINDOWS for key, level in self.levels.items())

    def _probe_goal(self) -> float:
        """Where an upward probe takes the limit: ``limit + sqrt(limit)`` before any knee is known, else
        just far enough that NORMAL and BATCH can fill the level that would confirm the knee."""
        if self.knee is None:
            return self.limit + math.sqrt(self.limit)
        return self._limit_for(max(self.knee + 1, CONFIRM_RATIO * self.knee))

    def _estimate(self, now: float) -> bool:
        """Forget stale levels, recompute the knee; True when the knee is confirmed."""
        for key in [k for k, level in self.levels.items() if now - level.seen_at > self.config.memory_s]:
            del self.levels[key]
        if not self.levels:
            self.knee = None
            self._knee_gauge.set(0)
            return False
        settled = sorted(key for key, level in self.levels.items() if level.windows >= PROBE_WINDOWS)
        keys = settled or sorted(self.levels)
        envelope, best = [], 0.0
        for key in keys:
            best = max(best, self.levels[key].tokens_per_s)
            envelope.append(best)
        knee = keys[-1]
        self._counted_top = keys[-1]
        for i, key in enumerate(keys):
            above = [self.levels[k] for k in keys[i:]]
            mean = sum(level.tokens_per_s for level in above) / len(above)
            if envelope[i] >= self.config.knee_fraction * mean:
                knee = key
                break
        self.knee = float(knee)
        self._knee_gauge.set(knee)
        # Confirmed by a level twice as high, or by the highest levels the load reaches: when fewer streams
        # were wanted there than the limit allowed, no probe can measure higher. The levels within
        # TOP_BAND of the highest count as one (a closed-loop load of 32 streams is 29 to 34 in flight
        # window by window, and a burst can set a new highest level measured once): the highest marked, and
        # the marked ones measured twice in all, not a single window of a limit change.
        # A level in the band measured only while an older, lower limit bound it (the probe's way up) does not
        # count against the load: that the load then wanted more than the level says nothing about more than
        # the highest level, which is what the mark is about.
        top = [self.levels[key] for key in keys if key >= TOP_BAND * keys[-1]]
        by_load = top[-1].demand_limited and sum(level.windows for level in top if level.demand_limited) >= 2
        # Or by a ceiling no probe can pass: the server refused streams below the level that would confirm the
        # knee (a probe there only has streams refused, window after window), or max_limit is below the limit at
        # that level (the knee was never confirmed, never probed below, and the limit sat at max_limit).
        confirming = max(knee + 1, CONFIRM_RATIO * knee)
        self._forget_stale_refusal(now)
        by_server = self.refused_at is not None and self.refused_at[0] <= confirming
        ceiling = self.config.max_limit
        by_bound = (self._limit_for(confirming) > ceiling
                    and keys[-1] + 1 >= ceiling - core_reserve(ceiling, self.config.core_reserved_slots))
        self._by_ceiling = by_server or by_bound
        return keys[-1] >= confirming or by_load or self._by_ceiling

    def _set(self, value: float) -> None:
        if self.server_cap is not None:
            value = min(value, self.server_cap)
        if self.refused_at is not None:  # no more than the server was seen to take, CORE's headroom out of it
            value = min(value, self.refused_at[0] - 1)
        self.limit = max(float(self.config.min_limit), min(float(self.config.max_limit), value))
        self._limit_gauge.set(self.streams)
