"""The fair policy and the tool-wait decision on the real scheduler (SchedulerCore, fake engine)."""

from __future__ import annotations

import math

import grpc
import pytest

from switchyard.common.priority import PriorityClass
from switchyard.common.tenant import agent_key
from switchyard.common.config import ConfigError, SwitchyardConfig
from switchyard.dispatcher.engines.base import KVCacheManager, StepBatch, StepEngine, StepResult
from switchyard.dispatcher.request import Request, RequestStatus
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.base import REACT_TASK_TYPE
from switchyard.dispatcher.scheduler.slack import CannotMeetDeadline
from switchyard.dispatcher import metrics  # noqa: F401 - the label sets start at 0
from prometheus_client import REGISTRY
from switchyard_harness.testing.scheduling import accept, finish, publish

pytestmark = pytest.mark.no_gpu


class KV(KVCacheManager):
    """KV bookkeeping only: 1000 bytes per computed token, 0.1 ms of prefill per token; frees recorded."""

    def __init__(self) -> None:
        self.released: list[Request] = []

    def kv_bytes(self, req: Request) -> int:
        return req.num_computed_tokens * 1000

    def free(self, req: Request) -> None:
        self.released.append(req)

    def recompute_seconds(self, tokens: int) -> float:
        return tokens * 1e-4


class Engine(StepEngine):
    """A step engine the scheduler reads (its KV manager) and never steps here."""

    def __init__(self) -> None:
        self.busy_seconds = 0.0
        self.kv = KV()

    @property
    def released(self) -> list[Request]:
        return self.kv.released

    async def execute_model(self, batch: StepBatch) -> StepResult:
        raise AssertionError("these tests step no engine")


def sched():
    return make_scheduler(SwitchyardConfig(), Engine(), policy="fair")


def req(rid, *, agent="", tenant="", prio=2, arrival=0.0, max_tokens=8, **kw):
    return Request(request_id=rid, agent_id=agent, tenant_id=tenant, priority=PriorityClass.from_proto(prio), prompt_tokens=100,
                   max_tokens=max_tokens, arrival=arrival, **kw)


def test_a_tenant_that_received_more_waits_behind_one_that_received_less():
    s = sched()
    s.ledger.charge("noisy-a", "noisy", 50_000, 0.0)
    accept(s, [req("noisy", agent="noisy-b", tenant="noisy", arrival=0.0),
               req("quiet", agent="quiet-a", tenant="quiet", arrival=1.0)], 1.0)
    assert [r.request_id for r in s.waiting] == ["quiet", "noisy"]


def test_classes_stay_strict_and_at_risk_work_goes_first_in_its_class():
    s = sched()
    accept(s, [req("batch", prio=3, arrival=0.0),
               req("relaxed", task_time_left_s=600.0, arrival=0.0),
               req("at-risk", task_time_left_s=3.0, expected_remaining_work_s=1.0, arrival=1.0),
               req("core", prio=1, arrival=2.0)], 2.0)
    assert [r.request_id for r in s.waiting] == ["core", "at-risk", "relaxed", "batch"]


def test_the_at_risk_threshold_weights_and_half_life_come_from_the_scheduler_config():
    config = SwitchyardConfig().with_overrides(**{
        "scheduler.policy": "fair", "scheduler.at_risk_slack_s": 0.5, "scheduler.tenant_weights": {"gold": 4.0},
        "scheduler.fairness_half_life_s": 7.0})
    s = make_scheduler(config, Engine(), policy="fair")
    assert s.ledger.weight("gold") == 4.0 and s.ledger.weight("other") == 1.0
    # 2 s of slack: at risk under the default 5 s threshold, not under 0.5 s (arrival order then decides)
    accept(s, [req("relaxed", task_time_left_s=600.0, arrival=0.0),
               req("two-s-slack", task_time_left_s=3.0, expected_remaining_work_s=1.0, arrival=1.0)], 1.0)
    assert [r.request_id for r in s.waiting] == ["relaxed", "two-s-slack"]
    # gold's service counts a quarter: four times the tokens of plain still orders it first
    s.ledger.charge("gold-a", "gold", 3_000, 1.0)
    s.ledger.charge("plain-a", "plain", 1_000, 1.0)
    accept(s, [req("plain", agent="plain-b", tenant="plain", arrival=2.0),
               req("gold", agent="gold-b", tenant="gold", arrival=3.0)], 3.0)
    assert [r.request_id for r in s.waiting][-2:] == ["gold", "plain"]
    # the counters halve every fairness_half_life_s: one half-life later gold's charge reads half
    served = s.ledger.tenants.service("gold", 1.0)
    assert s.ledger.tenants.service("gold", 8.0) == pytest.approx(served / 2)


@pytest.mark.parametrize("weights", [{"gold": 0.0}, {"gold": -1.0}, {"bad tenant": 1.0}, {"gold": float("inf")}])
def test_tenant_weights_must_be_positive_and_name_well_formed_tenants(weights):
    with pytest.raises(Exception) as caught:
        SwitchyardConfig().with_overrides(**{"scheduler.tenant_weights": weights})
    assert "tenant_weights" in str(caught.value)


@pytest.mark.parametrize("policy", ["priority", "fifo"])
@pytest.mark.parametrize("key, value", [("tenant_weights", {"gold": 4.0}), ("fairness_half_life_s", 7.0),
                                        ("at_risk_slack_s", 0.5)])
def test_a_fair_policy_key_under_a_policy_that_does_not_read_it_is_refused_at_load_naming_both_keys(policy, key, value):
    """Only the fair policy reads scheduler.tenant_weights, fairness_half_life_s and at_risk_slack_s; under the
    shipped policy (priority) or fifo they loaded and did nothing: tenants were served as if no weights were set,
    and nothing said so. At their defaults they load under any policy."""
    with pytest.raises(ConfigError) as caught:
        SwitchyardConfig().with_overrides(**{"scheduler.policy": policy, f"scheduler.{key}": value})
    message = str(caught.value)
    assert f"{key}: expected policy 'fair'" in message and f"got policy {policy!r}" in message
    fair = SwitchyardConfig().with_overrides(**{"scheduler.policy": "fair", f"scheduler.{key}": value})
    assert fair.scheduler.model_dump()[key] == value
    assert SwitchyardConfig().with_overrides(**{"scheduler.policy": policy}).scheduler.policy == policy

@pytest.mark.parametrize("policy", ["fair", "fifo"])
def test_the_priority_policys_aging_under_a_policy_that_does_not_read_it_is_refused_at_load(policy):
    """Only the priority policy's queue ages (scheduler.aging_max_wait_ms); the fair policy orders its classes
    strictly and fifo by arrival. Set under either it loaded and did nothing: an operator who shortened aging so
    that batch work under fair would not wait behind normal work read a config that said so, and nothing did."""
    with pytest.raises(ConfigError) as caught:
        SwitchyardConfig().with_overrides(**{"scheduler.policy": policy, "scheduler.aging_max_wait_ms": 1000})
    message = str(caught.value)
    assert "aging_max_wait_ms: expected policy 'priority'" in message and f"got policy {policy!r}" in message
    priority = SwitchyardConfig().with_overrides(**{"scheduler.policy": "priority", "scheduler.aging_max_wait_ms": 1000})
    assert priority.scheduler.aging_max_wait_ms == 1000
    assert SwitchyardConfig().with_overrides(**{"scheduler.policy": policy}).scheduler.aging_max_wait_ms == 5000


def test_a_request_that_cannot_make_its_deadline_is_refused_by_name():
    s = sched()
    with pytest.raises(CannotMeetDeadline) as caught:
        s.add_request(req("too-late", task_time_left_s=1.0, expected_remaining_work_s=5.0), 0.0)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "too-late" in str(caught.value) and "slack" in str(caught.value)
    assert s.num_waiting == 0


def test_the_refusal_and_the_order_count_the_time_the_request_already_waited_alike():
    # one time left, as both the early refusal and the queue's slack read it: what was sent less the time since
    # the request arrived; a request with 2 s left that arrived 1.5 s before it reaches the scheduler has 0.5 s
    s = sched()
    late = req("late", task_time_left_s=2.0, expected_remaining_work_s=1.0, arrival=0.0)
    assert s.time_left_s(late, 1.5) == pytest.approx(0.5)
    assert s.slack(late, 1.5) == pytest.approx(-0.5 - s.expected_service_s(late))
    with pytest.raises(CannotMeetDeadline) as caught:
        s.add_request(late, 1.5)
    assert caught.value.slack_s == pytest.approx(s.slack(late, 1.5))
    fresh = req("fresh", task_time_left_s=2.0, expected_remaining_work_s=1.0, arrival=1.5)
    s.add_request(fresh, 1.5)  # the same message arriving now: 1 s of slack, served
    assert s.time_left_s(req("no-deadline"), 9.0) is None and math.isinf(s.slack(req("no-deadline"), 9.0))


def test_a_draining_dispatcher_refuses_unavailable_before_judging_a_deadline():
    """A closed (draining) scheduler refuses UNAVAILABLE (DispatcherNotServing, retried on another replica) before any
    policy's own refusal, as SchedulerCore.add_request orders them. The fair policy judged the slack first: a
    closed scheduler answered a request its estimate found late with DEADLINE_EXCEEDED and counted an early
    refusal."""
    from switchyard.common.errors import DispatcherNotServing

    s = sched()
    s.close()
    with pytest.raises(DispatcherNotServing) as caught:
        s.add_request(req("too-late", task_time_left_s=1.0, expected_remaining_work_s=5.0), 0.0)
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert not s.counters.refused_early


def test_service_is_charged_from_each_steps_prefill_and_decode_tokens():
    s = sched()
    r = req("r", agent="a1", tenant="t1")
    accept(s, [r], 0.0)
    out = s.schedule(0.0)
    assert r in out.admitted
    s.update_from_output(StepBatch(prefill=[(r, 100)]), StepResult(), 0.1)  # the engine prefilled its prompt
    assert s.ledger.sessions.service(agent_key("t1", "a1"), 0.1) == pytest.approx(100)
    for t in (0.12, 0.14, 0.16):
        s.update_from_output(StepBatch(decode=[r]), StepResult(), t)  # one token each
    assert s.ledger.tenants.service("t1", 0.2) == pytest.approx(103, rel=0.01)


def _decisions(decision: str) -> float:
    return REGISTRY.get_sample_value("switchyard_tool_wait_decisions_total", {"decision": decision}) or 0.0


def _parked(s, agent="agent-1", tenant="default"):
    r = Request(request_id=f"{agent}-step", agent_id=agent, tenant_id=tenant, task_type=REACT_TASK_TYPE,
                prompt_tokens=2000, max_tokens=8, arrival=0.0)
    accept(s, [r], 0.0)
    s.schedule(0.0)
    r.num_computed_tokens = 2000
    finish(s, r, 0.5, RequestStatus.FINISHED_TOOL_CALLS)
    assert r.status is RequestStatus.PARKED
    return r


def test_tool_wait_keeps_a_short_wait_and_drops_a_long_one_without_dram():
    s = sched()
    publish(s)
    assert _decisions("keep") >= 0 and _decisions("drop") >= 0  # the label set exists from the start
    publish(s)
    keep0, drop0 = _decisions("keep"), _decisions("drop")
    r = _parked(s)
    out = s.tool_wait("agent-1", 0.01, now=0.5)
    assert out is not None and out.decision.value == "keep"
    assert s.parking.entry("agent-1").ttl_s == pytest.approx(0.02)
    publish(s)
    assert _decisions("keep") == keep0 + 1
    out = s.tool_wait("agent-1", 3600.0, now=0.6)  # no DRAM tier: holding it an hour costs more than 0.2 s
    assert out.decision.value == "drop"
    assert r in s.engine.released and s.parking.entry("agent-1") is None
    publish(s)
    assert _decisions("drop") == drop0 + 1
    assert s.tool_wait("agent-1", 1.0, now=0.7) is None  # nothing parked: nothing to decide


def test_tool_wait_refuses_a_negative_wait():
    with pytest.raises(ValueError, match="expected_wait_s"):
        sched().tool_wait("a", -1.0, now=0.0)


def test_expected_service_counts_a_long_decode_at_the_measured_step_time():
    """Slack counts the request's decode, not its prefill alone: the OUTPUT_QUANTILE of its task type's
    finished outputs x the measured step time; nothing before either is measured."""
    from switchyard.dispatcher.scheduler.fair import OUTPUT_QUANTILE

    s = sched()
    waiting = req("w", task_type=REACT_TASK_TYPE, max_tokens=1000)
    prefill = s.expected_service_s(waiting)
    assert prefill == pytest.approx(100 * 1e-4)  # nothing measured: its prefill only
    for n, tokens in enumerate([40] * 19 + [400]):  # a long answer among short tool calls
        done = req(f"d{n}", task_type=REACT_TASK_TYPE)
        done.output_tokens = [1] * tokens
        s._learn(done)
    assert s.expected_service_s(waiting) == prefill  # no step measured yet
    s.update_from_output(StepBatch(decode=[req("x", task_type=REACT_TASK_TYPE)]), StepResult(seconds=0.02), now=1.0)
    assert OUTPUT_QUANTILE >= 0.95
    assert s.expected_service_s(waiting) == pytest.approx(prefill + 400 * 0.02)  # budgets for the long one
    waiting.output_tokens = [1] * 100  # produced so far (and not computed: its prefill grows by them)
    assert s.expected_service_s(waiting) == pytest.approx(200 * 1e-4 + 300 * 0.02)


def test_expected_decode_is_at_most_the_requests_own_max_tokens_and_warm_ups_are_not_learnt():
    """A request cannot decode past its ``max_tokens``: its expected decode was its task type's P95 whatever
    its own cap, so a short chat (max_tokens 8) behind long ones of its type was refused as needing their 400
    tokens. A ``prefill_only`` warm-up's one token is no sample of its type's answers."""
    s = sched()
    for n in range(20):
        done = req(f"d{n}", task_type="chat", max_tokens=400)
        done.output_tokens = [1] * 400
        s._learn(done)
    for n in range(40):  # a rag_answer-like stream of warm-ups: one token each, not answers
        warm = req(f"p{n}", task_type="chat", prefill_only=True, max_tokens=1)
        warm.output_tokens = [1]
        s._learn(warm)
    s.update_from_output(StepBatch(decode=[req("x", task_type="chat")]), StepResult(seconds=0.02), now=1.0)
    prefill = 100 * 1e-4
    long = req("long", task_type="chat", max_tokens=1000)
    assert s.expected_service_s(long) == pytest.approx(prefill + 400 * 0.02)  # warm-ups did not pull it down
    short = req("short", task_type="chat")  # max_tokens 8
    assert s.expected_service_s(short) == pytest.approx(prefill + 8 * 0.02)
    assert s.expected_service_s(req("warm", task_type="chat", prefill_only=True, max_tokens=1)) == \
        pytest.approx(prefill + 1 * 0.02)
    # 1 s left: the short one makes it (0.17 s) and is admitted; the long one (8 s) is refused by name
    accept(s, [req("short-ok", task_type="chat", task_time_left_s=1.0, arrival=1.0)], 1.0)
    assert [r.request_id for r in s.waiting] == ["short-ok"]
    with pytest.raises(CannotMeetDeadline, match="long-refused"):
        s.add_request(req("long-refused", task_type="chat", max_tokens=1000, task_time_left_s=1.0, arrival=1.0), 1.0)


def test_expected_decode_is_learnt_per_bounded_task_type():
    """A task type is the caller's free text: each new one made a table of 256 output counts of its own (memory
    growing with what callers send). Types outside the workflows share ``other``, as the expected scores do."""
    from switchyard.common.metrics import TASK_TYPES

    s = sched()
    for n in range(500):
        done = req(f"d{n}", task_type=f"caller-made-{n}")
        done.output_tokens = [1] * 40
        s._learn(done)
    assert len(s._outputs) == len(s._output_q) == 1
    s.update_from_output(StepBatch(decode=[req("x")]), StepResult(seconds=0.02), now=1.0)
    waiting = req("w", task_type="yet-another", max_tokens=100)
    assert s.expected_service_s(waiting) == pytest.approx(100 * 1e-4 + 40 * 0.02)  # learnt under ``other``
    assert s.expected_service_s(req("r", task_type=TASK_TYPES[0])) == pytest.approx(100 * 1e-4)  # its own: none


def test_two_tenants_agents_of_one_id_never_share_a_parked_step_or_a_tool_wait():
    """An agent is its tenant's and its id's: acme's "agent-1" parked its KV; zeta's "agent-1" announcing a tool
    wait decided nothing (it has no parked step), and zeta's next step did not take acme's KV over. Keyed by the
    bare id, zeta's step took acme's parked prefix and acme's turn found nothing."""
    s = sched()
    acme = _parked(s, tenant="acme")
    assert s.tool_wait(agent_key("zeta", "agent-1"), 1.0, now=0.6) is None
    assert s.parking.entry(agent_key("acme", "agent-1")) is not None
    zeta = req("zeta-turn", agent="agent-1", tenant="zeta", arrival=0.7, task_type=REACT_TASK_TYPE, resume=True)
    accept(s, [zeta], 0.7)
    s.schedule(0.7)
    assert s.parking.handover(zeta) is None and s.parking.entry(agent_key("acme", "agent-1")).req is acme
    assert s.tool_wait(agent_key("acme", "agent-1"), 0.01, now=0.8).decision.value == "keep"
