"""``switchyard.json`` ``retrieval``: the retrieval service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from switchyard.common.config.base import _Strict
from switchyard.common.config.server import _health_port, _metrics_port, _port, distinct_ports


class RetrievalConfig(_Strict):
    """Retrieval (RetrievalService): ``switchyard.json`` ``retrieval``."""

    port: int = _port(50052)
    metrics_port: int = _metrics_port(9102)
    health_port: int | None = _health_port()

    @model_validator(mode="after")
    def _ports_of_its_own(self) -> "RetrievalConfig":
        distinct_ports("retrieval", {"port": self.port, "metrics_port": self.metrics_port,
                                     "health_port": self.health_port})
        return self

    index_dir: str = Field(
        "data/index", min_length=1, description="Folder of the vector index, a path (SWITCHYARD_INDEX_DIR)."
    )
    default_top_k: int = Field(
        4, ge=1, le=1000, description="Passages returned when a call asks for 0, passages."
    )
    max_top_k: int = Field(50, ge=1, le=10_000, description="Most passages one call may ask for, passages.")
    chunk_tokens: int = Field(
        256, ge=16, le=8192,
        description="Most word pieces (tokens) the embedding model sees for one passage, document heading and special "
        "tokens included, counted with the model's own tokenizer. At most the model's window (256 for "
        "all-MiniLM-L6-v2, its model card), so no passage is truncated; `switchyard bench retrieval` compares sizes.",
    )
    chunk_overlap_tokens: int = Field(
        32, ge=0, description="Word pieces (tokens) a passage repeats from the end of the one before it (cut at a word)."
    )
    hybrid: bool = Field(
        True,
        description="Also index the passages for BM25 and fuse its ranking with the vectors' (reciprocal rank "
        "fusion). `switchyard bench retrieval` shows what it adds on the labelled questions.",
    )
    rrf_k: float = Field(
        10, gt=0, le=10_000,
        description="Reciprocal rank fusion constant, a rank offset: a passage at rank r of a ranking scores 1 / (rrf_k + r). "
        "Cormack et al. (SIGIR 2009) use 60 for fusing long TREC runs; on the labelled questions 10, which "
        "weighs the top of each 50-passage list more, scores best (docs/benchmarks.md has the sweep).",
    )
    hybrid_candidates: int = Field(
        50, ge=1, le=10_000, description="Passages taken from each ranking before fusing (at least top_k is used), passages."
    )
    embed_batch_size: int = Field(32, ge=1, le=4096, description="Most queries embedded in one batch, queries.")
    embed_batch_wait_ms: float = Field(
        2, ge=0, le=1000, description="Longest wait for more queries to fill an embedding batch, milliseconds."
    )
    query_cache_size: int = Field(
        4096, ge=0, le=10_000_000,
        description="Recent query vectors kept in an LRU cache, entries (1.5 KiB each at 384 dims); a question "
        "asked again skips the embedding model. 0 turns the cache off.",
    )
    embed_backend: Literal["onnxruntime", "torch"] = Field(
        "onnxruntime",
        description="What runs the embedding model on the service's queries: onnxruntime (the encoder `switchyard "
        "index` exports into the index folder; no torch in the service, a lone question about twice as fast on "
        "one thread, the same vectors) or torch (sentence-transformers, as the indexer).",
    )
    embed_threads: int = Field(
        1, ge=0, le=256,
        description="Intra-op threads for query embedding in the service (ONNX Runtime's or torch's), threads; "
        "0 = the runtime's default (one "
        "per visible core). 1 suits a host whose cores the services share: OpenMP threads that wait for a busy "
        "core multiply a lone query's time (P95 26.8 ms with 1 thread against 515 ms with 2 on a loaded 2-core "
        "host, docs/benchmarks.md). A retrieval pod with whole cores of its own may set its core count. "
        "switchyard index always uses every core.",
    )

    @model_validator(mode="after")
    def _overlap(self) -> "RetrievalConfig":
        if self.chunk_overlap_tokens >= self.chunk_tokens // 2:
            raise ValueError(
                f"chunk_overlap_tokens ({self.chunk_overlap_tokens}) must be below half of chunk_tokens "
                f"({self.chunk_tokens})"
            )
        if self.default_top_k > self.max_top_k:
            raise ValueError(f"default_top_k ({self.default_top_k}) must not exceed max_top_k ({self.max_top_k})")
        return self
