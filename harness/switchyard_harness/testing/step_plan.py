"""A model step's planned reply: the agent benches' stated workload.

``bench agents --policies`` states each step's reply (its tokens, and whether it ends in a tool call)
as the workload draws it. On the simulated clock the engine holds each request's plan
(:class:`~switchyard_harness.bench.program_policies.AgentSimEngine`). With ``--stack`` the plan travels
in the prompt, whose last line is ``#plan <tokens> <finish_reason> <task start>``; the engines the bench
serves (the dispatcher's sim engine in
:class:`~switchyard_harness.bench.program_stack.PlannedSimEngine`, and ``sim-openai``) read it and reply
as planned. The line comes last so that a conversation's earlier text stays a prefix of its next step's
(a prefix cache sees what a real agent's turns give it).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.dispatcher.engines.sim import SimReply
from switchyard.dispatcher.request import ToolCall

PLAN = "#plan "
"""The plan line's opening."""


@dataclass(frozen=True)
class StepPlan:
    """One step's planned reply and when its task started.

    ``tokens``: completion tokens (at least 1); ``finish_reason``: ``tool_calls`` (a tool call whose
    arguments are the tokens) or ``stop``; ``task_started``: the task's start, ``time.monotonic()``
    seconds (the program FCFS order's key: the same clock in every process of the machine).
    """

    tokens: int
    finish_reason: str
    task_started: float

    def line(self) -> str:
        """The plan line (no newline)."""
        return f"{PLAN}{self.tokens} {self.finish_reason} {self.task_started:.6f}"

    def prompt(self, text: str) -> str:
        """``text`` with the plan line after it."""
        return f"{text}\n{self.line()}"

    def tool_calls(self, call_id: str) -> list[ToolCall]:
        """The step's tool call (``call_id``) when it ends in one, else none."""
        return [ToolCall(call_id, "search_docs", "{}")] if self.finish_reason == "tool_calls" else []

    def reply(self, call_id: str) -> SimReply:
        """The planned reply: ``tokens`` word pieces, ending in one tool call (``call_id``) or an answer."""
        return SimReply([f" w{i}" for i in range(self.tokens)], self.tool_calls(call_id), self.finish_reason)

    @classmethod
    def parse(cls, text: str) -> "StepPlan | None":
        """The plan of the text's last line; None when it holds none."""
        last = text.rstrip("\n").rsplit("\n", 1)[-1]
        if not last.startswith(PLAN):
            return None
        try:
            tokens, reason, started = last[len(PLAN):].split()
            return cls(max(1, int(tokens)), reason, float(started))
        except ValueError:
            return None


__all__ = ["PLAN", "StepPlan"]
