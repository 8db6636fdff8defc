"""The engine interfaces the dispatcher drives: typed model runners, their KV cache managers.

Shape after vLLM's v1 engine core (``vllm/v1/engine/core.py`` ``step()``:
``schedule()`` -> ``execute_model()`` -> ``update_from_output()``): the
scheduler decides, the engine runs the model and reports, the scheduler
writes the report into its requests. An engine mutates no request, but for
its own slot in it, ``Request.engine_state``, which nothing else reads.

- :class:`StepEngine`: engines that run the model one iteration at a time
  over a batch (``sim`` and ``torch``). :meth:`StepEngine.execute_model`
  takes a :class:`StepBatch` (what to prefill, how many prompt tokens each,
  what to decode) and returns a :class:`StepResult` (per ``Request.seq_id``: new token
  texts and their visibility, tool calls, whether the model emitted
  end-of-sequence, the KV prefix computed; the step's prompt tokens and
  seconds). What an engine can do is declared as class flags
  (``supports_layer_preemption``, ``supports_chunked_prefill``), never probed.
- :class:`KVCacheManager`: an engine's KV memory, owned and called by the
  scheduler (bytes per request, free, export/import for the memory tiers,
  prefix sharing and the prefix cache, compaction, memory facts).
  :class:`NullKVCacheManager` for engines that hold none.
- :class:`StreamEngine`: engines that do not step (the ``openai`` upstream).
  Each request is one streamed call of typed :data:`StreamItem`s; the stream
  loop turns each into a :class:`SeqOutput` for the same ``update_from_output``.

The stop check is the scheduler's, one for every engine
(:func:`switchyard.dispatcher.scheduler.update.check_stop`): end-of-sequence ->
``stop`` (``tool_calls`` when the step produced tool calls), the request's
``max_tokens`` or the engine's own length limit -> ``length``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence, Union

from switchyard.dispatcher.request import Request, ToolCall

if TYPE_CHECKING:
    from switchyard.dispatcher.scheduler.capacity import MemoryInfo


@dataclass
class StepBatch:
    """One engine step, as the scheduler composed it.

    ``prefill``: (request, prompt tokens to compute in this step); a request
    whose count covers its whole uncomputed prefix gets its next token, one
    whose count is smaller (a chunk, engines with ``supports_chunked_prefill``
    only) advances its ``num_computed_tokens`` by the count. An engine without
    chunked prefill computes the whole uncomputed prefix whatever the count.
    ``decode``: requests that get one token each.
    """

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [req for req, _ in self.prefill] + self.decode

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


@dataclass
class SeqOutput:
    """What one step produced for one request.

    ``texts``: new token texts (usually one; none for a prompt chunk or a bare
    end-of-sequence); ``visible``: streamed as text (False for tool-call
    argument tokens, which count in usage and in the KV prefix only).
    ``eos``: the model ended the sequence (end-of-text, or its reply plan is
    complete). ``length_capped``: the engine's own length limit was reached
    (the model's maximum sequence length, or an upstream's ``length``).
    ``num_computed_tokens``: the KV prefix the engine holds for it after the
    step (None: unchanged, a stream engine). ``prompt_tokens``: the engine's
    own count of the prompt, when it tokenizes (None: keep the caller's).
    ``error``: this request failed in the engine (the others of the step go on).
    ``usage``: an upstream's counts (stream engines). ``finish_reason``: the finish reason the engine
    reported with its end (an upstream's stop, length or tool_calls), which the stop check takes as is.
    """

    texts: list[str] = field(default_factory=list)
    visible: bool = True
    tool_calls: list[ToolCall] = field(default_factory=list)
    eos: bool = False
    length_capped: bool = False
    num_computed_tokens: int | None = None
    prompt_tokens: int | None = None
    error: BaseException | None = None
    usage: "Usage | None" = None
    finish_reason: str | None = None


@dataclass
class StepResult:
    """What :meth:`StepEngine.execute_model` returns: per ``Request.seq_id``, its :class:`SeqOutput`; the
    prompt tokens computed and the engine seconds the step took."""

    outputs: dict[int, SeqOutput] = field(default_factory=dict)
    prefill_tokens: int = 0
    seconds: float = 0.0


class KVCacheManager(abc.ABC):
    """An engine's KV memory, as the scheduler sees it. Called on the event loop only.

    Bytes are device bytes; tokens are prefix tokens of one request.
    """

    models_transfers: bool = False
    """The KV state is modelled (the sim): a swap moves a small record and its transfer time is owed to the
    step loop instead of spent."""

    def memory_info(self) -> "MemoryInfo | None":
        """Device, weight and per-token KV bytes (the HBM budget); None: not memory-bound (no budget)."""
        return None

    def device_used_bytes(self) -> int | None:
        """Device memory in use now (a GPU's reading), or None (the scheduler models usage)."""
        return None

    @abc.abstractmethod
    def kv_bytes(self, req: Request) -> int:
        """Bytes of KV state held for ``req`` now (0 when freed)."""

    @abc.abstractmethod
    def free(self, req: Request) -> None:
        """Drop ``req``'s KV state (preempted, finished); once ``req`` is finished, everything held for it.
        Idempotent. The scheduler then sets ``req.num_computed_tokens`` to 0."""

    def can_export(self) -> bool:
        """:meth:`export` can produce bytes (a swap to DRAM is possible)."""
        return False

    def export(self, req: Request) -> bytes | None:
        """``req``'s KV state as bytes for the DRAM tier, before it is freed; None when none is held."""
        return None

    def load(self, req: Request, payload: bytes, tokens: int) -> int:
        """Take back up to ``tokens`` prefix tokens from :meth:`export`'s bytes (at most all but ``req``'s
        newest token); returns tokens restored (0: a miss). The scheduler sets ``num_computed_tokens``."""
        return 0

    def share_prefix(self, source: Request, target: Request) -> int:
        """``target`` (a react_loop agent's next step) takes over ``source``'s (its parked step's) warm
        prefix; returns the prefix tokens ``target`` now holds (``target.num_computed_tokens`` when the
        prefix is modelled, not copied)."""
        return target.num_computed_tokens

    def recompute_seconds(self, tokens: int) -> float:
        """Engine seconds a prefill of ``tokens`` tokens costs (0: unknown); prices swap against recompute."""
        return 0.0

    def compact(self, holders: Iterable[Request]) -> int:
        """Defragment the allocations of ``holders`` (every request the scheduler holds: running, leaving,
        parked, waiting): shrink each to its valid blocks; returns device bytes freed."""
        return 0

    def match_prefix(self, req: Request) -> int:
        """Prompt tokens of a fresh ``req`` already in the prefix cache (computed by an earlier request)."""
        return 0

    @property
    def shares_prefixes(self) -> bool:
        """Whether a prompt prefix computed for one request is reused by a later one (automatic prefix
        caching, :meth:`match_prefix`)."""
        return False

    def prefix_cache_bytes(self) -> int:
        """Device bytes the prefix cache holds (evictable)."""
        return 0

    def evict_prefix_cache(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of the prefix cache, least recently used first; returns bytes freed."""
        return 0


class NullKVCacheManager(KVCacheManager):
    """The KV manager of an engine that holds no KV the dispatcher manages (a stream engine)."""

    def kv_bytes(self, req: Request) -> int:
        return 0

    def free(self, req: Request) -> None:
        pass


class StepEngine(abc.ABC):
    """An engine stepped by the step loop, one batched iteration per :meth:`execute_model`.

    Attributes every step engine has: ``model`` (model id reported in
    GenerateDone.model), ``busy_seconds`` (cumulative seconds in steps: the busy
    ratio), ``kv`` (its :class:`KVCacheManager`).
    """

    supports_layer_preemption: bool = False
    """:meth:`execute_between_layers` can run a prefill at a layer boundary of the step in flight.

    A step is a loop over the model's layers launched layer by layer by the
    host, so the host can stop launching the batch's layers at a boundary, run
    another request's whole prefill, and resume the batch from the next layer.
    This is REEF's preemption of best-effort DNN inference for real-time work
    (Han et al., OSDI 2022), at layer granularity; iteration-level schedulers
    (Orca, vLLM) only let work join between steps."""

    supports_chunked_prefill: bool = False
    """A prefill count below the uncomputed prefix computes that part only (vLLM V1's and
    Sarathi-Serve's chunked prefill, Agrawal et al., OSDI 2024): a long prompt over several short steps."""

    models_activity: bool = False
    """``memory_busy_seconds`` and ``tensor_busy_seconds`` are modelled (the compute score's engine source)."""

    runs_on_host_gpu: bool = True
    """The engine computes on this host's GPU, so NVML's utilisation of it (``scheduler.nvml_device_index``) is
    the engine's load and feeds the compute score. False: its GPU is modelled (the ``sim`` engine) or it computes
    on the CPU; whatever NVML reads on this host is other work's, and the score comes from the engine itself."""

    enforces_max_tokens: bool = False
    """The engine ends each sequence at the request's ``max_tokens`` itself; the stop check then does not
    count it (:func:`~switchyard.dispatcher.scheduler.update.check_stop`). False: the scheduler counts."""

    model: str = ""
    busy_seconds: float = 0.0
    memory_busy_seconds: float = 0.0
    tensor_busy_seconds: float = 0.0
    kv: KVCacheManager

    @abc.abstractmethod
    async def execute_model(self, batch: StepBatch) -> StepResult:
        """Run one step over ``batch`` (see :class:`StepBatch`) and report it; mutates no request (but for
        its own ``Request.engine_state``).

        A step of prefills only, decodes only, or both together (one forward
        pass: chunked-prefill scheduling, vLLM V1, Sarathi-Serve), so that
        requests joining the batch do not stall those already decoding.

        Raises:
            an out-of-memory error (``MemoryError``, CUDA's ``OutOfMemoryError``) or any other: the
                step failed for every member.
        """

    async def execute_between_layers(self, batch: StepBatch) -> StepResult | None:
        """Prefill ``batch.prefill`` at the next layer boundary of the step in flight
        (``supports_layer_preemption``); None, with nothing computed, when no step is in flight or it ends
        before another boundary. Its requests must not be members of the step in flight."""
        return None

    def decode_bound_tokens_per_s(self, batch_size: int) -> float:
        """The model's decode roofline at ``batch_size`` sequences, tokens/s (0: unknown)."""
        return 0.0


@dataclass(frozen=True)
class Usage:
    """Last item of a :meth:`StreamEngine.generate` stream: counts reported upstream.

    ``finish_reason`` is the upstream's (stop, length, tool_calls); None means
    the stream loop decides from what was streamed. ``model`` is the upstream
    model id that served the request (the fallback model when one was used);
    empty means ``engine.model``.
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    model: str = ""

    def completion_beyond(self, streamed: int) -> int:
        """Completion tokens the server counted beyond the ``streamed`` token texts (one chunk may carry
        several tokens: speculative decoding, a stream interval; a tool call's arguments come as no text);
        0 when it counted fewer."""
        return max(0, self.completion_tokens - streamed)


@dataclass(frozen=True)
class Reasoning:
    """A stream item: a piece of a reasoning model's thinking (``delta.reasoning_content``), generated before its
    answer. Its tokens count as the request's output (completion tokens, TTFT, KV prefix) but are not streamed to
    the caller: the answer is the token texts."""

    text: str


StreamItem = Union[str, Reasoning, ToolCall, Usage]
"""What a stream engine yields: token texts, reasoning, tool calls, and finally one Usage."""


class StreamEngine(abc.ABC):
    """An engine that streams a whole completion per request (no stepping)."""

    model: str = ""
    kv: KVCacheManager = NullKVCacheManager()
    enforces_max_tokens = True
    """The upstream is given ``max_tokens`` and ends the stream itself (``Usage`` last): a request ends
    when its stream ends, with the upstream's finish reason."""
    models_activity = False
    runs_on_host_gpu = False
    """A stream engine's GPU is its model server's (:attr:`StepEngine.runs_on_host_gpu`)."""
    busy_seconds = 0.0
    memory_busy_seconds = 0.0
    tensor_busy_seconds = 0.0
    stream_slots: Any = None
    """The streams in flight to the engine's upstream and the limit they are admitted under
    (:class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`), which the engine measures itself (the
    ``openai`` engine: over :class:`switchyard.gateway.pool.PoolLimit`, one adaptive limit per endpoint, fed by
    the gateway). None: an engine that measures nothing; the dispatcher admits its streams under an
    :class:`~switchyard.dispatcher.adaptive_limit.AdaptiveConcurrencyLimit` of ``model_gateway.concurrency``
    that nothing feeds (it stays at ``initial_limit``)."""

    @abc.abstractmethod
    def generate(self, req: Request) -> AsyncIterator[StreamItem]:
        """Stream ``req``'s completion: token texts and tool calls, then one :class:`Usage`.

        Retries and fallback before the first item are the engine's own
        business; tokens already yielded are never repeated. Reads ``req``, never writes it.

        Raises:
            SwitchyardError (or a subclass): carries the gRPC status and a
                message naming the cause; the Generate stream ends with it.
        """


    def reported_context_window(self, model: str) -> int:
        """The context window, tokens, the upstream reports for ``model`` (a client-facing id, "" for the
        default); 0 when it reports none, and by default. Callers take it through
        ``limits.context_window(model, reported)``, where a window configured for the model wins."""
        return 0

    def reported_context_windows(self) -> dict[str, int]:
        """Every model name the upstream reports a window for, tokens (:meth:`reported_context_window`'s, for
        callers that check requests naming other models than the default); empty by default."""
        return {}

    def served_names(self) -> Sequence[str]:
        """Every model name a request may give, as the upstream's model list says (its ids and the aliases of
        one), sorted; empty when not known (no list read, and by default): any name is sent and the upstream
        decides. Not to be changed by the caller (an engine may hand out the sequence it keeps)."""
        return ()

    def prompt_token_ratio(self, model: str) -> float:
        """The upstream's prompt tokens per token of the caller's count for ``model`` (a client-facing id), as
        measured on its recent calls (:class:`~switchyard.dispatcher.engines.token_ratio.PromptTokenRatios`);
        1.0 where none was measured, and by default. The window checks scale a prompt's count by it
        (``limits.context_window(model, reported, ratio)``)."""
        return 1.0

    def prompt_token_ratios(self) -> dict[str, float]:
        """Every model a ratio was measured for (:meth:`prompt_token_ratio`'s); empty by default."""
        return {}

    def start_describing(self) -> Any:
        """Start reading what the upstream reports of its models (its ``GET /v1/models``) in the background;
        nothing by default."""
        return None

    async def await_model_list(self, model: str, wait_s: float, *, read_unread: bool = False) -> None:
        """Wait, at most ``wait_s`` seconds in all, until the upstream's model list can say whether ``model`` (a
        client-facing name; "" the default) is served, and what window it has: the one owner of "is this model
        served, reading the list again if not", which a request's check (``RequestProcessor.open_request``) and
        ``DescribeModel`` both call.

        First the list as it stands: the read under way while no read has ended yet (the dispatcher's start
        began it), so that a request arriving before the list answered is checked against what the server
        reports; with ``read_unread`` (DescribeModel: its caller asks for the windows, and paces its asks), a
        list not read yet (the upstream was down) is read now and waited for; without it, once any read has
        ended, a down upstream costs a request nothing. Then, when the list does not name ``model``, it is read
        again (a model the server loaded since is served, not refused by the list of before), at most as often
        as the engine allows. Reads go on past the wait; the next caller finds them. Nothing by default. Never
        raises."""

    def refused_for_load(self, exc: BaseException) -> bool:
        """True when ``exc``, raised by :meth:`generate` before its first item, says the upstream refused the
        request for load (a 429 after the engine's own retries): the stream loop then puts the request back in
        the queue, behind the limit that backed off, instead of failing it. False by default."""
        return False

    async def aclose(self) -> None:
        """Close connections (called once by the dispatcher's stop)."""


def stream_item_output(item: StreamItem) -> SeqOutput:
    """A stream engine's item as a :class:`SeqOutput` for ``update_from_output``: a token text, reasoning (an
    output token not streamed to the caller, as a step engine's tool-call argument tokens), a tool
    call, or the final :class:`Usage` (the end of the stream, with the upstream's finish reason when it
    reported one, else the stop check derives it: tool_calls when it made tool calls, else stop)."""
    if isinstance(item, str):
        return SeqOutput(texts=[item])
    if isinstance(item, Reasoning):
        return SeqOutput(texts=[item.text], visible=False)
    if isinstance(item, ToolCall):
        return SeqOutput(tool_calls=[item])
    return SeqOutput(eos=True, finish_reason=item.finish_reason, usage=item)
