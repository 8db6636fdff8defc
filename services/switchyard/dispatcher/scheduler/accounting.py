"""Per-request accounting: compute score used and peak prefix-state memory of each request (one model call).

A task's figures are its requests' (a react_loop step, a rag_answer warm-up and answer, each a request here): its
orchestrator sums the compute score and takes the largest peak from each request's done chunk. Below, "task"
is the field's word for the request a task sent (its ``task_type``'s expected score is per request).

``compute_score_used`` is in score-seconds: for every stretch of time a
request holds a running slot, it is charged ``score * seconds / n_running``,
its equal share of the compute score (0-100) among the ``n_running`` requests
stepped together, the score measured over that stretch
(:meth:`~switchyard.dispatcher.scheduler.compute_score.ComputeScoreMonitor.score_over`).
Summed over all requests this gives the score-seconds the engine delivered, so
tasks (their requests summed) can be compared and billed.

The score a task *added* (what admission learns as its type's expected
score) is its marginal effect instead: the average score while it ran minus
the score when it was admitted (the running work's own score over its last
charged stretch, :attr:`Accounting.running_score`), split among the tasks
admitted in the same decision (never below 0). A share would not do: on a lightly loaded engine
each task's share is large, admission would then keep the load light, and the
estimate would feed itself. Only tasks admitted beside running work teach it
(``admitted_at_score`` not None): admission asks what one more task adds to an
engine that runs something (onto an idle engine it admits the head whatever
the score), and a task started on an idle engine measures the jump from idle
to busy instead, most of the busy-ratio score at once (about 68 of 100 for one
decode on the sim engine), which held every later task behind one running
decode and fed itself the same way.

``memory_peak_bytes`` is the largest KV held for the request seen at a
time-slice boundary, after a step, or when the request leaves the running set:
the engine's ``kv.kv_bytes(req)``, or, while a step runs, what that step
allocated for it when more (``Request.step_kv_bytes``: a prompt being
prefilled is held before the engine's count has it, so a request cancelled
mid-prefill reports the KV its prefill held, not 0).
What is accounted lives on the :class:`~switchyard.dispatcher.request.Request`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from switchyard.dispatcher.request import Request

if TYPE_CHECKING:
    from switchyard.dispatcher.engines.base import KVCacheManager
    from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor


def held_kv_bytes(kv: "KVCacheManager", req: Request) -> int:
    """KV bytes held for ``req`` now: the engine's count (``kv.kv_bytes``), or what the step in flight allocated
    for it when more (``req.step_kv_bytes``: a prefill's prompt is held while it is computed, before the engine's
    count has it). The one rule of a request's live KV: its memory peak here, the scheduler's preemption and
    fragmentation (``SchedulerCore._kv_bytes``)."""
    return max(kv.kv_bytes(req), req.step_kv_bytes)


class Accounting:
    """Charges running requests for score and memory; what it keeps is on the request (``charged_until``,
    ``charged_mark``, ``running_seconds``, ``score_seconds``, ``admitted_at_score``, ``admitted_together``,
    ``compute_score_used``, ``memory_peak_bytes``) but for the running set's latest
    score (:attr:`running_score`).

    Args:
        kv_bytes: bytes of KV/prefix state held for a request now (:func:`held_kv_bytes` over the engine's KV
            manager).
        monitor: the compute score, measured over each stretch charged.
    """

    def __init__(self, kv_bytes: Callable[[Request], int], monitor: "ComputeScoreMonitor") -> None:
        self._kv_bytes = kv_bytes
        self._monitor = monitor
        self.running_score = 0.0
        """The compute score (0-100) over the running set's latest charged stretch longer than 0 s (:meth:`charge`):
        what a request admitted now is measured from. The monitor's cached sample, up to
        ``score_sample_interval_ms`` old, may still describe the idle interval before the running set started,
        which read a task that joined one decode as adding the whole decode's score."""

    def start(self, req: Request, now: float, score: float, admitted_together: int = 1,
              onto_idle: bool = False) -> None:
        """``req`` takes a running slot at ``now``, when the compute score was ``score``.

        ``admitted_together``: tasks admitted in the same decision, which share
        the score increase that follows. ``onto_idle``: the engine ran nothing
        before that decision (what ``req`` adds is then no marginal score).
        """
        req.charged_until = now
        req.charged_mark = self._monitor.activity()
        req.admitted_at_score = None if onto_idle else score
        req.admitted_together = max(1, admitted_together)

    def charge(self, reqs: list[Request], now: float) -> None:
        """Charge every running request in ``reqs`` up to ``now``, each stretch's score shared ``len(reqs)``
        ways."""
        mark = self._monitor.activity()
        scores: dict[float, float] = {}  # the stretch's score, once per start (most share the last charge)
        for req in reqs:
            self._charge_one(req, len(reqs), now, mark, scores)
        # a stretch of no length (a second decision at the same instant) measures nothing: its score is the
        # monitor's cached sample, which may still describe the idle interval before the running set started
        measured = [since for since in scores if since < now]
        if measured:
            self.running_score = scores[max(measured)]

    def stop(self, req: Request, n_running: int, now: float) -> None:
        """``req`` leaves the running set at ``now`` (finished, parked or preempted): charge its last stretch."""
        self._charge_one(req, n_running, now, self._monitor.activity(), {})
        req.charged_until = None

    @staticmethod
    def marginal_score(req: Request) -> float | None:
        """Score (0-100) ``req`` added by running beside running work (see the module docstring), or None when
        it never ran or its last admission was onto an idle engine."""
        seconds = req.running_seconds
        if seconds <= 0 or req.admitted_at_score is None:
            return None
        average = req.score_seconds / seconds
        return max(0.0, average - req.admitted_at_score) / req.admitted_together

    def _charge_one(self, req: Request, n_running: int, now: float, mark: tuple[float, ...],
                    scores: dict[float, float]) -> None:
        since = req.charged_until
        if since is None:
            return
        seconds = max(0.0, now - since)
        score = scores.get(since)
        if score is None:
            score = scores[since] = self._monitor.score_over(since, req.charged_mark, now)
        req.charged_until = max(since, now)
        req.charged_mark = mark
        req.running_seconds += seconds
        req.score_seconds += score * seconds
        req.compute_score_used += score * seconds / max(1, n_running)
        req.observe_kv_bytes(int(self._kv_bytes(req)))
