"""Synthetic upstreams and the window loop that drive :class:`~switchyard.dispatcher.adaptive_limit.AdaptiveConcurrencyLimit`
without a server: the tests of the knee rule (tests/test_adaptive_limit.py) and ``tools/limit_noise.py``, which
prints where the limit settles under window-to-window noise.

A server is a function of the streams in flight to (tokens per second, TTFT seconds) for one window.
"""

from __future__ import annotations

import random
from typing import Callable

from switchyard.common.config import AdaptiveConcurrencyConfig
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit, refusal_for
from switchyard.dispatcher.scheduler.capacity import StreamSlots

WINDOW_S = 0.5
"""The windows' length, seconds (``model_gateway.concurrency.window_s`` of the shipped config)."""

Server = Callable[[int], tuple[float, float]]
"""Streams in flight -> (tokens per second, TTFT seconds) of a synthetic upstream over one window."""


def knee_server(knee: int, plateau: float = 1000.0, ttft_s: float = 0.01) -> Server:
    """A continuous-batching server: throughput rises linearly to ``knee`` streams, then stays flat;
    TTFT is flat up to the knee, then grows with the streams queued inside the server."""

    def serve(streams: int) -> tuple[float, float]:
        return plateau * min(streams, knee) / knee, ttft_s * max(1.0, streams / knee)

    return serve


def flat_then_falling(knee: int, plateau: float = 1000.0) -> Server:
    """A server on a small CPU: throughput flat from ``knee`` streams, falling to 60 % from 60 to 80 streams
    (in front of transformers serve on two cores: flat from 4 to 39 streams, lower at 62-77)."""

    def serve(streams: int) -> tuple[float, float]:
        falling = 1 - 0.4 * min(1.0, max(0, streams - 60) / 20)
        return plateau * min(streams, knee) / knee * falling, 0.01 * max(1.0, streams / knee)

    return serve


def noisy(server: Server, spread: float, seed: int) -> Server:
    """``server`` with each window's throughput scaled by a normal draw of mean 1 and deviation ``spread``
    (seeded): the window-to-window spread of a server sharing a small machine's CPU with the stack."""
    rng = random.Random(seed)

    def serve(streams: int) -> tuple[float, float]:
        tokens_per_s, ttft = server(streams)
        return tokens_per_s * max(0.0, rng.gauss(1.0, spread)), ttft

    return serve


class PoolOfOne:
    """What the dispatcher does with one endpoint's limit, without the gateway: it admits under it (the one
    admission, :class:`StreamSlots`) and sends each admitted stream to it (the limit counts what it measures)."""

    def __init__(self, limit: AdaptiveConcurrencyLimit) -> None:
        self.limit = limit
        self.slots = StreamSlots(limit)

    @property
    def core_in_flight(self) -> int:
        return self.slots.core_in_flight

    def refusal(self, priority: PriorityClass) -> str | None:
        return self.slots.refusal(priority)

    def acquire(self, priority: PriorityClass, now: float | None = None) -> None:
        self.slots.acquire(priority)
        self.limit.started(now)

    def release(self, priority: PriorityClass, now: float | None = None) -> None:
        self.slots.release(priority)
        self.limit.ended(now)


def make_limit(**fields: float) -> AdaptiveConcurrencyLimit:
    """A limit with ``window_s`` :data:`WINDOW_S` and ``fields`` over the config's defaults."""
    return AdaptiveConcurrencyLimit(AdaptiveConcurrencyConfig(**{"window_s": WINDOW_S, **fields}))


def drive(limit: AdaptiveConcurrencyLimit, server: Server, offered: int, windows: int, t: float = 0.0,
          trace: list[tuple[float, int]] | None = None) -> float:
    """Run ``windows`` windows of ``offered`` BATCH streams against ``server`` through ``limit``.

    Each window: in flight is set to what the limit lets BATCH take (at most ``offered``; a stream
    left waiting is refused under the limit, :meth:`~AdaptiveConcurrencyLimit.note_refused`, as the
    dispatcher's admission refuses it), the server's TTFT and
    tokens are reported at its clock. Returns the time after the last window (seconds);
    ``trace`` gets (limit, in flight) after each window.
    """
    for _ in range(windows):
        limit.on_tokens(0, t)  # the window clock ticks here: each window is [t, t + WINDOW_S)
        want = min(offered, limit.lower_class_ceiling)
        while limit.in_flight < want:
            limit.started(t)
        while limit.in_flight > want:
            limit.ended(t)
        if offered > want:  # the scheduler's head waits: the admission is refused under the limit
            assert refusal_for(PriorityClass.BATCH, limit.limit, limit.in_flight, 0, limit.reserve) is not None
            limit.note_refused()
        tokens_per_s, ttft = server(limit.in_flight)
        for k in range(4):  # four streams got their first token in this window
            limit.on_sample(ttft, t + WINDOW_S * (k + 1) / 10)
        limit.on_tokens(int(tokens_per_s * WINDOW_S), t + WINDOW_S / 2)
        t += WINDOW_S
        if trace is not None:
            trace.append((limit.limit, limit.in_flight))
    return t
