"""Lexical search: BM25 over the passages, for hybrid retrieval with the vector index.

A small sentence-embedding model misses questions that hinge on one exact
term (``__slots__``, ``removeprefix``, ``0x``); BM25 finds those and misses
paraphrases, which the embeddings find. :func:`fuse` merges the two rankings
by reciprocal rank fusion.

BM25 is ``bm25s`` (Lù, 2024; the Lucene variant of Robertson et al.'s BM25,
k1 = 1.5, b = 0.75) over words lower-cased, without bm25s's English stop
words, and stemmed with the Snowball English stemmer (PyStemmer). Keeping
stop words, or keeping Python's keywords (``with``, ``in``, ``is``) out of
the stop list, measured no better on the labelled questions (see
docs/benchmarks.md).

On disk it is the ``bm25/`` folder of an index (bm25s's own files).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable, Sequence

FOLDER = "bm25"
"""Sub-folder of an index folder that holds the BM25 index."""


def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


class LexicalIndex:
    """BM25 over passage texts, searchable by a question's words.

    Build with :meth:`build` or :meth:`load`; ``search`` is thread-safe.
    """

    def __init__(self, retriever, count: int) -> None:
        self._retriever = retriever
        self._stemmer = _stemmer()
        self._lock = threading.Lock()  # PyStemmer's stemmer object is not thread-safe
        self.count = count

    def __len__(self) -> int:
        return self.count

    def _tokens(self, texts: Sequence[str]) -> list[list[str]]:
        import bm25s

        with self._lock:
            return bm25s.tokenize(list(texts), lower=True, stopwords="en", stemmer=self._stemmer,
                                  return_ids=False, show_progress=False)

    @classmethod
    def build(cls, texts: Sequence[str]) -> "LexicalIndex":
        """Index ``texts`` (one per passage, in index order).

        Raises:
            ValueError: ``texts`` is empty.
        """
        import bm25s

        if not texts:
            raise ValueError("no passages to index")
        retriever = bm25s.BM25()
        index = cls(retriever, len(texts))
        retriever.index(index._tokens(texts), show_progress=False)
        return index

    def save(self, folder: str | Path) -> Path:
        """Write the BM25 files into ``folder``/bm25 (created)."""
        out = Path(folder) / FOLDER
        out.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(out))
        return out

    @classmethod
    def load(cls, folder: str | Path, count: int) -> "LexicalIndex | None":
        """The BM25 index in ``folder``/bm25, or None when the folder has none."""
        import bm25s

        path = Path(folder) / FOLDER
        if not (path / "params.index.json").is_file():
            return None
        return cls(bm25s.BM25.load(str(path)), count)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Up to ``k`` (passage id, BM25 score) pairs, best first; passages sharing no term are left out."""
        k = min(k, self.count)
        tokens = self._tokens([query])
        if k <= 0 or not tokens[0]:
            return []
        ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]


def fuse(rankings: Iterable[Sequence[int]], k: int, rrf_k: float) -> list[int]:
    """Reciprocal rank fusion: the ``k`` ids with the highest sum of 1 / (rrf_k + rank) over ``rankings``.

    Rank is 1-based; an id missing from a ranking adds nothing for it. Ties keep
    the order of first appearance. Source: Cormack, Clarke and Büttcher, "Reciprocal
    rank fusion outperforms Condorcet and individual rank learning methods",
    SIGIR 2009 (rrf_k = 60 there).
    """
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, 1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (rrf_k + rank)
    order = sorted(scores, key=lambda d: -scores[d])  # stable: first appearance breaks ties
    return order[:k]

