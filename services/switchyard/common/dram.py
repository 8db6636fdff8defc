"""The DRAM tier: one Redis, reached through redis-py's asyncio client, that degrades instead of failing.

Whatever a service keeps in the DRAM tier (agent memory, KV/prefix state) can
be rebuilt: a Redis outage must slow work down (recompute, no memory), never
fail a task. :meth:`DramClient.call` runs one Redis operation and answers a
fallback value when Redis is down or refuses it. The client is the tier's
circuit breaker, with two states that open on their own:

- *down* (a connection error or timeout): every call skips Redis at once
  (``switchyard_dram_degraded_operations_total``) and one call every
  ``[dram] retry_interval_s`` tries again, so a dead Redis costs no task a
  timeout more than once per interval.
- *refusing writes* (the server answered an operation that adds data with an
  error: ``OOM command not allowed`` at ``maxmemory`` under ``noeviction``,
  ``READONLY``, ``MISCONF``): operations that add data (``grows=True``) skip
  Redis, one every ``retry_interval_s`` probes; reads and deletes go on (a
  delete is what frees a full Redis).

Each state is logged once when it begins (a WARNING naming the address, the
operation and the server's error) and once when it ends, and counted
(``switchyard_dram_outages_total``, ``switchyard_dram_write_refusals_total``).
A log line never holds an operation's arguments: redis-py quotes a failed
pipeline command with its arguments (payload bytes included) in the error, and
only the server's own message is kept (:func:`describe_error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable, TypeVar

import redis.asyncio as aioredis
from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from switchyard.common.config import DramTierConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

# Registered through _DramSeries, not at import: a process that opens no DRAM tier exports none of them.
DRAM_UP = Gauge(
    "switchyard_dram_up", "1 while the DRAM tier's Redis answers; 0 while it is down and work goes on without it.",
    registry=None,
)
DRAM_OUTAGES = Counter(
    "switchyard_dram_outages_total", "Times the DRAM tier's Redis stopped answering (each outage counted once).",
    registry=None,
)
DRAM_DEGRADED = Counter(
    "switchyard_dram_degraded_operations_total",
    "DRAM-tier operations skipped or failed because Redis was down or refused them; the work went on without the tier.",
    registry=None,
)

DRAM_WRITE_REFUSALS = Counter(
    "switchyard_dram_write_refusals_total",
    "Times the DRAM tier's Redis began refusing writes (full at maxmemory with noeviction, read-only, cannot "
    "persist); each run of refusals counted once. Writes skip it meanwhile, one probe every retry_interval_s.",
    registry=None,
)


class _DramSeries(Collector):
    """The DRAM tier's series, exported once the process has opened the tier (a :class:`DramClient`): a dispatcher
    whose engine keeps no KV state (openai) opens none, and exported ``switchyard_dram_up`` 0 from start to end,
    Redis up, read as the tier down on the dashboard beside the orchestrator's 1."""

    opened = False
    """A :class:`DramClient` was made in this process."""

    _metrics = (DRAM_UP, DRAM_OUTAGES, DRAM_DEGRADED, DRAM_WRITE_REFUSALS)

    def describe(self) -> Iterable[Metric]:
        for metric in self._metrics:
            yield from metric.describe()

    def collect(self) -> Iterable[Metric]:
        if _DramSeries.opened:
            for metric in self._metrics:
                yield from metric.collect()


REGISTRY.register(_DramSeries())

_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class _WaitingPool(aioredis.BlockingConnectionPool):
    """redis-py's BlockingConnectionPool whose wait that runs out names the pool's size and its setting: it said
    only 'No connection available.', which reads as Redis refusing connections."""

    async def get_connection(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        try:
            return await super().get_connection(*args, **kwargs)
        except RedisConnectionError as exc:
            if not isinstance(exc.__cause__, asyncio.TimeoutError):
                raise
            raise RedisConnectionError(
                f"no connection to Redis free within {self.timeout:g} s: all {self.max_connections} "
                "(memory_policy.toml [dram] max_connections) were waiting on Redis's answers") from exc


def redis_client(config: DramTierConfig, *, socket_timeout: float, retries: int) -> aioredis.Redis:
    """An asyncio Redis client of ``config``'s address whose pool holds at most ``config.max_connections``.

    Args:
        config: ``memory_policy.toml [dram]``: address, db, connect timeout, pool size.
        socket_timeout: longest wait for one reply, seconds; also the longest wait for a free connection.
        retries: times a command is sent again on a connection error, with no backoff.

    A call that finds every connection in use waits for one (redis-py's BlockingConnectionPool): redis-py's
    default pool refuses it at once with MaxConnectionsError, a ConnectionError, so a burst of calls on a healthy
    Redis read as an outage (the DRAM tier skipped for retry_interval_s, SubmitTask answered 503). A wait that
    runs out raises ConnectionError naming the pool's size and ``[dram] max_connections``."""
    pool = _WaitingPool(
        host=config.host, port=config.port, db=config.db,
        socket_connect_timeout=config.connect_timeout_s, socket_timeout=socket_timeout,
        retry=Retry(NoBackoff(), retries), max_connections=config.max_connections, timeout=socket_timeout,
    )
    return aioredis.Redis.from_pool(pool)


class DramClient:
    """The DRAM tier's Redis for one service.

    Args:
        config: ``memory_policy.toml [dram]``: address, db, key prefix, timeouts.

    Keys are ``{key_prefix}{part}:{part}...`` (see :meth:`key`). Values are bytes.
    """

    def __init__(self, config: DramTierConfig) -> None:
        _DramSeries.opened = True
        self.config = config
        self.address = f"{config.host}:{config.port}"
        # No client-side retries: an outage is detected by the first failure and skipped
        # afterwards (retry_interval_s), instead of every call waiting out backoffs.
        self.redis = redis_client(config, socket_timeout=config.op_timeout_s, retries=0)
        self._down_since: float | None = None
        self._next_try = 0.0
        self._probe: asyncio.Lock = asyncio.Lock()
        self._refusing_since: float | None = None
        self._next_write_try = 0.0
        self._write_probe: asyncio.Lock = asyncio.Lock()
        self._skipped_writes = 0
        self._logged_refusals: set[tuple[str, str]] = set()
        self._watch: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        """False from the first failed call of an outage until a call succeeds again."""
        return self._down_since is None

    def accepts_writes(self) -> bool:
        """False while Redis refuses operations that add data, until the next probe is due."""
        return self._refusing_since is None or time.monotonic() >= self._next_write_try

    def key(self, *parts: str) -> str:
        """``key_prefix`` + parts joined by ``:``, e.g. ``key("agent", "a1", "memory")``."""
        return self.config.key_prefix + ":".join(parts)

    async def start(self) -> bool:
        """Ping once so that an outage at start-up is logged at once, then every ``retry_interval_s`` seconds
        until :meth:`close` (a background task of the running event loop): ``switchyard_dram_up`` and the
        outage's log lines follow Redis while no work calls it. Only calls had moved them, so an idle service
        reported 1 through a whole outage, and 0 after Redis was back until its next call. Returns whether
        Redis answered the first ping."""
        answered = await self.call(lambda r: r.ping(), False, "ping") is not False
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_redis(), name=f"dram-watch-{self.address}")
        return answered

    async def _watch_redis(self) -> None:
        """Ping Redis every ``retry_interval_s`` seconds; an outage found begins (or ends) as a call's would.
        A ping is not the tier's work: it is never a degraded operation."""
        while True:
            await asyncio.sleep(self.config.retry_interval_s)
            try:
                await asyncio.wait_for(self.redis.ping(), self.config.op_timeout_s + self.config.connect_timeout_s)
            except _OUTAGE_ERRORS as exc:
                self._mark_down(exc, "ping")
                continue
            except RedisError:  # a refusal (a loading or busy server) is an answer: it is up
                pass
            self._mark_up()

    async def call(self, fn: Callable[[aioredis.Redis], Awaitable[T]], fallback: T, op: str = "call", *,
                   grows: bool = False) -> T:
        """``await fn(redis)``, or ``fallback`` when Redis is down or refuses the command.

        Args:
            fn: one Redis operation (or a pipeline's ``execute``) on the client it is given.
            fallback: answered instead of raising.
            op: a short name for the log line.
            grows: the operation adds data (a write that a full Redis refuses): it is skipped while Redis
                refuses writes, but for one probe every ``retry_interval_s``.

        Never raises RedisError, OSError or a timeout: they become ``fallback``.
        """
        if self._down_since is not None:
            if time.monotonic() < self._next_try or self._probe.locked():
                DRAM_DEGRADED.inc()
                return fallback
            async with self._probe:
                return await self._attempt(fn, fallback, op, grows)
        if grows and self._refusing_since is not None:
            if time.monotonic() < self._next_write_try or self._write_probe.locked():
                self._skipped_writes += 1
                DRAM_DEGRADED.inc()
                return fallback
            async with self._write_probe:
                return await self._attempt(fn, fallback, op, grows)
        return await self._attempt(fn, fallback, op, grows)

    async def _attempt(self, fn: Callable[[aioredis.Redis], Awaitable[T]], fallback: T, op: str,
                       grows: bool = False) -> T:
        try:
            result = await asyncio.wait_for(fn(self.redis), self.config.op_timeout_s + self.config.connect_timeout_s)
        except _OUTAGE_ERRORS as exc:
            self._mark_down(exc, op)
            DRAM_DEGRADED.inc()
            return fallback
        except RedisError as exc:  # a refused command (OOM, read-only, wrong type): the server is up
            self._mark_up()
            if grows and _refuses_writes(exc):
                self._mark_refusing(exc, op)
            else:
                self._refused(exc, op)
            DRAM_DEGRADED.inc()
            return fallback
        self._mark_up()
        if grows:
            self._mark_accepting()
        return result

    def _mark_refusing(self, exc: BaseException, op: str) -> None:
        now = time.monotonic()
        self._next_write_try = now + self.config.retry_interval_s
        if self._refusing_since is None:
            self._refusing_since = now
            self._skipped_writes = 0
            DRAM_WRITE_REFUSALS.inc()
            log.warning(
                "DRAM tier refuses writes: Redis at %s refused %s: %s. Work goes on without it (KV swap and agent "
                "memory writes degrade to recompute); one write retries every %.1f s (memory_policy.toml [dram])",
                self.address, op, describe_error(exc), self.config.retry_interval_s,
            )

    def _mark_accepting(self) -> None:
        if self._refusing_since is not None:
            log.warning("DRAM tier accepts writes again: Redis at %s, after %.1f s (%d writes skipped meanwhile)",
                        self.address, time.monotonic() - self._refusing_since, self._skipped_writes)
            self._refusing_since = None

    def _refused(self, exc: BaseException, op: str) -> None:
        """One command refused (a read, or a write refused for itself, e.g. WRONGTYPE): logged once per
        operation and error class (at most 64 pairs remembered), then at DEBUG."""
        text = describe_error(exc)
        code = type(exc).__name__
        first = (op, code) not in self._logged_refusals
        if first and len(self._logged_refusals) < 64:
            self._logged_refusals.add((op, code))
        log.log(logging.WARNING if first else logging.DEBUG,
                "DRAM tier: Redis at %s refused %s: %s; going on without it%s", self.address, op, text,
                " (logged once; counted in switchyard_dram_degraded_operations_total)" if first else "")

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
                self.address, self.config.db, op, self._describe_outage(exc).rstrip("."),
                self.config.retry_interval_s,
            )

    def _describe_outage(self, exc: BaseException) -> str:
        """:func:`describe_error`, but the timeout of a whole call (asyncio's, with no message) names its bound."""
        if isinstance(exc, TimeoutError) and not str(exc):
            bound = self.config.op_timeout_s + self.config.connect_timeout_s
            return (f"no answer within {bound:g} s (memory_policy.toml [dram] op_timeout_s + "
                    "connect_timeout_s)")
        return describe_error(exc)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("DRAM tier back: Redis at %s answers again after %.1f s down",
                        self.address, time.monotonic() - self._down_since)
            self._down_since = None
        DRAM_UP.set(1)

    async def close(self) -> None:
        """Stop the pings (:meth:`start`) and close the connections."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await self.redis.aclose()


_PIPELINE_MARK = "of pipeline caused error: "


def _refuses_writes(exc: BaseException) -> bool:
    """The server refuses every write for now, not this one command: full (OOM), a read-only replica, or
    unable to persist (MISCONF)."""
    return isinstance(exc, (OutOfMemoryError, ReadOnlyError)) or "MISCONF" in str(exc)


def describe_error(exc: BaseException, limit: int = 160) -> str:
    """``<exception class>: <message>`` of ``exc`` (the class alone when it has no message; redis-py names the server's error code by the class,
    e.g. OutOfMemoryError for OOM), without the command's arguments, printable ASCII, at most ``limit`` characters.

    redis-py rewrites the error of a failed pipeline command as ``Command # N (<command and its arguments>)
    of pipeline caused error: (<server message>,)``; only the server message is kept.
    """
    text = str(exc)
    if _PIPELINE_MARK in text:
        text = text.split(_PIPELINE_MARK, 1)[1].strip().removeprefix("(").removesuffix(")").rstrip(",")
        text = text.strip("'\"")
    text = "".join(ch if " " <= ch <= "~" else "?" for ch in text)
    text = f"{type(exc).__name__}: {text}" if text.strip() else type(exc).__name__  # no message: the class alone
    return text if len(text) <= limit else text[:limit - 3] + "..."
