"""Prometheus metrics of the retrieval service (base units: seconds).

Queue depth and wait of the retrieval queue come from the shared queue metrics
(``switchyard_queue_*{queue="retrieval"}``); these cover the stages after it.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.metrics import STATUS_CODES

# A MiniLM forward pass on CPU takes ~1-50 ms for a few queries; a cold or
# large batch can take seconds.
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

EMBED_SECONDS = Histogram(
    "switchyard_retrieval_embed_seconds",
    "Per request: query handed to the micro-batcher -> its vector back (batch wait + forward pass).",
    buckets=STAGE_BUCKETS,
)
EMBED_FORWARD_SECONDS = Histogram(
    "switchyard_embed_forward_seconds",
    "One batched forward pass of the embedding model.",
    buckets=STAGE_BUCKETS,
)
EMBED_BATCH_SIZE = Histogram(
    "switchyard_embed_batch_size",
    "Queries encoded together in one forward pass.",
    buckets=BATCH_BUCKETS,
)
QUERY_CACHE = Counter(
    "switchyard_retrieval_query_cache_total",
    "Query vectors asked of the cache (retrieval.query_cache_size), by result: hit or miss.",
    ["result"],
)
for _result in ("hit", "miss"):
    QUERY_CACHE.labels(_result)
SEARCH_SECONDS = Histogram(
    "switchyard_retrieval_search_seconds",
    "Per request: the search over the index, by vectors (with retrieval.hybrid also the wait for the BM25 search "
    "begun beside the embedding, and the fusion of the two rankings).",
    buckets=STAGE_BUCKETS,
)
REQUESTS = Counter(
    "switchyard_retrieval_requests_total",
    "Retrieve calls by gRPC status code name (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).",
    ["code"],
)
for _code in STATUS_CODES:
    REQUESTS.labels(_code)
INDEX_PASSAGES = Gauge("switchyard_retrieval_index_passages", "Passages in the loaded vector index.")
