"""The stream loop: the scheduler's decisions applied to an upstream (stream) engine.

An upstream (vLLM, SGLang, TGI, a hosted API) does its own batching; what the
dispatcher controls is how much it sends. Each admitted request is one
streamed call. The running set is bounded by the engine's concurrency limit
(``StreamEngine.stream_slots``: for the ``openai`` engine under the gateway's
:class:`~switchyard.gateway.pool.PoolLimit`, the sum of one adaptive limit per
upstream endpoint, :mod:`switchyard.dispatcher.adaptive_limit`, each kept at its
server's knee from the TTFTs, tokens and 429/503 answers the gateway measures on
it, one endpoint being a pool of one), not by a fixed count; this loop feeds it
nothing: it admits under it, and gives a stream's slot back when its upstream call
has ended (not when the scheduler ended the request: a cancelled call still closes).
What the limit does not let through waits in the scheduler's queue, in
the policy's order, CORE first, and CORE may take the slots the limit holds
back from NORMAL and BATCH. A request the upstream refuses for load before its
first token (429) while other streams are in flight waits there again, up to
``MAX_REQUEUES`` times, rather than failing while the limit comes down.

Double buffering works as for a step engine: while the upstream streams the
current batches, arrivals fill the active buffer; when the upstream can take
more (a stream ended, or an admission wave got its first tokens), the buffer is swapped
and the whole buffer is admitted at once, as far as the limit allows. An idle
upstream takes a request at once.

``queues.inference.max_batches_in_prefill`` (the field's 4) counts admission
waves in prefill at once: the requests one scheduling decision started (a
flushed batch, part of one, or several: what the limit let through), sent
upstream, whose members have not all produced a first token (or ended). It
bounds the prefill burst sent ahead of the upstream's first answers, not the
streams in flight: a wave that is decoding no longer counts, so a server that
batches hundreds of requests is given hundreds. A
CORE request is not held back by that bound: it is admitted on arrival when the
limit has a slot for it (``scheduler.admit_core``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import time

from opentelemetry import context as otel_context
from opentelemetry import trace

from switchyard.common.config import SwitchyardConfig
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher import metrics
from switchyard.dispatcher.engine_loop import BUSY_WINDOW_S, LoopBase, output_marks, record_output
from switchyard.dispatcher.engines.base import (
    Reasoning,
    SeqOutput,
    StepBatch,
    StepResult,
    StreamEngine,
    stream_item_output,
)
from switchyard.dispatcher.scheduler.capacity import ConcurrencyCapacity, StreamSlots
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus, ToolCall


MAX_REQUEUES = 8
"""Times a request the upstream refused for load before its first token (a 429 or 503, answered or inside the
stream, after the gateway's retries and fallback: :meth:`StreamEngine.refused_for_load`) waits again in the queue before that refusal is its answer.
It waits again only while other streams are in flight to the upstream (one ending frees a place it took): a
429 with nothing else in flight is not about this load and is answered at once. The wait is behind the limit,
which each refusal brought down towards the streams the upstream took, one step of ``backoff_ratio`` at most
(the endpoint's ``on_overload``): the gateway's retries inside
one call hold its slot and last a fraction of a second, while a queue of 40 behind a server that takes 4 needs
seconds. Its own deadline bounds the wait, as any queued request's."""


CALLS_END_WAIT_S = 1.0
"""Longest a stream loop's drain or stop waits for the upstream calls it cancelled to end, seconds: a cancelled call
ends at its next await (its response closed, its endpoint's count and its slot given back), so the engine is closed
after them, not under them."""


class StreamLoop(LoopBase):
    """Drives a :class:`StreamEngine` (see the module docstring).

    Args:
        config: the whole config (``queues.inference.max_batches_in_prefill``, ``scheduler.time_slice_ms``).
        engine: the stream engine.
        scheduler: a scheduler built with a ``ConcurrencyCapacity``, whose ``slots`` (the engine's, whose limit
            measures itself) are the one count and limit the loop reads.

    Raises:
        ValueError: ``scheduler``'s capacity is not a ``ConcurrencyCapacity``.
    """

    def __init__(self, config: SwitchyardConfig, engine: StreamEngine, scheduler: SchedulerCore) -> None:
        super().__init__(config, engine, scheduler)
        if not isinstance(scheduler.capacity, ConcurrencyCapacity):
            raise ValueError("scheduler: a stream engine's scheduler needs a ConcurrencyCapacity")
        self.capacity = scheduler.capacity
        self.slots: StreamSlots = scheduler.capacity.slots
        self.max_prefilling = config.queues.inference.max_batches_in_prefill
        self._prefilling: dict[int, set[int]] = {}
        """Admission wave -> the ``seq_id`` of each member without a first token yet (not the caller's
        ``request_id``, which two requests of one wave may share)."""
        self._waves = itertools.count()

    def _cancel_finished_calls(self, outputs: list[RequestOutput]) -> None:
        """Cancel the upstream call of each request of ``outputs`` that finished while its stream still ran:
        wherever its end was decided (its caller gone, :meth:`abort`; its deadline found past by the time
        slice's decision, or by another stream's item reaching ``update_from_output``), its stream stops with
        it, and with it the endpoint's count of it (then the slot's, :meth:`_stream_ended`). A stream's own end
        is its task's to close (the current task). The one place a call is cancelled: every output passes here
        (:meth:`_apply_outputs`), a shutdown's included."""
        for out in outputs:  # called per streamed token: only a finished output asks for the current task
            if out.finished and (call := out.req.upstream_call) is not None and call is not asyncio.current_task():
                call.cancel()

    async def drain(self) -> None:
        """:meth:`LoopBase.drain`, then :meth:`_calls_ended`: a request that ended while it streamed (a deadline, a
        cancel) may still be closing its call."""
        await super().drain()
        await self._calls_ended()

    async def stop(self) -> None:
        """:meth:`LoopBase.stop` (every request held ends cancelled, its call cancelled), then :meth:`_calls_ended`."""
        await super().stop()
        await self._calls_ended()

    async def _calls_ended(self) -> None:
        """Wait, at most :data:`CALLS_END_WAIT_S`, until every upstream call this loop started has ended: the
        streams in flight (``slots.in_flight``, the one count of them) back to 0, each call's end waking the loop
        (:meth:`_stream_ended`). The dispatcher closes the engine once this returns."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CALLS_END_WAIT_S):
                while self.slots.in_flight:
                    self._wake.clear()
                    await self._wake.wait()

    def _can_take(self) -> bool:
        """A decision now could start a stream: an admission wave may go into prefill and the limit has a slot,
        of any class (CORE's reserved ones included: a CORE request waiting behind a held-back head takes one)."""
        return len(self._prefilling) < self.max_prefilling and self.slots.in_flight < int(self.slots.limit)

    def _takes_lower_class(self) -> bool:
        """A NORMAL or BATCH arrival could start now: an admission wave may go into prefill and the limit has a
        slot that is not held back for CORE. While only CORE's are left, such an arrival wakes no decision (it
        would refuse it, ``upstream_core_reserve``): it waits for a stream's end, a wave's first tokens or the
        time slice, as under a full limit."""
        return len(self._prefilling) < self.max_prefilling and self.slots.admits(PriorityClass.BATCH)

    def _wake_for_intake(self) -> None:
        if self._closing or self._takes_lower_class():
            self._wake.set()

    def _admit_core_early(self) -> None:
        """A CORE request arrived. Where the limit has a slot and a wave may go into prefill, a decision takes it
        (one that also takes CORE past a lower-class head held back for the reserve): the loop is woken. Else
        (``max_batches_in_prefill`` admission waves in prefill, or the limit taken) it does not wait for a first
        token or a stream's end (or the time slice): it is admitted now if it has a slot, CORE's reserved ones
        included, which stay its own when the limit came down below the lower-class streams
        (``scheduler.admit_core``: from the head of the waiting order, preempting nothing)."""
        if self._closing or self._can_take():
            self._wake.set()  # the loop takes it at its next decision
            return
        decision = self.scheduler.admit_core(time.monotonic())
        self._apply_outputs(decision.outputs)
        if decision.admitted:
            self._start_wave(decision.admitted)

    def _start_wave(self, admitted: list[Request]) -> None:
        wave = next(self._waves)
        self._prefilling[wave] = {req.seq_id for req in admitted}
        for req in admitted:
            call = asyncio.create_task(self._stream(req, wave), name=f"stream-{req.request_id}",
                                       context=_under_request_span(req))
            # the callback, not the coroutine's ``finally``: a task cancelled before its first step (its request
            # aborted in the same turn of the event loop that admitted it) never runs its body
            call.add_done_callback(functools.partial(self._stream_ended, req, wave))
            req.upstream_call = call

    def _stream_ended(self, req: Request, wave: int, call: asyncio.Task[None]) -> None:
        """``req``'s upstream call ``call`` is done (ended, failed or cancelled, even before its first step): its
        slot is given back here, the one release point, after its endpoint's (the gateway's ``finally``)."""
        self.capacity.call_ended(req)
        self._prefilled(wave, req)
        if req.upstream_call is call:
            req.upstream_call = None
        self._wake.set()

    async def _run(self) -> None:
        scheduler = self.scheduler
        last = 0.0
        while True:
            if not scheduler.has_work:
                if self._closing:
                    return
                await self._wait(BUSY_WINDOW_S)
                self._update_busy()  # idle: let the busy ratio fall
                scheduler.on_idle(time.monotonic())  # an idle upstream's score must not go stale
                self._publish_stats()
                continue
            now = time.monotonic()
            if self._can_take() or now - last >= self.time_slice_s:
                last = now
                out = scheduler.schedule(now)
                self._apply_outputs(out.outputs, throttled=True)  # its report at most every STATS_INTERVAL_S
                if out.admitted:
                    self._start_wave(out.admitted)
            await self._wait(self.time_slice_s)
            self._update_busy()  # the share of the limit the streams held (engine.busy_seconds), as a step loop's

    def _prefilled(self, wave: int, req: Request) -> None:
        """``req`` of admission ``wave`` got its first token or ended (either counts once)."""
        members = self._prefilling.get(wave)
        if members is None:
            return
        members.discard(req.seq_id)
        if not members:
            del self._prefilling[wave]
            self._wake.set()

    async def _stream(self, req: Request, wave: int) -> None:
        """Stream ``req`` from the engine: each item goes to the scheduler as a one-request step result
        (``update_from_output``: the same stop check as a step engine's), whose outputs are published."""
        engine, scheduler = self.engine, self.scheduler
        batch = StepBatch(decode=[req])
        first = True
        try:
            ended = False
            async with contextlib.aclosing(engine.generate(req)) as items:  # closed at once on a break
                async for item in items:
                    if req.is_finished:
                        break
                    now = time.monotonic()
                    if first and isinstance(item, (str, Reasoning, ToolCall)):  # its prefill is done
                        first = False
                        self._prefilled(wave, req)
                    before = output_marks(req)
                    seq = stream_item_output(item)
                    ended = seq.eos or seq.length_capped
                    outputs = scheduler.update_from_output(batch, StepResult({req.seq_id: seq}), now)
                    # TTFT (a token's or a tool call's) and inter-token latency: the step loop's rule
                    produced = record_output(req, *before)
                    if seq.usage is not None:  # the server's own count: one chunk may carry several tokens
                        produced += seq.usage.completion_beyond(len(req.output_tokens))
                    if produced:
                        metrics.GENERATED_TOKENS.inc(produced)
                    self._apply_outputs(outputs, stats=any(out.finished for out in outputs), throttled=True)  # not per token
            if not req.is_finished and not ended:  # the stream ended without a Usage: end-of-sequence
                seq = SeqOutput(eos=True)
                self._apply_outputs(scheduler.update_from_output(batch, StepResult({req.seq_id: seq}),
                                                           time.monotonic()))
        except asyncio.CancelledError:
            self._apply_outputs(scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED,
                                                    time.monotonic()))
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the caller's stream
            if req.is_finished:
                pass  # ended meanwhile (its deadline, found by another stream's item): answered already
            elif (first and engine.refused_for_load(exc) and self.slots.in_flight > 1
                    and req.preemptions < MAX_REQUEUES):
                scheduler.requeue(req, time.monotonic())  # the upstream is full: wait here, under the limit
            else:
                self._apply_outputs(scheduler.finish_requests([req], RequestStatus.FINISHED_ERROR,
                                                        time.monotonic(), exc))


def _under_request_span(req: Request) -> contextvars.Context:
    """The context ``req``'s upstream call runs in: its ``dispatcher.generate`` span current, so the gateway's
    ``gateway.chat_completions`` span is that span's child, in the task's trace.
    The call is a task the loop starts, whose context was the loop's: each upstream call was a trace of its own,
    with no parent and no link to the task it served (an unsampled task's sampled anew). With tracing off (no
    span, or the invalid one), the loop's context as it is."""
    context = contextvars.copy_context()
    if req.span is not None and req.span.get_span_context().is_valid:
        context.run(otel_context.attach, trace.set_span_in_context(req.span))
    return context
