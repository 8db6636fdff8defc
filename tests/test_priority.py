"""PriorityClass: the one priority type and its one conversion from the proto."""

from __future__ import annotations

from switchyard.api import agent_pb2
from switchyard.common.priority import LABELS, PriorityClass
from switchyard.dispatcher.sequence import Sequence


def test_conversion_from_the_proto_and_back():
    assert PriorityClass.from_proto(agent_pb2.CORE) is PriorityClass.CORE
    assert PriorityClass.from_proto(agent_pb2.BATCH) is PriorityClass.BATCH
    assert PriorityClass.from_proto(agent_pb2.PRIORITY_UNSPECIFIED) is PriorityClass.NORMAL
    assert PriorityClass.from_proto(99) is PriorityClass.NORMAL  # a number from a newer client
    assert [c.proto for c in PriorityClass] == [agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH]
    assert LABELS == ("core", "normal", "batch")
    assert sorted([PriorityClass.BATCH, PriorityClass.CORE, PriorityClass.NORMAL]) == list(PriorityClass)  # by rank


def test_a_sequence_carries_its_class():
    assert Sequence("r", priority=agent_pb2.PRIORITY_UNSPECIFIED).priority_class is PriorityClass.NORMAL
    assert Sequence("r", priority=42).priority == agent_pb2.NORMAL
    seq = Sequence("r", priority=agent_pb2.CORE)
    assert seq.priority_class is PriorityClass.CORE and seq.priority_name == "core"
