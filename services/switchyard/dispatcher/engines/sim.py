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
- Chunked prefill (:meth:`SimEngine.step_chunk`): a long prompt may be
  computed over several mixed steps under a token budget, each step costing
  the same mixed-step time for the tokens it computes.
- Layers: a step runs the model's ``layers`` (32) one after another, each
  taking step time / ``layers``. A prefill asked for while a step runs
  (:meth:`SimEngine.prefill_between_layers`) waits for the layer in progress
  to end, takes its own modelled prefill time there, and the step then goes
  on from the next layer (see
  :class:`~switchyard.dispatcher.engines.base.LayerPreemptible`).

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

from switchyard.common import telemetry
from switchyard.common.config import SimEngineConfig, SwitchyardConfig
from switchyard.dispatcher import metrics
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
    """Restore up to ``tokens`` prefix tokens from an :func:`export_modelled_kv` record (at most all but the
    newest token of ``req``, whose KV its next step computes); returns tokens restored (0: bad record)."""
    if len(payload) != _KV_RECORD.size:
        return 0
    magic, held, _ = _KV_RECORD.unpack(payload)
    if magic != b"SYKV":
        return 0
    restored = max(0, min(tokens, held, req.num_tokens - 1))
    req.num_computed_tokens = restored
    return restored


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


def extractive_answer(question: str, passages: list[Passage]) -> str:
    """The sentences of ``passages`` sharing most words with ``question``, cited.

    At most :data:`MAX_ANSWER_SENTENCES`, ranked by overlap (ties: passage
    order, then sentence order), each followed by `` [n]``. With no passage or
    no overlapping sentence: a short answer built from the question's words.
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
    answer = lead + extractive_answer(question, passages) if passages or not lead else lead.strip()
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
    pending: list[tuple[list[Request], "asyncio.Future[bool]"]] = field(default_factory=list)
    wake: "asyncio.Future[bool] | None" = None
    """Set while the step sleeps: resolved True to wake it for a pending prefill, False at its end."""


def _resolve(future: "asyncio.Future[bool]", value: bool) -> None:
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


class SimEngine:
    """A :class:`~switchyard.dispatcher.engines.base.StepEngine` driven by the latency model.

    Args:
        config: the whole config; reads ``sim``.
    """

    def __init__(self, config: SwitchyardConfig) -> None:
        self.params = config.sim
        self.model = self.params.model
        self.busy_seconds = 0.0
        self.memory_busy_seconds = 0.0
        """Modelled seconds the HBM was busy (see :func:`step_activity`)."""
        self.tensor_busy_seconds = 0.0
        """Modelled seconds the tensor cores were busy."""
        self.steps = 0
        self._replies: dict[Request, SimReply] = {}
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.params.prefix_block_tokens, self.params.prefix_block_tokens * self.params.kv_bytes_per_token)
            if self.params.prefix_caching else None
        )
        """Automatic prefix caching (``sim.prefix_caching``); None when off."""
        self._prompt_keys: dict[Request, list[int]] = {}
        self._flight: _StepInFlight | None = None

    def reply_for(self, req: Request) -> SimReply:
        """The planned reply of ``req`` (planned once, kept until :meth:`release`)."""
        reply = self._replies.get(req)
        if reply is None:
            reply = self._replies[req] = plan_reply(req.prompt, req.messages, req.tools)
        return reply

    async def prefill(self, reqs: list[Request]) -> None:
        """Compute each sequence's uncomputed prefix, then append its next token.

        Costs ``prefill_seconds(sum of uncomputed tokens)``: one overhead per
        batched prefill. Prompt blocks found in the prefix cache are not
        computed again. A sequence with output already (resumed after
        preemption) recomputes prompt plus output, counted in
        ``req.recomputed_tokens``.
        """
        reqs = [s for s in reqs if not s.is_finished]
        if not reqs:
            return
        self._reuse_cached_prefixes(reqs)
        tokens = sum(s.num_uncomputed_tokens for s in reqs)
        with tracer.start_as_current_span("engine.prefill") as span:
            span.set_attribute("switchyard.batch_size", len(reqs))
            span.set_attribute("switchyard.prefill_tokens", tokens)
            await self._run(prefill_seconds(self.params, tokens), tokens=tokens, kv_tokens=tokens)
        self._prefilled(reqs)

    def _reuse_cached_prefixes(self, reqs: list[Request]) -> None:
        """Fresh sequences start from the prompt blocks already in the prefix cache."""
        cache = self.prefix_cache
        if cache is None:
            return
        for req in reqs:
            if req.output_tokens or req.num_computed_tokens or req in self._prompt_keys:
                continue
            pieces = prompt_pieces(req)
            keys = cache.keys(pieces)
            self._prompt_keys[req] = keys
            hit_pieces = cache.match(keys) * cache.block_tokens
            if hit_pieces:
                # the cache counts the sim's own word pieces; the prompt's length is the caller's count
                cached = req.prompt_tokens * hit_pieces // max(1, len(pieces))
                req.num_computed_tokens = max(0, min(cached, req.prompt_tokens - 1))
            metrics.PREFIX_CACHE_BLOCKS.labels("hit").inc(hit_pieces // cache.block_tokens)
            metrics.PREFIX_CACHE_BLOCKS.labels("miss").inc(len(keys) - hit_pieces // cache.block_tokens)

    def _prefilled(self, reqs: list[Request]) -> None:
        """After a prefill: prefixes computed, prompt blocks cached, next token out."""
        for req in reqs:
            if req.output_tokens:
                req.recomputed_tokens += req.num_tokens - 1
            req.num_computed_tokens = req.num_tokens
            keys = self._prompt_keys.pop(req, None)
            if keys and self.prefix_cache is not None:
                self.prefix_cache.insert(keys)
                metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.nbytes)
            self._emit_next(req)

    def prefix_cache_bytes(self) -> int:
        """Device memory the prefix cache holds (evictable: see :meth:`evict_prefix_cache`)."""
        return self.prefix_cache.nbytes if self.prefix_cache is not None else 0

    def evict_prefix_cache(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of cached prompt blocks, least recently used first; returns bytes freed."""
        if self.prefix_cache is None:
            return 0
        freed = self.prefix_cache.evict(nbytes)
        metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.nbytes)
        return freed

    async def decode(self, reqs: list[Request]) -> None:
        """One decode step: one token for each sequence; costs ``decode_seconds(len(reqs))``."""
        reqs = [s for s in reqs if not s.is_finished]
        if not reqs:
            return
        with tracer.start_as_current_span("engine.decode") as span:
            span.set_attribute("switchyard.batch_size", len(reqs))
            await self._run(
                decode_seconds(self.params, len(reqs)), tokens=len(reqs), kv_tokens=sum(s.num_tokens for s in reqs)
            )
        for req in reqs:
            req.num_computed_tokens = req.num_tokens
            self._emit_next(req)

    async def step(self, prefill: list[Request], decode: list[Request]) -> None:
        """One mixed step: the uncomputed prefix of each ``prefill`` sequence and one token of each ``decode`` one.

        Costs :func:`mixed_step_seconds`: the prefill tokens ride along with the
        decode step's weight read (chunked-prefill scheduling, as vLLM V1 and
        Sarathi-Serve do), so no separate prefill launch stalls the running set.
        """
        prefill = [s for s in prefill if not s.is_finished]
        decode = [s for s in decode if not s.is_finished]
        if not prefill:
            await self.decode(decode)
            return
        self._reuse_cached_prefixes(prefill)
        tokens = sum(s.num_uncomputed_tokens for s in prefill)
        batch = prefill + decode
        with tracer.start_as_current_span("engine.step") as span:
            span.set_attribute("switchyard.batch_size", len(batch))
            span.set_attribute("switchyard.prefill_tokens", tokens)
            await self._run(
                mixed_step_seconds(self.params, tokens, len(batch)),
                tokens=tokens + len(decode),
                kv_tokens=tokens + sum(s.num_tokens for s in decode),
            )
        self._prefilled(prefill)
        for req in decode:
            req.num_computed_tokens = req.num_tokens
            self._emit_next(req)

    async def step_chunk(self, prefill: list[Request], decode: list[Request], max_prefill_tokens: int) -> None:
        """:meth:`step` under a budget of ``max_prefill_tokens`` prompt tokens (chunked prefill, see
        :class:`~switchyard.dispatcher.engines.base.ChunkedPrefill`); costs :func:`mixed_step_seconds` of the
        tokens computed."""
        prefill = [s for s in prefill if not s.is_finished]
        decode = [s for s in decode if not s.is_finished]
        self._reuse_cached_prefixes(prefill)
        chunks: list[tuple[Request, int]] = []
        left = max(1, max_prefill_tokens)
        for req in prefill:
            need = req.num_uncomputed_tokens
            if left <= 0 or (req.output_tokens and chunks and need > left):
                break
            n = need if req.output_tokens else min(need, left)
            chunks.append((req, n))
            left -= n
        if not chunks:
            await self.decode(decode)
            return
        tokens = sum(n for _, n in chunks)
        with tracer.start_as_current_span("engine.step") as span:
            span.set_attribute("switchyard.batch_size", len(chunks) + len(decode))
            span.set_attribute("switchyard.prefill_tokens", tokens)
            await self._run(
                mixed_step_seconds(self.params, tokens, len(chunks) + len(decode)),
                tokens=tokens + len(decode),
                kv_tokens=sum(req.num_computed_tokens + n for req, n in chunks) + sum(s.num_tokens for s in decode),
            )
        complete = []
        for req, n in chunks:
            if n >= req.num_uncomputed_tokens:
                complete.append(req)
            elif not req.is_finished:
                req.num_computed_tokens += n  # part of its prompt: it goes on in the next step
        self._prefilled(complete)
        for req in decode:
            req.num_computed_tokens = req.num_tokens
            self._emit_next(req)

    def release(self, req: Request) -> None:
        """Drop ``req``'s KV state (``kv_bytes`` becomes 0); its reply plan stays until it finishes.

        Its prompt blocks stay in the prefix cache (they are shared, and evicted by need).
        """
        req.num_computed_tokens = 0
        self._prompt_keys.pop(req, None)
        if req.is_finished:
            self._replies.pop(req, None)

    def decode_bound_tokens_per_s(self, batch_size: int) -> float:
        """The model's decode bound at ``batch_size`` sequences: ``batch_size / decode_seconds(batch_size)``, tokens/s.

        The roofline of this simulated GPU (decode is memory-bound: one weight
        read per step serves the whole batch); the dispatcher exports it as
        ``switchyard_engine_decode_bound_tokens_per_second``. A zero-cost engine (every latency
        parameter 0, as the pipeline-overhead benchmark runs it) has no bound: 0.
        """
        seconds = decode_seconds(self.params, batch_size)
        return batch_size / seconds if seconds > 0 else 0.0

    def kv_bytes(self, req: Request) -> int:
        """``num_computed_tokens x kv_bytes_per_token``."""
        return req.num_computed_tokens * self.params.kv_bytes_per_token

    models_transfers = True
    """The KV state is modelled: a swap moves a small record, and its transfer time is modelled
    (``[dram] transfer_gb_per_s``) by the step loop."""

    def export_kv(self, req: Request) -> bytes | None:
        """``req``'s KV state for the DRAM tier: a record of the tokens and bytes it stands for (the
        sim holds no tensors); None when it holds none."""
        return export_modelled_kv(req, self.params.kv_bytes_per_token)

    def import_kv(self, req: Request, payload: bytes, tokens: int) -> int:
        """Take back ``tokens`` prefix tokens of KV state from :meth:`export_kv`'s record; returns tokens restored."""
        return import_modelled_kv(req, payload, tokens)

    def recompute_seconds(self, tokens: int) -> float:
        """Seconds a prefill of ``tokens`` tokens costs (:func:`prefill_seconds`)."""
        return prefill_seconds(self.params, tokens)

    def memory_info(self) -> MemoryInfo:
        """The modelled GPU: ``hbm_gb`` of device memory (80 GB H100), weights ``params x bytes_per_param``."""
        p = self.params
        return MemoryInfo(
            device_bytes=int(p.hbm_gb * 1e9),
            weight_bytes=int(p.params_billion * 1e9 * p.bytes_per_param),
            kv_bytes_per_token=p.kv_bytes_per_token,
        )

    async def prefill_between_layers(self, reqs: list[Request]) -> bool:
        """Prefill ``reqs`` at the next layer boundary of the step in flight; True once each has its first token.

        The step's layers each last its modelled time / ``sim.layers``; the
        layer in progress ends, then ``reqs`` take ``prefill_seconds`` of their
        uncomputed tokens (prompt blocks in the prefix cache are not computed
        again, as in :meth:`prefill`; busy, memory and tensor time counted),
        and the step resumes from the next layer, its end later by that much.
        Prefills asked for before the same boundary run there together. False,
        with nothing computed, when no step is in flight or it is in its last
        layer (see :class:`~switchyard.dispatcher.engines.base.LayerPreemptible`).
        """
        flight = self._flight
        reqs = [s for s in reqs if not s.is_finished]
        if flight is None or not reqs:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        flight.pending.append((reqs, future))
        if flight.wake is not None:
            _resolve(flight.wake, True)
        return await future

    async def _run(self, seconds: float, tokens: int, kv_tokens: int) -> None:
        """Spend ``seconds`` on a step that computes ``tokens`` and reads the KV of ``kv_tokens``.

        One timer for the whole step, not one per layer: the sleep is woken
        only when a prefill asks for a layer boundary (:meth:`prefill_between_layers`).
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
                _resolve(future, False)

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
                _resolve(future, False)
            return
        await asyncio.sleep(max(0.0, flight.start + flight.paused + boundary * layer_s - loop.time()))
        jobs, flight.pending = flight.pending, []
        reqs = [s for job, _ in jobs for s in job if not s.is_finished]
        paused_at = loop.time()
        try:
            if reqs:
                self._reuse_cached_prefixes(reqs)
                tokens = sum(s.num_uncomputed_tokens for s in reqs)
                seconds = prefill_seconds(self.params, tokens)
                self._account(seconds, tokens, tokens)
                with tracer.start_as_current_span("engine.prefill_between_layers") as span:
                    span.set_attribute("switchyard.batch_size", len(reqs))
                    span.set_attribute("switchyard.prefill_tokens", tokens)
                    span.set_attribute("switchyard.layer", boundary)
                    await asyncio.sleep(seconds)
                self._prefilled(reqs)
        except BaseException:
            for _, future in jobs:
                future.cancel()
            raise
        finally:
            flight.paused += loop.time() - paused_at
        for _, future in jobs:
            _resolve(future, True)

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

    def _emit_next(self, req: Request) -> None:
        """Append the reply's next token; finish at its end or at max_tokens."""
        if req.is_finished:
            return
        reply = self.reply_for(req)
        index = len(req.output_tokens)
        if index < len(reply.tokens):
            req.append_token(reply.tokens[index], visible=not reply.tool_calls)
        if len(req.output_tokens) >= len(reply.tokens):
            for call in reply.tool_calls:
                req.add_tool_call(call)
            req.finish(reply.finish_reason)
            self._replies.pop(req, None)
        elif len(req.output_tokens) >= req.max_tokens:
            req.finish("length")
            self._replies.pop(req, None)
        req.observe_kv_bytes(self.kv_bytes(req))


__all__ = [
    "SimEngine",
    "SimReply",
    "Passage",
    "decode_seconds",
    "mixed_step_seconds",
    "prefill_seconds",
    "plan_reply",
    "parse_passages",
    "extractive_answer",
    "find_arithmetic",
]
