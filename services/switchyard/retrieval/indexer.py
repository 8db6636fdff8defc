"""``switchyard index [PATHS] [--out DIR] [--config-dir DIR]``: build the vector index.

With no PATHS it indexes CPython's documentation topics (``pydoc_data.topics``);
otherwise the given text, Markdown or rst files and folders. Documents are
chunked (``retrieval.chunk_chars``, ``retrieval.chunk_overlap_chars``), embedded
with all-MiniLM-L6-v2 and saved as a FAISS index (see
:mod:`switchyard.retrieval.index`) in ``retrieval.index_dir`` unless ``--out``
says otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from switchyard.common.config import ConfigError, SwitchyardConfig, load_config
from switchyard.retrieval.chunking import chunk_document, embedding_text
from switchyard.retrieval.documents import path_documents, pydoc_documents
from switchyard.retrieval.embedder import Embedder, load_embedder, set_threads
from switchyard.retrieval.index import Manifest, Passage, VectorIndex

ENCODE_SLICE = 64
"""Passages per encode call (one progress-bar step)."""


def embed_passages(
    embedder: Embedder, texts: Sequence[str], batch_size: int, progress: bool = True
) -> np.ndarray:
    """Embed ``texts`` in slices, shortest first (less padding), with a tqdm bar.

    Returns:
        (len(texts), dims) float32 normalized vectors, in the order of ``texts``.
    """
    order = np.argsort([len(t) for t in texts], kind="stable")
    vectors = np.zeros((len(texts), embedder.dims), dtype=np.float32)
    with tqdm(total=len(texts), unit="passage", desc="embedding", disable=not progress) as bar:
        for start in range(0, len(texts), ENCODE_SLICE):
            ids = order[start : start + ENCODE_SLICE]
            vectors[ids] = embedder.encode([texts[i] for i in ids], batch_size=batch_size)
            bar.update(len(ids))
    return vectors


def build_index(
    paths: list[str],
    out_dir: str | Path,
    config: SwitchyardConfig,
    progress: bool = True,
    embedder: Embedder | None = None,
) -> Manifest:
    """Chunk, embed and save documents as an index in ``out_dir``.

    Args:
        paths: files or folders to index; empty = CPython's documentation topics.
        out_dir: index folder (created; existing index files are replaced).
        config: chunk sizes and embed batch size come from ``service.retrieval``.
        progress: show a tqdm progress bar on stderr.
        embedder: the model to use; default :func:`load_embedder`.

    Returns:
        The manifest written (model, dims, passage count, documents).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: the paths hold no text to index.
    """
    settings = config.service.retrieval
    docs = path_documents(paths) if paths else pydoc_documents()
    passages: list[Passage] = []
    texts: list[str] = []
    for doc in docs:
        for passage in chunk_document(doc, settings.chunk_chars, settings.chunk_overlap_chars):
            passages.append(passage)
            texts.append(embedding_text(passage, doc.heading or doc.title))
    if not passages:
        raise ValueError(f"nothing to index in {', '.join(map(str, paths))}: no non-empty text files found")
    set_threads(settings.embed_threads)
    embedder = embedder or load_embedder()
    vectors = embed_passages(embedder, texts, settings.embed_batch_size, progress)
    manifest = Manifest(
        model=embedder.name,
        dims=embedder.dims,
        count=len(passages),
        chunk_chars=settings.chunk_chars,
        chunk_overlap_chars=settings.chunk_overlap_chars,
        documents=len(docs),
    )
    index = VectorIndex.build(vectors, passages, manifest)
    index.save(out_dir)
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config_dir)
    except ConfigError as exc:
        print(f"switchyard index: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or config.service.retrieval.index_dir)
    started = time.monotonic()
    try:
        manifest = build_index(args.paths, out, config, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as exc:
        print(f"switchyard index: {exc}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    print(
        f"indexed {manifest.count} passages from {manifest.documents} documents "
        f"({manifest.dims} dims, {manifest.model}) into {out} in {elapsed:.1f} s"
    )
    return 0
