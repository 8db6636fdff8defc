"""Per-task accounting: compute score used and peak prefix-state memory.

``compute_score_used`` is in score-seconds: for every stretch of time a
request holds a running slot, it is charged ``score * seconds / n_running``,
its equal share of the compute score (0-100) among the ``n_running`` requests
stepped together. Summed over all tasks this gives the score-seconds the
engine delivered, so tasks can be compared and billed.

The score a task *added* (what admission learns as its type's expected
score) is its marginal effect instead: the average score while it ran minus
the score when it was admitted, split among the tasks admitted in the same
decision (never below 0). A share would not do: on a lightly loaded engine
each task's share is large, admission would then keep the load light, and the
estimate would feed itself.

``memory_peak_bytes`` is the largest ``engine.kv_bytes(req)`` seen at a
time-slice boundary or when the request leaves the running set.
"""

from __future__ import annotations

from typing import Callable

from switchyard.dispatcher.request import Request


class Accounting:
    """Charges running requests for score and memory.

    Args:
        kv_bytes: bytes of KV/prefix state the engine holds for a request now.
    """

    def __init__(self, kv_bytes: Callable[[Request], int]) -> None:
        self._kv_bytes = kv_bytes
        self._charged_until: dict[Request, float] = {}
        self._running_s: dict[Request, float] = {}
        self._score_s: dict[Request, float] = {}
        self._admitted_at_score: dict[Request, float] = {}
        self._together: dict[Request, int] = {}

    def start(self, req: Request, now: float, score: float, admitted_together: int = 1) -> None:
        """``req`` takes a running slot at ``now``, when the compute score was ``score``.

        ``admitted_together``: tasks admitted in the same decision, which share
        the score increase that follows.
        """
        self._charged_until[req] = now
        self._running_s.setdefault(req, 0.0)
        self._score_s.setdefault(req, 0.0)
        self._admitted_at_score[req] = score
        self._together[req] = max(1, admitted_together)

    def charge(self, reqs: list[Request], score: float, now: float) -> None:
        """Charge every running request in ``reqs`` up to ``now`` at ``score`` shared ``len(reqs)`` ways."""
        for req in reqs:
            self._charge_one(req, score, len(reqs), now)

    def stop(self, req: Request, score: float, n_running: int, now: float) -> None:
        """``req`` leaves the running set at ``now`` (finished, parked or preempted): charge its last stretch."""
        self._charge_one(req, score, n_running, now)
        self._charged_until.pop(req, None)

    def running_seconds(self, req: Request) -> float:
        """Seconds ``req`` has held a running slot, over all its admissions."""
        return self._running_s.get(req, 0.0)

    def marginal_score(self, req: Request) -> float | None:
        """Score (0-100) ``req`` added by running (see the module docstring), or None when it never ran."""
        seconds = self.running_seconds(req)
        if seconds <= 0 or req not in self._admitted_at_score:
            return None
        average = self._score_s[req] / seconds
        return max(0.0, average - self._admitted_at_score[req]) / self._together[req]

    def forget(self, req: Request) -> None:
        """Drop everything kept for ``req`` (it left the system)."""
        for table in (self._charged_until, self._running_s, self._score_s, self._admitted_at_score, self._together):
            table.pop(req, None)

    def _charge_one(self, req: Request, score: float, n_running: int, now: float) -> None:
        since = self._charged_until.get(req)
        if since is None:
            return
        seconds = max(0.0, now - since)
        self._charged_until[req] = max(since, now)
        self._running_s[req] = self._running_s.get(req, 0.0) + seconds
        self._score_s[req] = self._score_s.get(req, 0.0) + score * seconds
        req.compute_score_used += score * seconds / max(1, n_running)
        req.observe_kv_bytes(int(self._kv_bytes(req)))
