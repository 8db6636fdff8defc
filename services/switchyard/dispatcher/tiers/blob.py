"""The sealed form of a KV entry in the DRAM and cold tiers: a header that names the key, the lengths and a digest.

A stored blob must prove that it is the whole entry written under its key
before its bytes reach an engine: a write cut short (a full disk, a process
killed while archiving, a serializer that raised), a payload another program
planted under the key, or bytes flipped on the way all read back as a
:class:`BlobError`, which the tiers count as a miss (the tokens are recomputed).

Layout (big-endian; :data:`HEADER`)::

    magic     4 bytes  b"SYKV"
    version   1 byte   1
    flags     1 byte   0 (reserved)
    key_len   2 bytes  bytes of the UTF-8 key that follows the header
    meta_len  4 bytes  bytes of the JSON metadata that follows the key
    payload   8 bytes  bytes of the engine's payload that follow the metadata
    digest   16 bytes  BLAKE2b-128 (hashlib.blake2b, digest_size=16) of the
                       header's first 20 bytes, the key, the metadata and the payload

The digest is a checksum against damage, not a signature against an attacker
who can write to the tier (that Redis has no password; keep it on loopback).
BLAKE2b hashes about 1 GB/s per core; payloads of :data:`THREAD_BYTES` or more
are sealed and opened in a worker thread (hashlib releases the GIL) so that the
event loop keeps stepping.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from typing import Any

from switchyard.dispatcher.tiers import metrics

log = logging.getLogger(__name__)

MAGIC = b"SYKV"
VERSION = 1
HEADER = struct.Struct(">4sBBHIQ16s")
"""magic, version, flags, key length, metadata length, payload length, digest: 36 bytes."""
_PREFIX = 20
"""Bytes of the header covered by the digest (all but the digest itself)."""
THREAD_BYTES = 1 << 20
"""Payloads this large (1 MiB) or larger are sealed and checked off the event loop."""
REASONS = metrics.CORRUPT_REASONS
"""Why a blob was refused, the ``reason`` label of ``switchyard_tier_corrupt_blobs_total``: header (no
SYKV header or an unknown version: a foreign value), key (sealed under another key), length (shorter or
longer than its header says: a cut-short write), checksum (the digest does not match the bytes)."""


class BlobError(ValueError):
    """A stored blob that is not the whole entry written under its key; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Opened:
    """A blob that proved itself: its metadata (a JSON object) and the engine's payload."""

    meta: dict[str, Any]
    payload: bytes


def _digest(*parts: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def seal(key: str, meta: dict[str, Any], payload: bytes) -> bytes:
    """The blob of ``payload`` under ``key`` with ``meta`` (JSON-serialisable values), as bytes.

    Raises:
        ValueError: the key is longer than 65,535 UTF-8 bytes.
    """
    raw_key = key.encode()
    if len(raw_key) > 0xFFFF:
        raise ValueError(f"KV key of {len(raw_key)} bytes; at most 65535")
    raw_meta = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    prefix = HEADER.pack(MAGIC, VERSION, 0, len(raw_key), len(raw_meta), len(payload), b"")[:_PREFIX]
    digest = _digest(prefix, raw_key, raw_meta, payload)
    return b"".join((prefix, digest, raw_key, raw_meta, payload))


def open_blob(key: str, blob: bytes) -> Opened:
    """Check ``blob`` against ``key`` and return its metadata and payload.

    Raises:
        BlobError: the blob is foreign (reason header), sealed under another key (key), cut short or
            padded (length), or damaged (checksum).
    """
    if len(blob) < HEADER.size or blob[:4] != MAGIC:
        raise BlobError("header", f"{len(blob)} bytes without a {MAGIC.decode()} header")
    magic, version, _flags, key_len, meta_len, payload_len, digest = HEADER.unpack_from(blob)
    if version != VERSION:
        raise BlobError("header", f"blob version {version}; this build reads version {VERSION}")
    expected = HEADER.size + key_len + meta_len + payload_len
    if len(blob) != expected:
        raise BlobError("length", f"{len(blob)} bytes where the header says {expected}")
    view = memoryview(blob)
    raw_key = bytes(view[HEADER.size:HEADER.size + key_len])
    if raw_key != key.encode():
        raise BlobError("key", f"sealed under another key ({len(raw_key)} bytes)")
    meta_end = HEADER.size + key_len + meta_len
    if _digest(view[:_PREFIX], view[HEADER.size:]) != digest:
        raise BlobError("checksum", f"digest mismatch over {len(blob)} bytes")
    try:
        meta = json.loads(bytes(view[HEADER.size + key_len:meta_end]))
    except ValueError as exc:  # a matching digest over bad JSON: written by a broken writer
        raise BlobError("header", f"metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise BlobError("header", "metadata is not a JSON object")
    return Opened(meta=meta, payload=bytes(view[meta_end:]))


_logged: set[tuple[str, str]] = set()


def check(tier: str, key: str, blob: bytes) -> Opened | None:
    """:func:`open_blob`, or None for a refused blob: counted in ``switchyard_tier_corrupt_blobs_total``
    (``tier``, ``reason``) and logged at WARNING the first time a tier refuses a blob for that reason
    (DEBUG after). The log names the key, the reason and lengths, never the payload's bytes."""
    try:
        return open_blob(key, blob)
    except BlobError as exc:
        metrics.TIER_CORRUPT.labels(tier, exc.reason).inc()
        first = (tier, exc.reason) not in _logged
        _logged.add((tier, exc.reason))
        log.log(logging.WARNING if first else logging.DEBUG,
                "%s tier: the KV entry under %s is refused (%s: %s); it counts as a miss and its tokens are "
                "recomputed%s", tier, key, exc.reason, exc, "" if not first else
                " (further refusals for this reason are logged at DEBUG; see switchyard_tier_corrupt_blobs_total)")
        return None


async def seal_async(key: str, meta: dict[str, Any], payload: bytes) -> bytes:
    """:func:`seal`, in a worker thread when the payload is :data:`THREAD_BYTES` or larger."""
    if len(payload) >= THREAD_BYTES:
        return await asyncio.to_thread(seal, key, meta, payload)
    return seal(key, meta, payload)


async def check_async(tier: str, key: str, blob: bytes) -> Opened | None:
    """:func:`check`, in a worker thread when the blob is :data:`THREAD_BYTES` or larger."""
    if len(blob) >= THREAD_BYTES:
        return await asyncio.to_thread(check, tier, key, blob)
    return check(tier, key, blob)
