"""Drive a step engine without a scheduler: the engine benchmark and the engine tests.

:class:`EngineDriver` composes :class:`~switchyard.dispatcher.engines.base.StepBatch`\\ es
(whole prefills), runs them, and writes each :class:`~switchyard.dispatcher.engines.base.StepResult`
into its requests with the scheduler's own code (:func:`switchyard.dispatcher.scheduler.update.apply_output`:
the one stop check), so what it shows is what the dispatcher does with the same results.
"""

from __future__ import annotations

import time

from switchyard.dispatcher.engines.base import StepBatch, StepEngine, StepResult
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus
from switchyard.dispatcher.scheduler.update import apply_output, compose_batch


class EngineDriver:
    """Runs ``engine`` step by step over requests it treats as running; their KV is freed by :meth:`preempt`
    and :meth:`end` only.

    Args:
        engine: the step engine.
        publish: push each step's outputs to the requests' output streams (default True).
    """

    def __init__(self, engine: StepEngine, publish: bool = True) -> None:
        self.engine = engine
        self.publish = publish

    def _start(self, reqs: list[Request]) -> None:
        for req in reqs:
            if req.status < RequestStatus.RUNNING:
                req.status = RequestStatus.RUNNING

    async def prefill(self, reqs: list[Request]) -> StepResult:
        """Prefill every unfinished member of ``reqs`` whole (prefix cache hits taken first)."""
        return await self.step(reqs, [])

    async def decode(self, reqs: list[Request]) -> StepResult:
        """One token for each unfinished member of ``reqs``."""
        return await self.step([], reqs)

    def batch(self, prefill: list[Request], decode: list[Request], budget: int | None = None) -> StepBatch:
        """The step batch the scheduler composes (:func:`switchyard.dispatcher.scheduler.update.compose_batch`)."""
        self._start(prefill + decode)
        return compose_batch(self.engine.kv, [s for s in prefill if not s.is_finished],
                             [s for s in decode if not s.is_finished], budget)

    async def step(self, prefill: list[Request], decode: list[Request], budget: int | None = None) -> StepResult:
        """One mixed step: ``prefill`` (chunked under ``budget`` prompt tokens when given) and ``decode``."""
        batch = self.batch(prefill, decode, budget)
        result = await self.engine.execute_model(batch)
        self.apply(batch, result)
        return result

    async def between_layers(self, reqs: list[Request]) -> StepResult | None:
        """Prefill ``reqs`` at a layer boundary of the step in flight (None: no boundary reached)."""
        batch = self.batch(reqs, [])
        result = await self.engine.execute_between_layers(batch)
        if result is not None:
            self.apply(batch, result)
        return result

    def apply(self, batch: StepBatch, result: StepResult) -> list[RequestOutput]:
        """Write ``result`` into ``batch``'s requests (the one stop check ends them); a finished request's KV
        stays held until :meth:`end`, so a test can read it."""
        now = time.monotonic()
        outputs = []
        prefilled = {id(req) for req, _ in batch.prefill}
        for req in batch.requests:
            seq = result.outputs.get(req.seq_id)
            if seq is None or req.is_finished:
                continue
            out, status = apply_output(req, seq, prefilled=id(req) in prefilled, now=now,
                                       kv=self.engine.kv)
            if status is not None:
                req.status = status
                out.finished = True
            if self.publish:
                out.publish()
            outputs.append(out)
        return outputs

    def preempt(self, req: Request) -> None:
        """What the scheduler does to a preempted request: its KV is freed, its streamed tokens kept
        (its next prefill recomputes the prefix)."""
        req.mark_preempted()
        self.engine.kv.free(req)
        req.num_computed_tokens = 0

    def end(self, reqs: list[Request], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish every member of ``reqs`` still unfinished with ``status`` and free its KV."""
        for req in reqs:
            if not req.is_finished:
                req.status = status
                if self.publish:
                    RequestOutput(req, finished=True).publish()
            self.engine.kv.free(req)
            req.num_computed_tokens = 0
