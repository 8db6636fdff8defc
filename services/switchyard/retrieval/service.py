"""The retrieval service: ``agent.RetrievalService.Retrieve`` over the vector index.

A Retrieve call is validated, then waits in the retrieval queue
(``queues.retrieval`` in queue.json: capacity, workers, timeout_ms). A worker
embeds the query through the micro-batcher (concurrent queries share one
forward pass) and searches the index on a worker thread: by vectors and, with
``retrieval.hybrid``, by BM25 too (run while the question is embedded, so it
adds only the fusion to a call's time), the two rankings fused
(:meth:`VectorIndex.hybrid_search`). Passages come best first by that ranking;
each one's score is its cosine similarity to the query, so with hybrid search
the scores need not descend. The response carries
the passages with cosine scores and the time spent in each stage; each stage
is also an OpenTelemetry span (``retrieval.queue_wait``, ``retrieval.embed``,
``retrieval.search``) and a Prometheus histogram.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import telemetry
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import InvalidArgument, SERVER_FAULT_CODES, abort, status_for
from switchyard.common.queues import QueueTimeoutError, WorkQueue
from switchyard.common.server import GRPC_SERVICES
from switchyard.retrieval.embedder import MicroBatcher, OnnxEmbedder, QueryEncoder, load_query_encoder
from switchyard.retrieval.index import IndexMismatchError, VectorIndex, load_index
from switchyard.retrieval.metrics import EMBED_SECONDS, INDEX_PASSAGES, REQUESTS, SEARCH_SECONDS

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)

QUEUE_NAME = "retrieval"


@dataclass(frozen=True)
class _Result:
    passages: list[agent_pb2.Passage]
    embed_s: float
    search_s: float


class RetrievalService(agent_pb2_grpc.RetrievalServiceServicer):
    """Serves ``agent.RetrievalService`` (the common.server.Service protocol).

    Args:
        config: ``retrieval`` (index_dir, top_k, max_top_k, embed batching)
            and ``queues.retrieval``.
        embedder: the embedding model; default: all-MiniLM-L6-v2 loaded at :meth:`start`.
    """

    name = "retrieval"
    grpc_service_names = (GRPC_SERVICES["retrieval"],)

    def __init__(self, config: SwitchyardConfig, embedder: QueryEncoder | None = None) -> None:
        self.config = config
        self.settings = config.retrieval
        self.queue = WorkQueue(QUEUE_NAME, config.queues.retrieval)
        self._embedder = embedder
        self._batcher: MicroBatcher | None = None
        self._index: VectorIndex | None = None

    @property
    def index(self) -> VectorIndex:
        """The loaded index. Raises RuntimeError before :meth:`start`."""
        if self._index is None:
            raise RuntimeError("RetrievalService.start() has not run")
        return self._index

    @property
    def batcher(self) -> MicroBatcher:
        """The query micro-batcher. Raises RuntimeError before :meth:`start`."""
        if self._batcher is None:
            raise RuntimeError("RetrievalService.start() has not run")
        return self._batcher

    def register(self, server: grpc.aio.Server) -> None:
        agent_pb2_grpc.add_RetrievalServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Load the index and the embedding model, then start the queue and the batcher.

        Raises:
            IndexNotFoundError: no index in ``retrieval.index_dir`` (the message says
                which folder and to run ``switchyard index``).
            IndexMismatchError: the index was built with another model or width.
        """
        index = await asyncio.to_thread(load_index, self.settings.index_dir)
        try:
            embedder = self._embedder or await asyncio.to_thread(
                load_query_encoder, self.settings.index_dir, self.settings.embed_backend, self.settings.embed_threads
            )
        except (FileNotFoundError, ValueError) as exc:  # no query encoder beside the index, or a broken one
            raise IndexMismatchError(str(exc)) from exc
        if self.settings.hybrid and index.lexical is None:
            raise IndexMismatchError(
                f"index in {self.settings.index_dir} has no BM25 part but retrieval.hybrid is on; rebuild it with "
                "`switchyard index` (or set retrieval.hybrid to false)"
            )
        if index.manifest.model != embedder.name or index.manifest.dims != embedder.dims:
            raise IndexMismatchError(
                f"index in {self.settings.index_dir} was built with {index.manifest.model} "
                f"({index.manifest.dims} dims) but the service embeds with {embedder.name} "
                f"({embedder.dims} dims); rebuild it with `switchyard index`"
            )
        await asyncio.to_thread(embedder.encode, ["warm-up"])  # the first forward pass is slow
        self._index, self._embedder = index, embedder
        INDEX_PASSAGES.set(len(index))
        self._batcher = MicroBatcher(
            embedder, self.settings.embed_batch_size, self.settings.embed_batch_wait_ms, self.settings.query_cache_size
        )
        self._batcher.start()
        self.queue.start()
        log.info(
            "retrieval: %d passages from %s (%s, %d dims, queries on %s)",
            len(index), self.settings.index_dir, index.manifest.model, index.manifest.dims,
            "onnxruntime" if isinstance(embedder, OnnxEmbedder) else "torch",
        )

    async def stop(self) -> None:
        """Stop the queue workers and the batcher."""
        await self.queue.stop()
        if self._batcher is not None:
            await self._batcher.stop()

    def _top_k(self, top_k: int) -> int:
        if top_k == 0:
            return self.settings.default_top_k
        if not 1 <= top_k <= self.settings.max_top_k:
            raise InvalidArgument(
                "top_k",
                f"0 (the default, {self.settings.default_top_k}) or 1..{self.settings.max_top_k} (retrieval.max_top_k)",
                top_k,
            )
        return top_k

    async def retrieve(self, query: str, top_k: int = 0) -> agent_pb2.RetrieveResponse:
        """Embed ``query`` and return the ``top_k`` most similar passages, best first.

        Args:
            query: the question; must contain a non-space character.
            top_k: passages wanted; 0 = ``retrieval.default_top_k``; at most ``retrieval.max_top_k``.

        Returns:
            passages (text, cosine score -1..1, source, title), and queue_wait_s,
            embed_s, search_s in seconds.

        Raises:
            InvalidArgument: empty query, one past ``limits.max_query_chars``, or top_k out of range (names
                the field).
            QueueFullError: the retrieval queue holds ``capacity`` items.
            QueueTimeoutError: no worker took the call within ``timeout_ms``.
        """
        if not query.strip():
            raise InvalidArgument("query", "a non-empty question", query)
        if len(query) > self.config.limits.max_query_chars:
            raise InvalidArgument("query", f"at most {self.config.limits.max_query_chars} characters "
                                  "(limits.max_query_chars)", f"{len(query)} characters")
        k = self._top_k(top_k)
        parent = otel_context.get_current()
        enqueued_ns = time.time_ns()
        ticket = self.queue.submit(lambda: self._run(query, k, parent, enqueued_ns))
        try:
            result, wait_s = await ticket.result()
        except QueueTimeoutError as exc:
            self._queue_wait_span(parent, enqueued_ns, time.time_ns(), exc)
            raise
        return agent_pb2.RetrieveResponse(
            passages=result.passages, queue_wait_s=wait_s, embed_s=result.embed_s, search_s=result.search_s
        )

    def _queue_wait_span(
        self, parent: otel_context.Context, start_ns: int, end_ns: int, exc: BaseException | None = None
    ) -> None:
        span = telemetry.start_queue_wait_span(tracer, "retrieval.queue_wait", QUEUE_NAME, start_ns, parent)
        if exc is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        span.end(end_time=end_ns)

    async def _run(self, query: str, k: int, parent: otel_context.Context, enqueued_ns: int) -> _Result:
        # Runs on a queue worker; the caller's trace context is attached explicitly
        # because the worker task does not inherit it.
        self._queue_wait_span(parent, enqueued_ns, time.time_ns())
        token = otel_context.attach(parent)
        try:
            lexical = None
            if self.settings.hybrid:  # BM25 needs no vector: it runs while the question is embedded
                lexical = asyncio.ensure_future(asyncio.to_thread(
                    self.index.lexical_search, query, k, self.settings.hybrid_candidates))
            with tracer.start_as_current_span("retrieval.embed") as span:
                started = time.monotonic()
                try:
                    vector = await self.batcher.embed(query)
                except BaseException:
                    if lexical is not None:
                        lexical.cancel()
                    raise
                embed_s = time.monotonic() - started
                span.set_attribute("retrieval.query_chars", len(query))
            EMBED_SECONDS.observe(embed_s)
            with tracer.start_as_current_span("retrieval.search") as span:
                started = time.monotonic()
                lexical_ids = await lexical if lexical is not None else None
                hits = await asyncio.to_thread(self._search, query, vector, k, lexical_ids)
                search_s = time.monotonic() - started
                span.set_attribute("retrieval.top_k", k)
                span.set_attribute("retrieval.passages", len(hits))
            SEARCH_SECONDS.observe(search_s)
        finally:
            otel_context.detach(token)
        passages = [
            agent_pb2.Passage(text=h.passage.text, score=h.score, source=h.passage.source, title=h.passage.title)
            for h in hits
        ]
        return _Result(passages, embed_s, search_s)

    def _search(self, query: str, vector, k: int, lexical_ids: list[int] | None) -> list:
        if self.settings.hybrid:
            return self.index.hybrid_search(
                query, vector, k, self.settings.hybrid_candidates, self.settings.rrf_k, lexical_ids
            )
        return self.index.search(vector, k)[0]

    async def Retrieve(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.RetrieveRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.RetrieveResponse:
        """gRPC handler: :meth:`retrieve`, with errors sent as gRPC status.

        INVALID_ARGUMENT names ``query`` or ``top_k``; a full queue is
        RESOURCE_EXHAUSTED and a queue timeout DEADLINE_EXCEEDED, both naming
        the retrieval queue.
        """
        try:
            response = await self.retrieve(request.query, request.top_k)
        except asyncio.CancelledError:
            REQUESTS.labels("CANCELLED").inc()
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves as a gRPC status
            code, details = status_for(exc)
            REQUESTS.labels(code.name).inc()
            if code in SERVER_FAULT_CODES and code is not grpc.StatusCode.DEADLINE_EXCEEDED:
                log.exception("Retrieve failed")
            await abort(context, exc, "retrieval")
        REQUESTS.labels("OK").inc()
        return response
