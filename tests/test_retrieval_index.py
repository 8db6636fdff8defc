"""The vector index: save/load round trip, cosine search, clear errors for a missing or broken index."""

import json
import re

import numpy as np
import pytest

from switchyard.retrieval.index import (
    IndexMismatchError,
    IndexNotFoundError,
    Manifest,
    Passage,
    VectorIndex,
    load_index,
)


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def _index(n: int = 20, dims: int = 8) -> tuple[VectorIndex, np.ndarray]:
    vectors = _unit(np.random.default_rng(7).normal(size=(n, dims)))
    passages = [Passage(f"text {i} — ünïcode", f"title {i}", f"src:{i}") for i in range(n)]
    return VectorIndex.build(vectors, passages, Manifest(model="m", dims=dims, count=n, documents=3)), vectors


def test_save_load_round_trip(tmp_path):
    index, vectors = _index()
    index.save(tmp_path / "idx")
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["index.faiss", "manifest.json", "passages.jsonl"]
    loaded = load_index(tmp_path / "idx")
    assert loaded.passages == index.passages
    assert loaded.manifest == index.manifest
    assert loaded.manifest.created_at
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert (manifest["model"], manifest["dims"], manifest["count"]) == ("m", 8, 20)
    for before, after in zip(index.search(vectors[:3], 5), loaded.search(vectors[:3], 5)):
        assert before == after


def test_search_returns_cosine_scores_best_first():
    index, vectors = _index()
    hits = index.search(vectors[4], 3)[0]
    assert hits[0].passage.source == "src:4"
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    expected = float(vectors[4] @ vectors[int(hits[1].passage.source.split(":")[1])])
    assert hits[1].score == pytest.approx(expected, abs=1e-5)
    assert len(index.search(vectors[0], 100)[0]) == 20  # k above the count: every passage once


def test_missing_index_names_the_folder_and_the_fix(tmp_path):
    with pytest.raises(IndexNotFoundError) as err:
        load_index(tmp_path / "absent")
    message = str(err.value)
    assert str(tmp_path / "absent") in message and "switchyard index" in message


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "passages.jsonl").open("a").write('{"x":\n'),
     r"passages.jsonl: line 21: expected a JSON object of text, title and source, strings \(Expecting value"),
    (lambda d: (d / "passages.jsonl").write_text("[1, 2]\n"),
     r"passages.jsonl: line 1: expected a JSON object of text, title and source, strings \(got '\[1, 2\]'\)"),
    (lambda d: (d / "passages.jsonl").write_text('{"text": 5, "title": "t", "source": "s"}\n'),
     r"passages.jsonl: line 1: .* \(a value is not a string\)"),
    (lambda d: (d / "passages.jsonl").write_bytes(b'{"text": "caf\xe9", "title": "t", "source": "s"}\n'),
     r"passages.jsonl: not UTF-8 text"),
    (lambda d: (d / "index.faiss").write_bytes((d / "index.faiss").read_bytes()[:100]),
     r"index.faiss: not a FAISS index faiss can read \(.*\); rebuild it with `switchyard index`"),
    # the manifest's own refusals were pydantic's dump ("1 validation error for Manifest ... For further
    # information visit https://errors.pydantic.dev/...") with no way out, and a dims disagreement named no file
    (lambda d: (d / "manifest.json").write_text("{bad\n"),
     r"manifest.json: not a valid manifest \(Invalid JSON: key must be a string at line 1 column 2\); rebuild the "
     r"index with `switchyard index`$"),
    (lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"count": ', '"count": "many", "x": ')),
     r"manifest.json: not a valid manifest \(count: Input should be a valid integer"),
    (lambda d: (d / "manifest.json").write_text(re.sub(r'"dims": \d+', '"dims": 768', (d / "manifest.json").read_text())),
     r": index vectors have \d+ dims, manifest says 768; rebuild it with `switchyard index`"),
])
def test_a_file_of_the_index_that_cannot_be_read_is_named_with_its_line(tmp_path, damage, message):
    """A line of passages.jsonl that was not JSON failed retrieval's start with 'Expecting value: line 2 column 1
    (char 6)', naming neither the file nor its line; one not an object, with a TypeError; a FAISS file cut short
    with faiss's C++ assertion."""
    index, _ = _index()
    index.save(tmp_path)
    damage(tmp_path)
    with pytest.raises(IndexMismatchError, match=message) as refused:
        load_index(tmp_path)
    assert str(tmp_path) in str(refused.value) and "switchyard index" in str(refused.value)
    assert "errors.pydantic.dev" not in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_inconsistent_files_are_rejected(tmp_path):
    index, _ = _index()
    index.save(tmp_path)
    with (tmp_path / "passages.jsonl").open("a") as fh:
        fh.write(json.dumps({"text": "extra", "title": "t", "source": "s"}) + "\n")
    with pytest.raises(IndexMismatchError, match="rebuild"):
        load_index(tmp_path)
    with pytest.raises(IndexMismatchError, match="dims"):
        index.search(np.zeros(5, dtype=np.float32), 1)


# --------------------------------------------------------------------------- BM25 and hybrid search

from switchyard.retrieval.lexical import LexicalIndex, fuse  # noqa: E402

TEXTS = [
    "The with statement wraps a block in a context manager's enter and exit.",
    "str.removeprefix returns the string without the given prefix.",
    "Lists are mutable sequences; tuples are immutable.",
    "__slots__ deny the creation of __dict__ for instances.",
]


def test_bm25_finds_exact_terms_and_stems():
    lexical = LexicalIndex.build(TEXTS)
    assert lexical.search("removeprefix", 4)[0][0] == 1
    assert lexical.search("what do __slots__ do", 4)[0][0] == 3
    assert [i for i, _ in lexical.search("mutability of tuples", 4)][:1] == [2]  # tuples ~ tuple, stemmed
    assert lexical.search("zeppelin", 4) == []  # no shared term: nothing, not zero-score filler


def test_reciprocal_rank_fusion_matches_hand_computed_order():
    # a: 1/(1+1) + 1/(1+3) = 0.75; b: 1/(1+2) + 1/(1+1) = 0.833; c: 1/(1+3) = 0.25; d: 1/(1+2) = 0.333
    assert fuse([["a", "b", "c"], ["b", "d", "a"]], 4, 1) == ["b", "a", "d", "c"]
    assert fuse([["a", "b"], ["b", "a"]], 1, 60) == ["a"]  # a tie keeps the first ranking's order


def test_hybrid_search_fuses_rankings_and_round_trips_with_bm25(tmp_path):
    index, vectors = _index(n=4)
    passages = [Passage(t, f"t{i}", f"s:{i}") for i, t in enumerate(TEXTS)]
    index = VectorIndex(index.manifest.model_copy(update={"count": 4}), passages, index.index,
                        LexicalIndex.build(TEXTS))
    index.save(tmp_path / "idx")
    loaded = load_index(tmp_path / "idx")
    assert loaded.manifest.lexical == "bm25" and loaded.lexical is not None
    query = vectors[0]  # nearest by vectors: passage 0; by words: passage 1
    by_vectors = [h.passage.title for h in loaded.search(query, 4)[0]]
    hits = loaded.hybrid_search("removeprefix", query, 2, 4, 1)
    assert by_vectors[0] == "t0" and {h.passage.title for h in hits} == {"t0", "t1"}
    assert all(h.score == pytest.approx(float(vectors[int(h.passage.title[1:])] @ query), abs=1e-5) for h in hits)
    (tmp_path / "idx" / "bm25" / "params.index.json").unlink()
    with pytest.raises(IndexMismatchError, match="BM25 index but .*bm25 is missing"):
        load_index(tmp_path / "idx")


def test_an_index_records_its_corpus_so_a_users_own_is_never_taken_for_the_default(pydoc_index_dir, tmp_path):
    """The tests reuse ``make index``'s data/index only when it is the default corpus (conftest): an index
    of a user's own files in that folder records ``files`` and is rebuilt, not copied, for the tests."""
    from switchyard.common.config import load_config
    from switchyard.retrieval.index import DEFAULT_CORPUS
    from switchyard.retrieval.indexer import build_index

    assert load_index(pydoc_index_dir).manifest.corpus == DEFAULT_CORPUS
    (tmp_path / "notes.md").write_text("# Notes\n\nOur deploy runbook says to drain a node before its upgrade.\n")
    manifest = build_index([str(tmp_path / "notes.md")], tmp_path / "index", load_config("config"), progress=False)
    assert manifest.corpus == "files"
    assert load_index(tmp_path / "index").manifest.corpus == "files"
