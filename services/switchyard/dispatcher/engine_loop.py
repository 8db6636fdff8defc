"""The engine loop: flushed batches in, scheduled engine steps out.

Two tasks run while the dispatcher serves:

- **intake** awaits the double buffer's flushed batches, stamps each sequence
  with its flush info, records the batch (metrics, one ``dispatcher.batch``
  span linked to every member's request span), and hands the batch on: to the
  scheduling policy for a :class:`StepEngine`, or to a bounded pool of stream
  workers for a :class:`StreamEngine`.
- **steps** (step engines only) does iteration-level batching: at each step
  boundary where something changed (a batch arrived, a sequence finished or
  was cancelled) or after ``time_slice_ms`` of decode steps, the policy
  re-evaluates admission and preemption; admitted sequences are prefilled and
  join the running set, which then decodes one token per sequence per step.

It also holds the interface the loop needs of a scheduling policy
(:class:`SchedulingPolicy`); the policies live in :mod:`switchyard.dispatcher.scheduler`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

from opentelemetry import trace

from switchyard.common import telemetry
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher import metrics
from switchyard.dispatcher.double_buffer import DoubleBuffer, FlushReason
from switchyard.dispatcher.engines.base import StepEngine, StreamEngine, Usage
from switchyard.dispatcher.inference_queue import InferenceQueue, InferenceQueueTimeout
from switchyard.dispatcher.scheduler import make_scheduler, should_park
from switchyard.dispatcher.sequence import SchedulerOutput, Sequence, ToolCall

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)

BUSY_WINDOW_S = 1.0
"""The engine busy ratio is measured over windows of at least this many seconds."""


# --------------------------------------------------------------------------- policy interface


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Decides, at each step boundary, which sequences run.

    The engine loop calls, on the event loop and never concurrently:
    :meth:`add` with each flushed batch (flush order); :meth:`schedule` at
    every time-slice boundary; :meth:`finish` when a sequence ends, running or
    waiting. A policy may also offer ``park(seq, now)``: then a sequence for
    which ``switchyard.dispatcher.scheduler.should_park(seq)`` holds (a
    react_loop agent waiting on a tool) is parked instead of finished and its
    KV state is left to the policy. The full contract, parking included, is
    ``switchyard.dispatcher.scheduler.base.Scheduler``.

    The loop applies each output: ``seq.mark_preempted(now)`` and
    ``engine.release(seq)`` for ``preempted``; a prefill for running
    sequences that need one (admitted, or resumed after preemption); decode
    steps for ``running`` until the next boundary.
    """

    name: str

    def add(self, seqs: list[Sequence], now: float) -> None:
        """New sequences join the waiting set. ``now`` is ``time.monotonic()``."""

    def schedule(self, now: float) -> SchedulerOutput:
        """Admit and preempt; returns the decision and the running set after it."""

    def finish(self, seq: Sequence, now: float) -> None:
        """``seq`` left the system: free its slot or drop it from waiting. Idempotent."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


def make_policy(config: SwitchyardConfig, engine: object, name: str | None = None) -> SchedulingPolicy:
    """The scheduling policy the dispatcher runs: ``make_scheduler(config, engine, policy=name)``.

    ``name`` None means ``scheduler_config.json`` ``policy``.

    Raises:
        ValueError: unknown ``name``.
    """
    return make_scheduler(config, engine, policy=name)


def _park_rule(policy: object) -> Callable[[Sequence], bool] | None:
    """The scheduler's ``should_park`` when ``policy`` can park sequences, else None."""
    return should_park if hasattr(policy, "park") else None


# --------------------------------------------------------------------------- the loop


class EngineLoop:
    """Drives one engine from the double buffer.

    Args:
        config: the whole config (``scheduler.time_slice_ms``,
            ``queue.queues.inference.workers``).
        engine: a :class:`StepEngine` or a :class:`StreamEngine`.
        policy: the scheduling policy (step engines only; may be None for a
            stream engine).
        queue: the inference queue; a sequence leaves it when it reaches the engine.
        buffer: the double buffer the service puts accepted sequences into.
        on_batch_done: called with a batch's service time in seconds (flush ->
            its last sequence ended), e.g. ``AdaptiveFlush.on_batch_done``.
    """

    def __init__(
        self,
        config: SwitchyardConfig,
        engine: StepEngine | StreamEngine,
        policy: SchedulingPolicy | None,
        queue: InferenceQueue,
        buffer: DoubleBuffer[Sequence],
        on_batch_done: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.stepping = isinstance(engine, StepEngine)
        if self.stepping and policy is None:
            raise ValueError("policy: a step engine needs a scheduling policy")
        self.policy = policy
        self._should_park = _park_rule(policy)
        self.queue = queue
        self.buffer = buffer
        self.time_slice_s = config.scheduler.time_slice_ms / 1000
        self.workers = asyncio.Semaphore(config.queue.queues.inference.workers)
        self.on_batch_done = on_batch_done
        self._wake = asyncio.Event()
        self._intake_done = False
        self._tasks: list[asyncio.Task[None]] = []
        self._streams: dict[Sequence, asyncio.Task[None]] = {}
        self._live: set[Sequence] = set()
        self._batch_left: dict[int, list[Any]] = {}  # batch number -> [members left, flushed_at]
        self._batch_numbers = itertools.count()
        self._batch_of: dict[Sequence, int] = {}
        self._busy_mark = (time.monotonic(), self._busy_seconds())
        self.steps = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the intake and step tasks on the running loop (idempotent)."""
        if self._tasks:
            return
        self._tasks.append(asyncio.create_task(self._intake(), name="dispatcher-intake"))
        if self.stepping:
            self._tasks.append(asyncio.create_task(self._steps(), name="dispatcher-steps"))

    async def drain(self) -> None:
        """Close the buffer, flush what it holds (DRAIN) and run every sequence to its end."""
        self.buffer.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._streams:
            await asyncio.gather(*list(self._streams.values()), return_exceptions=True)
        self._tasks = []

    async def stop(self) -> None:
        """Cancel everything at once: running sequences fail with CancelledError's stream end."""
        self.buffer.close()
        for task in [*self._tasks, *self._streams.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._streams.values(), return_exceptions=True)
        for seq in list(self._live):
            seq.finish("cancelled")
            self._end(seq)
        self._tasks = []

    # ------------------------------------------------------------------ called by the service

    def cancel(self, seq: Sequence) -> None:
        """The caller went away: end ``seq`` now, free its slot and its KV state. Idempotent."""
        seq.cancelled = True
        seq.finish("cancelled")
        task = self._streams.get(seq)
        if task is not None:
            task.cancel()
        if seq in self._live:
            self._end(seq)
        self.queue.leave(seq)
        self._wake.set()

    @property
    def busy_ratio(self) -> float:
        """Engine busy seconds / wall seconds over the current measuring window (0-1)."""
        since, busy = self._busy_mark
        wall = time.monotonic() - since
        return min(1.0, max(0.0, (self._busy_seconds() - busy) / wall)) if wall > 0 else 0.0

    # ------------------------------------------------------------------ intake

    async def _intake(self) -> None:
        try:
            async for batch, reason in self.buffer:
                self._accept(batch, reason)
        finally:
            self._intake_done = True
            self._wake.set()

    def _accept(self, batch: list[Sequence], reason: FlushReason) -> None:
        now = time.monotonic()
        metrics.BATCH_SIZE.observe(len(batch))
        metrics.FLUSHES.labels(reason.label).inc()
        links = [trace.Link(s.span_context) for s in batch if s.span_context is not None]
        with tracer.start_as_current_span(
            "dispatcher.batch",
            links=links,
            attributes={"switchyard.batch_size": len(batch), "switchyard.flush_reason": reason.label},
        ):
            live = []
            for seq in batch:
                seq.flushed_at = now
                seq.batch_size = len(batch)
                seq.flush_reason = int(reason)
                if not seq.is_finished:
                    live.append(seq)
            if live:
                key = next(self._batch_numbers)
                self._batch_left[key] = [len(live), now]
                for seq in live:
                    self._batch_of[seq] = key
                    self._live.add(seq)
            if self.stepping:
                assert self.policy is not None
                self.policy.add(live, now)
                self._wake.set()
            else:
                for seq in live:
                    self._streams[seq] = asyncio.create_task(self._stream(seq), name=f"stream-{seq.request_id}")
        self._update_gauges()

    # ------------------------------------------------------------------ step engines

    async def _steps(self) -> None:
        policy, engine = self.policy, self.engine
        assert policy is not None and isinstance(engine, StepEngine)
        while True:
            if policy.num_running == 0 and policy.num_waiting == 0:
                if self._intake_done:
                    return
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), BUSY_WINDOW_S)
                except TimeoutError:
                    self._update_busy()  # idle: let the busy ratio fall
                continue
            self._wake.clear()
            now = time.monotonic()
            out = policy.schedule(now)
            for seq in out.preempted:
                seq.mark_preempted(now)
                engine.release(seq)
            for seq in out.admitted:
                self._reach_engine(seq, now)
            self._reap(out.admitted, now)
            running = [s for s in out.running if not s.is_finished]
            self._update_gauges()
            if not running:
                # Work waits but the policy admits none (load too high): re-evaluate after a slice.
                try:
                    await asyncio.wait_for(self._wake.wait(), self.time_slice_s)
                except TimeoutError:
                    pass
                continue
            prefill = [s for s in running if s.needs_prefill]
            if prefill:
                await self._step(engine.prefill, prefill)
                if self._reap(prefill, time.monotonic()):
                    continue
            slice_end = time.monotonic() + self.time_slice_s
            while not self._wake.is_set():
                decode = [s for s in running if not s.is_finished and not s.needs_prefill]
                if not decode:
                    break
                await self._step(engine.decode, decode)
                if self._reap(decode, time.monotonic()) or time.monotonic() >= slice_end:
                    break

    def _reach_engine(self, seq: Sequence, now: float) -> None:
        """First admission: leave the inference queue (or fail if it waited too long)."""
        if not self.queue.holds(seq):
            return
        try:
            self.queue.check_deadline(seq, now)
        except InferenceQueueTimeout as exc:
            self.queue.leave(seq)
            seq.fail(exc)
            return
        self.queue.leave(seq, now)
        seq.queue_wait_s = now - seq.arrival

    async def _step(self, fn: Callable[[list[Sequence]], Awaitable[None]], seqs: list[Sequence]) -> None:
        engine = self.engine
        before = [(s.first_token_at, s.last_token_at, len(s.output_tokens)) for s in seqs]
        try:
            await fn(seqs)
        except Exception as exc:  # noqa: BLE001 - every member of the step gets the error
            log.exception("engine step failed for %d sequences", len(seqs))
            for seq in seqs:
                seq.fail(exc)
        self.steps += 1
        for seq, (first, last, count) in zip(seqs, before):
            if first is None and seq.first_token_at is not None:
                metrics.TTFT.observe(seq.first_token_at - seq.arrival)
            elif last is not None and len(seq.output_tokens) > count and seq.last_token_at is not None:
                metrics.INTER_TOKEN_LATENCY.observe(seq.last_token_at - last)
            if isinstance(engine, StepEngine):
                seq.observe_kv_bytes(engine.kv_bytes(seq))
        self._update_busy()

    def _reap(self, seqs: list[Sequence], now: float) -> bool:
        """End the finished members of ``seqs``; True when any slot freed."""
        freed = False
        for seq in seqs:
            if seq.is_finished and seq in self._live:
                self._end(seq, now)
                freed = True
        if freed:
            self._update_gauges()
        return freed

    def _end(self, seq: Sequence, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._live.discard(seq)
        self.queue.leave(seq)
        if self.policy is not None:
            if self._should_park is not None and self._should_park(seq):
                self.policy.park(seq, now)  # type: ignore[attr-defined]
            else:
                self.policy.finish(seq, now)
                if isinstance(self.engine, StepEngine):
                    self.engine.release(seq)
        key = self._batch_of.pop(seq, None)
        if key is not None:
            entry = self._batch_left[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._batch_left[key]
                if self.on_batch_done is not None:
                    self.on_batch_done(max(0.0, now - entry[1]))

    # ------------------------------------------------------------------ stream engines

    async def _stream(self, seq: Sequence) -> None:
        engine = self.engine
        assert isinstance(engine, StreamEngine)
        try:
            async with self.workers:
                if seq.is_finished:
                    return
                self._reach_engine(seq, time.monotonic())
                if seq.is_finished:
                    return
                finish: str | None = None
                async for item in engine.generate(seq):
                    if seq.is_finished:
                        break
                    if isinstance(item, str):
                        last = seq.last_token_at
                        seq.append_token(item)
                        if last is None:
                            metrics.TTFT.observe(time.monotonic() - seq.arrival)
                        else:
                            metrics.INTER_TOKEN_LATENCY.observe(time.monotonic() - last)
                    elif isinstance(item, ToolCall):
                        seq.add_tool_call(item)
                    elif isinstance(item, Usage):
                        seq.usage_prompt_tokens = item.prompt_tokens
                        seq.usage_completion_tokens = item.completion_tokens
                        finish = item.finish_reason
                        if item.model:
                            seq.model = item.model  # the upstream model that answered (fallback included)
                if not seq.is_finished:
                    seq.finish(finish or ("tool_calls" if seq.tool_calls else "stop"))
        except asyncio.CancelledError:
            seq.finish("cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the caller's stream
            seq.fail(exc)
        finally:
            self._streams.pop(seq, None)
            if seq in self._live:
                self._end(seq)

    # ------------------------------------------------------------------ metrics

    def _busy_seconds(self) -> float:
        return float(getattr(self.engine, "busy_seconds", 0.0))

    def _update_busy(self) -> None:
        since, busy = self._busy_mark
        now = time.monotonic()
        if now - since >= BUSY_WINDOW_S:
            metrics.ENGINE_BUSY_RATIO.set(self.busy_ratio)
            self._busy_mark = (now, self._busy_seconds())

    def _update_gauges(self) -> None:
        if self.policy is not None:
            metrics.RUNNING_SEQUENCES.set(self.policy.num_running)
            metrics.WAITING_SEQUENCES.set(self.policy.num_waiting)
        else:
            metrics.RUNNING_SEQUENCES.set(len(self._streams))
            metrics.WAITING_SEQUENCES.set(0)
