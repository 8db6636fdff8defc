"""``scheduler_config.json``: the dispatcher's scheduler (dispatcher/scheduler/)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from switchyard.common.config.base import _Strict
from switchyard.common.priority import LABELS, PriorityClass
from switchyard.common.tenant import EXPECTED as TENANT_EXPECTED
from switchyard.common.tenant import TENANT_PATTERN


class ComputeScoreWeights(_Strict):
    """Weights of the compute score (0-100) the scheduler admits work by; they sum to 1."""

    cuda_util: float = Field(0.2, ge=0, le=1, description="Weight of GPU (SM) utilisation, a fraction.")
    bandwidth_util: float = Field(0.2, ge=0, le=1, description="Weight of memory-bandwidth utilisation, a fraction.")
    tensor_util: float = Field(0.6, ge=0, le=1, description="Weight of tensor-core activity, a fraction.")

    @model_validator(mode="after")
    def _sum_to_one(self) -> "ComputeScoreWeights":
        total = self.cuda_util + self.bandwidth_util + self.tensor_util
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"weights must sum to 1.0, got {self.cuda_util} + {self.bandwidth_util} + {self.tensor_util} = {total:g}"
            )
        return self


class PriorityBoost(_Strict):
    """Multiplier of each priority class in ordering and in the value of held state."""

    core: float = Field(10, gt=0, description="Boost of core work, a multiplier.")
    normal: float = Field(5, gt=0, description="Boost of normal work, a multiplier.")
    batch: float = Field(1, gt=0, description="Boost of batch work, a multiplier.")

    @model_validator(mode="after")
    def _ordered(self) -> "PriorityBoost":
        if not self.core >= self.normal >= self.batch:
            raise ValueError(f"expected core >= normal >= batch, got {self.core}, {self.normal}, {self.batch}")
        return self

    def of(self, priority: PriorityClass) -> float:
        """The boost of class ``priority``: the field its label names (the one reading of the boosts by class,
        for the priority policy's aging and the value score's weights)."""
        return (self.core, self.normal, self.batch)[priority]


assert tuple(PriorityBoost.model_fields) == LABELS, "PriorityBoost's fields are the classes' labels, in rank order"


class SchedulerConfig(_Strict):
    """The dispatcher's scheduler (dispatcher/scheduler/): ``scheduler_config.json``, the whole file."""

    time_slice_ms: float = Field(
        20, gt=0, le=10_000,
        description="Decode steps run this long between re-evaluations, milliseconds (a stream engine, which has no "
        "steps: the longest wait between two scheduling decisions while its upstream's limit is taken). It also caps "
        "the adaptive flush window (flush_interval_ms \"auto\"; min_interval_ms wins where larger)."
    )
    compute_score_weights: ComputeScoreWeights = Field(
        ComputeScoreWeights(), description="Weights of GPU, bandwidth and tensor utilisation in the compute score."
    )
    admission_score_limit: float = Field(
        80, ge=0, le=100,
        description="Admission stops, for every class, while the compute score plus the head's expected score "
        "(and those of the requests admitted before it in the same decision) would reach this, score (0-100); with "
        "nothing running the head is admitted whatever the score.",
    )
    max_admitted_per_decision: int = Field(
        10, ge=1, le=100_000,
        description="Admission wave: most waiting requests admitted in one admission decision, requests "
        "(not a cap on the running set, which KV memory and the compute score bound).",
    )
    max_step_prefill_tokens: int = Field(
        512, ge=1, le=10_000_000,
        description="Most prompt tokens one engine step prefills beside the running decodes, tokens: newcomers beyond "
        "it are prefilled in the next steps of the same turn, a longer prompt split over steps (chunked prefill, on an "
        "engine that can; else alone in its step). A step's length bounds how long core work waits for its next layer "
        "boundary and the running requests for their next token (vLLM's max_num_batched_tokens bounds a step the same "
        "way; 512 is Sarathi-Serve's and vLLM's former chunked-prefill default).",
    )
    priority_boost: PriorityBoost = Field(PriorityBoost(), description="Multiplier per priority class.")
    preemption_enabled: bool = Field(True, description="Core work that does not fit may preempt running normal and batch "
                                             "work (batch first); never other core work. Step engines only: an "
                                             "upstream's stream cannot be paused, so the openai engine never preempts.")
    core_wait_before_preempt_ms: float = Field(
        0, ge=0, le=60_000,
        description="A core request that does not fit waits this long for running work to free room before it preempts "
        "lower-class running work, milliseconds; 0: it preempts at once (mid-step, at the step's next layer boundary, "
        "with core_preemption layer).",
    )
    policy: Literal["priority", "fifo", "fair"] = Field(
        "priority", description="Scheduling policy, a name. priority: classes, aging, admission by compute score, preemption; "
        "fifo: arrival order; fair: classes, least slack first for work at risk of its deadline, then least attained "
        "service per tenant and per agent session (admission and preemption as priority)."
    )
    fairness_half_life_s: float = Field(
        60, gt=0, le=86_400,
        description="fair policy: the attained service each tenant and each agent session is charged (prompt tokens "
        "prefilled, one per decoded token) halves every this many seconds, so old service weighs less than new, "
        "seconds. Set under another policy, refused at load.",
    )
    at_risk_slack_s: float = Field(
        5, ge=0, le=3600,
        description="fair policy: a waiting request whose slack (its task's time left minus its own expected "
        "service and the task's work expected after it) is below this is at risk and goes ahead of the rest of its "
        "priority class, least slack first, seconds. Set under another policy, refused at load.",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="fair policy: tenant id -> weight (> 0): a tenant's attained service is divided by its weight "
        "before tenants are compared, so a tenant of weight 2 is served about twice as much as one of weight 1 when "
        "both wait; a tenant not named weighs 1. Set under another policy, refused at load (none weighs tenants).",
    )
    aging_max_wait_ms: float = Field(
        5000,
        gt=0,
        le=3_600_000,
        description="priority policy: aging, milliseconds: once a waiting task has waited this long more than newer "
        "work, no newer arrival (of any class) is ordered ahead of it, so batch work never starves. Set under another "
        "policy, refused at load (fair orders its classes strictly, fifo by arrival).",
    )
    expected_score_initial: float = Field(
        10, ge=0, le=100, description="Compute score a task type is expected to add before any of it has finished, score (0-100)."
    )
    expected_score_ema_alpha: float = Field(
        0.2, gt=0, le=1, description="Weight of the latest finished task in the expected-score moving average, a fraction."
    )
    tool_wait_ttl_s: float = Field(
        30, ge=0, le=3600,
        description="A react_loop agent waiting on a tool keeps its prefix state warm this long, seconds, unless its "
        "tool's announcement (ToolWait) decides otherwise: keep (warm until the decision's revisit time), swap or drop "
        "(out of HBM at once).",
    )
    tool_wait_cold_resume_weight: float = Field(
        5.0, ge=0, le=10_000,
        description="Engine-seconds one second of a cold resume's restore stall costs, a weight: a swapped agent's KV "
        "is timed back into HBM where the KV held idle until its turn (its share of the KV budget x pressure x "
        "seconds) and the turns that come back before it (this weight x one transfer each) cost least, over the "
        "tool's measured return times (dispatcher/scheduler/tool_wait.py restore_landing_s).",
    )
    tool_wait_idle_price_floor: float = Field(
        0.75, ge=0, le=1,
        description="The least KV-budget pressure, a fraction 0..1, at which a tool-wait decision prices HBM held idle "
        "(keeping an agent's KV through its tool, or holding a swapped one restored ahead until its turn): the hold "
        "costs the KV's share of the budget x max(the pressure at the decision, this floor) a second "
        "(dispatcher/scheduler/tool_wait.py). The pressure at the decision says little of the pressure while a long "
        "tool's KV is held seconds later: at 0.25 a drain's batch jobs, decided at 4-35 % pressure, were restored "
        "ahead and held up to 13 s each. 1: HBM held idle is priced as at full pressure whatever the pressure.",
    )
    tool_wait_announce_hold_s: float = Field(
        0.2, ge=0, le=10,
        description="A react_loop agent's step that ended in a tool call is parked undecided until its tool's "
        "announcement (ToolWait) decides keep, swap or drop; for this long after parking, seconds, its KV is not "
        "evicted to make room for waiting work, so that the decision is the announcement's and not the eviction's. "
        "Applies once this dispatcher has received an announcement (an orchestrator that announces); 0: no hold.",
    )
    tool_wait_turn_hold_s: float = Field(
        1.0, ge=0, le=60,
        description="A react_loop agent's KV that its tool-wait decision kept in HBM, or restored ahead of the tool's "
        "return, and whose next step has arrived and waits for admission: for this long after that step joined the "
        "waiting queue (its flush from the double buffer, at most flush.flush_interval_ms after its arrival), "
        "seconds, the prefix is not moved out of HBM to make room for a waiting request of another class than core "
        "while running work is there to end and free room (the warm resume the plan held HBM for is not turned "
        "into a cold one); past it, or for core work, or with nothing running, it is moved as any warm prefix "
        "being handed over. 0: no hold.",
    )
    score_sample_interval_ms: float = Field(
        100, gt=0, le=60_000, description="Read NVML (or the engine busy ratio) at most this often, milliseconds."
    )
    nvml_device_index: int = Field(0, ge=0, le=63, description="Index of the GPU whose utilisation feeds the compute score.")
    score_without_nvml: Literal["engine_model", "busy_ratio"] = Field(
        "engine_model",
        description="Compute score source without NVML, a name: the engine's modelled GPU, memory and tensor activity where it has them "
        "(the sim engine), or only its busy ratio as GPU utilisation.",
    )
    core_preemption: Literal["layer", "step"] = Field(
        "layer",
        description="Where core work may interrupt a running step engine's step, a name. layer: a core request arriving while "
        "a step runs is admitted at once when it fits without preempting anything, and prefilled at the step's next layer "
        "boundary (it waits one layer, not the rest of the step; the batch step in flight lasts longer by that prefill, "
        "which the running requests' inter-token latency shows); step: only at step boundaries, as vLLM and Orca schedule.",
    )

    @field_validator("tenant_weights")
    @classmethod
    def _tenant_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        for tenant, weight in weights.items():
            if not TENANT_PATTERN.fullmatch(tenant):
                raise ValueError(f"tenant ids as keys ({TENANT_EXPECTED}); {tenant[:80]!r} is none")
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"a finite weight > 0 for each tenant; {tenant!r} has {weight!r}")
        return weights

    @model_validator(mode="after")
    def _policy_keys_need_their_policy(self) -> "SchedulerConfig":
        """The keys one policy alone reads (:data:`POLICY_ONLY_KEYS`): set to other than their default under
        another policy they would do nothing, silently."""
        fields = type(self).model_fields
        values = self.model_dump(include=set(POLICY_ONLY_KEYS))
        for name, policy in POLICY_ONLY_KEYS.items():
            if self.policy == policy:
                continue
            if values[name] != fields[name].get_default(call_default_factory=True):
                raise ValueError(f"{name}: expected policy {policy!r} (the only policy that reads it), got policy "
                                 f"{self.policy!r}: set scheduler.policy to {policy!r} or leave {name} at its default")
        return self


POLICY_ONLY_KEYS: dict[str, str] = {
    "tenant_weights": "fair",
    "fairness_half_life_s": "fair",
    "at_risk_slack_s": "fair",
    "aging_max_wait_ms": "priority",
}
"""The scheduler keys one policy alone reads -> that policy (the fair policy's ledger and slack; the priority
policy's aging queue: fair orders classes strictly, fifo by arrival). Set under another policy, refused at load."""
