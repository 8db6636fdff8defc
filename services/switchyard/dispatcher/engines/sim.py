"""The ``sim`` engine: a latency model with deterministic, extractive text.

No GPU and no weights. Time passes with ``asyncio.sleep`` (no CPU is burnt),
so many simulated sequences share one event loop the way they share one GPU.

Latency model (parameters in ``switchyard.json`` ``sim``), in the manner of
public inference simulators (Vidur, LLMServingSim), for a 7B fp16 model on one
H100 SXM:

- Weights: 7e9 parameters x 2 bytes = 14 GB.
- Decode is memory-bound: every step streams the weights once, so a step costs
  about weight bytes / HBM bandwidth = 14 GB / 3.35 TB/s = 4.2 ms
  (``decode_base_ms``), plus a small per-sequence term for reading each
  sequence's KV cache and sampling (``decode_per_seq_ms`` = 0.15 ms). Batching
  decode is therefore nearly free: 32 sequences cost 4.2 + 32 x 0.15 = 9 ms
  per step instead of 32 x 4.35 ms.
- Prefill is compute-bound: about 2 x parameters = 14 GFLOP per token; at
  roughly 60 % of the H100's 989 TFLOP/s dense bf16 peak that is
  14e9 / 5.9e14 = 0.024 ms per token (``prefill_per_token_ms`` = 0.025), plus a
  fixed launch/scheduling overhead (``prefill_overhead_ms`` = 5 ms).
  TTFT alone = prefill_overhead_ms + prompt tokens x prefill_per_token_ms.
- KV cache: 2 (K and V) x 32 layers x 4096 hidden x 2 bytes = 512 KiB per
  token (``kv_bytes_per_token`` = 524288), Llama-2-7B's shape.
- Chunked prefill (``supports_chunked_prefill``): a long prompt may be
  computed over several mixed steps under the scheduler's token budget, each
  step costing the same mixed-step time for the tokens it computes.
- Layers: a step runs the model's ``layers`` (32) one after another, each
  taking step time / ``layers``. A prefill asked for while a step runs
  (:meth:`SimEngine.execute_between_layers`) waits for the layer in progress
  to end, takes its own modelled prefill time there, and the step then goes
  on from the next layer (see
  ``supports_layer_preemption``).

Text: the orchestrator renders retrieved passages inside ``<context>`` ...
``</context>`` (each passage starts with a line ``[n] Title``) and the question
inside ``<question>`` ... ``</question>``. The sim answers extractively: it
picks the context sentences with the highest word overlap with the question
(ties broken by passage, then sentence order) and emits them with citations
like ``[1]``. With no context it emits a short answer derived from the
question. With tools offered it emits tool calls in the OpenAI
function-calling shape (see :func:`plan_reply`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from switchyard.common import telemetry
from switchyard.common.config import SimEngineConfig, SwitchyardConfig
from switchyard.dispatcher import metrics
from switchyard.dispatcher.engines.base import KVCacheManager, SeqOutput, StepBatch, StepEngine, StepResult
from switchyard.dispatcher.engines.prefix_cache import PrefixCache
from switchyard.dispatcher.scheduler.capacity import MemoryInfo
from switchyard.dispatcher.request import Message, Request, Tool, ToolCall, word_pieces

tracer = telemetry.get_tracer(__name__)


MAX_ANSWER_SENTENCES = 3
"""Context sentences an extractive answer quotes at most."""

_STOPWORDS = frozenset(
    "a an and are as at be by can do does from how i in is it its me of on or so that the this to was what "
    "when where which who why will you your".split()
)
_WORD = re.compile(r"[a-z0-9_]+")
_PASSAGE_HEAD = re.compile(r"^\[(\d+)\]\s*(.*)$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ARITHMETIC = re.compile(r"[\d(][\d\s.+\-*/%()]*[\d)]")
_HAS_OPERATOR = re.compile(r"[\d)]\s*(\*\*|[+\-*/%])\s*[\d(]")


# --------------------------------------------------------------------------- latency model


def prefill_seconds(params: SimEngineConfig, tokens: int) -> float:
    """Seconds one prefill of ``tokens`` prompt tokens (summed over the batch) takes.

    ``prefill_overhead_ms + tokens x prefill_per_token_ms``, in seconds.
    """
    return (params.prefill_overhead_ms + tokens * params.prefill_per_token_ms) / 1000


def decode_seconds(params: SimEngineConfig, batch_size: int) -> float:
    """Seconds one decode step over ``batch_size`` sequences takes.

    ``decode_base_ms + decode_per_seq_ms x batch_size``, in seconds.
    """
    return (params.decode_base_ms + params.decode_per_seq_ms * batch_size) / 1000


def mixed_step_seconds(params: SimEngineConfig, prefill_tokens: int, batch_size: int) -> float:
    """Seconds one mixed step takes: ``batch_size`` sequences, ``prefill_tokens`` of them new prompt tokens.

    ``decode_base_ms + decode_per_seq_ms x batch_size + prefill_tokens x prefill_per_token_ms``:
    one weight read serves the whole batch (no separate prefill launch), and the
    prompt tokens add their compute.
    """
    return (params.decode_base_ms + params.decode_per_seq_ms * batch_size
            + prefill_tokens * params.prefill_per_token_ms) / 1000


def step_activity(params: SimEngineConfig, seconds: float, flops: float, hbm_bytes: float) -> tuple[float, float]:
    """Modelled (memory-busy seconds, tensor-busy seconds) of one step lasting ``seconds``.

    Memory-busy time is the time needed to move ``hbm_bytes`` at the HBM
    bandwidth; tensor-busy time is ``flops`` at the tensor peak. Both are capped
    by the step's length. Over a window they give the GPU's memory (bandwidth)
    and tensor utilisation, the two NVML/DCGM readings the compute score
    weighs, as a roofline model predicts them (Williams et al., "Roofline",
    CACM 2009): a decode step streams every weight once and barely uses the
    tensor cores; a prefill is the opposite.
    """
    memory = hbm_bytes / (params.hbm_tb_per_s * 1e12)
    tensor = flops / (params.peak_tflops * 1e12)
    return min(seconds, memory), min(seconds, tensor)


_KV_RECORD = struct.Struct("<4sQQ")


def export_modelled_kv(req: Request, kv_bytes_per_token: int) -> bytes | None:
    """A modelled engine's KV record: magic, prefix tokens, bytes they stand for; None when none are held."""
    if req.num_computed_tokens <= 0:
        return None
    return _KV_RECORD.pack(b"SYKV", req.num_computed_tokens, req.num_computed_tokens * kv_bytes_per_token)


def import_modelled_kv(req: Request, payload: bytes, tokens: int) -> int:
    """Up to ``tokens`` prefix tokens restorable from an :func:`export_modelled_kv` record (at most all but
    the newest token of ``req``, whose KV its next step computes); returns that count (0: bad record)."""
    if len(payload) != _KV_RECORD.size:
        return 0
    magic, held, _ = _KV_RECORD.unpack(payload)
    if magic != b"SYKV":
        return 0
    return max(0, min(tokens, held, req.num_tokens - 1))


class ModelledKV(KVCacheManager):
    """KV memory of a modelled engine: ``num_computed_tokens x kv_bytes_per_token`` per request, swapped as
    a small record (:func:`export_modelled_kv`), its transfer time modelled (``[dram] transfer_gb_per_s``)
    by the step loop.

    Args:
        params: the ``sim`` section (``kv_bytes_per_token``, the modelled GPU, prefill costs).
    """

    models_transfers = True

    def __init__(self, params: SimEngineConfig) -> None:
        self.params = params

    def memory_info(self) -> MemoryInfo:
        """The modelled GPU: ``hbm_gb`` of device memory (80 GB H100), weights ``params x bytes_per_param``."""
        p = self.params
        return MemoryInfo(
            device_bytes=int(p.hbm_gb * 1e9),
            weight_bytes=int(p.params_billion * 1e9 * p.bytes_per_param),
            kv_bytes_per_token=p.kv_bytes_per_token,
        )

    def kv_bytes(self, req: Request) -> int:
        """``num_computed_tokens x kv_bytes_per_token``."""
        return req.num_computed_tokens * self.params.kv_bytes_per_token

    def free(self, req: Request) -> None:
        """Nothing is held beyond ``num_computed_tokens`` (which the scheduler zeroes)."""

    def can_export(self) -> bool:
        return True

    def export(self, req: Request) -> bytes | None:
        """A record of the tokens and bytes ``req``'s KV stands for (no tensors); None when none is held."""
        return export_modelled_kv(req, self.params.kv_bytes_per_token)

    def load(self, req: Request, payload: bytes, tokens: int) -> int:
        return import_modelled_kv(req, payload, tokens)

    def recompute_seconds(self, tokens: int) -> float:
        """Seconds a prefill of ``tokens`` tokens costs (:func:`prefill_seconds`)."""
        return prefill_seconds(self.params, tokens)


# --------------------------------------------------------------------------- text


@dataclass(frozen=True)
class Passage:
    """One ``[n] Title`` block of a rendered context."""

    number: int
    title: str
    text: str


@dataclass(frozen=True)
class SimReply:
    """What the sim answers to one turn.

    ``tokens`` are the completion's word pieces; for a tool-call turn they are
    the pieces of the calls' argument JSON (counted in usage, not streamed as
    text) and ``tool_calls`` is non-empty. ``finish_reason`` is stop or
    tool_calls.
    """

    tokens: list[str]
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def text(self) -> str:
        return "" if self.tool_calls else "".join(self.tokens)


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS and len(w) > 1}


def _between(text: str, tag: str) -> str | None:
    match = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S)
    return match.group(1).strip() if match else None


def parse_passages(context: str) -> list[Passage]:
    """Split a rendered context into passages at ``[n] Title`` lines.

    Text before the first header, or a context with no header at all, becomes
    passage 1 with an empty title.
    """
    passages: list[Passage] = []
    number, title, body = 1, "", []
    seen_head = False
    for line in context.splitlines():
        head = _PASSAGE_HEAD.match(line.strip())
        if head:
            if seen_head or any(part.strip() for part in body):
                passages.append(Passage(number, title, " ".join(body).strip()))
            number, title, body, seen_head = int(head.group(1)), head.group(2).strip(), [], True
        else:
            body.append(line.strip())
    if seen_head or any(part.strip() for part in body):
        passages.append(Passage(number, title, " ".join(body).strip()))
    return [p for p in passages if p.text or p.title]


def extractive_answer(question: str, passages: list[Passage], retrieved: bool = True) -> str:
    """The sentences of ``passages`` sharing most words with ``question``, cited.

    At most :data:`MAX_ANSWER_SENTENCES`, ranked by overlap (ties: passage
    order, then sentence order), each followed by `` [n]``. With no passage or
    no overlapping sentence: a short answer built from the question's words,
    saying that no passage covered it where passages were ``retrieved`` (a
    prompt with a context section or tool results), else only what it is about.
    """
    asked = _words(question)
    scored: list[tuple[int, int, int, str, int]] = []
    for p_index, passage in enumerate(passages):
        for s_index, sentence in enumerate(_SENTENCE_END.split(passage.text)):
            sentence = sentence.strip()
            overlap = len(asked & _words(sentence)) if sentence else 0
            if overlap:
                scored.append((-overlap, p_index, s_index, sentence, passage.number))
    scored.sort(key=lambda item: item[:3])
    picked = scored[:MAX_ANSWER_SENTENCES]
    if not picked:
        topic = " ".join(w for w in _WORD.findall(question.lower()) if w not in _STOPWORDS) or "your question"
        if not retrieved:  # a chat prompt: nothing was looked up
            return f"A short answer (the sim engine has no model) about: {topic}."
        return f"No retrieved passage covers this, so only a short answer is possible about: {topic}."
    return " ".join(f"{sentence} [{number}]" for _, _, _, sentence, number in picked)


def find_arithmetic(text: str) -> str | None:
    """The longest arithmetic expression in ``text`` (digits and + - * / ( ) . % **), or None."""
    found = [m.group(0).strip() for m in _ARITHMETIC.finditer(text) if _HAS_OPERATOR.search(m.group(0))]
    return max(found, key=len) if found else None


def _question_and_context(prompt: str, messages: list[Message]) -> tuple[str, str]:
    if messages:
        users = [m.content for m in messages if m.role == "user"]
        texts = [m.content for m in messages if m.role in ("system", "user")]
        last_user = users[-1] if users else ""
        question = _between(last_user, "question") or last_user
        contexts = [c for c in (_between(t, "context") for t in texts) if c]
        context = "\n".join(contexts)
        if question == last_user and "<context>" in question:
            question = re.sub(r"<context>.*?</context>", "", question, flags=re.S).strip()
        return question, context
    question = _between(prompt, "question")
    context = _between(prompt, "context") or ""
    if question is None:
        question = re.sub(r"<context>.*?</context>", "", prompt, flags=re.S).strip()
    return question, context


def _tool_call(name: str, arguments: dict[str, str], seed: str) -> ToolCall:
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    digest = hashlib.sha256(f"{seed}|{name}|{arguments_json}".encode()).hexdigest()[:16]
    return ToolCall(call_id=f"call_{digest}", name=name, arguments_json=arguments_json)


def plan_reply(prompt: str, messages: list[Message], tools: list[Tool]) -> SimReply:
    """The sim's deterministic reply to one turn.

    Tool policy, when ``tools`` is non-empty:

    1. no tool result in ``messages`` yet and ``search_docs`` offered ->
       call ``search_docs`` with ``{"query": question}``;
    2. else the question holds an arithmetic expression, ``calculator`` is
       offered and no calculator result is present -> call ``calculator`` with
       ``{"expression": ...}``;
    3. else answer from the tool results (finish_reason stop).

    Without tools: an extractive answer from the ``<context>`` passages.
    """
    question, context = _question_and_context(prompt, messages)
    results = [m for m in messages if m.role == "tool"]
    offered = {t.name for t in tools}
    seed = f"{question}|{len(results)}"
    call: ToolCall | None = None
    if tools:
        expression = find_arithmetic(question)
        if not results and "search_docs" in offered:
            call = _tool_call("search_docs", {"query": question}, seed)
        elif expression and "calculator" in offered and not any(m.name == "calculator" for m in results):
            call = _tool_call("calculator", {"expression": expression}, seed)
    if call is not None:
        return SimReply(tokens=word_pieces(call.arguments_json), tool_calls=[call], finish_reason="tool_calls")
    lead = ""
    passages = parse_passages(context) if context else []
    for result in results:
        if result.name == "calculator":
            value = result.content.strip().rstrip(".")
            if "=" not in value:  # a bare value: restate the expression
                value = f"{find_arithmetic(question) or 'the expression'} = {value}"
            lead += f"{value}. "
        else:
            found = parse_passages(result.content)
            offset = len(passages)
            passages += [Passage(offset + i + 1, p.title, p.text) for i, p in enumerate(found)]
    retrieved = bool(context) or any(r.name != "calculator" for r in results)
    answer = lead + extractive_answer(question, passages, retrieved) if passages or not lead else lead.strip()
    return SimReply(tokens=word_pieces(answer))


# --------------------------------------------------------------------------- engine


@dataclass
class _StepInFlight:
    """A modelled step being slept through, and the prefills waiting for one of its layer boundaries."""

    start: float
    """The event loop's clock when the step began, seconds."""
    seconds: float
    """Its modelled length, seconds."""
    paused: float = 0.0
    """Seconds spent so far in prefills between its layers (the step's own progress excludes them)."""
    pending: list[tuple[list[tuple[Request, int]], "asyncio.Future[StepResult | None]"]] = field(default_factory=list)
    wake: "asyncio.Future[bool] | None" = None
    """Set while the step sleeps: resolved True to wake it for a pending prefill, False at its end."""


def _resolve(future: "asyncio.Future[Any]", value: Any) -> None:
    if not future.done():
        future.set_result(value)


def prompt_pieces(req: Request) -> list[str]:
    """The prompt as the sim's tokens (word pieces), messages marked by role: what prefix caching hashes."""
    if not req.messages:
        return word_pieces(req.prompt)
    pieces: list[str] = []
    for message in req.messages:
        pieces.append(f"<{message.role}>")
        pieces.extend(word_pieces(message.content))
    return pieces


@dataclass(eq=False)
class SimSeq:
    """The sim engine's state of one request (``Request.engine_state``): its reply, planned once, kept until
    the reply is complete or the request finishes; its prompt's prefix-cache block keys, kept from the
    prefix match until its prefill completes (:meth:`SimKV.cache_prompt`)."""

    reply: "SimReply | None" = None
    prompt_keys: list[int] | None = None


def sim_seq(req: Request) -> SimSeq:
    """``req``'s :class:`SimSeq`, made on first use."""
    seq = req.engine_state
    if seq is None:
        seq = req.engine_state = SimSeq()
    return seq


class SimKV(ModelledKV):
    """The sim engine's KV memory: modelled bytes (:class:`ModelledKV`) and its automatic prefix cache
    (``sim.prefix_caching``): fresh prompts start from the blocks an earlier prompt computed."""

    def __init__(self, engine: "SimEngine") -> None:
        super().__init__(engine.params)
        self._engine = engine
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.params.prefix_block_tokens, self.params.prefix_block_tokens * self.params.kv_bytes_per_token)
            if self.params.prefix_caching else None
        )
        """Automatic prefix caching (``sim.prefix_caching``); None when off."""

    def match_prefix(self, req: Request) -> int:
        """Prompt tokens of a fresh ``req`` whose blocks the prefix cache holds (at most all but one);
        its block keys are kept until its prefill completes (:meth:`cache_prompt`)."""
        cache = self.prefix_cache
        if cache is None or req.output_tokens or req.num_computed_tokens:
            return 0
        seq = sim_seq(req)
        if seq.prompt_keys is not None:
            return 0
        pieces = prompt_pieces(req)
        keys = seq.prompt_keys = cache.keys(pieces)
        hit_pieces = cache.match(keys) * cache.block_tokens
        cached = 0
        if hit_pieces:
            # the cache counts the sim's own word pieces; the prompt's length is the caller's count
            cached = max(0, min(req.prompt_tokens * hit_pieces // max(1, len(pieces)), req.prompt_tokens - 1))
        metrics.PREFIX_CACHE_BLOCKS.labels("hit").inc(hit_pieces // cache.block_tokens)
        metrics.PREFIX_CACHE_BLOCKS.labels("miss").inc(len(keys) - hit_pieces // cache.block_tokens)
        return cached

    def cache_prompt(self, req: Request) -> None:
        """``req``'s prefill completed: its prompt blocks join the prefix cache."""
        seq = req.engine_state
        keys = None
        if seq is not None:
            keys, seq.prompt_keys = seq.prompt_keys, None
        if keys and self.prefix_cache is not None:
            self.prefix_cache.insert(keys)
            metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.nbytes)

    def free(self, req: Request) -> None:
        """Its prompt blocks stay in the prefix cache (shared, evicted by need); its reply plan goes once
        it has finished."""
        seq = req.engine_state
        if seq is not None:
            seq.prompt_keys = None
            if req.is_finished:
                seq.reply = None

    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache.nbytes if self.prefix_cache is not None else 0

    @property
    def shares_prefixes(self) -> bool:
        return self.prefix_cache is not None

    def evict_prefix_cache(self, nbytes: int) -> int:
        if self.prefix_cache is None:
            return 0
        freed = self.prefix_cache.evict(nbytes)
        metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.nbytes)
        return freed


class SimEngine(StepEngine):
    """A :class:`~switchyard.dispatcher.engines.base.StepEngine` driven by the latency model.

    Args:
        config: the whole config; reads ``sim``.
    """

    supports_layer_preemption = True
    supports_chunked_prefill = True
    models_activity = True
    runs_on_host_gpu = False  # the GPU it simulates is its own model's: the host's GPU, if any, is not it

    def __init__(self, config: SwitchyardConfig) -> None:
        self.params = config.sim
        self.model = self.params.model
        self.busy_seconds = 0.0
        self.memory_busy_seconds = 0.0
        """Modelled seconds the HBM was busy (see :func:`step_activity`)."""
        self.tensor_busy_seconds = 0.0
        """Modelled seconds the tensor cores were busy."""
        self.steps = 0
        self.kv: SimKV = SimKV(self)
        self._flight: _StepInFlight | None = None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.kv.prefix_cache

    def reply_for(self, req: Request) -> SimReply:
        """The planned reply of ``req`` (planned once, kept until it finishes)."""
        seq = sim_seq(req)
        if seq.reply is None:
            seq.reply = plan_reply(req.prompt, req.messages, req.tools)
        return seq.reply

    async def execute_model(self, batch: StepBatch) -> StepResult:
        """One modelled step over ``batch``; costs :func:`prefill_seconds` of the prompt tokens (prefills
        alone: one launch overhead), :func:`decode_seconds` (decodes alone) or :func:`mixed_step_seconds`
        (both: the prefill tokens ride along with the decode step's weight read, as vLLM V1 and
        Sarathi-Serve schedule it)."""
        prefill = [(s, n) for s, n in batch.prefill if not s.is_finished]
        decode = [s for s in batch.decode if not s.is_finished]
        tokens = sum(n for _, n in prefill)
        if not prefill and not decode:
            return StepResult()
        before = self.busy_seconds
        if not prefill:
            with tracer.start_as_current_span("engine.decode") as span:
                span.set_attribute("switchyard.batch_size", len(decode))
                await self._run(decode_seconds(self.params, len(decode)), tokens=len(decode),
                                kv_tokens=sum(s.num_tokens for s in decode))
        elif not decode:
            with tracer.start_as_current_span("engine.prefill") as span:
                span.set_attribute("switchyard.batch_size", len(prefill))
                span.set_attribute("switchyard.prefill_tokens", tokens)
                await self._run(prefill_seconds(self.params, tokens), tokens=tokens, kv_tokens=tokens)
        else:
            with tracer.start_as_current_span("engine.step") as span:
                span.set_attribute("switchyard.batch_size", len(prefill) + len(decode))
                span.set_attribute("switchyard.prefill_tokens", tokens)
                await self._run(
                    mixed_step_seconds(self.params, tokens, len(prefill) + len(decode)),
                    tokens=tokens + len(decode),
                    kv_tokens=sum(s.num_computed_tokens + n for s, n in prefill) + sum(s.num_tokens for s in decode),
                )
        result = StepResult(prefill_tokens=tokens, seconds=self.busy_seconds - before)
        self._prefilled(prefill, result)
        for req in decode:
            result.outputs[req.seq_id] = self._next(req)
        return result

    def _prefilled(self, prefill: list[tuple[Request, int]], result: StepResult) -> None:
        """After a prefill: chunks advance, complete prefixes cache their prompt blocks and get a token."""
        for req, n in prefill:
            if n < req.num_uncomputed_tokens:  # part of its prompt: it goes on in the next step
                result.outputs[req.seq_id] = SeqOutput(num_computed_tokens=req.num_computed_tokens + n)
                continue
            self.kv.cache_prompt(req)
            result.outputs[req.seq_id] = self._next(req)

    def decode_bound_tokens_per_s(self, batch_size: int) -> float:
        """The model's decode bound at ``batch_size`` sequences: ``batch_size / decode_seconds(batch_size)``, tokens/s.

        The roofline of this simulated GPU (decode is memory-bound: one weight
        read per step serves the whole batch); the dispatcher exports it as
        ``switchyard_engine_decode_bound_tokens_per_second``. A zero-cost engine (every latency
        parameter 0, as the pipeline-overhead benchmark runs it) has no bound: 0.
        """
        seconds = decode_seconds(self.params, batch_size)
        return batch_size / seconds if seconds > 0 else 0.0

    def memory_info(self) -> MemoryInfo:
        """The modelled GPU (:meth:`ModelledKV.memory_info`)."""
        return self.kv.memory_info()

    async def execute_between_layers(self, batch: StepBatch) -> StepResult | None:
        """Prefill ``batch.prefill`` at the next layer boundary of the step in flight.

        The step's layers each last its modelled time / ``sim.layers``; the
        layer in progress ends, then the prefills take ``prefill_seconds`` of
        their tokens (busy, memory and tensor time counted), and the step
        resumes from the next layer, its end later by that much. Prefills asked
        for before the same boundary run there together. None, with nothing
        computed, when no step is in flight or it is in its last layer.
        """
        flight = self._flight
        prefill = [(s, n) for s, n in batch.prefill if not s.is_finished]
        if flight is None or not prefill:
            return None
        future: asyncio.Future[StepResult | None] = asyncio.get_running_loop().create_future()
        flight.pending.append((prefill, future))
        if flight.wake is not None:
            _resolve(flight.wake, True)
        return await future

    async def _run(self, seconds: float, tokens: int, kv_tokens: int) -> None:
        """Spend ``seconds`` on a step that computes ``tokens`` and reads the KV of ``kv_tokens``.

        One timer for the whole step, not one per layer: the sleep is woken
        only when a prefill asks for a layer boundary (:meth:`execute_between_layers`).
        """
        self._account(seconds, tokens, kv_tokens)
        if seconds <= 0 or self.params.layers < 2 or self._flight is not None:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        flight = self._flight = _StepInFlight(loop.time(), seconds)
        try:
            while True:
                if flight.pending:
                    await self._between_layers(flight)
                elif not await self._sleep_until(flight, flight.start + flight.paused + flight.seconds):
                    return
        finally:
            self._flight = None
            for _, future in flight.pending:  # asked for too late: the step ended first
                _resolve(future, None)

    async def _sleep_until(self, flight: _StepInFlight, deadline: float) -> bool:
        """Sleep until ``deadline`` (the loop's clock); True when woken earlier for a pending prefill."""
        loop = asyncio.get_running_loop()
        wake = flight.wake = loop.create_future()
        timer = loop.call_at(deadline, _resolve, wake, False)
        try:
            return await wake
        finally:
            timer.cancel()
            flight.wake = None

    async def _between_layers(self, flight: _StepInFlight) -> None:
        """Run the pending prefills at the step's next layer boundary (none left: the step ends first)."""
        loop = asyncio.get_running_loop()
        layers = self.params.layers
        layer_s = flight.seconds / layers
        boundary = math.floor((loop.time() - flight.start - flight.paused) / layer_s) + 1
        if boundary >= layers:  # in its last layer: no boundary before the step's end
            jobs, flight.pending = flight.pending, []
            for _, future in jobs:
                _resolve(future, None)
            return
        await asyncio.sleep(max(0.0, flight.start + flight.paused + boundary * layer_s - loop.time()))
        jobs, flight.pending = flight.pending, []
        prefill = [(s, n) for job, _ in jobs for s, n in job if not s.is_finished]
        paused_at = loop.time()
        result = StepResult()
        try:
            if prefill:
                tokens = sum(n for _, n in prefill)
                seconds = prefill_seconds(self.params, tokens)
                self._account(seconds, tokens, tokens)
                with tracer.start_as_current_span("engine.prefill_between_layers") as span:
                    span.set_attribute("switchyard.batch_size", len(prefill))
                    span.set_attribute("switchyard.prefill_tokens", tokens)
                    span.set_attribute("switchyard.layer", boundary)
                    await asyncio.sleep(seconds)
                result = StepResult(prefill_tokens=tokens, seconds=seconds)
                self._prefilled(prefill, result)
        except BaseException:
            for _, future in jobs:
                future.cancel()
            raise
        finally:
            flight.paused += loop.time() - paused_at
        for job, future in jobs:
            mine = {s.seq_id for s, _ in job}
            _resolve(future, StepResult({k: v for k, v in result.outputs.items() if k in mine},
                                        result.prefill_tokens, result.seconds))

    def _account(self, seconds: float, tokens: int, kv_tokens: int) -> None:
        """Count one step of ``seconds`` computing ``tokens`` and reading the KV of ``kv_tokens``: busy,
        memory-busy and tensor-busy seconds (:func:`step_activity`)."""
        p = self.params
        flops = 2 * p.params_billion * 1e9 * tokens
        hbm_bytes = p.params_billion * 1e9 * p.bytes_per_param + kv_tokens * p.kv_bytes_per_token
        memory, tensor = step_activity(p, seconds, flops, hbm_bytes)
        self.steps += 1
        self.busy_seconds += seconds
        self.memory_busy_seconds += memory
        self.tensor_busy_seconds += tensor

    def _next(self, req: Request) -> SeqOutput:
        """The reply's next token; end-of-sequence (with its tool calls) once the reply is complete. The
        KV prefix then covers every token but the new one."""
        reply = self.reply_for(req)
        index = len(req.output_tokens)
        out = SeqOutput(visible=not reply.tool_calls, num_computed_tokens=req.num_tokens)
        if index < len(reply.tokens):
            out.texts.append(reply.tokens[index])
        if index + len(out.texts) >= len(reply.tokens):
            out.tool_calls = list(reply.tool_calls)
            out.eos = True
            req.engine_state.reply = None
        return out


__all__ = [
    "ModelledKV",
    "SimEngine",
    "SimKV",
    "SimReply",
    "SimSeq",
    "Passage",
    "decode_seconds",
    "mixed_step_seconds",
    "prefill_seconds",
    "plan_reply",
    "parse_passages",
    "extractive_answer",
    "find_arithmetic",
]
