"""A scheduler capacity of a fixed number of running requests: baselines and tests, never the product.

The product's capacity comes from the hardware (``scheduler.capacity``:
:class:`switchyard.dispatcher.scheduler.capacity.KvBudget` and its kin). A fixed count
of slots is what ``switchyard bench compare``'s scenario A (one slot: no batching) is
measured against, and what scheduler tests use to stand in for a KV budget that holds
exactly that many requests. It implements
:class:`switchyard.dispatcher.scheduler.capacity.Capacity`.
"""

from __future__ import annotations

from typing import Any


class FixedSlots:
    """A scheduler capacity of ``n`` running requests, for baselines only (scenario A: ``n`` = 1, no batching).

    The product's capacity comes from the hardware (``scheduler.capacity``); a fixed count is what
    the baseline is measured against.
    """

    CLASS_REFUSALS: frozenset[str] = frozenset()

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.running = 0

    def refusal(self, req: Any) -> str | None:
        return None if self.running < self.n else "kv_memory"

    def never_fits(self, req: Any) -> str | None:
        return None

    def take(self, req: Any) -> None:
        self.running += 1

    def give(self, req: Any) -> None:
        self.running -= 1


__all__ = ["FixedSlots"]
