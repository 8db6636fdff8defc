"""What the orchestrator measures of its tasks' programs, and the deadline rule it budgets them by.

The orchestrator runs each task's whole program (workflows.py, react.py), so it
sees every step start and end. Two measurements come out of that, each over a
bounded window of recent samples (a ``collections.deque``; quantiles by
``numpy.quantile``):

- :class:`ToolDurations`: each tool's recent call durations. Its estimate, the
  ``orchestrator.program.tool_wait_estimate_quantile`` quantile (P75 by default),
  is the expected wait announced to the agent's dispatcher when a call starts
  (``ToolWait``); a tool with no call measured yet is expected to take
  ``tool_wait_cold_estimate_s``. Exported as ``switchyard_tool_duration_seconds{tool}``
  (histogram) and ``switchyard_tool_wait_estimate_seconds{tool}`` (gauge).
- :class:`StepTimes`: the mean time of each step kind (``model``: one Generate;
  ``tool``: one react round's tool calls; ``retrieval``: one Retrieve) per task
  type, and the mean model steps a react_loop task takes. Exported as
  ``switchyard_step_time_estimate_seconds{task_type,kind}``. A model step's time
  grows with the tokens it makes, so each is kept with its completion tokens, and
  the expected time of a step asking ``max_tokens`` counts of a measured step that
  made more at most the share ``max_tokens / tokens`` of its time (an estimate from
  below: the step's fixed part, its prefill, is scaled too): a 5-token answer is not
  expected to take as long as the 3,000-token answers measured before it.

**The deadline rule** (:meth:`Program.budget`). Before each model step the
orchestrator computes the task's time left (its deadline: the task type's time
limit or the caller's deadline, whichever is sooner) and the work expected after
this step: the model steps and tool rounds its workflow has left times their
measured means (react_loop's steps left from its recent mean steps per task;
rag_answer and chat have none after their one model step). Both go on the
GenerateRequest (``task_time_left_s``, ``expected_remaining_work_s``), so the
dispatcher can serve least slack first, slack = time left - expected work:
earliest-deadline-first generalised to remaining work, i.e. least-laxity-first
(EDF: Liu & Layland, "Scheduling Algorithms for Multiprogramming in a Hard-Real-Time
Environment", JACM 1973; least laxity first: Mok, MIT PhD thesis 1983). A task whose
time left is below its expected work (this step and those after it) by more than
``refuse_early_margin_s`` cannot meet its deadline on the measured means: it is
refused DEADLINE_EXCEEDED now (a rag_answer task at its start, before its
retrieval and the warm-up beside it: its work is the retrieval and the model step), naming the task, the time left,
what set the deadline and the expected work
(:class:`~switchyard.common.errors.TaskRefusedEarly`), instead of being served late,
and counted in ``switchyard_tasks_refused_early_total{task_type}``. A step kind with
no sample yet counts 0 s: a task is never refused on a guess.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.config import ProgramConfig
from switchyard.common.errors import TaskRefusedEarly
from switchyard.common.metrics import OTHER, TASK_TYPES, bounded
from switchyard.orchestrator.metrics import STAGE_DURATION

TOOL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_KINDS = ("model", "tool", "retrieval")
"""Step kinds measured per task type: one Generate, one react round's tool calls, one Retrieve."""

TOOL_DURATION = Histogram(
    "switchyard_tool_duration_seconds", "Duration of one tool call (its retries included), by tool.", ["tool"],
    buckets=TOOL_BUCKETS,
)
TOOL_WAIT_ESTIMATE = Gauge(
    "switchyard_tool_wait_estimate_seconds",
    "The tool's expected wait announced to the dispatcher: orchestrator.program.tool_wait_estimate_quantile of "
    "its recent calls (tool_wait_cold_estimate_s before its first).", ["tool"],
)
STEP_TIME_ESTIMATE = Gauge(
    "switchyard_step_time_estimate_seconds",
    "Mean time of a step kind (model, tool, retrieval) over its recent steps, by task type; 0 before the first.",
    ["task_type", "kind"],
)
TASKS_REFUSED_EARLY = Counter(
    "switchyard_tasks_refused_early_total",
    "Tasks refused DEADLINE_EXCEEDED before a model step: their time left was below their expected work by more "
    "than orchestrator.program.refuse_early_margin_s.", ["task_type"],
)
for _task_type in TASK_TYPES:
    TASKS_REFUSED_EARLY.labels(_task_type)
    for _kind in STEP_KINDS:
        STEP_TIME_ESTIMATE.labels(_task_type, _kind)


class ToolDurations:
    """Recent call durations of each tool and its expected wait.

    Args:
        config: ``orchestrator.program``.
        tools: the registered tools' names (the metrics' label set; any other name is counted as ``other``).
    """

    def __init__(self, config: ProgramConfig, tools: Iterable[str]) -> None:
        self.quantile = config.tool_wait_estimate_quantile
        self.cold_s = config.tool_wait_cold_estimate_s
        self._kept = config.tool_wait_samples_kept
        self.tools = frozenset(tools)
        self._samples: dict[str, deque[float]] = {}
        self._estimates: dict[str, float] = {}
        for name in (*sorted(self.tools), OTHER):
            TOOL_DURATION.labels(name)
            STAGE_DURATION.labels(f"tool:{name}")  # the tool call's stage (react.py), at 0 from the start too
            TOOL_WAIT_ESTIMATE.labels(name).set(self.cold_s)

    def label(self, tool: str) -> str:
        """``tool``'s metric label: its name when registered, else ``other`` (a model may invent names)."""
        return bounded(tool, self.tools)

    def observe(self, tool: str, seconds: float) -> None:
        """One call of ``tool`` took ``seconds``: the estimate moves to the quantile of the recent calls."""
        label = self.label(tool)
        TOOL_DURATION.labels(label).observe(seconds)
        window = self._samples.get(label)
        if window is None:
            window = self._samples[label] = deque(maxlen=self._kept)
        window.append(seconds)
        estimate = float(np.quantile(np.fromiter(window, float, len(window)), self.quantile))
        self._estimates[label] = estimate
        TOOL_WAIT_ESTIMATE.labels(label).set(estimate)

    def expected_s(self, tool: str) -> float:
        """Expected seconds of a call of ``tool``: the quantile of its recent calls, or the cold estimate."""
        return self._estimates.get(self.label(tool), self.cold_s)


class StepTimes:
    """Mean step time per (task type, step kind) and mean model steps per react_loop task, over recent samples.

    Args:
        samples_kept: samples kept per series (``orchestrator.program.step_time_samples_kept``).
    """

    def __init__(self, samples_kept: int) -> None:
        self._kept = samples_kept
        self._times: dict[tuple[str, str], deque[tuple[float, int]]] = {}
        self._turns: deque[int] = deque(maxlen=samples_kept)

    def observe(self, task_type: str, kind: str, seconds: float, tokens: int = 0) -> None:
        """A ``kind`` step (:data:`STEP_KINDS`) of a ``task_type`` task took ``seconds``; ``tokens``: the
        completion tokens a model step made (0: not counted, the step's time is taken whole by :meth:`mean`)."""
        window = self._times.get((task_type, kind))
        if window is None:
            window = self._times[(task_type, kind)] = deque(maxlen=self._kept)
        window.append((seconds, tokens))
        STEP_TIME_ESTIMATE.labels(bounded(task_type, TASK_TYPES), bounded(kind, STEP_KINDS)).set(self.mean(task_type, kind))

    def mean(self, task_type: str, kind: str, max_tokens: int | None = None) -> float:
        """Mean seconds of the recent ``kind`` steps of ``task_type`` tasks; 0 before the first.

        ``max_tokens``: the completion tokens the step to come may make at most; a measured step that made more
        (``tokens``) counts ``seconds * max_tokens / tokens`` (see the module docstring). None: every step whole.
        """
        window = self._times.get((task_type, kind))
        if not window:
            return 0.0
        if max_tokens is None:
            return sum(seconds for seconds, _ in window) / len(window)
        return sum(seconds * max_tokens / tokens if tokens > max_tokens else seconds
                   for seconds, tokens in window) / len(window)

    def observe_turns(self, model_steps: int) -> None:
        """A react_loop task finished after ``model_steps`` model steps."""
        self._turns.append(model_steps)

    def mean_turns(self) -> float | None:
        """Mean model steps of the recent react_loop tasks; None before the first."""
        return sum(self._turns) / len(self._turns) if self._turns else None


@dataclass(frozen=True)
class Budget:
    """One model step's place in its task's time (seconds)."""

    time_left_s: float
    """Until the task's deadline."""
    this_step_s: float
    """Expected time of the model step about to start."""
    remaining_after_s: float
    """Expected work after it (the GenerateRequest's ``expected_remaining_work_s``)."""
    deadline_source: str = ""
    """What set the task's deadline (the GenerateRequest's ``deadline_source``: the task type's time limit key,
    or the caller's gRPC deadline); "" when not known."""

    @property
    def slack_s(self) -> float:
        """Time left minus all the expected work, this step's included (negative: late on the means)."""
        return self.time_left_s - self.this_step_s - self.remaining_after_s


class Program:
    """The measurements one orchestrator keeps of its tasks' programs, and the budget of each model step.

    Args:
        config: ``orchestrator.program``.
        tools: the registered tools' names.
        max_steps: ``orchestrator.react.max_steps`` (a react_loop task takes at most max_steps + 1 model steps).
    """

    def __init__(self, config: ProgramConfig, tools: Iterable[str], max_steps: int) -> None:
        self.config = config
        self.tools = ToolDurations(config, tools)
        self.steps = StepTimes(config.step_time_samples_kept)
        self.max_steps = max_steps

    def remaining_after(self, task_type: str, model_steps_done: int, prefill: bool = False,
                        max_tokens: int | None = None) -> float:
        """Expected seconds of work after the model step about to start, ``model_steps_done`` having run.

        react_loop: ``min(mean model steps per task, max_steps + 1) - (model_steps_done + 1)`` more steps
        (none before any task finished), each after one tool round: steps x (mean model step + mean tool round).
        rag_answer and chat have one model step: nothing after it. ``prefill``: the step is a prefill-only
        warm-up sent before retrieval, followed by retrieval and the one model step. ``max_tokens``: the
        completion tokens each model step to come may make (:meth:`StepTimes.mean`).
        """
        steps = self.steps
        if prefill:
            return steps.mean(task_type, "retrieval") + steps.mean(task_type, "model", max_tokens)
        if task_type != "react_loop":
            return 0.0
        turns = steps.mean_turns()
        if turns is None:
            return 0.0
        left = max(0.0, min(turns, self.max_steps + 1) - (model_steps_done + 1))
        return left * (steps.mean(task_type, "model", max_tokens) + steps.mean(task_type, "tool"))

    def budget(self, task_id: str, task_type: str, deadline_s: float, model_steps_done: int,
               prefill: bool = False, max_tokens: int | None = None, deadline_source: str = "") -> Budget:
        """The budget of the model step about to start; refuses a task that cannot make its deadline.

        Args:
            deadline_s: the task's deadline, a ``time.monotonic()`` instant.
            deadline_source: what set it (the task type's time limit key, or the caller's gRPC deadline), named
                by the refusal.
            max_tokens: the completion tokens the step (and each one after it) may make at most; a measured
                step that made more counts the share of its time these could take (:meth:`StepTimes.mean`).
                None: measured steps count whole.
            prefill: the step is rag_answer's prefill-only warm-up, sent at the task's start beside its
                retrieval: it is no model step of its own (0 s), and the retrieval and the one model step
                follow it (:meth:`remaining_after`). The rule is checked there, before the retrieval runs,
                so that a rag_answer task that cannot make it is refused before any of its work is done.

        Raises:
            TaskRefusedEarly: ``refuse_early`` is on and time left + ``refuse_early_margin_s`` is below the
                expected work (see the module docstring); counted in ``switchyard_tasks_refused_early_total``.
        """
        budget = Budget(max(0.0, deadline_s - time.monotonic()),
                        0.0 if prefill else self.steps.mean(task_type, "model", max_tokens),
                        self.remaining_after(task_type, model_steps_done, prefill=prefill, max_tokens=max_tokens),
                        deadline_source)
        config = self.config
        if config.refuse_early and budget.slack_s < -config.refuse_early_margin_s:
            TASKS_REFUSED_EARLY.labels(bounded(task_type, TASK_TYPES)).inc()
            raise TaskRefusedEarly(task_id, budget.time_left_s, budget.this_step_s + budget.remaining_after_s,
                                   model_steps_done, config.refuse_early_margin_s, deadline_source)
        return budget
