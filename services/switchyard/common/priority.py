"""Priority classes: the one type for CORE / NORMAL / BATCH, and its one conversion from the proto.

Values are ranks (0 is the most important), so sorting by class sorts by
importance. ``label`` is the lower-case name used in metrics, logs, config keys
(``scheduler_config.json`` ``priority_boost``) and span attributes.
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

from switchyard.api import agent_pb2
from switchyard.common.errors import InvalidArgument


class PriorityClass(enum.IntEnum):
    """CORE (latency-critical), NORMAL, BATCH (throughput work); the value is the rank."""

    CORE = 0
    NORMAL = 1
    BATCH = 2

    @classmethod
    def from_proto(cls, value: int) -> "PriorityClass":
        """``agent.Priority`` -> class; PRIORITY_UNSPECIFIED (and any unknown number) is NORMAL."""
        return _FROM_PROTO.get(value, cls.NORMAL)

    @property
    def label(self) -> str:
        """core, normal or batch."""
        return _LABEL[self]

    @property
    def proto(self) -> int:
        """The ``agent.Priority`` value of this class."""
        return _TO_PROTO[self]


_FROM_PROTO = {agent_pb2.CORE: PriorityClass.CORE, agent_pb2.NORMAL: PriorityClass.NORMAL,
               agent_pb2.BATCH: PriorityClass.BATCH}
_TO_PROTO = {cls: value for value, cls in _FROM_PROTO.items()}
_LABEL = {cls: cls.name.lower() for cls in PriorityClass}


LABELS: tuple[str, ...] = tuple(c.label for c in PriorityClass)
"""Every class's label, most important first: the bounded label set of per-class metrics."""

LABELS_EXPECTED = f"{', '.join(LABELS[:-1])} or {LABELS[-1]}"
"""What a refusal of a class's name says was expected: core, normal or batch (the HTTP body's ``priority``, the
x-priority header, ``switchyard run --priority``)."""

ClassLabel = Literal["core", "normal", "batch"]
"""A class's label as a type, for config keys and the HTTP face's body: pydantic refuses any other value, naming
these three."""
assert get_args(ClassLabel) == LABELS, "ClassLabel lists PriorityClass's labels, most important first"


def check_priority(value: int, field: str = "priority") -> None:
    """``value`` is an ``agent.Priority``: CORE, NORMAL, BATCH, or unset (PRIORITY_UNSPECIFIED, read as NORMAL).
    Every edge that takes one (RunTask and SubmitTask, Generate, ToolWait) refuses any other number by this.

    Raises:
        InvalidArgument: naming ``field``.
    """
    if value not in _PROTO_VALUES:
        raise InvalidArgument(field, "CORE, NORMAL or BATCH (unset = NORMAL)", value)


_PROTO_VALUES = frozenset(agent_pb2.Priority.values())
