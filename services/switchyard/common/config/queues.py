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
    inference: QueueConfig = Field(
        QueueConfig(capacity=512, workers=4, timeout_ms=30000),
        description="The dispatcher's queue of Generate calls; workers = prefills at once (the dispatcher reads it).",
    )
