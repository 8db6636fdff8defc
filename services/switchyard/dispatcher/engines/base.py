"""The two engine interfaces the dispatcher drives.

- :class:`StepEngine`: engines that run the model one iteration at a time over
  a batch (``sim`` and ``torch``). The step loop does iteration-level
  batching with them: requests join and leave the running set at step
  boundaries, and the scheduling policy can preempt between steps.
- :class:`StreamEngine`: engines that do not step (the ``openai`` upstream).
  Each request is one streamed call; the stream loop fans requests out as
  concurrent tasks bounded by an adaptive concurrency limit.

A step engine takes part in the memory tiers (:mod:`switchyard.dispatcher.tiers`)
through optional methods, each used when present: ``memory_info()`` (device,
weight and per-token KV bytes: the HBM budget), ``device_used_bytes()`` (memory
in use, or None), ``export_kv(req) -> bytes | None`` and ``import_kv(req,
payload, tokens) -> int`` (swap to and from DRAM: :class:`KvSwap`), ``recompute_seconds(tokens)``
(the prefill a swap saves), ``share_prefix(source, target) -> int`` (a warm
resume between requests that hold their own caches), ``compact_kv() -> int``
(defragmentation, bytes freed) and ``evict_prefix_cache(nbytes) -> int``.

A step engine may also let core work in between the layers of the step it is
running (:class:`LayerPreemptible`, ``prefill_between_layers``); the step loop
uses it when present and ``scheduler.core_preemption`` is ``layer``. Engines
without it keep the step boundary as the only point where work joins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Union, runtime_checkable

from switchyard.dispatcher.request import Request, ToolCall


@runtime_checkable
class StepEngine(Protocol):
    """An engine stepped by the engine loop, one batched iteration per call."""

    model: str
    """Model id reported in GenerateDone.model."""

    busy_seconds: float
    """Cumulative seconds the engine spent in prefill and decode (for the busy ratio)."""

    async def prefill(self, reqs: list[Request]) -> None:
        """Compute the uncomputed prefix of each request and append its next token.

        The prefix is the prompt on first admission, or prompt plus every token
        already generated after a preemption (``req.num_computed_tokens == 0``
        with output present); the engine adds the recomputed part to
        ``req.recomputed_tokens``. Afterwards ``req.num_computed_tokens`` is
        ``req.num_tokens - 1``. A request that reaches its end (stop,
        ``max_tokens`` or a tool call) is finished with ``req.finish``.
        """

    async def decode(self, reqs: list[Request]) -> None:
        """One decode step: append exactly one token to each request.

        Every request must have been prefilled and not be finished.
        Finishing works as in :meth:`prefill`.
        """

    async def step(self, prefill: list[Request], decode: list[Request]) -> None:
        """One mixed iteration: prefill ``prefill`` and decode one token of each of ``decode`` together.

        What :meth:`prefill` and :meth:`decode` do to their requests, in one
        forward pass (chunked-prefill scheduling: vLLM V1, Sarathi-Serve), so
        that requests joining the batch do not stall those already decoding.
        """

    def release(self, req: Request) -> None:
        """Drop the request's KV/prefix state (finished, cancelled or preempted). Idempotent."""

    def kv_bytes(self, req: Request) -> int:
        """Bytes of KV/prefix state the engine holds for ``req`` now (0 when released)."""


@runtime_checkable
class KvSwap(Protocol):
    """A step engine whose KV state of a request can leave HBM and come back (optional capability):
    the DRAM tier (:mod:`switchyard.dispatcher.tiers`) swaps it there under memory pressure."""

    def export_kv(self, req: Request) -> bytes | None:
        """``req``'s KV state as bytes, or None when the engine holds none for it."""

    def import_kv(self, req: Request, payload: bytes, tokens: int) -> int:
        """Restore ``payload`` (``tokens`` tokens of ``req``'s KV, from :meth:`export_kv`); the tokens restored."""


@runtime_checkable
class LayerPreemptible(Protocol):
    """A step engine that can run a prefill at a layer boundary of the step in flight (optional capability).

    A step is a loop over the model's layers launched layer by layer by the
    host, so the host can stop launching the batch's layers at a boundary, run
    another request's whole prefill, and resume the batch from the next layer;
    the batch's partial state (hidden states, the KV written by the layers
    done) stays as it is. This is REEF's preemption of best-effort DNN
    inference for real-time work at kernel granularity (Han et al., OSDI 2022,
    "Microsecond-scale Preemption for Concurrent GPU-accelerated DNN
    Inferences"), at layer granularity; iteration-level schedulers (Orca, vLLM)
    only let work join between steps. The engine still runs one thing at a
    time: the prefill runs in the pause, the batch step lasts longer by it.
    """

    async def prefill_between_layers(self, reqs: list[Request]) -> bool:
        """Prefill ``reqs`` at the next layer boundary of the step in flight; True once they have their first token.

        What :meth:`StepEngine.prefill` does to ``reqs`` (their next token
        appended, finishing as there), run inside the pause. False, with
        nothing computed for ``reqs``, when no step is in flight, or when the
        step ends before it reaches another layer boundary: the caller then
        prefills them as ordinary newcomers at the next step boundary.
        ``reqs`` must not be members of the step in flight.

        Raises:
            whatever :meth:`StepEngine.prefill` raises for ``reqs`` (the step in
            flight goes on).
        """


@runtime_checkable
class ChunkedPrefill(Protocol):
    """A step engine that can prefill part of a prompt in one step (optional capability).

    vLLM V1's and Sarathi-Serve's chunked prefill (Agrawal et al., OSDI 2024):
    a long prompt is computed over several steps, each under a token budget,
    so that no step runs long: the running requests' next token and core work
    waiting for a layer boundary (:class:`LayerPreemptible`) wait for one short
    step, not for a whole long prompt.
    """

    async def step_chunk(self, prefill: list[Request], decode: list[Request], max_prefill_tokens: int) -> None:
        """:meth:`StepEngine.step`, computing at most ``max_prefill_tokens`` prompt tokens of ``prefill``.

        ``prefill`` in order: each fresh prompt (no output yet) takes what is
        left of the budget, its ``num_computed_tokens`` advancing by the part
        computed; only a request whose prompt is complete gets its next token.
        A request with output (a recompute after preemption) is computed whole,
        alone when it exceeds the budget. Every ``decode`` request gets one token.
        """


@dataclass(frozen=True)
class Usage:
    """Last item of a :meth:`StreamEngine.generate` stream: counts reported upstream.

    ``finish_reason`` is the upstream's (stop, length, tool_calls); None means
    the engine loop decides from what was streamed. ``model`` is the upstream
    model id that served the request (the fallback model when one was used);
    empty means ``engine.model``.
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    model: str = ""


StreamItem = Union[str, ToolCall, Usage]
"""What a stream engine yields: token texts, tool calls, and finally one Usage."""


@runtime_checkable
class StreamEngine(Protocol):
    """An engine that streams a whole completion per request (no stepping)."""

    model: str

    concurrency_limit: Any
    """The dispatcher's admission limit when the engine brings its own (a pool of upstream endpoints: the
    sum of one adaptive limit per endpoint, :class:`switchyard.gateway.pool.PoolLimit`); None when the
    dispatcher keeps one itself (:class:`switchyard.dispatcher.adaptive_limit.AdaptiveConcurrencyLimit`)."""

    async def generate(self, req: Request) -> AsyncIterator[StreamItem]:
        """Stream ``req``'s completion: token texts and tool calls, then one :class:`Usage`.

        Retries and fallback before the first item are the engine's own
        business; tokens already yielded are never repeated.

        Raises:
            SwitchyardError (or a subclass): carries the gRPC status and a
                message naming the cause; the Generate stream ends with it.
        """
        yield ""  # pragma: no cover - protocol body

    async def aclose(self) -> None:
        """Close connections (called once by the dispatcher's stop)."""
