"""Retrieval quality: the labelled query set and the BEIR/MTEB ranking metrics.

The query set (``data/pydoc_queries.jsonl``, one JSON object per line) holds
questions written for this project over CPython's documentation topics, the
corpus ``switchyard index`` builds by default::

    {"id": "q001", "query": "...", "evidence": "...", "topics": ["with", "compound"], "tail": false}

- ``evidence``: a verbatim phrase of the answer (compared with runs of
  whitespace made single spaces). A passage answers the question when it comes
  from one of ``topics`` and contains the phrase.
- ``topics``: every topic whose text holds the phrase (topics repeat each
  other: ``compound`` contains ``with``, ``if`` and ``else`` are the same text).
- ``tail``: the phrase lies only past the first 256 word pieces of the
  passages that held it under the old character chunking (900 characters, 100
  overlap), so the model never saw it.

Each question has one answer, which may be found in several passages (topics
that repeat each other, overlap between passages): answering passages count as
one relevant document, at the rank of the first of them. With that, the metrics
are those of BEIR (Thakur et al., 2021, computed with trec_eval) as MTEB
reports them, with binary relevance:

- recall@k: relevant documents in the top k / relevant documents;
- MRR@k: 1 / rank of the first relevant document in the top k, else 0;
- nDCG@k: sum over the top k of rel_i / log2(i + 1), divided by the same sum
  for the ideal ranking.

Each is averaged over the questions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

from switchyard.retrieval.index import Passage

QUERIES_FILE = Path(__file__).resolve().parent / "data" / "pydoc_queries.jsonl"
"""The labelled query set shipped with the package."""


def normalize(text: str) -> str:
    """``text`` with every run of whitespace made one space (how evidence is matched)."""
    return " ".join(text.split())


@dataclass(frozen=True)
class LabelledQuery:
    """One question of the set (see the module docstring for the fields)."""

    id: str
    query: str
    evidence: str
    topics: tuple[str, ...]
    tail: bool = False

    def answers(self, passage: Passage) -> bool:
        """Whether ``passage`` (title = topic name) holds the answer."""
        return passage.title in self.topics and self.evidence in normalize(passage.text)


def load_queries(path: str | Path | None = None) -> list[LabelledQuery]:
    """Read a query set (JSON lines; default :data:`QUERIES_FILE`).

    Raises:
        ValueError: a line is not JSON or lacks a field; the message names the file, line and field.
        OSError: the file cannot be read.
    """
    source = Path(path) if path is not None else QUERIES_FILE
    queries: list[LabelledQuery] = []
    seen: set[str] = set()
    for number, line in enumerate(source.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object")
        for field, kind in (("id", str), ("query", str), ("evidence", str), ("topics", list)):
            if not isinstance(item.get(field), kind) or not item[field]:
                raise ValueError(f"{where}: field {field!r} must be a non-empty {kind.__name__}")
        if not all(isinstance(t, str) and t for t in item["topics"]):
            raise ValueError(f"{where}: field 'topics' must list topic names (strings)")
        if item["id"] in seen:
            raise ValueError(f"{where}: field 'id' repeats {item['id']!r}")
        seen.add(item["id"])
        queries.append(LabelledQuery(item["id"], item["query"], normalize(item["evidence"]),
                                     tuple(item["topics"]), bool(item.get("tail", False))))
    if not queries:
        raise ValueError(f"{source}: no questions")
    return queries


def recall_at_k(ranked: Sequence[Hashable], relevant: set[Hashable], k: int) -> float:
    """BEIR recall@k: the share of ``relevant`` found in the first ``k`` of ``ranked``."""
    return len(set(ranked[:k]) & relevant) / len(relevant) if relevant else 0.0


def mrr_at_k(ranked: Sequence[Hashable], relevant: set[Hashable], k: int) -> float:
    """MRR@k: 1 / (1-based) rank of the first relevant document in the first ``k``, else 0."""
    return next((1.0 / rank for rank, doc in enumerate(ranked[:k], 1) if doc in relevant), 0.0)


def ndcg_at_k(ranked: Sequence[Hashable], relevant: set[Hashable], k: int) -> float:
    """nDCG@k with binary gains: DCG = sum of 1 / log2(rank + 1) over relevant ranks <= k, over the ideal DCG."""
    dcg = sum(1.0 / math.log2(rank + 1) for rank, doc in enumerate(ranked[:k], 1) if doc in relevant)
    ideal = sum(1.0 / math.log2(rank + 1) for rank in range(1, min(k, len(relevant)) + 1))
    return dcg / ideal if ideal else 0.0


ANSWER = "answer"
"""The document id every answering passage of a question is mapped to."""


def ranked_documents(query: LabelledQuery, hits: Sequence[Passage]) -> list[Hashable]:
    """Document ids of ``hits`` in rank order: answering passages become :data:`ANSWER` (kept once, at
    its best rank), every other passage is a document of its own (its position in ``hits``)."""
    ranked: list[Hashable] = []
    for i, passage in enumerate(hits):
        if query.answers(passage):
            if ANSWER not in ranked:
                ranked.append(ANSWER)
        else:
            ranked.append(i)
    return ranked


@dataclass(frozen=True)
class Scores:
    """Mean metrics over a query set (each 0..1) and how many questions were scored."""

    recall_at_1: float
    recall_at_5: float
    mrr_at_10: float
    ndcg_at_10: float
    queries: int


def score(queries: Sequence[LabelledQuery], hits: Sequence[Sequence[Passage]]) -> Scores:
    """recall@1, recall@5, MRR@10 and nDCG@10 averaged over ``queries``.

    Args:
        queries: the labelled questions.
        hits: for each question, the retrieved passages best first (at least 10 wanted,
            more so that answers repeated in several passages still leave 10 documents).

    Raises:
        ValueError: ``hits`` and ``queries`` differ in length.
    """
    if len(hits) != len(queries):
        raise ValueError(f"{len(hits)} result lists for {len(queries)} questions")
    if not queries:
        return Scores(0.0, 0.0, 0.0, 0.0, 0)
    r1 = r5 = mrr = ndcg = 0.0
    for query, passages in zip(queries, hits):
        ranked = ranked_documents(query, passages)
        relevant = {ANSWER}
        r1 += recall_at_k(ranked, relevant, 1)
        r5 += recall_at_k(ranked, relevant, 5)
        mrr += mrr_at_k(ranked, relevant, 10)
        ndcg += ndcg_at_k(ranked, relevant, 10)
    n = len(queries)
    return Scores(r1 / n, r5 / n, mrr / n, ndcg / n, n)
