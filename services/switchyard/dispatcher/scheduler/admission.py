"""Admission by compute score, with expected scores learned per task type.

Rule (``scheduler_config.json``, docs/architecture.md): a waiting task is admitted while

    score + expected_score(task_type) < admission_score_limit
    and  admitted in this decision < max_admitted_per_decision

where ``score`` is the current compute score (0-100) plus the expected scores
of the tasks already admitted in the same decision (the sampled score cannot
see them yet). One exception keeps the engine from idling forever: when nothing
runs, the head of the queue is admitted whatever the score says (the score is
then other processes' load, which waiting does not lower).

``max_admitted_per_decision`` (the field's value 10) is the admission wave: the most
requests one decision admits. It does not bound the running set; memory and
the score do (:mod:`.capacity`). A wave bounds the prefill that running
decodes wait behind at one step boundary, so a burst of arrivals joins the
running set over a few steps.

The expected score of a task type is an exponential moving average, over
finished tasks of that type admitted beside running work, of the score each
added by running: the average score while it ran minus the running work's
score over its last stretch before it joined, split among the tasks admitted
with it (:meth:`.accounting.Accounting.marginal_score`; a task admitted onto an
idle engine, or a ``prefill_only`` warm-up, teaches nothing), starting from
``expected_score_initial``.
"""

from __future__ import annotations

from collections import Counter

from switchyard.common.config import SchedulerConfig
from switchyard.common.metrics import TASK_TYPES, bounded

ADMISSION_WAVE = "admission_wave"
"""Refusal reason: ``max_admitted_per_decision`` requests were admitted in this decision already."""
COMPUTE_SCORE = "compute_score"
"""Refusal reason: score + expected score would reach ``admission_score_limit``."""


class ExpectedScores:
    """Per-task-type expected compute score (0-100 scale), learned by an EMA.

    Args:
        initial: value before any task of a type finished (``expected_score_initial``).
        alpha: weight of the newest observation, in (0, 1] (``expected_score_ema_alpha``).
    """

    def __init__(self, initial: float, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"expected_score_ema_alpha: expected a value in (0, 1], got {alpha}")
        self.initial = initial
        self.alpha = alpha
        self._values: dict[str, float] = {}

    def get(self, task_type: str) -> float:
        """Expected score of ``task_type`` (unset is ``unknown``; a type outside the workflows is ``other``)."""
        return self._values.get(bounded(task_type, TASK_TYPES), self.initial)

    def learn(self, task_type: str, observed: float) -> float:
        """Fold one finished task's observed score into the average; returns the new value.

        Types are the bounded set of :data:`switchyard.common.metrics.TASK_TYPES` plus
        ``unknown`` and ``other``, so neither this table nor the gauge grows with what callers send.
        """
        key = bounded(task_type, TASK_TYPES)
        value = self.get(task_type) + self.alpha * (observed - self.get(task_type))
        self._values[key] = value
        return value

    def snapshot(self) -> dict[str, float]:
        """Learned values by task type (types never seen are absent): ``switchyard_expected_compute_score``."""
        return dict(self._values)


class Admission:
    """Decides whether the next waiting task may start, and counts refusals by reason.

    Args:
        config: ``scheduler_config.json`` (max_admitted_per_decision,
            admission_score_limit, expected_score_initial, expected_score_ema_alpha).
        refusals: where refusals are counted, by reason (the scheduler's
            :attr:`~.base.SchedulerCounters.admissions_refused`); default a counter of its own.
        by_score: whether the compute score bounds admission: False for a stream engine, whose score is the
            share of its upstream's concurrency limit in use, which that limit alone bounds.
    """

    def __init__(self, config: SchedulerConfig, refusals: Counter[str] | None = None, by_score: bool = True) -> None:
        self.by_score = by_score
        self.max_admitted_per_decision = config.max_admitted_per_decision
        """The admission wave: the most requests one decision admits (not a bound on the running set)."""
        self.admission_score_limit = config.admission_score_limit
        self.expected = ExpectedScores(config.expected_score_initial, config.expected_score_ema_alpha)
        self.refusals: Counter[str] = refusals if refusals is not None else Counter()
        """Refusals so far, by reason (:data:`ADMISSION_WAVE`, :data:`COMPUTE_SCORE`, and the capacity's):
        ``switchyard_admissions_refused_total``, published by the loop."""

    def check(self, task_type: str, num_running: int, projected_score: float, wave: int = 0) -> str | None:
        """None when a task of ``task_type`` may start now, else the refusal reason.

        Args:
            task_type: the waiting task's type (selects its expected score).
            num_running: requests running now, including those admitted in this decision.
            projected_score: compute score (0-100) plus the expected scores of
                the tasks admitted earlier in this decision.
            wave: tasks admitted earlier in this decision.
        """
        if self.wave_full(wave):
            return ADMISSION_WAVE
        if (self.by_score and num_running > 0
                and projected_score + self.expected.get(task_type) >= self.admission_score_limit):
            return COMPUTE_SCORE
        return None

    def wave_full(self, wave: int) -> bool:
        """True when ``wave`` requests admitted in this decision fill the admission wave."""
        return wave >= self.max_admitted_per_decision

    def refuse(self, reason: str) -> None:
        """Count one decision that left work waiting for ``reason``."""
        self.refusals[reason] += 1
