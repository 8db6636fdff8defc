"""PriorityClass: the one priority type and its one conversion from the proto."""

from __future__ import annotations

import pytest

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


def test_a_request_carries_its_class_and_refuses_a_number():
    """The class's ranks (CORE 0, NORMAL 1) and the proto's numbers (CORE 1) overlap: a proto number given where
    the class is expected would be a silent wrong class, so the Request refuses it."""
    assert Request("r").priority is PriorityClass.NORMAL
    req = Request("r", priority=PriorityClass.CORE)
    assert req.priority is PriorityClass.CORE and req.priority.label == "core"
    for number in (agent_pb2.CORE, 0, 42):
        with pytest.raises(TypeError, match="PriorityClass.from_proto"):
            Request("r", priority=number)


def test_every_edge_refuses_a_priority_number_the_proto_does_not_name_in_the_same_words():
    """RunTask's validation and Generate's (and ToolWait, through the same check) refuse an unknown
    agent.Priority by one rule, common.priority.check_priority; they had one wording each."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.errors import InvalidArgument
    from switchyard.dispatcher.processor import to_request
    from switchyard.orchestrator.validation import validate

    config = SwitchyardConfig()
    refusals = []
    for refuse in (lambda: validate(agent_pb2.RunTaskRequest(payload="p", priority=7), config, "sim-7b"),
                   lambda: to_request(agent_pb2.GenerateRequest(request_id="r", prompt="p", priority=7), config,
                                      "sim-7b")):
        with pytest.raises(InvalidArgument) as refused:
            refuse()
        refusals.append(str(refused.value))
    assert refusals == ["priority: expected CORE, NORMAL or BATCH (unset = NORMAL) (got 7)"] * 2


def test_the_boosts_are_read_by_class_in_one_place():
    """scheduler_config.json priority_boost is read by class through PriorityBoost.of: the priority policy's
    head starts and the value score's weights (which read it by label through a model_dump, a fallback beside
    it) agree for any boosts."""
    from switchyard.common.config import PriorityBoost, SchedulerConfig, ValueScoreConfig
    from switchyard.dispatcher.scheduler.priority import head_start
    from switchyard.dispatcher.tiers.value import ValueScore

    boost = PriorityBoost(core=7, normal=3, batch=2)
    assert [boost.of(cls) for cls in PriorityClass] == [7, 3, 2]
    value = ValueScore(ValueScoreConfig(), boost)
    assert [value.weight(label) for label in LABELS] == [7, 3, 2] and value.weight("unknown") == 3
    starts = head_start(SchedulerConfig(priority_boost=boost, aging_max_wait_ms=5000))
    assert starts == pytest.approx((5.0, 1.0, 0.0))
