"""The fair policy: priority classes, and inside a class deadlines at risk first, then fairness.

Order of the waiting set (smallest key first), fixed when a request joins it::

    (class, not at risk, latest start if at risk, tenant's weighted service, session's service, arrival)

- Classes strictly: core, then normal, then batch (no aging across classes;
  the ``priority`` policy's aging is not applied here).
- A request *at risk* (its slack below ``scheduler.at_risk_slack_s``)
  goes ahead of the rest of its class, least slack first (latest start time
  ``now + slack``): :mod:`.slack` (least-laxity-first; earliest deadline
  first, Liu & Layland 1973). Slack comes from the request's ``time_left_s``,
  ``expected_remaining_work_s`` and its own expected service (the engine's
  prefill of its uncomputed tokens and its expected decode at the measured
  step time: :meth:`FairScheduler.expected_service_s`).
- The rest: the tenant's weighted attained service (llm-d inference
  scheduler's per-flow fairness, the flow being the tenant), then the agent
  session's (Autellix's program-level least attained service), then arrival:
  :mod:`.fairness`. A tenant's service is divided by its weight
  (``scheduler.tenant_weights``, 1 when not named); both counters halve every
  ``scheduler.fairness_half_life_s``.

A request whose task can no longer make its deadline is refused when it
arrives (:class:`~switchyard.dispatcher.scheduler.slack.CannotMeetDeadline`,
DEADLINE_EXCEEDED naming it and its slack) instead of being served late, and
counted by class in ``switchyard_requests_refused_early_total``.

Attained service is charged from what the engine computed for each request
(:meth:`FairScheduler.update_from_output`), for both engine kinds: a step
engine's step charges the prompt tokens it prefilled and one token per
decode; an upstream (``openai``) engine's stream charges one token per
streamed token and, at its end, the upstream's own count of the prompt it
prefilled and of the completion tokens not streamed as text (tool-call
arguments), from the stream's usage. The order is the waiting queue's key
(:class:`FairQueue`, the
:class:`~switchyard.dispatcher.scheduler.request_queue.RequestQueue`
contract): the step loop's waiting set and the stream loop's upstream
admission queue (what waits for an upstream concurrency slot) are the same
queue, so the one rule orders both. The keys are computed when a request
joins and again at a decision when service was charged since the last one
(:meth:`FairScheduler.schedule`): attained service moves while requests
wait, and two requests of one tenant must be compared on the tenant's
service at the same time (then their sessions' service decides).

Admission and preemption are the ``priority`` policy's.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Iterable

from switchyard.common.config import SwitchyardConfig
from switchyard.common.metrics import TASK_TYPES, bounded
from switchyard.common.tenant import DEFAULT_TENANT
from switchyard.dispatcher.engines.base import StepBatch, StepResult
from switchyard.dispatcher.request import Request, RequestOutput, SchedulerOutput
from switchyard.dispatcher.scheduler import slack as slack_rule
from switchyard.dispatcher.scheduler.fairness import FairnessLedger
from switchyard.dispatcher.scheduler.priority import PriorityScheduler
from switchyard.dispatcher.scheduler.request_queue import OrderKey, RequestQueue


OUTPUT_SAMPLES = 256
"""Finished requests per task type whose output tokens give a request's expected decode."""

OUTPUT_QUANTILE = 0.95
"""Quantile of a task type's output tokens a request's expected decode budgets for. A step's length is not
known before it runs (a react step ends in a short tool call or a long answer): slack and the early refusal
count on a long one, so that a task refused is one that would likely miss and one admitted likely makes it
(the mean let a core task's 400-token answer, decoded in a large batch, end 0.2 s past its deadline)."""

STEP_EMA_ALPHA = 0.05
"""Weight of the latest step in the moving average of a decode step's seconds."""


class FairQueue(RequestQueue):
    """The fair policy's waiting queue: ``order_key`` is :meth:`FairScheduler.fair_key`."""

    name = "fair"

    def __init__(self, policy: "FairScheduler") -> None:
        super().__init__()
        self.policy = policy

    def order_key(self, req: Request, now: float) -> OrderKey:
        return self.policy.fair_key(req, now)


class FairScheduler(PriorityScheduler):
    """Classes, then least slack for work at risk, then tenant and session fairness (module docstring).

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "fair"

    def __init__(self, config: SwitchyardConfig, *args: Any, **kwargs: Any) -> None:
        policy = config.scheduler
        self.at_risk_slack_s = policy.at_risk_slack_s
        """A request whose slack is below this many seconds is at risk: least slack first in its class
        (``scheduler.at_risk_slack_s``)."""
        self.ledger = FairnessLedger(policy.fairness_half_life_s, dict(policy.tenant_weights))
        """Attained service per tenant and session (``scheduler.fairness_half_life_s``, ``scheduler.tenant_weights``)."""
        self.tenant_labels = tenant_labels(policy.tenant_weights)
        """The tenants counted under their own label in ``switchyard_tenant_service_tokens_total``."""
        self._charged = False  # service was charged since the waiting queue's keys were last computed
        # keyed by the bounded task type (the expected scores' key, ``bounded(task_type, TASK_TYPES)``): a caller's
        # free-form task_type must not grow these tables
        self._outputs: dict[str, deque[int]] = {}  # task type -> output tokens of its last finished requests
        self._output_q: dict[str, int] = {}  # task type -> OUTPUT_QUANTILE of those
        self._step_s = 0.0  # moving average of the seconds of a step with decodes (0: none measured)
        super().__init__(config, *args, **kwargs)

    def make_queue(self) -> RequestQueue:
        """:class:`FairQueue`, ordered by :meth:`fair_key`."""
        return FairQueue(self)

    def expected_service_s(self, req: Request) -> float:
        """Seconds ``req`` is expected to need: the prefill of what it has not computed, plus its expected
        decode: the :data:`OUTPUT_QUANTILE` quantile of the output tokens of the last
        :data:`OUTPUT_SAMPLES` finished requests of its task type, at most its own ``max_tokens`` (it
        cannot produce more; a ``prefill_only`` request's is 1), less what it has produced, x the
        measured seconds of one step with decodes (an exponential moving average,
        :data:`STEP_EMA_ALPHA`; each decode gets one token a step, so under a large batch a token takes
        longer). 0 for what is not measured yet (no finished request of the type, or an engine whose
        results carry no step seconds): nothing is refused on a guess."""
        prefill = self.tiers.recompute_seconds(req.num_uncomputed_tokens)
        output = self._output_q.get(bounded(req.task_type, TASK_TYPES))
        if output is None or self._step_s <= 0:
            return prefill
        if req.max_tokens > 0:
            output = min(output, req.max_tokens)
        return prefill + max(0.0, output - len(req.output_tokens)) * self._step_s

    def _learn(self, req: Request) -> None:
        """As the core's, and its output tokens join its task type's samples; a ``prefill_only`` request's
        do not (its one token is no answer of its type: a rag_answer task's warm-up would halve the samples
        its answers' decode is budgeted from)."""
        super()._learn(req)
        if req.prefill_only:
            return
        task_type = bounded(req.task_type, TASK_TYPES)
        outputs = self._outputs.get(task_type)
        if outputs is None:
            outputs = self._outputs[task_type] = deque(maxlen=OUTPUT_SAMPLES)
        outputs.append(len(req.output_tokens))
        ordered = sorted(outputs)
        self._output_q[task_type] = ordered[min(len(ordered) - 1, int(OUTPUT_QUANTILE * len(ordered)))]

    @staticmethod
    def time_left_s(req: Request, now: float) -> float | None:
        """Seconds ``req``'s task has left at ``now``: its ``task_time_left_s`` as sent, less the time since it
        arrived (monotonic seconds); None when its caller gave none (no deadline)."""
        return None if req.task_time_left_s is None else req.task_time_left_s - max(0.0, now - req.arrival)

    def slack(self, req: Request, now: float) -> float:
        """``req``'s slack at ``now`` (:func:`switchyard.dispatcher.scheduler.slack.slack_s`), seconds."""
        return slack_rule.slack_s(self.time_left_s(req, now), req.expected_remaining_work_s,
                                  self.expected_service_s(req))

    def _refuse_early(self, req: Request, now: float) -> None:
        """Refuse a request that cannot make its deadline (:meth:`SchedulerCore.add_request` asks once the
        dispatcher is known not to be draining: a draining one answers UNAVAILABLE, retried elsewhere).

        A request that says ``no_early_refusal`` (its orchestrator's ``orchestrator.program.refuse_early`` is off)
        is never refused here: it is ordered by its slack, and served; one short by no more than its
        ``early_refusal_margin_s`` (its orchestrator's ``refuse_early_margin_s``) is served too.

        Raises:
            CannotMeetDeadline: its slack is already below ``-early_refusal_margin_s`` (DEADLINE_EXCEEDED).
        """
        left = self.time_left_s(req, now)
        if left is not None and not req.no_early_refusal:
            try:
                slack_rule.check(req.request_id, left, req.expected_remaining_work_s, self.expected_service_s(req),
                                 req.early_refusal_margin_s, req.deadline_source)
            except slack_rule.CannotMeetDeadline:
                self.counters.refused_early[req.priority.label] += 1  # switchyard_requests_refused_early_total
                if req.resume and req.agent_key:  # its task ends here: nothing is kept for its next turn
                    self.forget_agent(req.program_key)
                raise

    def fair_key(self, req: Request, now: float) -> OrderKey:
        """``(class, not at risk, latest start if at risk, tenant's weighted service, session's service,
        arrival)`` for ``req`` joining the queue at ``now`` (the module docstring's order)."""
        slack = self.slack(req, now)
        urgent = slack < self.at_risk_slack_s
        tenant, session, arrival = self.ledger.order_key(req.agent_key, req.tenant_id, req.arrival, now)
        return (float(req.priority), 0.0 if urgent else 1.0, now + slack if urgent else 0.0, tenant, session,
                arrival)

    def schedule(self, now: float) -> SchedulerOutput:
        """:meth:`SchedulerCore.schedule`, the waiting keys computed again at ``now`` first when service was
        charged since they were (:meth:`~.request_queue.RequestQueue.reorder`)."""
        if self._charged and len(self.queue) > 1:
            self.queue.reorder(now)
        self._charged = False
        return super().schedule(now)

    def update_from_output(self, batch: StepBatch, result: StepResult, now: float) -> list[RequestOutput]:
        """:meth:`SchedulerCore.update_from_output`, after charging each of ``batch``'s requests the
        service the engine gave it (:meth:`service_tokens`)."""
        charged = charge_service(self.ledger, batch, result, now)
        if charged:
            self._charged = True
            for tenant, tokens in charged.items():  # switchyard_tenant_service_tokens_total
                self.counters.tenant_service[bounded(tenant, self.tenant_labels, empty=DEFAULT_TENANT)] += tokens
        if batch.decode and result.seconds > 0:  # one token per decode: the step time is a token's
            self._step_s = (result.seconds if self._step_s <= 0
                            else self._step_s + STEP_EMA_ALPHA * (result.seconds - self._step_s))
        return super().update_from_output(batch, result, now)


def tenant_labels(tenant_weights: Iterable[str]) -> frozenset[str]:
    """The tenant label values of ``switchyard_tenant_service_tokens_total`` besides ``other`` (every tenant not
    named, a tenant called ``other`` with them): the default tenant and the tenants ``scheduler.tenant_weights``
    names. Tenants are the callers' words; the label set stays bounded by the config."""
    return frozenset(tenant_weights) | {DEFAULT_TENANT}


def service_tokens(req: Request, result: StepResult) -> int:
    """Tokens of service a decode entry of ``result`` gave ``req``, before it is written into ``req``.

    A step engine's decode step: one token (its texts, when it produced several). A stream engine's
    item: one per streamed token text, none for a tool call (its argument tokens come in the usage);
    the stream's final usage: the upstream's prompt tokens (its prefill) plus its completion tokens
    not already charged as streamed texts.
    """
    seq = result.outputs.get(req.seq_id)
    if seq is None:
        return 1
    if seq.usage is not None:
        return max(0, seq.usage.prompt_tokens) + seq.usage.completion_beyond(len(req.output_tokens))
    if seq.texts:
        return len(seq.texts)
    return 0 if seq.tool_calls else 1


def charge_service(ledger: FairnessLedger, batch: StepBatch, result: StepResult, now: float) -> Counter[str]:
    """Charge ``ledger`` the service ``result`` (the engine's step, or an upstream's stream item) gave each of
    ``batch``'s requests: their prefill tokens, and each decode entry's :func:`service_tokens`, to their agent
    session and tenant at ``now``. The one rule the fair policy and the benches' anchor ledgers share.
    Returns the tokens charged, by tenant id (empty, false, when nothing was)."""
    charged: Counter[str] = Counter()
    for req, tokens in batch.prefill:
        if tokens > 0:
            ledger.charge(req.agent_key, req.tenant_id, tokens, now)
            charged[req.tenant_id] += tokens
    for req in batch.decode:
        tokens = service_tokens(req, result)
        if tokens > 0:
            ledger.charge(req.agent_key, req.tenant_id, tokens, now)
            charged[req.tenant_id] += tokens
    return charged
