"""Split documents into passages of at most ``chunk_chars`` characters.

Passages break on paragraph boundaries (blank lines) where possible; a
paragraph longer than a passage breaks on line ends, then on whitespace, and
only a single unbroken run longer than a passage is cut mid-word. Each passage
after the first starts with up to ``overlap_chars`` characters from the end of
the one before (cut at a word boundary), so that a sentence split across two
passages can still be found. Every passage keeps its document's title and
source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from switchyard.retrieval.index import Passage

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_SEP = "\n\n"


@dataclass(frozen=True)
class Document:
    """A text to index.

    Attributes:
        text: the full text.
        title: short name kept by every passage (a topic name such as ``with``, or a file's heading).
        source: where it came from (``pydoc_data.topics:with`` or a file path).
        heading: a descriptive first line, prepended to each passage when it is embedded
            (defaults to the title).
    """

    text: str
    title: str
    source: str
    heading: str = ""


def _split_run(text: str, limit: int) -> Iterator[str]:
    """Cut one line into pieces of at most ``limit`` chars at whitespace, mid-word only when unavoidable."""
    while len(text) > limit:
        cut = text.rfind(" ", 0, limit + 1)
        if cut <= 0:
            cut = limit
        head, text = text[:cut].rstrip(), text[cut:].lstrip()
        if head:
            yield head
    if text.strip():
        yield text


def _split_paragraph(paragraph: str, limit: int) -> Iterator[str]:
    """Pack the lines of a too-long paragraph into pieces of at most ``limit`` chars."""
    current = ""
    for line in paragraph.split("\n"):
        for unit in _split_run(line, limit) if len(line) > limit else [line]:
            if not current:
                current = unit
            elif len(current) + 1 + len(unit) <= limit:
                current += "\n" + unit
            else:
                yield current
                current = unit
    if current.strip():
        yield current


def _pieces(text: str, limit: int) -> Iterator[str]:
    """Paragraphs of ``text``, each at most ``limit`` chars (long ones split)."""
    for paragraph in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
        paragraph = paragraph.strip("\n").rstrip()
        if not paragraph.strip():
            continue
        if len(paragraph) <= limit:
            yield paragraph
        else:
            yield from _split_paragraph(paragraph, limit)


def _tail(text: str, size: int) -> str:
    """The last ``size`` chars of ``text`` or fewer, starting at a word boundary."""
    if size <= 0:
        return ""
    tail = text[-size:]
    if len(tail) < len(text) and not text[-size - 1].isspace():
        space = re.search(r"\s", tail)
        tail = tail[space.end():] if space else ""
    return tail.strip()


def chunk_text(text: str, chunk_chars: int, overlap_chars: int) -> list[str]:
    """Split ``text`` into passages of at most ``chunk_chars`` characters.

    Args:
        text: any text; blank lines separate paragraphs.
        chunk_chars: the most characters in one passage (``retrieval.chunk_chars``), >= 1.
        overlap_chars: characters repeated from the previous passage
            (``retrieval.chunk_overlap_chars``), 0 <= overlap_chars < chunk_chars.
            Less is repeated when the next paragraph leaves no room.

    Returns:
        The passages in order; empty for blank text.

    Raises:
        ValueError: the sizes are out of range.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    if not 0 <= overlap_chars < chunk_chars:
        raise ValueError(f"overlap_chars must be in [0, chunk_chars={chunk_chars}), got {overlap_chars}")
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, chunk_chars):
        if not current:
            current = piece
        elif len(current) + len(_SEP) + len(piece) <= chunk_chars:
            current += _SEP + piece
        else:
            chunks.append(current)
            tail = _tail(current, min(overlap_chars, chunk_chars - len(piece) - len(_SEP)))
            current = tail + _SEP + piece if tail else piece
    if current:
        chunks.append(current)
    return chunks


def chunk_document(doc: Document, chunk_chars: int, overlap_chars: int) -> list[Passage]:
    """The passages of ``doc``, each with the document's title and source (see :func:`chunk_text`)."""
    return [Passage(text, doc.title, doc.source) for text in chunk_text(doc.text, chunk_chars, overlap_chars)]


def embedding_text(passage: Passage, heading: str) -> str:
    """What is embedded for ``passage``: its text, led by the document heading unless it already starts with it."""
    heading = heading.strip()
    if not heading or passage.text.startswith(heading):
        return passage.text
    return f"{heading}\n\n{passage.text}"
