"""Per-task accounting: compute score used and peak prefix-state memory.

``compute_score_used`` is in score-seconds: for every stretch of time a
sequence holds a running slot, it is charged ``score * seconds / n_running``,
its equal share of the compute score (0-100) among the ``n_running`` sequences
stepped together. Summed over all tasks this gives the score-seconds the
engine delivered, so tasks can be compared and billed. Divided by the task's
running seconds it is the score the task added while running, which is what
admission learns as the task type's expected score.

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

    def start(self, seq: Sequence, now: float) -> None:
        """``seq`` takes a running slot at ``now``."""
        self._charged_until[seq] = now
        self._running_s.setdefault(seq, 0.0)

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

    def observed_score(self, seq: Sequence) -> float | None:
        """Score (0-100) ``seq`` added while running, or None when it never ran measurably."""
        seconds = self.running_seconds(seq)
        return seq.compute_score_used / seconds if seconds > 0 else None

    def forget(self, seq: Sequence) -> None:
        """Drop everything kept for ``seq`` (it left the system)."""
        self._charged_until.pop(seq, None)
        self._running_s.pop(seq, None)

    def _charge_one(self, seq: Sequence, score: float, n_running: int, now: float) -> None:
        since = self._charged_until.get(seq)
        if since is None:
            return
        seconds = max(0.0, now - since)
        self._charged_until[seq] = max(since, now)
        self._running_s[seq] = self._running_s.get(seq, 0.0) + seconds
        seq.compute_score_used += score * seconds / max(1, n_running)
        seq.observe_kv_bytes(int(self._kv_bytes(seq)))
