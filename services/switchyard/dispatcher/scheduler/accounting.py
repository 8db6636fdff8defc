"""Per-task accounting: compute score used and peak prefix-state memory.

``compute_score_used`` is in score-seconds: for every stretch of time a
sequence holds a running slot, it is charged ``score * seconds / n_running``,
its equal share of the compute score (0-100) among the ``n_running`` sequences
stepped together. Summed over all tasks this gives the score-seconds the
engine delivered, so tasks can be compared and billed.

The score a task *added* (what admission learns as its type's expected
score) is its marginal effect instead: the average score while it ran minus
the score when it was admitted, split among the tasks admitted in the same
decision (never below 0). A share would not do: on a lightly loaded engine
each task's share is large, admission would then keep the load light, and the
estimate would feed itself.

``memory_peak_bytes`` is the largest ``engine.kv_bytes(seq)`` seen at a
time-slice boundary or when the sequence leaves the running set.
"""

from __future__ import annotations

from typing import Callable

from switchyard.dispatcher.sequence import Sequence


class Accounting:
    """Charges running sequences for score and memory.

    Args:
        kv_bytes: bytes of KV/prefix state the engine holds for a sequence now.
    """

    def __init__(self, kv_bytes: Callable[[Sequence], int]) -> None:
        self._kv_bytes = kv_bytes
        self._charged_until: dict[Sequence, float] = {}
        self._running_s: dict[Sequence, float] = {}
        self._score_s: dict[Sequence, float] = {}
        self._admitted_at_score: dict[Sequence, float] = {}
        self._together: dict[Sequence, int] = {}

    def start(self, seq: Sequence, now: float, score: float, admitted_together: int = 1) -> None:
        """``seq`` takes a running slot at ``now``, when the compute score was ``score``.

        ``admitted_together``: tasks admitted in the same decision, which share
        the score increase that follows.
        """
        self._charged_until[seq] = now
        self._running_s.setdefault(seq, 0.0)
        self._score_s.setdefault(seq, 0.0)
        self._admitted_at_score[seq] = score
        self._together[seq] = max(1, admitted_together)

    def charge(self, seqs: list[Sequence], score: float, now: float) -> None:
        """Charge every running sequence in ``seqs`` up to ``now`` at ``score`` shared ``len(seqs)`` ways."""
        for seq in seqs:
            self._charge_one(seq, score, len(seqs), now)

    def stop(self, seq: Sequence, score: float, n_running: int, now: float) -> None:
        """``seq`` leaves the running set at ``now`` (finished, parked or preempted): charge its last stretch."""
        self._charge_one(seq, score, n_running, now)
        self._charged_until.pop(seq, None)

    def running_seconds(self, seq: Sequence) -> float:
        """Seconds ``seq`` has held a running slot, over all its admissions."""
        return self._running_s.get(seq, 0.0)

    def marginal_score(self, seq: Sequence) -> float | None:
        """Score (0-100) ``seq`` added by running (see the module docstring), or None when it never ran."""
        seconds = self.running_seconds(seq)
        if seconds <= 0 or seq not in self._admitted_at_score:
            return None
        average = self._score_s[seq] / seconds
        return max(0.0, average - self._admitted_at_score[seq]) / self._together[seq]

    def forget(self, seq: Sequence) -> None:
        """Drop everything kept for ``seq`` (it left the system)."""
        for table in (self._charged_until, self._running_s, self._score_s, self._admitted_at_score, self._together):
            table.pop(seq, None)

    def _charge_one(self, seq: Sequence, score: float, n_running: int, now: float) -> None:
        since = self._charged_until.get(seq)
        if since is None:
            return
        seconds = max(0.0, now - since)
        self._charged_until[seq] = max(since, now)
        self._running_s[seq] = self._running_s.get(seq, 0.0) + seconds
        self._score_s[seq] = self._score_s.get(seq, 0.0) + score * seconds
        seq.compute_score_used += score * seconds / max(1, n_running)
        seq.observe_kv_bytes(int(self._kv_bytes(seq)))
