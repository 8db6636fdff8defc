"""``switchyard index [PATHS] [--out DIR] [--config-dir DIR]``: build the vector index.

With no PATHS it indexes CPython's documentation topics (``pydoc_data.topics``);
otherwise the given text, Markdown or rst files and folders. Documents are
chunked by the embedding model's own tokenizer (``retrieval.chunk_tokens``,
``retrieval.chunk_overlap_tokens``) so that no passage exceeds the model's
window, embedded with all-MiniLM-L6-v2 and saved as a FAISS index (see
:mod:`switchyard.retrieval.index`), with a BM25 index of the same passages when
``retrieval.hybrid`` is on, in ``retrieval.index_dir`` unless ``--out`` says
otherwise. The summary line says how many passages were made and how many
were truncated (0 unless the window is smaller than ``chunk_tokens``).

Progress: a bar on a terminal; otherwise (a log file, a pipe) a plain line
every :data:`LOG_EVERY_S` seconds, so logs hold no control characters.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence, TextIO

import numpy as np
from tqdm import tqdm

from switchyard.common import outputs
from switchyard.common.config import ConfigError, SwitchyardConfig, load_config
from switchyard.retrieval.chunking import Chunked, Document, chunk_for_model
from switchyard.retrieval.documents import path_documents, pydoc_documents
from switchyard.retrieval.embedder import ONNX_FILE, Embedder, export_onnx, load_embedder, set_threads
from switchyard.retrieval.index import DEFAULT_CORPUS, MANIFEST_FILE, Manifest, VectorIndex
from switchyard.retrieval.lexical import LexicalIndex

ENCODE_SLICE = 64
"""Passages per encode call (one progress step)."""
LOG_EVERY_S = 10.0
"""Seconds between plain progress lines when stderr is not a terminal."""


class _Progress:
    """A tqdm bar on a terminal; elsewhere ``embedding: N/M passages`` lines at most every LOG_EVERY_S seconds."""

    def __init__(self, total: int, enabled: bool, stream: TextIO) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.terminal = enabled and stream.isatty()
        self.plain = enabled and not self.terminal
        self.bar = tqdm(total=total, unit="passage", desc="embedding", file=stream, disable=not self.terminal)
        self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.monotonic()
        if self.plain and (now - self.last >= LOG_EVERY_S or self.done == self.total):
            self.last = now
            print(f"embedding: {self.done}/{self.total} passages", file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()


def embed_passages(
    embedder: Embedder,
    texts: Sequence[str],
    batch_size: int,
    progress: bool = True,
    stream: TextIO | None = None,
) -> np.ndarray:
    """Embed ``texts`` in slices, shortest first (less padding), reporting progress on ``stream``.

    Args:
        progress: report progress: a tqdm bar when ``stream`` is a terminal, else a plain
            line every :data:`LOG_EVERY_S` seconds and one at the end.
        stream: where progress goes (default ``sys.stderr``).

    Returns:
        (len(texts), dims) float32 normalized vectors, in the order of ``texts``.
    """
    order = np.argsort([len(t) for t in texts], kind="stable")
    vectors = np.zeros((len(texts), embedder.dims), dtype=np.float32)
    bar = _Progress(len(texts), progress, stream or sys.stderr)
    try:
        for start in range(0, len(texts), ENCODE_SLICE):
            ids = order[start : start + ENCODE_SLICE]
            vectors[ids] = embedder.encode([texts[i] for i in ids], batch_size=batch_size)
            bar.update(len(ids))
    finally:
        bar.close()
    return vectors


def chunk_corpus(docs: Sequence[Document], embedder: Embedder, config: SwitchyardConfig) -> Chunked:
    """Chunk ``docs`` for ``embedder`` with ``retrieval.chunk_tokens`` / ``chunk_overlap_tokens``.

    Raises:
        ValueError: ``chunk_tokens`` is above the model's window (names the key, the value and the window).
    """
    settings = config.retrieval
    if settings.chunk_tokens > embedder.window:
        raise ValueError(
            f"retrieval.chunk_tokens={settings.chunk_tokens} is above the window of {embedder.name} "
            f"({embedder.window} word pieces): passages would be truncated; expected at most {embedder.window}"
        )
    return chunk_for_model(docs, embedder.tokenizer, embedder.window, settings.chunk_tokens,
                           settings.chunk_overlap_tokens)


def build_index(
    paths: list[str],
    out_dir: str | Path,
    config: SwitchyardConfig,
    progress: bool = True,
    embedder: Embedder | None = None,
    stream: TextIO | None = None,
) -> Manifest:
    """Chunk, embed and save documents as an index in ``out_dir``.

    Args:
        paths: files or folders to index; empty = CPython's documentation topics.
        out_dir: index folder (created; existing index files are replaced).
        config: chunk sizes and embed batch size come from ``retrieval``.
        progress: report embedding progress on ``stream`` (a bar on a terminal, else plain lines).
        embedder: the model to use; default :func:`load_embedder`.
        stream: where progress goes (default ``sys.stderr``).

    Returns:
        The manifest written (model, dims, passage count, documents, window, longest
        passage and truncated passages, in word pieces).

    Raises:
        FileNotFoundError: a path does not exist.
        OSError: a file cannot be read.
        ValueError: a file is binary (a NUL byte), the paths hold no text to index, or ``retrieval.chunk_tokens``
            exceeds the model's window.
    """
    settings = config.retrieval
    docs = path_documents(paths) if paths else pydoc_documents()
    set_threads(0)  # an offline job: every core (retrieval.embed_threads is the service's query path)
    embedder = embedder or load_embedder()
    chunked = chunk_corpus(docs, embedder, config)
    if not chunked.passages:
        raise ValueError(f"nothing to index in {', '.join(map(str, paths))}: no non-empty text files found")
    vectors = embed_passages(embedder, chunked.texts, settings.embed_batch_size, progress, stream)
    manifest = Manifest(
        model=embedder.name,
        dims=embedder.dims,
        count=len(chunked.passages),
        chunk_tokens=settings.chunk_tokens,
        chunk_overlap_tokens=settings.chunk_overlap_tokens,
        window_tokens=chunked.window,
        longest_tokens=chunked.longest,
        truncated=chunked.truncated,
        documents=len(docs),
        corpus="files" if paths else DEFAULT_CORPUS,
    )
    index = VectorIndex.build(vectors, chunked.passages, manifest)
    if settings.hybrid:
        index.lexical = LexicalIndex.build(chunked.texts)
    index.save(out_dir)
    export_onnx(embedder, out_dir)  # the service's query encoder (retrieval.embed_backend "onnxruntime")
    return index.manifest


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard index``; returns the exit status (0 ok, 2 bad input)."""
    parser = argparse.ArgumentParser(
        prog="switchyard index",
        description="Build the retrieval index. With no PATHS, index CPython's documentation topics (pydoc_data).",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH", help="text, Markdown or rst files, or folders of them")
    parser.add_argument("--out", metavar="DIR", help="index folder (default: retrieval.index_dir of the config)")
    parser.add_argument("--config-dir", metavar="DIR", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress report (by default: a bar on a terminal, plain lines otherwise)")
    parser.add_argument("--encoder-only", action="store_true",
                        help="only export the query encoder into the index already in --out (an index built "
                        "before the export existed), leaving its passages as they are")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config_dir, service="retrieval")
    except ConfigError as exc:
        print(f"switchyard index: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or config.retrieval.index_dir)
    started = time.monotonic()
    if args.encoder_only:
        return _export_encoder_only(out, args.paths, started)
    if problem := _unwritable_folder(out):  # found now, not after minutes of embedding
        print(f"switchyard index: --out: expected a folder this user can make or write, got '{out}' ({problem})",
              file=sys.stderr)
        return 2
    try:
        manifest = build_index(args.paths, out, config, progress=not args.no_progress)
    except (OSError, ValueError) as exc:  # a path missing or unreadable, a binary file, no text at all
        print(f"switchyard index: {exc}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    print(
        f"indexed {manifest.count} passages from {manifest.documents} documents "
        f"({manifest.dims} dims, {manifest.model}) into {out} in {elapsed:.1f} s"
    )
    if manifest.lexical:
        print(f"lexical index: {manifest.lexical} over the same passages (retrieval.hybrid)")
    print(
        f"passages truncated: {manifest.truncated} (window {manifest.window_tokens} word pieces, "
        f"longest passage {manifest.longest_tokens}, chunk_tokens {manifest.chunk_tokens}, "
        f"overlap {manifest.chunk_overlap_tokens})"
    )
    print(f"query encoder: {ONNX_FILE} (ONNX Runtime, retrieval.embed_backend) beside the index")
    return 0


def _unwritable_folder(out: Path) -> str:
    """Why the index cannot be written into the folder ``out``; "" when it can (the folder is made now)."""
    if problem := outputs.unwritable(out / MANIFEST_FILE):
        return problem
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def _export_encoder_only(out: Path, paths: list[str], started: float) -> int:
    """``switchyard index --encoder-only``: the query encoder into the index in ``out``; 0, or 2 on bad input."""
    from switchyard.retrieval.index import IndexMismatchError, IndexNotFoundError, load_index

    if paths:
        print("switchyard index: --encoder-only takes no PATHS: it leaves the index's passages as they are",
              file=sys.stderr)
        return 2
    try:
        manifest = load_index(out).manifest
    except (IndexNotFoundError, IndexMismatchError) as exc:
        print(f"switchyard index: {exc}", file=sys.stderr)
        return 2
    if problem := outputs.unwritable(out / ONNX_FILE):
        print(f"switchyard index: --out: expected a folder this user can write, got '{out}' ({problem})",
              file=sys.stderr)
        return 2
    embedder = load_embedder()
    if manifest.model != embedder.name:
        print(f"switchyard index: the index in {out} was built with {manifest.model}, not {embedder.name}; "
              "rebuild it with `switchyard index`", file=sys.stderr)
        return 2
    export_onnx(embedder, out)
    print(f"query encoder: {ONNX_FILE} exported into {out} in {time.monotonic() - started:.1f} s "
          f"({manifest.count} passages left as they are)")
    return 0
