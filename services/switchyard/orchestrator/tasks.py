"""The in-process task table behind SubmitTask and GetTaskStatus.

Bounded: at most ``capacity`` records; when full, the oldest finished record
is evicted. A table full of unfinished tasks rejects new ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from switchyard.api import agent_pb2
from switchyard.common.errors import SwitchyardError

import grpc


@dataclass
class TaskRecord:
    task_id: str
    state: int = agent_pb2.QUEUED
    result: agent_pb2.FinalEvent | None = None
    error: str = ""
    timings: agent_pb2.Timings = field(default_factory=agent_pb2.Timings)

    def to_status(self) -> agent_pb2.TaskStatus:
        status = agent_pb2.TaskStatus(task_id=self.task_id, state=self.state, error=self.error)
        status.timings.CopyFrom(self.timings)
        if self.result is not None:
            status.result.CopyFrom(self.result)
            status.compute_score_used = self.result.compute_score_used
            status.memory_peak_bytes = self.result.memory_peak_bytes
            status.timings.CopyFrom(self.result.timings)
        return status


class TaskTable:
    """task_id -> TaskRecord, insertion ordered."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, TaskRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def create(self, task_id: str) -> TaskRecord:
        """Add a QUEUED record.

        Raises:
            SwitchyardError: ALREADY_EXISTS for a known task_id; RESOURCE_EXHAUSTED
                when every slot holds an unfinished task.
        """
        if task_id in self._records:
            raise SwitchyardError(
                f"task_id: {task_id!r} already exists; use a new id or poll GetTaskStatus",
                grpc.StatusCode.ALREADY_EXISTS,
            )
        if len(self._records) >= self.capacity:
            for key, record in self._records.items():
                if record.state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED):
                    del self._records[key]
                    break
            else:
                raise SwitchyardError(
                    f"task table full: {self.capacity} unfinished tasks (orchestrator.task_table_size)",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
        record = TaskRecord(task_id)
        self._records[task_id] = record
        return record

    def get(self, task_id: str) -> TaskRecord:
        """The record of ``task_id``.

        Raises:
            SwitchyardError: NOT_FOUND naming the id.
        """
        try:
            return self._records[task_id]
        except KeyError:
            raise SwitchyardError(
                f"task_id: no task {task_id!r} (unknown, or evicted after {self.capacity} newer tasks)",
                grpc.StatusCode.NOT_FOUND,
            ) from None
