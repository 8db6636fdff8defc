"""The DRAM tier: KV state as bytes in Redis, through redis-py's asyncio client.

One Redis hash per entry, under ``switchyard:kv:<kind>:<id>`` (kind ``seq``:
a preempted sequence's KV, by request id; ``agent``: a parked agent's prefix,
by agent id). Fields: ``payload`` (the engine's bytes), ``tokens``,
``nbytes`` (device bytes the state takes in HBM), ``priority`` (class name),
``hits``, ``cost_us`` (prefill microseconds it saves) and ``stored_at`` (Unix
seconds). Every entry has a TTL (``[dram] ttl_sec``).

A Redis outage never fails a task: every operation that raises (connection
refused, timeout, an error reply) is logged once per outage with what it means
("KV state will be recomputed"), counted in ``switchyard_tier_errors_total``,
and reported as a miss; for ``[dram] retry_after_sec`` afterwards the tier
reports itself unavailable, so the scheduler recomputes without waiting on
Redis timeouts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from switchyard.common.config import DramTier
from switchyard.dispatcher.tiers import metrics

log = logging.getLogger(__name__)

KEY_PREFIX = "switchyard:kv:"
META_FIELDS = ("tokens", "nbytes", "priority", "hits", "cost_us", "stored_at")


@dataclass(frozen=True)
class Entry:
    """One DRAM entry's metadata (``payload`` is empty when only the metadata was read)."""

    key: str
    tokens: int
    nbytes: int
    priority: str
    hits: int
    cost_us: float
    stored_at: float
    payload: bytes = b""


def _entry(key: str, fields: dict[bytes, bytes]) -> Entry:
    def num(name: str) -> float:
        raw = fields.get(name.encode())
        return float(raw) if raw else 0.0

    return Entry(
        key=key,
        tokens=int(num("tokens")),
        nbytes=int(num("nbytes")),
        priority=(fields.get(b"priority") or b"normal").decode(),
        hits=int(num("hits")),
        cost_us=num("cost_us"),
        stored_at=num("stored_at"),
        payload=fields.get(b"payload", b""),
    )


class RedisStore:
    """KV entries in one Redis database.

    Args:
        config: ``memory_policy.toml`` ``[dram]`` (host, port, db, ttl_sec, timeout_ms, retry_after_sec).
        client: a ``redis.asyncio.Redis`` to use instead of one built from ``config`` (tests).
    """

    def __init__(self, config: DramTier, client: Any = None) -> None:
        self.config = config
        self._client = client
        self._down_until = 0.0
        self._down = False
        self.nbytes = 0
        """Device bytes of the entries this process wrote and has not seen go (the tier's size)."""
        self._sizes: dict[str, int] = {}

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}/{self.config.db}"

    def available(self, now: float | None = None) -> bool:
        """False within ``retry_after_sec`` of the last failure."""
        return (time.monotonic() if now is None else now) >= self._down_until

    def client(self) -> Any:
        """The asyncio client, created on first use (no connection is made until a command)."""
        if self._client is None:
            import redis.asyncio as aioredis

            timeout = self.config.timeout_ms / 1000
            self._client = aioredis.Redis(
                host=self.config.host, port=self.config.port, db=self.config.db,
                socket_timeout=timeout, socket_connect_timeout=timeout,
            )
        return self._client

    async def put(self, key: str, payload: bytes, *, tokens: int, nbytes: int, priority: str, hits: int,
                  cost_us: float) -> bool:
        """Store one entry with its TTL; False (logged, counted) when Redis failed."""
        mapping = {"payload": payload, "tokens": tokens, "nbytes": nbytes, "priority": priority, "hits": hits,
                   "cost_us": cost_us, "stored_at": time.time()}
        try:
            async with self.client().pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=mapping)
                pipe.expire(key, int(self.config.ttl_sec))
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure degrades to recompute
            self._failed("put", exc)
            return False
        self._ok()
        self._account(key, nbytes)
        return True

    async def get(self, key: str) -> Entry | None:
        """The whole entry, or None when absent or Redis failed."""
        try:
            fields = await self.client().hgetall(key)
        except Exception as exc:  # noqa: BLE001
            self._failed("get", exc)
            return None
        self._ok()
        if not fields:
            self._account(key, 0)
            return None
        return _entry(key, fields)

    async def delete(self, key: str) -> None:
        """Remove one entry (errors are logged and counted, never raised)."""
        self._account(key, 0)
        try:
            await self.client().delete(key)
        except Exception as exc:  # noqa: BLE001
            self._failed("delete", exc)
            return
        self._ok()

    async def touch(self, key: str) -> None:
        """Renew an entry's TTL."""
        try:
            await self.client().expire(key, int(self.config.ttl_sec))
        except Exception as exc:  # noqa: BLE001
            self._failed("scan", exc)

    async def scan(self) -> AsyncIterator[Entry]:
        """Every entry under :data:`KEY_PREFIX`, metadata only (no payload)."""
        try:
            client = self.client()
            seen: set[str] = set()
            async for raw in client.scan_iter(match=KEY_PREFIX + "*", count=500):
                key = raw.decode() if isinstance(raw, bytes) else str(raw)
                values = await client.hmget(key, list(META_FIELDS))
                if values[0] is None:
                    continue
                seen.add(key)
                yield _entry(key, {name.encode(): value for name, value in zip(META_FIELDS, values) if value})
        except Exception as exc:  # noqa: BLE001
            self._failed("scan", exc)
            return
        self._ok()
        for gone in [k for k in self._sizes if k not in seen]:  # expired by TTL or removed elsewhere
            self._account(gone, 0)

    async def aclose(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass

    def _account(self, key: str, nbytes: int) -> None:
        self.nbytes += nbytes - self._sizes.pop(key, 0)
        if nbytes:
            self._sizes[key] = nbytes
        metrics.TIER_BYTES.labels("dram").set(self.nbytes)

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.TIER_ERRORS.labels("dram", operation).inc()
        self._down_until = time.monotonic() + self.config.retry_after_sec
        if not self._down:
            self._down = True
            log.warning(
                "DRAM tier: Redis at %s failed on %s (%s: %s); KV state is recomputed instead of swapped "
                "until Redis answers again (next try in %g s)",
                self.address, operation, type(exc).__name__, exc, self.config.retry_after_sec,
            )

    def _ok(self) -> None:
        if self._down:
            self._down = False
            log.info("DRAM tier: Redis at %s answers again; swapping resumes", self.address)
