"""Bookkeeping shared by every policy: waiting, running and parked sets, accounting, metrics.

A policy (:mod:`.priority`, :mod:`.fifo`) subclasses :class:`SchedulerCore`
and decides three things only: the order of the waiting set
(:meth:`SchedulerCore._order_key`), whether the head may start
(:meth:`SchedulerCore._refusal`), and what to preempt
(:meth:`SchedulerCore._preempt`).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from switchyard.common.config import SchedulerFile
from switchyard.dispatcher.scheduler import metrics
from switchyard.dispatcher.scheduler.accounting import Accounting
from switchyard.dispatcher.scheduler.admission import Admission
from switchyard.dispatcher.scheduler.base import CLASS_ORDER, class_name
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.parking import ParkedAgents
from switchyard.dispatcher.sequence import SchedulerOutput, Sequence


class SchedulerCore:
    """Implements :class:`~switchyard.dispatcher.scheduler.base.Scheduler` but the policy hooks.

    Args:
        config: ``scheduler_config.json``.
        engine: the step engine; its ``busy_seconds``, ``kv_bytes(seq)`` and
            ``release(seq)`` are used when present (a stream engine has none:
            the score then counts the engine idle and memory as 0).
        monitor: compute-score source; default a :class:`ComputeScoreMonitor`
            reading NVML, falling back to the engine's own activity.
    """

    name = "base"

    def __init__(self, config: SchedulerFile, engine: Any = None, monitor: ComputeScoreMonitor | None = None) -> None:
        self.config = config
        self.engine = engine
        self.monitor = monitor or ComputeScoreMonitor(config, engine=engine)
        self.admission = Admission(config)
        self.accounting = Accounting(self._kv_bytes)
        self.parking = ParkedAgents(config.tool_wait_ttl_s, self._release, self._kv_bytes)
        self._waiting: list[tuple[tuple[float, ...], Sequence]] = []
        self._running: list[Sequence] = []
        self._preempted: set[Sequence] = set()
        self._handover: dict[Sequence, Sequence] = {}
        """Waiting resumed sequence -> its agent's parked sequence, whose prefix state it takes at admission."""
        self._counter = itertools.count()
        self.score = 0.0
        """Compute score (0-100) read at the last decision."""

    # ------------------------------------------------------------------ views

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for _, seq in self._waiting]

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def parked(self) -> list[Sequence]:
        return self.parking.sequences

    @property
    def parked_kv_bytes(self) -> int:
        return self.parking.kv_bytes

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ engine loop calls

    def add(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            if seq.resume and seq.agent_id:
                self._resume_prefix(seq, now)
            self._enqueue(seq, now)
        self._publish()

    def resume(self, seq: Sequence, now: float) -> None:
        seq.resume = True
        self.add([seq], now)

    def schedule(self, now: float) -> SchedulerOutput:
        score = self.monitor.read(now)
        self.score = score
        self.accounting.charge(self._running, score, now)
        self.parking.expire(now)
        out = SchedulerOutput()
        projected = score
        while self._waiting:
            seq = self._waiting[0][1]
            reason = self._refusal(seq, projected)
            if reason is not None:
                self.admission.refuse(reason)
                break
            self._waiting.pop(0)
            self._start(seq, now, out)
            projected += self.admission.expected.get(seq.task_type)
        self._preempt(now, out)
        for seq in out.admitted:
            self.accounting.start(seq, now, score, len(out.admitted))
        out.running = list(self._running)
        self._publish()
        return out

    def finish(self, seq: Sequence, now: float) -> None:
        if seq in self._running:
            self._stop(seq, now)
            self._learn(seq)
        elif not self._remove_waiting(seq):
            self.parking.drop(seq)
        self._preempted.discard(seq)
        self._end_handover(seq)
        self.accounting.forget(seq)
        self._publish()

    def park(self, seq: Sequence, now: float) -> None:
        if seq in self._running:
            self._stop(seq, now)
            self._learn(seq)
        else:
            self._remove_waiting(seq)
        self._preempted.discard(seq)
        self._end_handover(seq)
        self.accounting.forget(seq)
        self.parking.park(seq, now)
        self._publish()

    def close(self) -> None:
        """Release NVML. The engine loop calls it once at shutdown."""
        self.monitor.close()

    # ------------------------------------------------------------------ policy hooks

    def _order_key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        """Sort key of ``seq`` in the waiting set (smallest first), fixed while it waits."""
        raise NotImplementedError

    def _refusal(self, seq: Sequence, projected_score: float) -> str | None:
        """None when the head ``seq`` may start now, else the refusal reason."""
        return self.admission.check(seq.task_type, len(self._running), projected_score)

    def _preempt(self, now: float, out: SchedulerOutput) -> None:
        """Preempt running work for waiting work, after the admission pass (default: never)."""

    # ------------------------------------------------------------------ helpers for policies

    def _enqueue(self, seq: Sequence, now: float) -> None:
        key = (*self._order_key(seq, now), float(next(self._counter)))
        bisect.insort(self._waiting, (key, seq), key=lambda entry: entry[0])

    def _remove_waiting(self, seq: Sequence) -> bool:
        for i, (_, queued) in enumerate(self._waiting):
            if queued is seq:
                del self._waiting[i]
                return True
        return False

    def _start(self, seq: Sequence, now: float, out: SchedulerOutput) -> None:
        seq.admitted_at = now
        self._running.append(seq)
        if seq in self._preempted:
            self._preempted.discard(seq)
            metrics.RESUMES.labels("preempted").inc()
        self._end_handover(seq)
        out.admitted.append(seq)

    def _stop(self, seq: Sequence, now: float) -> None:
        self.accounting.stop(seq, self.score, len(self._running), now)
        self._running.remove(seq)

    def _preempt_one(self, victim: Sequence, now: float, out: SchedulerOutput) -> None:
        """Take ``victim``'s slot: it waits again at its original place (its key comes from its arrival)."""
        self._stop(victim, now)
        self._preempted.add(victim)
        self._enqueue(victim, now)
        metrics.PREEMPTIONS.labels(class_name(victim)).inc()
        out.preempted.append(victim)

    def _resume_prefix(self, seq: Sequence, now: float) -> None:
        found = self.parking.take(seq.agent_id, now)
        if found.parked is not None:
            self._handover[seq] = found.parked
        if found.warm:
            # The new step repeats the parked prefix: keep it, compute only the rest (at least one token).
            seq.num_computed_tokens = max(0, min(found.prefix_tokens, seq.prompt_tokens - 1))
            metrics.RESUMES.labels("tool_warm").inc()
        else:
            seq.recomputed_tokens += min(found.prefix_tokens, seq.prompt_tokens)
            metrics.RESUMES.labels("tool_cold").inc()

    def _end_handover(self, seq: Sequence) -> None:
        """``seq`` started (its prefix state is now its own) or left: release its agent's parked step."""
        parked = self._handover.pop(seq, None)
        if parked is not None:
            self._release(parked)

    def _learn(self, seq: Sequence) -> None:
        observed = self.accounting.marginal_score(seq)
        if observed is not None:
            self.admission.expected.learn(seq.task_type, observed)
        metrics.TASK_COMPUTE_SCORE_USED.observe(seq.compute_score_used)
        metrics.TASK_MEMORY_PEAK_BYTES.observe(seq.memory_peak_bytes)

    def _kv_bytes(self, seq: Sequence) -> int:
        kv_bytes = getattr(self.engine, "kv_bytes", None)
        return int(kv_bytes(seq)) if callable(kv_bytes) else 0

    def _release(self, seq: Sequence) -> None:
        release = getattr(self.engine, "release", None)
        if callable(release):
            release(seq)

    def _publish(self) -> None:
        for name in CLASS_ORDER:
            metrics.RUNNING_AGENTS.labels(name).set(sum(1 for s in self._running if class_name(s) == name))
            metrics.WAITING_AGENTS.labels(name).set(sum(1 for _, s in self._waiting if class_name(s) == name))
