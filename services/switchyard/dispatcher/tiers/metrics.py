"""Prometheus metrics of the memory tiers.

Label ``tier`` is one of :data:`TIERS` (hbm: device memory; dram: host memory
through Redis; cold: the object-store tier). Every counter with a known label
set starts at 0. The DRAM tier's availability is :mod:`switchyard.common.dram`'s
(``switchyard_dram_up``, ``switchyard_dram_outages_total``,
``switchyard_dram_degraded_operations_total``).

Vocabulary: a *hit* is a lookup of reusable KV state that found it in that
tier, a *miss* one that did not; an *eviction* removes state from a tier (it
may go down a tier or be dropped); a *demotion* moves state from that tier to
the one below, a *promotion* from that tier to the one above.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

TIERS = ("hbm", "dram", "cold")

TIER_BYTES = Gauge(
    "switchyard_tier_bytes",
    "Bytes of KV state held per memory tier (hbm: running reservations, parked agents and the prefix cache; "
    "dram: swapped-out KV state in Redis, as the engine's KV bytes it stands for).",
    ["tier"],
)
TIER_HITS = Counter("switchyard_tier_hits_total", "Lookups of reusable KV state found in this tier.", ["tier"])
TIER_MISSES = Counter("switchyard_tier_misses_total", "Lookups of reusable KV state not found in this tier.", ["tier"])
TIER_EVICTIONS = Counter("switchyard_tier_evictions_total", "KV state removed from this tier.", ["tier"])
TIER_PROMOTIONS = Counter(
    "switchyard_tier_promotions_total", "KV state moved from this tier to the tier above it.", ["tier"]
)
TIER_DEMOTIONS = Counter(
    "switchyard_tier_demotions_total", "KV state moved from this tier to the tier below it.", ["tier"]
)
COLD_ERRORS = Counter(
    "switchyard_cold_tier_errors_total",
    "Cold-tier operations (put: archive, get: take back) that failed in the fsspec store; the KV state is "
    "recomputed instead. DRAM-tier failures are switchyard_dram_degraded_operations_total.",
    ["operation"],
)
CORRUPT_REASONS = ("header", "key", "length", "checksum")
TIER_CORRUPT = Counter(
    "switchyard_tier_corrupt_blobs_total",
    "KV entries read from a tier that did not prove themselves and were refused (each also a miss; the tokens "
    "are recomputed): reason header (no Switchyard header: a foreign value), key (sealed under another key), "
    "length (cut short or padded), checksum (the digest does not match).",
    ["tier", "reason"],
)
OOM_AVOIDED = Counter(
    "switchyard_kv_oom_avoided_total",
    "Requests whose KV did not fit the HBM budget even after eviction (an allocation that would have failed, "
    "avoided): refused at intake when they could never fit the engine (INVALID_ARGUMENT naming max_tokens), or "
    "held waiting at admission until room came (each such head once).",
)
OOM = Counter(
    "switchyard_kv_oom_total",
    "Real device allocation failures (CUDA out of memory) in an engine step; the step's sequences are "
    "preempted and retried, the process goes on.",
)
FRAGMENTATION = Gauge(
    "switchyard_kv_fragmentation_ratio",
    "Share of the KV block pool's allocated bytes that hold no token state (reserved or partly filled "
    "blocks), 0-1; Kwon et al., SOSP 2023 (PagedAttention), section 2.3.",
)
DEFRAGMENTATIONS = Counter(
    "switchyard_kv_defragmentations_total",
    "Compactions of the KV block table (run only while the compute score is below defrag_below_score).",
)
DEFRAG_FREED_BYTES = Counter(
    "switchyard_kv_defrag_freed_bytes_total", "Device bytes given back by compactions of the KV block table."
)
RESTORED_TOKENS = Counter(
    "switchyard_kv_restored_tokens_total",
    "Prefix tokens whose KV state came back from a lower tier (DRAM) instead of being recomputed.",
)
RECOMPUTED_TOKENS = Counter(
    "switchyard_kv_recomputed_tokens_total",
    "Prefix tokens whose KV state was computed again (after preemption, eviction or a tier miss).",
)
SCANS = Counter("switchyard_tier_scans_total", "Periodic scans of a memory tier.", ["tier"])

for _tier in TIERS:
    TIER_BYTES.labels(_tier).set(0)
    for _family in (TIER_HITS, TIER_MISSES, TIER_EVICTIONS, TIER_PROMOTIONS, TIER_DEMOTIONS, SCANS):
        _family.labels(_tier)
for _tier in ("dram", "cold"):
    for _reason in CORRUPT_REASONS:
        TIER_CORRUPT.labels(_tier, _reason)
for _op in ("put", "get"):
    COLD_ERRORS.labels(_op)
