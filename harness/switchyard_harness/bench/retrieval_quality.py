"""``switchyard bench retrieval``: answer quality and single-query time of retrieval.

Scores the labelled query set (:mod:`switchyard.retrieval.quality`) against
the CPython documentation topics, chunked two ways and embedded with
all-MiniLM-L6-v2:

- ``chars 900/100``: the character chunking the index used before (900
  characters, 100 overlap), whose longer passages run past the model's window
  and are truncated;
- ``tokens N/M``: passages sized by the model's own tokenizer
  (``retrieval.chunk_tokens`` / ``chunk_overlap_tokens``, or ``--chunk-tokens``).

Each is searched by vectors alone with FAISS's exact ``IndexFlatIP`` (what the
service uses); the token chunking also hybrid, vectors and BM25 fused
(``retrieval.hybrid``, what the service does by default), and with an
approximate HNSW index (``IndexHNSWFlat``, M=32, efSearch 64) to show whether
approximate search pays at this corpus size.
Printed per row: passages, passages truncated, recall@1, recall@5, MRR@10,
nDCG@10, recall@5 on the "tail" questions (answered only past the old
passages' first 256 word pieces), search time per query (BM25 included), and
the P95 of a question's retrieval time: embedding, then search, with BM25
run during the embedding as the service runs it. Queries are embedded one at a time, as a lone
Retrieve call is, twice, taking turns: as the service runs it now (``retrieval.embed_backend``,
by default the exported encoder on ONNX Runtime, on ``retrieval.embed_threads``) for the token rows,
and through torch on torch's default threads (as the service ran before) for the old character row.
With ``--index-dir`` it scores a built index instead.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from switchyard.common.config import ConfigError, load_config
from switchyard.retrieval.chunking import Document, chunk_document, chunk_for_model, embedding_text, token_length
from switchyard.retrieval.quality import LabelledQuery, Scores, load_queries, score

DEPTH = 20
"""Passages retrieved per question: 10 documents are scored, answers repeated in several passages count once."""
HNSW_M, HNSW_EF_SEARCH = 32, 64
OLD_CHUNK = (900, 100)
"""The character chunking of the index before token-aware chunking (chunk_chars, chunk_overlap_chars)."""
OLD_EMBED_THREADS = 0
"""How the service embedded questions before ``retrieval.embed_threads`` and ``embed_backend``: torch, default threads."""


@dataclass(frozen=True)
class Row:
    """One chunking x index x search measurement (times in seconds); ``index`` is e.g. "flat hybrid"."""

    name: str
    index: str
    passages: int
    truncated: int
    scores: Scores
    tail: Scores
    search_s: list[float]
    retrieval_s: list[float]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


@dataclass(frozen=True)
class QueryPath:
    """One way of embedding a lone question: ``label`` for the report, ``encode(text) -> (dims,) vector``."""

    label: str
    encode: Callable[[str], np.ndarray]


def torch_path(embedder, threads: int) -> QueryPath:
    """Embedding through sentence-transformers on ``threads`` torch threads (0 = torch's default)."""
    from switchyard.retrieval.embedder import set_threads

    def encode(text: str) -> np.ndarray:
        set_threads(threads)
        return embedder.encode([text], batch_size=1)[0]

    return QueryPath(f"torch, {_threads(threads, 'torch')}", encode)


def onnx_path(encoder, threads: int) -> QueryPath:
    """Embedding through the exported encoder on ONNX Runtime (what the service runs by default)."""
    return QueryPath(f"onnxruntime, {_threads(threads, 'onnxruntime')}",
                     lambda text: encoder.encode([text], batch_size=1)[0])


def _threads(count: int, runtime: str) -> str:
    return f"{runtime}'s default threads" if count == 0 else f"{count} thread{'s' if count != 1 else ''}"


def embed_queries(paths: Sequence[QueryPath], queries: Sequence[LabelledQuery]) -> tuple[np.ndarray, list[list[float]]]:
    """Embed each question alone through each of ``paths``.

    The paths take turns question by question, so a noisy machine weighs on each alike.
    Returns (n, dims) vectors (from the first path) and, per path, seconds per question.
    """
    for path in paths:
        path.encode("warm-up")
    vectors: list[np.ndarray] = []
    seconds: list[list[float]] = [[] for _ in paths]
    for q in queries:
        for i, path in enumerate(paths):
            started = time.perf_counter()
            vector = path.encode(q.query)
            seconds[i].append(time.perf_counter() - started)
            if i == 0:
                vectors.append(vector)
    return np.stack(vectors), seconds


def measure(name: str, kind: str, search, size: int, truncated: int, queries: Sequence[LabelledQuery],
            vectors: np.ndarray, embed_s: Sequence[float]) -> Row:
    """Score ``search`` on each question alone and time it.

    ``search(question, vector) -> (passages, overlapped_s, after_s)``: the part of its time
    that runs while the question is embedded (BM25, as the service runs it) and the part
    after. A question's retrieval time is max(embed, overlapped) + after.
    """
    search(queries[0].query, vectors[0])  # warm-up
    hits, search_s, retrieval_s = [], [], []
    for query, vector, embed in zip(queries, vectors, embed_s):
        found, overlapped, after = search(query.query, vector)
        search_s.append(overlapped + after)
        retrieval_s.append(max(embed, overlapped) + after)
        hits.append(found)
    tail = [i for i, q in enumerate(queries) if q.tail]
    return Row(
        name, kind, size, truncated, score(queries, hits),
        score([queries[i] for i in tail], [hits[i] for i in tail]),
        search_s, retrieval_s,
    )


def searcher(index, hybrid: bool, rrf_k: float, candidates: int):
    """A timed search over ``index`` for :func:`measure`: vectors only, or hybrid (vectors + BM25)."""

    def search(query: str, vector: np.ndarray):
        started = time.perf_counter()
        lexical = index.lexical_search(query, DEPTH, candidates) if hybrid else None
        middle = time.perf_counter()
        if hybrid:
            hits = index.hybrid_search(query, vector, DEPTH, candidates, rrf_k, lexical)
        else:
            hits = index.search(vector, DEPTH)[0]
        return [h.passage for h in hits], middle - started, time.perf_counter() - middle

    return search


def _build(vectors: np.ndarray, passages, kind: str):
    import faiss

    from switchyard.retrieval.index import Manifest, VectorIndex

    manifest = Manifest(model="bench", dims=vectors.shape[1], count=len(passages))
    if kind == "flat":
        return VectorIndex.build(vectors, passages, manifest)
    hnsw = faiss.IndexHNSWFlat(vectors.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efSearch = HNSW_EF_SEARCH
    hnsw.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return VectorIndex(manifest, passages, hnsw)


def chunk_chars(docs: Sequence[Document], embedder, chars: int, overlap: int):
    """The old character chunking; returns passages, embedded texts and how many exceed the window."""
    length = token_length(embedder.tokenizer)
    special = embedder.tokenizer.num_special_tokens_to_add(pair=False)
    passages, texts = [], []
    for doc in docs:
        for passage in chunk_document(doc, chars, overlap):
            passages.append(passage)
            texts.append(embedding_text(passage, doc.heading or doc.title))
    truncated = sum(length(t) + special > embedder.window for t in texts)
    return passages, texts, truncated


def run(args: argparse.Namespace):
    """Measure every row the arguments ask for (progress on stderr).

    Returns rows, questions, and per embedding setting ("service", and "old" with the baseline) its
    torch threads and seconds per question.
    """
    from switchyard.retrieval.documents import pydoc_documents
    from switchyard.retrieval.embedder import load_embedder, set_threads
    from switchyard.retrieval.index import load_index
    from switchyard.retrieval.indexer import embed_passages
    from switchyard.retrieval.lexical import LexicalIndex

    config = load_config(args.config_dir)
    settings = config.retrieval
    rrf_k, candidates = settings.rrf_k, settings.hybrid_candidates
    try:
        queries = load_queries(args.queries)
    except OSError as exc:  # "[Errno 2] No such file or directory: '0'" named no flag
        raise ValueError(f"--queries {args.queries}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--queries {args.queries}: expected UTF-8 JSON lines ({exc})") from None
    embedder = load_embedder()
    if too_long := [size for size in args.chunk_tokens or () if size > embedder.window]:  # as switchyard index
        raise ValueError(f"--chunk-tokens {too_long[0]} is above the window of {embedder.name} ({embedder.window} "
                         f"word pieces): passages would be truncated; expected at most {embedder.window}")
    with tempfile.TemporaryDirectory(prefix="switchyard-encoder-") as scratch:
        service_path = _service_path(embedder, settings, args.index_dir, scratch)
        if args.index_dir or args.no_baseline:
            vectors, (embed_s,) = embed_queries([service_path], queries)
            old_embed_s = embed_s  # no old row to charge
        else:  # the old row as the service ran before: its chunking, torch on torch's default threads
            old_path = torch_path(embedder, OLD_EMBED_THREADS)
            vectors, (embed_s, old_embed_s) = embed_queries([service_path, old_path], queries)
    set_threads(0)  # passages are embedded in batches: every core
    rows: list[Row] = []
    if args.index_dir:
        index = load_index(args.index_dir)
        modes = [("flat vectors", False)] + ([("flat hybrid", True)] if index.lexical is not None else [])
        for kind, hybrid in modes:
            rows.append(measure("built index", kind, searcher(index, hybrid, rrf_k, candidates),
                                len(index), index.manifest.truncated, queries, vectors, embed_s))
        return rows, queries, {"service": (service_path.label, embed_s)}
    docs = pydoc_documents()
    variants = []
    if not args.no_baseline:
        passages, texts, truncated = chunk_chars(docs, embedder, *OLD_CHUNK)
        variants.append((f"chars {OLD_CHUNK[0]}/{OLD_CHUNK[1]} (old)", passages, texts, truncated, False))
    sizes = args.chunk_tokens or [settings.chunk_tokens]
    for size in sizes:
        overlap = min(settings.chunk_overlap_tokens, size // 2 - 1)
        chunked = chunk_for_model(docs, embedder.tokenizer, embedder.window, size, overlap)
        variants.append((f"tokens {size}/{overlap}", chunked.passages, chunked.texts, chunked.truncated,
                         size == sizes[0]))
    for name, passages, texts, truncated, full in variants:
        started = time.monotonic()
        passage_vectors = embed_passages(embedder, texts, settings.embed_batch_size, progress=False)
        print(f"{name}: embedded {len(texts)} passages in {time.monotonic() - started:.1f} s", file=sys.stderr)
        kinds = ["flat"] + (["hnsw"] if full and not args.no_hnsw else [])
        lexical = LexicalIndex.build(texts) if name.startswith("tokens") else None
        for kind in kinds:
            index = _build(passage_vectors, passages, kind)
            index.lexical = lexical
            row_embed_s = old_embed_s if name.endswith("(old)") else embed_s
            rows.append(measure(name, f"{kind} vectors", searcher(index, False, rrf_k, candidates), len(passages),
                                truncated, queries, vectors, row_embed_s))
            if lexical is None:
                continue
            for fusion_k in (args.rrf_k or [rrf_k]) if kind == "flat" else [rrf_k]:
                label = f"{kind} hybrid" + (f" k={fusion_k:g}" if args.rrf_k else "")
                rows.append(measure(name, label, searcher(index, True, fusion_k, candidates), len(passages),
                                    truncated, queries, vectors, embed_s))
    embed = {"service": (service_path.label, embed_s)}
    if not args.no_baseline:
        embed["old"] = (old_path.label, old_embed_s)
    return rows, queries, embed


def _service_path(embedder, settings, index_dir: str | None, scratch: str) -> QueryPath:
    """The service's query path (``retrieval.embed_backend``, ``embed_threads``): the encoder exported
    beside ``index_dir``, or one exported into ``scratch`` (the index folder is never written)."""
    from switchyard.retrieval.embedder import ONNX_FILE, OnnxEmbedder, export_onnx

    if settings.embed_backend == "torch":
        return torch_path(embedder, settings.embed_threads)
    folder = index_dir
    if folder is None or not (Path(folder) / ONNX_FILE).is_file():
        if folder is not None:
            print(f"{folder} has no {ONNX_FILE}: timing an encoder exported into a temporary folder "
                  f"(`switchyard index --encoder-only --out {folder}` adds it to the index)", file=sys.stderr)
        folder = scratch
        export_onnx(embedder, folder)
    return onnx_path(OnnxEmbedder(folder, settings.embed_threads), settings.embed_threads)


_WHO = {"service": "as the service runs it now", "old": "as the old row's service ran it"}


def report(rows: list[Row], queries: Sequence[LabelledQuery],
           embed_s: dict[str, tuple[str, Sequence[float]]]) -> str:
    """The table ``switchyard bench retrieval`` prints (times in milliseconds)."""
    tail = sum(q.tail for q in queries)
    lines = [
        f"retrieval quality: {len(queries)} labelled questions ({tail} tail) over CPython's documentation topics "
        f"(Python {platform.python_version()}), all-MiniLM-L6-v2, top {DEPTH} passages per question",
        *(
            f"query embedding, one query at a time, "
            f"{_WHO[who]} "
            f"({label}): p50 {_pct(seconds, 50) * 1e3:.1f} ms, p95 {_pct(seconds, 95) * 1e3:.1f} ms"
            for who, (label, seconds) in embed_s.items()
        ),
        "",
        f"{'chunking':<24}{'search':<18}{'passages':>9}{'truncated':>10}{'R@1':>7}{'R@5':>7}{'MRR@10':>8}"
        f"{'nDCG@10':>9}{'tail R@5':>9}{'search p50/p95 ms':>19}{'retrieval p95 ms':>17}",
    ]
    for r in rows:
        lines.append(
            f"{r.name:<24}{r.index:<18}{r.passages:>9}{r.truncated:>10}{r.scores.recall_at_1:>7.3f}"
            f"{r.scores.recall_at_5:>7.3f}{r.scores.mrr_at_10:>8.3f}{r.scores.ndcg_at_10:>9.3f}"
            f"{r.tail.recall_at_5:>9.3f}"
            f"{f'{_pct(r.search_s, 50) * 1e3:.3f}/{_pct(r.search_s, 95) * 1e3:.3f}':>19}"
            f"{_pct(r.retrieval_s, 95) * 1e3:>17.2f}"
        )
    old = next((r for r in rows if r.name.endswith("(old)")), None)
    lines.append("")
    for new in [r for r in rows if r.name.startswith("tokens") and r.index.startswith("flat")][:2] if old else []:
        lines += [(
            f"{new.name} {new.index} vs {old.name} {old.index}: "
            f"recall@5 {new.scores.recall_at_5 - old.scores.recall_at_5:+.3f}, "
            f"MRR@10 {new.scores.mrr_at_10 - old.scores.mrr_at_10:+.3f}, "
            f"nDCG@10 {new.scores.ndcg_at_10 - old.scores.ndcg_at_10:+.3f}, "
            f"tail recall@5 {new.tail.recall_at_5 - old.tail.recall_at_5:+.3f}; "
            f"truncated passages {old.truncated} -> {new.truncated}"
        )]
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 16 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected comma-separated word-piece counts >= 16, e.g. 128,256; got {text!r}")
    return sizes


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v < math.inf for v in values):  # nan passed `<= 0`
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, e.g. 10,60; got {text!r}")
    return values


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard bench retrieval``: 0, or 2 on a bad config, query set or index."""
    parser = argparse.ArgumentParser(
        prog="switchyard bench retrieval",
        description="Retrieval quality (recall@1, recall@5, MRR@10, nDCG@10 on the labelled CPython-docs "
        "questions) and time per query: the old character chunking against token-aware chunking, and exact "
        "(flat) against approximate (HNSW) FAISS search.",
    )
    parser.add_argument("--config-dir", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--queries", metavar="FILE", help="labelled query set, JSON lines (default: the shipped set)")
    parser.add_argument("--chunk-tokens", type=_sizes, metavar="N[,N...]",
                        help="token chunk sizes to compare (default: retrieval.chunk_tokens)")
    parser.add_argument("--rrf-k", type=_floats, metavar="K[,K...]",
                        help="fusion constants to compare for hybrid search (default: retrieval.rrf_k)")
    parser.add_argument("--index-dir", metavar="DIR", help="score this built index only (no chunking, no embedding)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the old character chunking")
    parser.add_argument("--no-hnsw", action="store_true", help="skip the approximate index")
    args = parser.parse_args(argv)
    from switchyard.retrieval.index import IndexMismatchError, IndexNotFoundError

    try:
        rows, queries, embed_s = run(args)
    except (ConfigError, ValueError, OSError, IndexNotFoundError, IndexMismatchError) as exc:
        print(f"switchyard bench retrieval: {exc}", file=sys.stderr)
        return 2
    if args.index_dir:
        print(f"built index: {args.index_dir}")
    print(report(rows, queries, embed_s))
    return 0
