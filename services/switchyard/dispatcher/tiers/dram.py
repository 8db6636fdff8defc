"""KV state in the DRAM tier: entries in the Redis of :class:`switchyard.common.dram.DramClient`.

One Redis hash per entry, under ``{key_prefix}kv:<kind>:<id>`` (kind ``seq``: a
preempted request's KV, by request id; ``agent``: a parked agent's prefix, by
agent id). Fields: ``payload`` (the engine's bytes, sealed by :mod:`.blob` with
the key, the metadata, the lengths and a digest), ``tokens``, ``nbytes``
(device bytes the state takes in HBM), ``priority`` (class name), ``hits``,
``cost_us`` (prefill microseconds it saves) and ``stored_at`` (Unix seconds).
The plain fields serve the DRAM scan, which reads no payload; a restore takes
everything from the sealed blob, and a blob that does not prove itself (cut
short, planted by another writer, damaged) is a miss, counted in
``switchyard_tier_corrupt_blobs_total``, and deleted. Every entry has a TTL
(``[dram] kv_ttl_s``), so a Redis full at ``maxmemory`` under a ``volatile-*`` policy
(``deploy/k8s/base/redis.yaml``: ``volatile-lru``) may evict it: the tier is a cache, and
an evicted entry is a miss like an expired one (counted in ``switchyard_tier_misses_total``,
its tokens computed again by prefill; the DRAM scan drops it from the tier's size when it
no longer finds it).

Outages are the client's business (one WARNING per outage,
``switchyard_dram_up``, ``switchyard_dram_outages_total``,
``switchyard_dram_degraded_operations_total``): here a failed operation is a
miss, and :meth:`KvStore.available` tells the scheduler not to swap while
Redis is down (until ``[dram] retry_interval_s`` has passed, when the next
swap is the client's probe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from switchyard.common.dram import DramClient
from switchyard.dispatcher.tiers import blob, metrics

META_FIELDS = ("tokens", "nbytes", "priority", "hits", "cost_us", "stored_at")
_FAILED = object()


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


def _entry(key: str, fields: dict[bytes, bytes], payload: bytes = b"") -> Entry:
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
        payload=payload,
    )


class KvStore:
    """KV entries in the DRAM tier.

    Args:
        dram: the service's DRAM client (address, key prefix, timeouts, outage handling).
        ttl_s: TTL of an entry (``[dram] kv_ttl_s``).
    """

    def __init__(self, dram: DramClient, ttl_s: float) -> None:
        self.dram = dram
        self.ttl_s = int(ttl_s)
        self.nbytes = 0
        """Device bytes of the entries this process wrote and has not seen go (the tier's size)."""
        self._sizes: dict[str, int] = {}
        self._retry_at = 0.0

    def key(self, kind: str, ident: str) -> str:
        """``{key_prefix}kv:{kind}:{ident}``."""
        return self.dram.key("kv", kind, ident)

    def available(self) -> bool:
        """False while Redis is down, until ``retry_interval_s`` after the last failed operation, and while it
        refuses writes (full: see :meth:`DramClient.accepts_writes`)."""
        return self.dram.accepts_writes() and (self.dram.up or time.monotonic() >= self._retry_at)

    async def put(self, key: str, payload: bytes, *, tokens: int, nbytes: int, priority: str, hits: int,
                  cost_us: float) -> bool:
        """Store one entry with its TTL; False when Redis failed or refused it (a miss later)."""
        meta = {"tokens": tokens, "nbytes": nbytes, "priority": priority, "hits": hits, "cost_us": cost_us,
                "stored_at": time.time()}
        mapping = {"payload": await blob.seal_async(key, meta, payload), **meta}

        async def write(redis: Any) -> bool:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=mapping)
                pipe.expire(key, self.ttl_s)
                await pipe.execute()
            return True

        if not await self._call(write, "KV swap-out", grows=True):
            return False
        self._account(key, nbytes)
        return True

    async def get(self, key: str) -> Entry | None:
        """The whole entry, or None when absent, when Redis failed, or when its payload does not prove
        itself (:func:`.blob.check`: counted, logged once per reason, and the entry deleted)."""
        fields = await self._call(lambda redis: redis.hget(key, "payload"), "KV restore")
        if not fields:
            if fields is not None:
                self._account(key, 0)
            return None
        opened = await blob.check_async("dram", key, fields)
        if opened is None:
            await self.delete(key)
            return None
        meta = {name.encode(): str(opened.meta[name]).encode() for name in META_FIELDS if name in opened.meta}
        return _entry(key, meta, payload=opened.payload)

    async def delete(self, key: str) -> None:
        """Remove one entry (a failure only leaves it to its TTL)."""
        self._account(key, 0)
        await self._call(lambda redis: redis.delete(key), "KV delete")

    async def touch(self, key: str) -> None:
        """Renew an entry's TTL."""
        await self._call(lambda redis: redis.expire(key, self.ttl_s), "KV TTL renewal")

    async def scan(self) -> AsyncIterator[Entry]:
        """Every KV entry, metadata only (no payload); stops early when Redis fails."""

        async def one_page(redis: Any, cursor: int) -> Any:
            cursor, keys = await redis.scan(cursor, match=self.dram.key("kv", "*"), count=500)
            rows = []
            for raw in keys:
                rows.append((raw, await redis.hmget(raw, list(META_FIELDS))))
            return cursor, rows

        cursor, seen, complete = 0, set(), False
        while True:
            page = await self._call(lambda redis: one_page(redis, cursor), "KV scan")
            if page is None:
                break
            cursor, rows = page
            for raw, values in rows:
                key = raw.decode() if isinstance(raw, bytes) else str(raw)
                if values[0] is None:
                    continue
                seen.add(key)
                yield _entry(key, {name.encode(): value for name, value in zip(META_FIELDS, values) if value})
            if cursor == 0:
                complete = True
                break
        if complete:
            for gone in [k for k in self._sizes if k not in seen]:  # expired by TTL or removed elsewhere
                self._account(gone, 0)

    async def aclose(self) -> None:
        await self.dram.close()

    async def _call(self, fn: Any, op: str, grows: bool = False) -> Any:
        """``fn(redis)`` through the client; None when it failed (and no swap is tried for a while)."""
        result = await self.dram.call(fn, _FAILED, op, grows=grows)
        if result is _FAILED:
            self._retry_at = time.monotonic() + self.dram.config.retry_interval_s
            return None
        return result

    def _account(self, key: str, nbytes: int) -> None:
        self.nbytes += nbytes - self._sizes.pop(key, 0)
        if nbytes:
            self._sizes[key] = nbytes
        metrics.TIER_BYTES.labels("dram").set(self.nbytes)
