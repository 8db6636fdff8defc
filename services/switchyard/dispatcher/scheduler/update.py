"""What the scheduler writes into a request from an engine's report, and the one stop check.

:func:`compose_batch` builds a step's :class:`~switchyard.dispatcher.engines.base.StepBatch`
(prefix-cache hits first, then the prompt tokens each prefill computes, under a
token budget when chunked); :func:`apply_output` writes one request's
:class:`~switchyard.dispatcher.engines.base.SeqOutput` into it and returns what
the caller must hear (:class:`~switchyard.dispatcher.request.RequestOutput`)
and, when the request ends, its finished status (:func:`check_stop`). The
scheduler's ``update_from_output`` uses both for every engine, step or stream.
:func:`release_kv` frees what a request holds once it leaves the engine's memory.
"""

from __future__ import annotations

from switchyard.dispatcher.engines.base import KVCacheManager, SeqOutput, StepBatch
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus


def check_stop(req: Request, seq: SeqOutput, *, engine_enforces_max_tokens: bool = False) -> RequestStatus | None:
    """The finished status ``req`` reaches with ``seq`` applied, or None (it goes on).

    The finish reason the engine reported with its end (``seq.finish_reason``: an upstream's) -> its
    status; else end-of-sequence -> ``FINISHED_TOOL_CALLS`` when it made tool calls, else
    ``FINISHED_STOPPED``; the engine's length limit or ``max_tokens`` generated -> ``FINISHED_LENGTH_CAPPED``
    (OpenAI's stop / tool_calls / length; vLLM's ``check_stop`` in ``vllm/v1/core/sched/utils.py`` orders
    them the same way). ``engine_enforces_max_tokens`` (a stream engine: its upstream is given
    ``max_tokens`` and ends the stream itself, ``Usage`` last): ``max_tokens`` is not counted here, the
    request ends with the engine's end, so nothing the upstream sends after its last token is lost.
    """
    if seq.finish_reason is not None:
        return RequestStatus.finished_with(seq.finish_reason)
    if seq.eos:
        return RequestStatus.FINISHED_TOOL_CALLS if req.tool_calls else RequestStatus.FINISHED_STOPPED
    if seq.length_capped or (not engine_enforces_max_tokens and len(req.output_tokens) >= req.max_tokens):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def apply_output(req: Request, seq: SeqOutput, *, prefilled: bool, now: float,
                 kv: KVCacheManager | None = None,
                 engine_enforces_max_tokens: bool = False) -> tuple[RequestOutput, RequestStatus | None]:
    """Write ``seq`` into ``req``; returns its output (visible tokens with their index, tool calls) and
    the finished status it reached (None: it goes on; ``FINISHED_ERROR`` with ``req.error`` set).

    ``prefilled``: ``req`` was a prefill of the step. A prefill of a request that has output and no KV
    (a recompute after preemption) counts ``num_tokens - 1`` in ``recomputed_tokens``. ``now``: monotonic seconds (token times). ``kv``: the engine's KV manager (the KV held after the
    step: ``memory_peak_bytes``). ``engine_enforces_max_tokens``: see :func:`check_stop`.
    """
    out = RequestOutput(req)
    if seq.error is not None:
        req.error = seq.error
        return out, RequestStatus.FINISHED_ERROR
    if seq.prompt_tokens is not None:
        req.prompt_tokens = seq.prompt_tokens
    if seq.usage is not None:
        req.usage_prompt_tokens = seq.usage.prompt_tokens
        req.usage_completion_tokens = seq.usage.completion_tokens
        if seq.usage.model:
            req.answered_by = seq.usage.model  # the upstream model that answered (fallback included)
    if seq.num_computed_tokens is not None:
        if prefilled:
            if req.output_tokens and req.num_computed_tokens == 0:
                req.recomputed_tokens += req.num_tokens - 1
        req.num_computed_tokens = seq.num_computed_tokens
    for text in seq.texts:
        index = len(req.output_tokens)
        req.output_tokens.append(text)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        if seq.visible:
            out.tokens.append((text, index))
    if seq.tool_calls:
        if req.first_token_at is None:
            req.first_token_at = now
        req.tool_calls.extend(seq.tool_calls)
        out.tool_calls.extend(seq.tool_calls)
    if kv is not None:
        req.observe_kv_bytes(kv.kv_bytes(req))
    return out, check_stop(req, seq, engine_enforces_max_tokens=engine_enforces_max_tokens)


def release_kv(kv: KVCacheManager, req: Request) -> None:
    """Free ``req``'s KV in the engine (``kv.free``) and what the scheduler counts of it (its computed prefix, its
    step's allocation); a parked step leaving its parking ends as tool_calls. The one release of a request's KV:
    the scheduler's at an end or a preemption, the parking's for a parked step (given as its ``release``, so that
    neither calls back into the other)."""
    if req.status is RequestStatus.PARKED:
        req.status = RequestStatus.FINISHED_TOOL_CALLS
    kv.free(req)
    req.num_computed_tokens = 0
    req.step_kv_bytes = 0


def compose_batch(kv: KVCacheManager, prefill: list[Request], decode: list[Request],
                  budget: int | None = None) -> StepBatch:
    """The step over ``prefill`` and ``decode``: fresh prompts first take their prefix-cache hits
    (``kv.match_prefix``, written into ``num_computed_tokens``); each prefill then computes its whole
    uncomputed prefix, or, with a ``budget`` (chunked prefill), fresh prompts in order take what is left
    of ``budget`` prompt tokens (the last one a chunk) while a recompute after preemption is computed
    whole, alone when it exceeds what is left."""
    for req in prefill:
        cached = kv.match_prefix(req)
        if cached:
            req.num_computed_tokens = cached
    if budget is None:
        return StepBatch([(req, req.num_uncomputed_tokens) for req in prefill], list(decode))
    chunks: list[tuple[Request, int]] = []
    left = max(1, budget)
    for req in prefill:
        need = req.num_uncomputed_tokens
        if left <= 0 or (req.output_tokens and chunks and need > left):
            break
        n = need if req.output_tokens else min(need, left)
        chunks.append((req, n))
        left -= n
    return StepBatch(chunks, list(decode))
