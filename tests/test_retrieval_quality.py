"""The labelled query set matches the corpus, and the ranking metrics follow BEIR's definitions."""

from __future__ import annotations

import json
import math

import pytest

from switchyard.retrieval.documents import pydoc_documents
from switchyard.retrieval.index import Passage
from switchyard.retrieval.quality import (
    ANSWER,
    LabelledQuery,
    load_queries,
    mrr_at_k,
    ndcg_at_k,
    normalize,
    ranked_documents,
    recall_at_k,
    score,
)


def test_the_shipped_set_has_200_questions_each_labelled_with_every_topic_holding_its_answer():
    queries = load_queries()
    topics = {d.title: normalize(d.text) for d in pydoc_documents()}
    assert len(queries) >= 200 and len({q.query for q in queries}) == len(queries)
    assert sum(q.tail for q in queries) >= 20  # answered only by the later part of a long topic
    for q in queries:
        holding = tuple(t for t, text in topics.items() if q.evidence in text)
        assert q.topics == holding, (q.id, q.evidence)
    assert len({t for q in queries for t in q.topics}) >= 60  # spread over the corpus, not a few topics


def test_metrics_match_hand_computed_values():
    ranked = ["a", "x", "b", "y", "z"]
    relevant = {"a", "b", "c"}
    assert recall_at_k(ranked, relevant, 1) == pytest.approx(1 / 3)
    assert recall_at_k(ranked, relevant, 5) == pytest.approx(2 / 3)
    assert mrr_at_k(["x", "y", "b"], relevant, 10) == pytest.approx(1 / 3)
    assert mrr_at_k(["x", "y", "b"], relevant, 2) == 0.0
    dcg = 1 / math.log2(2) + 1 / math.log2(4)
    ideal = 1 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert ndcg_at_k(ranked, relevant, 10) == pytest.approx(dcg / ideal)
    assert ndcg_at_k(["a"], {"a"}, 10) == 1.0 and ndcg_at_k(["x", "a"], {"a"}, 10) == pytest.approx(1 / math.log2(3))


def test_an_answer_repeated_in_several_passages_counts_once_at_its_best_rank():
    q = LabelledQuery("q", "Is the else clause skipped on break?", "skipping the optional", ("break", "compound"))
    other = Passage("unrelated text", "while", "s")
    wrong_topic = Passage("skipping the optional else", "lists", "s")  # the phrase, but not in a labelled topic
    answer = Passage("... loop, skipping the optional \"else\" clause", "break", "s")
    repeat = Passage("skipping   the\noptional", "compound", "s")
    hits = [other, wrong_topic, answer, repeat, other]
    assert ranked_documents(q, hits) == [0, 1, ANSWER, 4]
    result = score([q], [hits])
    assert (result.recall_at_1, result.recall_at_5) == (0.0, 1.0)
    assert result.mrr_at_10 == pytest.approx(1 / 3) and result.ndcg_at_10 == pytest.approx(0.5)


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"id": "a", "query": "q", "evidence": "e"}', "field 'topics'"),
        ('{"id": "a", "query": "", "evidence": "e", "topics": ["with"]}', "field 'query'"),
    ],
)
def test_a_bad_query_file_names_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "ok", "query": "q", "evidence": "e", "topics": ["with"]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"q.jsonl:2: .*{message}"):
        load_queries(path)
