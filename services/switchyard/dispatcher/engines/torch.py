"""The ``torch`` engine: a real transformer stepped in-process with batched forward passes.

A :class:`~switchyard.dispatcher.engines.base.StepEngine` over
:class:`~switchyard.dispatcher.engines.torch_model.DecoderLM` (config section
``torch`` in ``switchyard.json``). Dummy random weights from a fixed seed by
default, as inference servers do for benchmarking, or a local checkpoint.

- **execute_model**: ONE batched forward over the step: the uncomputed prefix
  of every prefilling sequence (padded, with an attention mask; in chunks of
  at most ``prefill_chunk_tokens`` per sequence): the prompt on first
  admission, prompt plus every generated token after a preemption; and one
  new token of each decoding sequence, over their per-sequence KV caches. It
  reports each sequence's next token (:class:`~switchyard.dispatcher.engines.base.StepResult`);
  it writes no request.
- **kv.free**: drops the sequence's KV cache (``kv_bytes`` becomes 0). Its
  token ids stay until it finishes, so a preempted sequence recomputes exactly
  the same prefix and continues where it stopped: no token lost or repeated.
- Forward passes run off the event loop (``asyncio.to_thread``); their wall
  time (after ``torch.cuda.synchronize`` on CUDA) is ``busy_seconds``.
- **execute_between_layers**: while a forward runs, another batch's prefill
  (core work) is put in a slot that the worker thread checks between two
  layers (:meth:`DecoderLM.extend`'s ``between_layers``); the worker runs that
  prefill's whole forward there, on the same thread (the engine never runs
  two forwards at once), hands the next ids to the event loop, which reports
  the tokens, and resumes the batch from the next layer. The batch's state is
  local to its forward, so its tokens are the same as without the pause.

Prompt: the request's ``prompt``, or its messages rendered one per line as
``role: content`` followed by ``assistant:`` (tools offered are listed first
as ``tools: name, ...``). Token counts are the engine's tokenizer's:
each step reports the rendered prompt's length (``SeqOutput.prompt_tokens``), which the scheduler
writes into ``req.prompt_tokens``, so usage and ``num_computed_tokens`` are in the model's own tokens.

Sampling: greedy (``temperature`` 0) or, with ``temperature`` > 0, sampled
from a generator seeded by (``seed``, request_id, position), so a sequence's
tokens do not depend on its batch neighbours or on preemption. End-of-text
is reported as end-of-sequence (the scheduler finishes it with ``stop``) unless ``ignore_eos``.

Tool calls: random weights cannot call tools. When a request offers tools,
the reply (tool calls, or the answer after tool results) is decided by the
sim engine's deterministic policy (:func:`switchyard.dispatcher.engines.sim.plan_reply`)
and the engine force-decodes its tokens: every token still goes through the
model's forward passes and KV cache, only the choice of the next id is
taken from the plan instead of the logits. Without tools, text is the model's own.

Memory tiers (:class:`TorchKV`, the engine's ``kv``): ``export`` copies a sequence's KV tensor (its valid tokens)
and token ids to host bytes for the DRAM tier; ``load`` puts them back
into a new cache, for as many leading tokens as the sequence's own ids share
with the copy (a preempted sequence: all; a react_loop agent's next step: the
prefix it repeats). ``recompute_seconds`` is the measured prefill time per
token; ``compact`` shrinks every cache tensor to its valid blocks and, on
CUDA, hands the allocator's free cached segments back (``empty_cache``);
``device_used_bytes`` is NVML's used memory on a GPU (what the HBM scan holds
against ``emergency_evict_ratio``).

Limits: a sequence holds at most ``max_seq_len`` tokens. A prompt of
``max_seq_len`` tokens or more fails the sequence with INVALID_ARGUMENT naming
``prompt_tokens`` and the limit; reaching the limit while generating is reported
as ``length_capped`` (finish reason ``length``). A react_loop agent's warm prefix handed over by the scheduler
is copied into the new sequence's cache for the leading token ids the two
share (``share_prefix``); the rest of its prompt is prefilled.

Benchmark: ``python -m switchyard_harness.bench.torch_engine --batch 1,8,32``
prints prefill time, decode step time and decode tokens/s per batch size.
"""

from __future__ import annotations

import asyncio
import io
import os
import codecs
import hashlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from switchyard.common.config import SwitchyardConfig, TorchEngineConfig
from switchyard.common.errors import InvalidArgument
from switchyard.dispatcher.engines.base import KVCacheManager, SeqOutput, StepBatch, StepEngine, StepResult
from switchyard.dispatcher.engines.sim import plan_reply, tracer
from switchyard.dispatcher.engines.torch_model import (
    DecoderLM,
    ExtendInput,
    KVCache,
    Tokenizer,
    build_model,
    extend_in_chunks,
)
from switchyard.dispatcher.scheduler.capacity import MemoryInfo
from switchyard.dispatcher.request import Message, Request, Tool, ToolCall


def render_prompt(prompt: str, messages: list[Message], tools: list[Tool]) -> str:
    """The text the model reads (see the module docstring for the layout)."""
    if not messages:
        head = f"tools: {', '.join(t.name for t in tools)}\n" if tools else ""
        return head + prompt
    lines = [f"tools: {', '.join(t.name for t in tools)}"] if tools else []
    lines += [f"{m.role}: {m.content}" for m in messages]
    lines.append("assistant:")
    return "\n".join(lines)


@dataclass
class ForcedReply:
    """A reply decided by the sim's tool policy, force-decoded through the model."""

    ids: list[int]
    visible: bool
    tool_calls: list[ToolCall]
    finish_reason: str


@dataclass
class SeqState:
    """What the engine keeps for a sequence until it finishes (survives preemption).

    Kept in ``Request.engine_state``. ``ids`` are the prompt's model ids
    followed by every generated id; ``cache``, the sequence's KV (None while it
    holds none: before its prefill, after ``free``), covers a prefix of them.
    """

    ids: list[int]
    prompt_len: int
    text: codecs.IncrementalDecoder
    forced: ForcedReply | None = None
    cache: KVCache | None = None


@dataclass
class NestedPrefill:
    """A prefill waiting in the slot for a layer boundary of the forward in flight.

    ``batch`` and ``keys`` are built on the event loop; the worker thread runs
    them and schedules :meth:`TorchEngine._deliver` on ``loop``, which reports
    the tokens of ``reqs`` and resolves ``future`` (their result; None when the
    forward ended before another boundary).
    """

    reqs: list[Request]
    batch: list[ExtendInput]
    keys: list[int | None]
    loop: asyncio.AbstractEventLoop
    future: "asyncio.Future[StepResult | None]"


def _settle(future: "asyncio.Future[Any]", value: Any) -> None:
    """Resolve ``future`` (on its loop) with ``value``, or fail it with the exception; a no-op once done."""
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: NVML's figure for a CUDA device (CUDA's own when NVML is absent),
    the machine's physical memory for the CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML: CUDA knows the total as well
            return int(torch.cuda.mem_get_info(index)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cache(req: Request) -> KVCache | None:
    """``req``'s KV cache in this engine, None when it holds none."""
    state = req.engine_state
    return state.cache if state is not None else None


def _extend_input(req: Request) -> ExtendInput:
    """``req``'s uncomputed ids on its cache: what a forward extends it by."""
    state = req.engine_state
    return ExtendInput(state.cache, state.ids[state.cache.length:])


class TorchKV(KVCacheManager):
    """The torch engine's KV memory: one cache tensor per sequence (see the module docstring)."""

    def __init__(self, engine: "TorchEngine") -> None:
        self._engine = engine

    def kv_bytes(self, req: Request) -> int:
        """Bytes of the KV cache tensor held for ``req`` (allocated blocks), 0 when freed."""
        cache = _cache(req)
        return cache.nbytes if cache is not None else 0

    def free(self, req: Request) -> None:
        """Drop ``req``'s KV cache; its token ids go too once it has finished. Idempotent."""
        state = req.engine_state
        if state is not None:
            state.cache = None
            if req.is_finished:
                req.engine_state = None

    def can_export(self) -> bool:
        return True

    def export(self, req: Request) -> bytes | None:
        """``req``'s KV state as bytes (valid tokens' keys and values, on the host, and their token ids);
        None when it holds none."""
        state = req.engine_state
        cache = _cache(req)
        if cache is None or cache.length == 0:
            return None
        buffer = io.BytesIO()
        torch.save({"ids": state.ids[: cache.length], "kv": cache.data[:, :, :, : cache.length].to("cpu")}, buffer)
        return buffer.getvalue()

    def load(self, req: Request, payload: bytes, tokens: int) -> int:
        """Restore up to ``tokens`` leading tokens of KV from :meth:`export`'s bytes, as many as ``req``'s
        ids share with the copy (all but its newest token at most); returns tokens restored."""
        engine = self._engine
        state, _ = engine._state(req)
        if state is None:
            return 0
        try:
            saved = torch.load(io.BytesIO(payload), map_location=engine.device, weights_only=True)
            ids, kv = list(saved["ids"]), saved["kv"]
        except Exception:  # noqa: BLE001 - a corrupt or foreign entry is a miss
            return 0
        return engine._adopt(req, ids, kv, min(tokens, kv.shape[3]))

    def share_prefix(self, source: Request, target: Request) -> int:
        """``target`` starts from ``source``'s KV (still held) for the leading ids they share: a react_loop
        agent's next step taking over its parked step's warm prefix. Returns tokens shared (a copy)."""
        engine = self._engine
        held, cache = source.engine_state, _cache(source)
        if cache is None or engine._state(target)[0] is None:
            return 0
        return engine._adopt(target, held.ids, cache.data, cache.length)

    def recompute_seconds(self, tokens: int) -> float:
        """Measured prefill seconds for ``tokens`` tokens (0 before the first prefill was measured)."""
        return tokens * self._engine._prefill_s_per_token

    def compact(self, holders: Iterable[Request]) -> int:
        """Shrink the cache tensor of each of ``holders`` to its valid tokens' blocks; returns device bytes
        freed (CUDA also returns the caching allocator's free segments to the driver)."""
        freed = 0
        for cache in filter(None, map(_cache, holders)):
            blocks = -(-cache.length // cache.block_tokens)
            keep = blocks * cache.block_tokens
            if keep < cache.data.shape[3]:
                before = cache.nbytes
                cache.data = cache.data[:, :, :, :keep].clone()
                freed += before - cache.nbytes
        if self._engine.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def device_used_bytes(self) -> int | None:
        """Device memory in use, every process's: NVML's ``used`` on a GPU (CUDA's free/total reading when
        NVML is absent); None on the CPU (the scheduler models usage instead)."""
        device = self._engine.device
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML: CUDA knows it as well
            free, total = torch.cuda.mem_get_info(index)
            return int(total - free)

    def memory_info(self) -> MemoryInfo:
        """Device memory (NVML's total on a GPU, physical RAM on a CPU), weight bytes and KV bytes per token.

        KV bytes per token: ``n_layers x 2 (K and V) x d_model x element size``.
        """
        engine = self._engine
        weights = sum(p.numel() * p.element_size() for p in engine.model_net.parameters())
        element = engine.model_net.embed.weight.element_size()
        per_token = engine.params.n_layers * 2 * engine.params.d_model * element
        return MemoryInfo(device_memory_bytes(engine.device), weights, per_token)


class TorchEngine(StepEngine):
    """A :class:`~switchyard.dispatcher.engines.base.StepEngine` running :class:`DecoderLM`.

    Args:
        config: the whole config; reads ``torch``.

    Raises:
        ValueError: a bad checkpoint (see :func:`build_model`).
    """

    supports_layer_preemption = True

    def __init__(self, config: SwitchyardConfig) -> None:
        self.params: TorchEngineConfig = config.torch
        if self.params.threads:
            torch.set_num_threads(self.params.threads)
        self.model_net: DecoderLM = build_model(self.params)
        self.device = self.model_net.embed.weight.device
        self.runs_on_host_gpu = self.device.type == "cuda"  # on the CPU, a GPU NVML reads runs other work
        self.tokenizer = Tokenizer(self.params.vocab_size)
        self.model = self.params.model
        self.busy_seconds = 0.0
        self.steps = 0
        self.kv = TorchKV(self)
        self._prefill_s_per_token = 0.0
        """Measured prefill seconds per token (moving average; 0 until a prefill ran)."""
        self._slot_lock = threading.Lock()
        self._in_flight = False  # a forward runs on the worker thread (under _slot_lock)
        self._slot: list[NestedPrefill] = []  # prefills for its next layer boundary (under _slot_lock)

    # ------------------------------------------------------------------ StepEngine

    async def execute_model(self, batch: StepBatch) -> StepResult:
        """One forward pass over ``batch``: the uncomputed prefix of each prefill (whole: this engine
        chunks inside the forward, ``prefill_chunk_tokens``) and one token of each decode.

        The prefill rows ride along with the decode rows in one batched
        ``extend`` (chunked-prefill scheduling, as in vLLM V1 and Sarathi-Serve,
        Agrawal et al., OSDI 2024), so running sequences keep decoding while new
        ones join. A sequence whose prompt does not fit ``max_seq_len`` fails
        with :class:`InvalidArgument` (``prompt_tokens``); the others go on.
        """
        result = StepResult()
        ready = self._ready_for_prefill([req for req, _ in batch.prefill], result)
        running = [s for s in batch.decode if not s.is_finished and s.engine_state is not None]
        for req in running:
            if req.engine_state.cache is None:  # not prefilled (should not happen): compute its prefix now
                req.engine_state.cache = self.model_net.new_cache(self.params.kv_block_tokens)
        reqs = ready + running
        if not reqs:
            return result
        name = "engine.step" if ready and running else "engine.prefill" if ready else "engine.decode"
        tokens = sum(len(s.engine_state.ids) - s.engine_state.cache.length for s in ready)
        before = self.busy_seconds
        with tracer.start_as_current_span(name) as span:
            span.set_attribute("switchyard.batch_size", len(reqs))
            if ready:
                span.set_attribute("switchyard.prefill_tokens", tokens)
            await self._step(reqs, result)
        result.prefill_tokens = tokens
        result.seconds = self.busy_seconds - before
        if ready:
            self._measured_prefill(tokens, result.seconds)
        return result

    def _measured_prefill(self, tokens: int, seconds: float) -> None:
        """Fold a forward that prefilled ``tokens`` tokens in ``seconds`` into the per-token estimate."""
        if tokens >= 16:  # long enough that the per-token cost dominates the step
            measured = seconds / tokens
            old = self._prefill_s_per_token
            self._prefill_s_per_token = measured if not old else 0.8 * old + 0.2 * measured

    def _ready_for_prefill(self, reqs: list[Request], result: StepResult) -> list[Request]:
        """The members of ``reqs`` that can be prefilled, each with a KV cache of its own (a failed one's
        error goes into ``result``)."""
        ready = []
        for req in reqs:
            if req.is_finished:
                continue
            state, error = self._state(req)
            if state is None:
                result.outputs[req.seq_id] = SeqOutput(error=error)
                continue
            if state.cache is None:
                state.cache = self.model_net.new_cache(self.params.kv_block_tokens)
            ready.append(req)
        return ready

    async def execute_between_layers(self, batch: StepBatch) -> StepResult | None:
        """Prefill ``batch.prefill`` at the next layer boundary of the forward in flight.

        The worker thread running the forward takes them from the slot at its
        next boundary, runs their forward (chunked as :meth:`execute_model`), and
        the event loop reports their tokens before the forward in flight returns.
        Their seconds count in ``busy_seconds`` on their own (the forward's
        own time excludes them). None, with nothing computed, when no forward
        runs or it ends before another boundary. A sequence whose prompt does
        not fit ``max_seq_len`` fails as in :meth:`execute_model`.

        Raises:
            what the prefill's forward raises (the forward in flight goes on).
        """
        with self._slot_lock:
            if not self._in_flight:
                return None
        failed = StepResult()
        ready = self._ready_for_prefill([req for req, _ in batch.prefill], failed)
        if not ready:
            return failed if failed.outputs else None
        loop = asyncio.get_running_loop()
        nested = NestedPrefill(
            reqs=ready,
            batch=[_extend_input(s) for s in ready],
            keys=[self._sampling_key(s) for s in ready],
            loop=loop,
            future=loop.create_future(),
        )
        with self._slot_lock:
            if not self._in_flight:
                return None
            self._slot.append(nested)
        with tracer.start_as_current_span("engine.prefill_between_layers") as span:
            span.set_attribute("switchyard.batch_size", len(ready))
            span.set_attribute("switchyard.prefill_tokens", sum(len(item.new_ids) for item in nested.batch))
            result = await nested.future
        if result is not None:
            result.outputs.update(failed.outputs)
        return result

    def _adopt(self, req: Request, ids: list[int], kv: torch.Tensor, tokens: int) -> int:
        """Give ``req`` a cache holding ``kv``'s first tokens, as many of ``tokens`` as its own ids share with
        ``ids`` (all but its newest token at most); returns that count."""
        state = req.engine_state
        limit = min(tokens, len(ids), len(state.ids) - 1)
        shared = 0
        while shared < limit and ids[shared] == state.ids[shared]:
            shared += 1
        cache = self.model_net.new_cache(self.params.kv_block_tokens)
        if shared <= 0 or tuple(kv.shape[:3]) + (kv.shape[4],) != cache.shape:
            return 0
        cache.reserve(shared)
        cache.data[:, :, :, :shared] = kv[:, :, :, :shared].to(device=cache.data.device, dtype=cache.data.dtype)
        cache.length = shared
        state.cache = cache
        return shared

    # ------------------------------------------------------------------ internals

    def _state(self, req: Request) -> tuple[SeqState | None, BaseException | None]:
        """The sequence's state, created (prompt tokenized, length checked) on first sight; (None, the
        error) when its prompt does not fit."""
        state = req.engine_state
        if state is not None:
            return state, None
        ids = self.tokenizer.encode(render_prompt(req.prompt, req.messages, req.tools)) or [self.tokenizer.eos_id]
        limit = self.params.max_seq_len
        if len(ids) >= limit:
            return None, InvalidArgument(
                "prompt_tokens",
                f"at most {limit - 1} (torch.max_seq_len {limit}, less room for one generated token)",
                len(ids),
            )
        state = SeqState(ids=ids, prompt_len=len(ids), text=Tokenizer.stream_decoder())
        if req.tools:
            reply = plan_reply(req.prompt, req.messages, req.tools)
            state.forced = ForcedReply(
                ids=self.tokenizer.encode("".join(reply.tokens)),
                visible=not reply.tool_calls,
                tool_calls=list(reply.tool_calls),
                finish_reason=reply.finish_reason,
            )
        req.engine_state = state
        return state, None

    async def _step(self, reqs: list[Request], result: StepResult) -> None:
        batch = [_extend_input(s) for s in reqs]
        keys = [self._sampling_key(s) for s in reqs]
        next_ids, seconds = await asyncio.to_thread(self._forward, batch, keys)
        self.steps += 1
        self.busy_seconds += seconds
        for req, token_id in zip(reqs, next_ids):
            if not req.is_finished:
                result.outputs[req.seq_id] = self._next(req, token_id)

    def _sampling_key(self, req: Request) -> int | None:
        """Seed of the next token's draw (None: greedy)."""
        if self.params.temperature <= 0:
            return None
        position = len(req.engine_state.ids)
        digest = hashlib.blake2b(f"{self.params.seed}|{req.request_id}|{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") & (2**63 - 1)

    def _forward(self, batch: list[ExtendInput], keys: list[int | None]) -> tuple[list[int], float]:
        """Worker thread: one batched forward and the next id of each sequence; returns (ids, busy seconds).

        Between its layers it runs the prefills waiting in the slot
        (:meth:`_run_slot`); their time is not in the seconds returned.
        """
        nested_s = 0.0

        def between_layers(layer: int) -> None:
            nonlocal nested_s
            if self._slot:  # a racy peek, locked in _run_slot: a prefill put now is seen at the next boundary
                nested_s += self._run_slot()

        with self._slot_lock:
            self._in_flight = True
        try:
            start = time.monotonic()
            with torch.inference_mode():
                logits = extend_in_chunks(self.model_net, batch, self.params.prefill_chunk_tokens, between_layers)
                chosen = self._choose(logits, keys)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return chosen, time.monotonic() - start - nested_s
        finally:
            with self._slot_lock:
                self._in_flight = False
                late, self._slot = self._slot, []
            for nested in late:  # the forward ended before another boundary
                nested.loop.call_soon_threadsafe(_settle, nested.future, None)

    def _run_slot(self) -> float:
        """Worker thread, at a layer boundary: run the prefills in the slot as one forward, hand their ids to
        the event loop (:meth:`_deliver`); returns the seconds they took."""
        with self._slot_lock:
            pending, self._slot = self._slot, []
        if not pending:
            return 0.0
        loop = pending[0].loop
        batch = [item for nested in pending for item in nested.batch]
        keys = [key for nested in pending for key in nested.keys]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the batch's layers launched so far are not the prefill's time
        start = time.monotonic()
        try:
            with torch.inference_mode():
                chosen = self._choose(extend_in_chunks(self.model_net, batch, self.params.prefill_chunk_tokens), keys)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - the prefills fail, the forward in flight goes on
            for nested in pending:
                nested.loop.call_soon_threadsafe(_settle, nested.future, exc)
            return time.monotonic() - start
        seconds = time.monotonic() - start
        loop.call_soon_threadsafe(self._deliver, pending, chosen, seconds)
        return seconds

    def _deliver(self, pending: list[NestedPrefill], chosen: list[int], seconds: float) -> None:
        """Event loop: report the first tokens of prefills run between layers, count their time, resolve them.

        Scheduled before the forward in flight returns, so the tokens are out before that step's."""
        self.steps += 1
        self.busy_seconds += seconds
        self._measured_prefill(sum(len(item.new_ids) for nested in pending for item in nested.batch), seconds)
        ids = iter(chosen)
        for nested in pending:
            result = StepResult(prefill_tokens=sum(len(item.new_ids) for item in nested.batch), seconds=seconds)
            for req in nested.reqs:
                token_id = next(ids)
                if not req.is_finished:
                    result.outputs[req.seq_id] = self._next(req, token_id)
            _settle(nested.future, result)

    def _choose(self, logits: torch.Tensor, keys: list[int | None]) -> list[int]:
        """The next id of each row of ``logits``: greedy, or drawn with each row's seeded generator."""
        if self.params.ignore_eos:
            logits[:, self.tokenizer.eos_id] = float("-inf")
        if self.params.temperature <= 0:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits / self.params.temperature, dim=-1).cpu()
        chosen = []
        for row, key in zip(probs, keys):
            generator = torch.Generator().manual_seed(key)
            chosen.append(int(torch.multinomial(row, 1, generator=generator)))
        return chosen

    def _next(self, req: Request, sampled: int) -> SeqOutput:
        """The next token (sampled, or the forced reply's) and whether it ends the sequence."""
        state = req.engine_state
        cache = state.cache
        out = SeqOutput(num_computed_tokens=cache.length if cache is not None else None,
                        prompt_tokens=state.prompt_len)
        forced = state.forced
        generated = len(state.ids) - state.prompt_len
        if forced is not None:
            if generated >= len(forced.ids):
                out.tool_calls, out.eos = list(forced.tool_calls), True
                return out
            token_id, out.visible = forced.ids[generated], forced.visible
        else:
            token_id = sampled
            if token_id == self.tokenizer.eos_id:
                out.eos = True
                return out
        state.ids.append(token_id)
        out.texts.append(state.text.decode(self.tokenizer.piece(token_id)))
        if forced is not None and generated + 1 >= len(forced.ids):
            out.tool_calls, out.eos = list(forced.tool_calls), True
        elif len(state.ids) >= self.params.max_seq_len:
            out.length_capped = True
        return out


__all__ = ["TorchEngine", "NestedPrefill", "render_prompt"]
