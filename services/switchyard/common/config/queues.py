"""``queue.json`` ``queues``: the bounded work queue of each service (common/queues.py)."""

from __future__ import annotations

from pydantic import Field

from switchyard.common.config.base import _Strict


class QueueConfig(_Strict):
    """One bounded work queue (common/queues.py): ``queue.json`` ``queues.<name>``."""

    capacity: int = Field(ge=1, le=1_000_000, description="Most items waiting, items; a full queue rejects.")
    workers: int = Field(ge=1, le=1024, description="Items processed concurrently, workers.")
    timeout_ms: int = Field(
        ge=1, le=3_600_000, description="Longest wait in the queue before DEADLINE_EXCEEDED, milliseconds."
    )


class InferenceQueueConfig(_Strict):
    """The dispatcher's queue of Generate calls (dispatcher/scheduler/): ``queue.json`` ``queues.inference``.

    The requests accepted and not yet admitted wait here in the scheduler's order. It has no
    workers: what runs is bounded by the engine's capacity (KV memory, the upstream's limit).
    """

    capacity: int = Field(
        ge=1, le=1_000_000, description="Most requests waiting for admission, requests; a full queue rejects."
    )
    max_batches_in_prefill: int = Field(
        ge=1, le=1024,
        description="openai engine only: admission waves (the requests one scheduling decision starts: a flushed "
        "batch, or what freed slots admit) sent upstream whose members have not all had a first token, waves "
        "(dispatcher/stream_loop.py); it bounds the prefill burst ahead of the upstream's first answers, not the "
        "streams in flight. CORE requests are not held back by it.",
    )
    timeout_ms: int = Field(
        ge=1, le=3_600_000, description="Longest wait for a first admission before DEADLINE_EXCEEDED, milliseconds "
        "(a request that ran and waits again, preempted or requeued, is bound by its own deadline instead)."
    )


class QueuesConfig(_Strict):
    """The three work queues, one per service: ``queue.json`` ``queues``. Each service reads its own only."""

    orchestration: QueueConfig = Field(
        QueueConfig(capacity=2048, workers=16, timeout_ms=3000),
        description="The orchestrator's queue of task steps (the orchestrator reads it).",
    )
    retrieval: QueueConfig = Field(
        QueueConfig(capacity=1024, workers=8, timeout_ms=2000),
        description="Retrieval's queue of Retrieve calls (retrieval reads it).",
    )
    inference: InferenceQueueConfig = Field(
        InferenceQueueConfig(capacity=512, max_batches_in_prefill=4, timeout_ms=30000),
        description="The dispatcher's queue of Generate calls waiting for admission (the dispatcher reads it).",
    )
