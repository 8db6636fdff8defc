"""The DRAM tier: one Redis, reached through redis-py's asyncio client, that degrades instead of failing.

Whatever a service keeps in the DRAM tier (agent memory, KV/prefix state) can
be rebuilt: a Redis outage must slow work down (recompute, no memory), never
fail a task. :meth:`DramClient.call` runs one Redis operation and answers a
fallback value when Redis is down. Each outage is logged once when it begins
(a WARNING naming the address and the error) and once when it ends, and
counted in ``switchyard_dram_outages_total``; while it lasts, calls skip Redis
at once (``switchyard_dram_degraded_operations_total``) and one call every
``[dram] retry_interval_s`` tries again, so a dead Redis costs no task a
timeout more than once per interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from switchyard.common.config import DramTierConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAM_UP = Gauge(
    "switchyard_dram_up", "1 while the DRAM tier's Redis answers; 0 while it is down and work goes on without it."
)
DRAM_OUTAGES = Counter(
    "switchyard_dram_outages_total", "Times the DRAM tier's Redis stopped answering (each outage counted once)."
)
DRAM_DEGRADED = Counter(
    "switchyard_dram_degraded_operations_total",
    "DRAM-tier operations skipped or failed because Redis was down or refused them; the work went on without the tier.",
)

_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class DramClient:
    """The DRAM tier's Redis for one service.

    Args:
        config: ``memory_policy.toml [dram]``: address, db, key prefix, timeouts.

    Keys are ``{key_prefix}{part}:{part}...`` (see :meth:`key`). Values are bytes.
    """

    def __init__(self, config: DramTierConfig) -> None:
        self.config = config
        self.address = f"{config.host}:{config.port}"
        self.redis = aioredis.Redis(
            host=config.host,
            port=config.port,
            db=config.db,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.op_timeout_s,
            # No client-side retries: an outage is detected by the first failure and skipped
            # afterwards (retry_interval_s), instead of every call waiting out backoffs.
            retry=Retry(NoBackoff(), 0),
        )
        self._down_since: float | None = None
        self._next_try = 0.0
        self._probe: asyncio.Lock = asyncio.Lock()

    @property
    def up(self) -> bool:
        """False from the first failed call of an outage until a call succeeds again."""
        return self._down_since is None

    def key(self, *parts: str) -> str:
        """``key_prefix`` + parts joined by ``:``, e.g. ``key("agent", "a1", "memory")``."""
        return self.config.key_prefix + ":".join(parts)

    async def start(self) -> bool:
        """Ping once so that an outage at start-up is logged at once. Returns whether Redis answered."""
        return await self.call(lambda r: r.ping(), False, "ping") is not False

    async def call(self, fn: Callable[[aioredis.Redis], Awaitable[T]], fallback: T, op: str = "call") -> T:
        """``await fn(redis)``, or ``fallback`` when Redis is down or refuses the command.

        Args:
            fn: one Redis operation (or a pipeline's ``execute``) on the client it is given.
            fallback: answered instead of raising.
            op: a short name for the log line.

        Never raises RedisError, OSError or a timeout: they become ``fallback``.
        """
        if self._down_since is not None:
            if time.monotonic() < self._next_try or self._probe.locked():
                DRAM_DEGRADED.inc()
                return fallback
            async with self._probe:
                return await self._attempt(fn, fallback, op)
        return await self._attempt(fn, fallback, op)

    async def _attempt(self, fn: Callable[[aioredis.Redis], Awaitable[T]], fallback: T, op: str) -> T:
        try:
            result = await asyncio.wait_for(fn(self.redis), self.config.op_timeout_s + self.config.connect_timeout_s)
        except _OUTAGE_ERRORS as exc:
            self._mark_down(exc, op)
            DRAM_DEGRADED.inc()
            return fallback
        except RedisError as exc:  # a refused command (OOM, wrong type): the server is up
            log.warning("DRAM tier: Redis at %s refused %s: %s; going on without it", self.address, op, exc)
            DRAM_DEGRADED.inc()
            return fallback
        self._mark_up()
        return result

    def _mark_down(self, exc: BaseException, op: str) -> None:
        now = time.monotonic()
        self._next_try = now + self.config.retry_interval_s
        if self._down_since is None:
            self._down_since = now
            DRAM_OUTAGES.inc()
            DRAM_UP.set(0)
            log.warning(
                "DRAM tier unavailable: Redis at %s (db %d) failed %s: %s. Work goes on without it (agent memory "
                "and KV swap degrade to recompute); retrying every %.1f s (memory_policy.toml [dram])",
                self.address, self.config.db, op, str(exc).rstrip(".") or type(exc).__name__,
                self.config.retry_interval_s,
            )

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("DRAM tier back: Redis at %s answers again after %.1f s down",
                        self.address, time.monotonic() - self._down_since)
            self._down_since = None
        DRAM_UP.set(1)

    async def close(self) -> None:
        await self.redis.aclose()
