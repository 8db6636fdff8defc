"""PriorityClass: the one priority type and its one conversion from the proto."""

from __future__ import annotations

from switchyard.api import agent_pb2
from switchyard.common.priority import LABELS, PriorityClass
from switchyard.dispatcher.request import Request


def test_conversion_from_the_proto_and_back():
    assert PriorityClass.from_proto(agent_pb2.CORE) is PriorityClass.CORE
    assert PriorityClass.from_proto(agent_pb2.BATCH) is PriorityClass.BATCH
    assert PriorityClass.from_proto(agent_pb2.PRIORITY_UNSPECIFIED) is PriorityClass.NORMAL
    assert PriorityClass.from_proto(99) is PriorityClass.NORMAL  # a number from a newer client
    assert [c.proto for c in PriorityClass] == [agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH]
    assert LABELS == ("core", "normal", "batch")
    assert sorted([PriorityClass.BATCH, PriorityClass.CORE, PriorityClass.NORMAL]) == list(PriorityClass)  # by rank


def test_a_request_carries_its_class():
    assert Request("r", priority=agent_pb2.PRIORITY_UNSPECIFIED).priority_class is PriorityClass.NORMAL
    assert Request("r", priority=42).priority == agent_pb2.NORMAL
    req = Request("r", priority=agent_pb2.CORE)
    assert req.priority_class is PriorityClass.CORE and req.priority_name == "core"
