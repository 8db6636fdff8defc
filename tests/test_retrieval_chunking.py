"""Chunking keeps titles, respects sizes and splits on paragraphs; documents come from pydoc or files."""

import pytest

from switchyard.retrieval.chunking import Document, chunk_document, chunk_for_model, chunk_text, embedding_text
from switchyard.retrieval.documents import first_heading, path_documents, pydoc_documents


def _words(text: str) -> list[str]:
    return text.split()


def test_pydoc_topics_chunk_within_size_and_keep_their_titles():
    docs = pydoc_documents()
    with_doc = next(d for d in docs if d.title == "with")
    assert with_doc.source == "pydoc_data.topics:with"
    assert with_doc.heading == 'The "with" statement'
    for doc in docs:
        passages = chunk_document(doc, 1200, 150)
        assert passages, doc.title
        assert all(len(p.text) <= 1200 for p in passages)
        assert {(p.title, p.source) for p in passages} == {(doc.title, doc.source)}


@pytest.mark.parametrize("chunk_chars, overlap", [(100, 0), (300, 50), (1200, 150)])
def test_chunks_respect_size_and_cover_every_word(chunk_chars, overlap):
    paragraphs = [" ".join(f"w{p}_{i}" for i in range(n)) for p, n in enumerate([3, 40, 7, 200, 1, 15])]
    text = "\n\n".join(paragraphs) + "\n\n" + "x" * 450  # one unbreakable run too
    chunks = chunk_text(text, chunk_chars, overlap)
    assert all(0 < len(c) <= chunk_chars for c in chunks)
    seen = set(_words(" ".join(chunks)))
    missing = [w for w in _words(text) if w not in seen and not w.startswith("x")]
    assert missing == []
    assert "".join(c for c in "".join(chunks) if c == "x").count("x") >= 450


def test_splits_on_paragraph_boundaries_when_they_fit():
    paragraphs = ["alpha " * 30, "beta " * 30, "gamma " * 30]  # ~180, 150, 180 chars
    chunks = chunk_text("\n\n".join(p.strip() for p in paragraphs), 400, 0)
    assert chunks == ["\n\n".join([paragraphs[0].strip(), paragraphs[1].strip()]), paragraphs[2].strip()]


def test_overlap_repeats_the_end_of_the_previous_passage_at_a_word_boundary():
    text = "\n\n".join(" ".join(f"p{p}w{i}" for i in range(20)) for p in range(6))
    chunks = chunk_text(text, 300, 40)
    assert len(chunks) > 1
    for before, after in zip(chunks, chunks[1:]):
        first_word = after.split()[0]
        assert first_word in before.split()  # a whole word carried over, not a fragment


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="overlap must be in"):
        chunk_text("text", 100, 100)
    with pytest.raises(ValueError, match="limit"):
        chunk_text("text", 0, 0)
    assert chunk_text("  \n\n  ", 100, 10) == []


def test_embedding_text_leads_with_the_heading_once():
    doc = Document('The "with" statement\n*****\n\nBody.', "with", "pydoc_data.topics:with", 'The "with" statement')
    first, = chunk_document(doc, 1200, 150)
    assert embedding_text(first, doc.heading) == first.text
    later = chunk_document(Document("More body.", "with", "s"), 100, 0)[0]
    assert embedding_text(later, doc.heading) == 'The "with" statement\n\nMore body.'


def test_first_heading_reads_markdown_and_rst():
    assert first_heading("intro\n\n## Queue waits ##\ntext") == "Queue waits"
    assert first_heading("Batching\n========\n\ntext") == "Batching"
    assert first_heading("=====\n-----\nplain") is None


def test_path_documents_reads_files_and_folders(tmp_path):
    (tmp_path / "docs" / ".hidden").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Flush\n\nThe buffer flushes by size.\n")
    (tmp_path / "docs" / "b.rst").write_text("Admission\n=========\n\nBy compute score.\n")
    (tmp_path / "docs" / "c.bin").write_bytes(b"\x00\x01")
    (tmp_path / "docs" / ".hidden" / "d.md").write_text("secret")
    (tmp_path / "notes.txt").write_text("no heading here")
    docs = path_documents([str(tmp_path / "docs"), str(tmp_path / "notes.txt")])
    assert [(d.title, d.source) for d in docs] == [
        ("Flush", str(tmp_path / "docs" / "a.md")),
        ("Admission", str(tmp_path / "docs" / "b.rst")),
        ("notes.txt", str(tmp_path / "notes.txt")),
    ]
    with pytest.raises(FileNotFoundError, match="nope"):
        path_documents([str(tmp_path / "nope")])


# --------------------------------------------------------------------------- token-aware chunking
# These use all-MiniLM-L6-v2's own tokenizer (the model loads from its package, offline).


@pytest.fixture(scope="module")
def embedder():
    from switchyard.retrieval.embedder import load_embedder

    return load_embedder()


def _model_tokens(embedder, text: str) -> int:
    """Word pieces the model sees for ``text``, special tokens included, counted independently of the chunker."""
    return len(embedder.tokenizer(text, truncation=False)["input_ids"])


def test_no_pydoc_passage_exceeds_the_model_window_and_every_word_is_kept(embedder):
    docs = pydoc_documents()
    chunked = chunk_for_model(docs, embedder.tokenizer, embedder.window, 256, 32)
    assert embedder.window == 256
    assert chunked.truncated == 0 and chunked.longest <= 256
    assert max(_model_tokens(embedder, t) for t in chunked.texts) <= 256
    by_topic: dict[str, set[str]] = {}
    for passage in chunked.passages:
        by_topic.setdefault(passage.title, set()).update(passage.text.split())
    for doc in docs:
        assert set(doc.text.split()) <= by_topic[doc.title], doc.title


def test_long_runs_long_lines_and_long_headings_still_fit(embedder):
    text = "\n\n".join([
        "x" * 5000,  # one unbroken run: cut mid-word
        " ".join(f"tokenization{i}" for i in range(600)),  # one line of many words
        "\n".join(f"line {i} of a paragraph with several words" for i in range(120)),
    ])
    heading = " ".join(["an unusually long heading"] * 80)
    doc = Document(text, "long", "test:long", heading)
    chunked = chunk_for_model([doc], embedder.tokenizer, embedder.window, 128, 16)
    assert len(chunked.passages) > 10 and chunked.truncated == 0
    assert max(_model_tokens(embedder, t) for t in chunked.texts) <= 128
    assert "".join(p.text for p in chunked.passages).count("x") >= 5000
    kept = set(" ".join(p.text for p in chunked.passages).split())
    assert {f"tokenization{i}" for i in range(600)} <= kept


def test_token_overlap_repeats_whole_words(embedder):
    text = "\n\n".join(" ".join(f"p{p}w{i}" for i in range(40)) for p in range(8))
    chunked = chunk_for_model([Document(text, "t", "s")], embedder.tokenizer, embedder.window, 96, 24)
    texts = [p.text for p in chunked.passages]
    assert len(texts) > 2
    for before, after in zip(texts, texts[1:]):
        assert after.split()[0] in before.split()


def test_sizes_that_leave_no_room_are_rejected(embedder):
    with pytest.raises(ValueError, match="chunk_tokens=4"):
        chunk_for_model([Document("text", "t", "s")], embedder.tokenizer, embedder.window, 4, 0)
