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
payload, tokens) -> int`` (swap to and from DRAM), ``recompute_seconds(tokens)``
(the prefill a swap saves), ``share_prefix(source, target) -> int`` (a warm
resume between requests that hold their own caches), ``compact_kv() -> int``
(defragmentation, bytes freed) and ``evict_prefix_cache(nbytes) -> int``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Union, runtime_checkable

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
