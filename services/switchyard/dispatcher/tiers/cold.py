"""The cold tier: KV entries archived out of DRAM, as files through fsspec.

``memory_policy.toml [oss] path`` is an fsspec URL: a local folder by default
(``./cold_data``), ``s3://bucket/prefix``, ``gs://...`` and the rest through
fsspec's backends (installed separately: s3fs, gcsfs, ...). One file per
entry, named after its DRAM key (``seq/<request id>.kv``,
``agent/<agent id>.kv``, the id percent-encoded): a JSON line of metadata (the
DRAM entry's fields but the payload) followed by the payload bytes.

File I/O runs in a worker thread (``asyncio.to_thread``), so a slow object
store never stalls the event loop. Like the DRAM tier, a failure is a logged,
counted miss (``switchyard_cold_tier_errors_total``), never a failed task.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import quote

from switchyard.dispatcher.tiers import metrics
from switchyard.dispatcher.tiers.dram import Entry

log = logging.getLogger(__name__)


class ColdStore:
    """Archived KV entries under one fsspec URL.

    Args:
        path: ``[oss] path`` (a folder or an fsspec URL).
        key_prefix: ``[dram] key_prefix``, left out of file names.

    Raises:
        ValueError: ``path`` names a protocol fsspec does not know, or whose package is not installed.
    """

    def __init__(self, path: str, key_prefix: str = "switchyard:") -> None:
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(path)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"memory_policy.toml [oss] path {path!r}: {exc}") from None
        self.path = path
        self.key_prefix = key_prefix + "kv:"
        self.nbytes = 0
        """Device bytes of the entries this process archived and has not taken back."""

    def _file(self, key: str) -> str:
        kind, _, ident = key.removeprefix(self.key_prefix).partition(":")
        return f"{self.root.rstrip('/')}/{kind}/{quote(ident, safe='')}.kv"

    async def put(self, entry: Entry) -> bool:
        """Archive ``entry`` (with its payload); False (logged, counted) when the store failed."""
        meta = {"key": entry.key, "tokens": entry.tokens, "nbytes": entry.nbytes, "priority": entry.priority,
                "hits": entry.hits, "cost_us": entry.cost_us, "stored_at": entry.stored_at}
        blob = json.dumps(meta).encode() + b"\n" + entry.payload
        path = self._file(entry.key)

        def write() -> None:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(path, "wb") as handle:
                handle.write(blob)

        try:
            await asyncio.to_thread(write)
        except Exception as exc:  # noqa: BLE001 - any store failure is a miss later
            self._failed("put", exc)
            return False
        self.nbytes += entry.nbytes
        metrics.TIER_BYTES.labels("cold").set(self.nbytes)
        return True

    async def take(self, key: str) -> Entry | None:
        """Read and remove the archived entry under ``key`` (it goes back up); None when absent or on failure."""
        path = self._file(key)

        def read() -> bytes | None:
            if not self.fs.exists(path):
                return None
            with self.fs.open(path, "rb") as handle:
                blob = handle.read()
            self.fs.rm(path)
            return blob

        try:
            blob = await asyncio.to_thread(read)
        except Exception as exc:  # noqa: BLE001
            self._failed("get", exc)
            return None
        if blob is None:
            return None
        head, _, payload = blob.partition(b"\n")
        try:
            meta: dict[str, Any] = json.loads(head)
            entry = Entry(key=key, tokens=int(meta["tokens"]), nbytes=int(meta["nbytes"]),
                          priority=str(meta["priority"]), hits=int(meta["hits"]), cost_us=float(meta["cost_us"]),
                          stored_at=float(meta["stored_at"]), payload=payload)
        except (ValueError, KeyError, TypeError) as exc:
            self._failed("get", exc)
            return None
        self.nbytes = max(0, self.nbytes - entry.nbytes)
        metrics.TIER_BYTES.labels("cold").set(self.nbytes)
        return entry

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.COLD_ERRORS.labels(operation).inc()
        log.warning("cold tier at %s failed on %s (%s: %s); the KV state will be recomputed",
                    self.path, operation, type(exc).__name__, exc)
