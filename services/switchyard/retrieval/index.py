"""The vector index on disk: FAISS inner-product search over normalized vectors.

An index folder holds three files:

- ``index.faiss``: a ``faiss.IndexFlatIP`` (exact search); with L2-normalized
  vectors the inner product is the cosine similarity.
- ``passages.jsonl``: one JSON object per vector, in index order:
  ``{"text": ..., "title": ..., "source": ...}``.
- ``bm25/``: the BM25 index of the same passages (:mod:`switchyard.retrieval.lexical`),
  when the manifest's ``lexical`` is ``"bm25"``;
- ``manifest.json``: model name, dims, passage count and chunking settings,
  written last, so a folder with a manifest is complete.

:meth:`VectorIndex.hybrid_search` fuses the vector ranking with the BM25
ranking (reciprocal rank fusion); :meth:`VectorIndex.search` is vectors only.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import faiss
import grpc
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from switchyard.common import untrusted
from switchyard.common.errors import SwitchyardError
from switchyard.retrieval.lexical import LexicalIndex, fuse

INDEX_FILE = "index.faiss"
PASSAGES_FILE = "passages.jsonl"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class IndexNotFoundError(SwitchyardError):
    """No complete index in the folder (FAILED_PRECONDITION at start-up)."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, folder: Path, missing: Sequence[str]) -> None:
        super().__init__(
            f"no vector index in {folder} (missing {', '.join(missing)}); "
            "run `switchyard index` to build it (or set SWITCHYARD_INDEX_DIR / retrieval.index_dir)"
        )


class IndexMismatchError(SwitchyardError):
    """The index on disk does not fit the embedding model or is inconsistent."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class Passage:
    """One chunk of a document: its text, the document's title and where it came from."""

    text: str
    title: str
    source: str


@dataclass(frozen=True)
class Hit:
    """A search result: the passage and its cosine similarity (-1..1)."""

    passage: Passage
    score: float


DEFAULT_CORPUS = "pydoc_topics"
"""``Manifest.corpus`` of the default index: CPython's documentation topics (``pydoc_data``)."""


class Manifest(BaseModel):
    """What an index folder holds; ``manifest.json``."""

    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())

    format_version: int = FORMAT_VERSION
    model: str = Field(description="Embedding model id, e.g. sentence-transformers/all-MiniLM-L6-v2.")
    dims: int = Field(ge=1, description="Vector width.")
    count: int = Field(ge=0, description="Passages (= vectors) in the index.")
    metric: str = "cosine"
    chunk_tokens: int = Field(0, ge=0, description="retrieval.chunk_tokens used to build it (0 = unknown).")
    chunk_overlap_tokens: int = Field(0, ge=0, description="retrieval.chunk_overlap_tokens used to build it.")
    window_tokens: int = Field(0, ge=0, description="The embedding model's input window in word pieces.")
    longest_tokens: int = Field(0, ge=0, description="Word pieces of the longest embedded passage, specials included.")
    truncated: int = Field(0, ge=0, description="Passages longer than the window (tails not embedded).")
    lexical: str = Field("", description='"bm25" when the folder holds a BM25 index of the passages, else "".')
    documents: int = Field(0, ge=0, description="Source documents the passages came from.")
    corpus: str = Field("", description=f'"{DEFAULT_CORPUS}" when built from CPython\'s documentation topics (no '
                        'PATHS given), "files" from the files named, "" when not recorded (an older index).')
    created_at: str = ""


class VectorIndex:
    """Passages with their vectors, searchable by cosine similarity.

    Args:
        manifest: what the index holds.
        passages: one per vector, in index order.
        index: a FAISS inner-product index of ``manifest.dims`` with ``len(passages)`` vectors.

    Raises:
        IndexMismatchError: counts or dims disagree.
    """

    def __init__(
        self, manifest: Manifest, passages: list[Passage], index: faiss.Index, lexical: "LexicalIndex | None" = None
    ) -> None:
        if index.ntotal != len(passages) or manifest.count != len(passages):
            raise IndexMismatchError(
                f"index holds {index.ntotal} vectors, {len(passages)} passages and a manifest count "
                f"of {manifest.count}; rebuild it with `switchyard index`"
            )
        if index.d != manifest.dims:
            raise IndexMismatchError(f"index vectors have {index.d} dims, manifest says {manifest.dims}; rebuild it "
                                     "with `switchyard index`")
        if lexical is not None and len(lexical) != len(passages):
            raise IndexMismatchError(f"BM25 index holds {len(lexical)} passages, the vector index {len(passages)}; "
                                     "rebuild it with `switchyard index`")
        self.manifest = manifest
        self.passages = passages
        self.index = index
        self.lexical = lexical

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def build(cls, vectors: np.ndarray, passages: list[Passage], manifest: Manifest) -> "VectorIndex":
        """Build an exact inner-product index from (n, dims) float32 normalized ``vectors``."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(passages):
            raise IndexMismatchError(f"expected ({len(passages)}, dims) vectors, got shape {vectors.shape}")
        index = faiss.IndexFlatIP(vectors.shape[1])
        if len(vectors):
            index.add(vectors)
        return cls(manifest, passages, index)

    def search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        """The ``k`` passages most similar to each query, best first.

        Args:
            queries: (dims,) or (n, dims) float32, L2-normalized.
            k: results per query; fewer come back when the index is smaller.

        Returns:
            n lists of up to ``k`` hits.
        """
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.manifest.dims:
            raise IndexMismatchError(f"query vectors have {queries.shape[1]} dims, index has {self.manifest.dims}")
        k = min(k, len(self.passages))
        if k <= 0:
            return [[] for _ in range(len(queries))]
        scores, ids = self.index.search(queries, k)
        return [
            [Hit(self.passages[i], float(s)) for s, i in zip(row_scores, row_ids) if i >= 0]
            for row_scores, row_ids in zip(scores, ids)
        ]

    def hybrid_search(
        self,
        query: str,
        vector: np.ndarray,
        k: int,
        candidates: int,
        rrf_k: float,
        lexical_ids: Sequence[int] | None = None,
    ) -> list[Hit]:
        """The ``k`` best passages for one question by vectors and BM25 together, best first.

        Each ranking contributes its top ``candidates`` passages; they are merged by
        reciprocal rank fusion (:func:`switchyard.retrieval.lexical.fuse`). Without a
        BM25 index this is :meth:`search`. Every hit's score is its cosine similarity.

        Args:
            query: the question's text (for BM25).
            vector: its (dims,) float32 L2-normalized embedding.
            k: results wanted; fewer come back when the index is smaller.
            candidates: passages taken from each ranking, >= k.
            rrf_k: the fusion constant (``retrieval.rrf_k``).
            lexical_ids: the BM25 ranking if already computed (:meth:`lexical_search`, which
                needs no vector and so can run while the question is embedded).
        """
        if self.lexical is None:
            return self.search(vector, k)[0]
        query_vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        if query_vector.shape[0] != self.manifest.dims:
            raise IndexMismatchError(f"query vectors have {query_vector.shape[0]} dims, index has {self.manifest.dims}")
        n = min(max(candidates, k), len(self.passages))
        if n <= 0:
            return []
        scores, ids = self.index.search(query_vector.reshape(1, -1), n)
        cosine = {int(i): float(s) for s, i in zip(scores[0], ids[0]) if i >= 0}
        if lexical_ids is None:
            lexical_ids = self.lexical_search(query, k, candidates)
        hits = []
        for i in fuse([list(cosine), lexical_ids], k, rrf_k):
            score = cosine[i] if i in cosine else float(self.index.reconstruct(i) @ query_vector)
            hits.append(Hit(self.passages[i], score))
        return hits

    def lexical_search(self, query: str, k: int, candidates: int) -> list[int]:
        """Passage ids ranked by BM25 for ``query`` (the BM25 half of :meth:`hybrid_search`); [] without BM25."""
        if self.lexical is None:
            return []
        return [i for i, _ in self.lexical.search(query, min(max(candidates, k), len(self.passages)))]

    def save(self, folder: str | Path) -> Path:
        """Write the index files (and ``bm25/`` when there is a BM25 index) into ``folder``; the manifest goes last.

        Each file is written to a temporary name and renamed, so a reader never
        sees a half-written file; a stale ``bm25/`` left by an earlier build is
        ignored unless the new manifest lists it.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(out / INDEX_FILE, lambda p: faiss.write_index(self.index, str(p)))
        _write_atomic(
            out / PASSAGES_FILE,
            lambda p: p.write_text(
                "".join(json.dumps(asdict(x), ensure_ascii=False) + "\n" for x in self.passages), encoding="utf-8"
            ),
        )
        if self.lexical is not None:
            self.lexical.save(out)
        manifest = self.manifest.model_copy(update={"lexical": "bm25" if self.lexical is not None else ""})
        if not manifest.created_at:
            manifest = manifest.model_copy(update={"created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        self.manifest = manifest
        _write_atomic(out / MANIFEST_FILE, lambda p: p.write_text(manifest.model_dump_json(indent=2), encoding="utf-8"))
        return out


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_PASSAGE_KEYS = frozenset(("text", "title", "source"))
"""The keys of a line of ``passages.jsonl`` (:class:`Passage`'s fields)."""


def _read_passages(path: Path) -> list[Passage]:
    """The passages of ``path`` (``passages.jsonl``), one JSON object a line.

    Raises:
        IndexMismatchError: naming the file and the line that is not a passage, or why the file cannot be read
            (a line that was not JSON failed the start with 'Expecting value: line 2 column 1 (char 6)', naming
            neither the file nor its line).
    """
    passages = []
    try:
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    fields = untrusted.loads(line.rstrip("\n"))
                    if not isinstance(fields, dict) or set(fields) != _PASSAGE_KEYS:
                        raise ValueError(f"got {untrusted.shown(line.strip(), 80)}")
                    if not all(isinstance(value, str) for value in fields.values()):
                        raise ValueError("a value is not a string")
                except ValueError as exc:
                    raise IndexMismatchError(
                        f"{path}: line {number}: expected a JSON object of text, title and source, strings ({exc}); "
                        "rebuild the index with `switchyard index`") from None
                passages.append(Passage(**fields))
    except UnicodeDecodeError as exc:
        raise IndexMismatchError(f"{path}: not UTF-8 text ({exc}); rebuild the index with `switchyard index`") from None
    except OSError as exc:
        raise _unreadable(path, exc) from None
    return passages


def _unreadable(path: Path, exc: OSError) -> IndexMismatchError:
    return IndexMismatchError(f"{path}: cannot be read ({exc.strerror or exc}); expected a file of the index "
                              "`switchyard index` writes")


def load_index(folder: str | Path) -> VectorIndex:
    """Read an index folder written by :meth:`VectorIndex.save`.

    Raises:
        IndexNotFoundError: the folder or one of its files is missing.
        IndexMismatchError: the files disagree with each other, or one cannot be read as what it should hold
            (naming it, and the line of ``passages.jsonl``).
    """
    root = Path(folder)
    missing = [name for name in (MANIFEST_FILE, INDEX_FILE, PASSAGES_FILE) if not (root / name).is_file()]
    if missing:
        raise IndexNotFoundError(root, missing)
    try:
        manifest = Manifest.model_validate_json((root / MANIFEST_FILE).read_text(encoding="utf-8"))
    except ValidationError as exc:  # one line, the first problem: pydantic's own dump ends in a link to its docs
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise IndexMismatchError(f"{root / MANIFEST_FILE}: not a valid manifest ({where + ': ' if where else ''}"
                                 f"{first['msg']}); rebuild the index with `switchyard index`") from None
    except ValueError as exc:
        raise IndexMismatchError(f"{root / MANIFEST_FILE}: not a valid manifest ({exc}); rebuild the index with "
                                 "`switchyard index`") from None
    except OSError as exc:
        raise _unreadable(root / MANIFEST_FILE, exc) from None
    passages = _read_passages(root / PASSAGES_FILE)
    try:
        index = faiss.read_index(str(root / INDEX_FILE))
    except RuntimeError as exc:  # faiss's C++ exception: a file cut short, or not an index
        reason = str(exc).splitlines()[0].rpartition("Error: ")[2] or str(exc).splitlines()[0]
        raise IndexMismatchError(f"{root / INDEX_FILE}: not a FAISS index faiss can read ({reason[:200]}); rebuild "
                                 "it with `switchyard index`") from None
    lexical = None
    if manifest.lexical == "bm25":
        try:
            lexical = LexicalIndex.load(root, len(passages))
        except (OSError, ValueError) as exc:
            raise IndexMismatchError(f"{root / 'bm25'}: not a BM25 index bm25s can read ({exc}); rebuild it with "
                                     "`switchyard index`") from None
        if lexical is None:
            raise IndexMismatchError(f"{root}: the manifest lists a BM25 index but {root / 'bm25'} is missing; "
                                     "rebuild it with `switchyard index`")
    try:
        return VectorIndex(manifest, passages, index, lexical)
    except IndexMismatchError as exc:  # the files disagree: the folder they are in
        raise IndexMismatchError(f"{root}: {exc}") from None
