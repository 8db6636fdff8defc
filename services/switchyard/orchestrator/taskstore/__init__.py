"""Durable records of SubmitTask tasks, read by GetTaskStatus.

``orchestrator.task_store.backend`` picks the store: ``sqlite`` (a file, the
default) or ``redis`` (shared by orchestrator replicas). Both survive the death
of the orchestrator process; see :mod:`.base` for leases and orphaned tasks.
"""

from __future__ import annotations

from switchyard.common.config import SwitchyardConfig
from switchyard.orchestrator.taskstore.base import (
    OutageLog,
    TaskRecord,
    TaskStore,
    TaskStoreUnavailable,
    fingerprint,
    task_status,
)


def make_task_store(config: SwitchyardConfig) -> TaskStore:
    """The store ``config.orchestrator.task_store`` names (not yet opened)."""
    store = config.orchestrator.task_store
    if store.backend == "redis":
        from switchyard.orchestrator.taskstore.redis_store import RedisTaskStore

        return RedisTaskStore(store, config.memory.dram)
    from switchyard.orchestrator.taskstore.sqlite_store import SqliteTaskStore

    return SqliteTaskStore(store)


__all__ = ["OutageLog", "TaskRecord", "TaskStore", "TaskStoreUnavailable", "fingerprint", "make_task_store", "task_status"]
