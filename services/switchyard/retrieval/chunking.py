"""Split documents into passages that fit the embedding model's input window.

One splitter, two ways to measure size. :func:`chunk_text` takes a *length*
function: the embedding model's own tokenizer (word pieces, what the index
uses; see :func:`token_length`) or ``len`` (characters, the chunking used
before passages were sized in tokens, kept as the benchmark's baseline).

Passages break on paragraph boundaries (blank lines) where possible; a
paragraph longer than a passage breaks on line ends, then on spaces, and only
a single unbroken run longer than a passage is cut mid-word. Each passage
after the first starts with up to ``overlap`` units from the end of the one
before (cut at a word boundary), so that a sentence split across two passages
can still be found. Every passage keeps its document's title and source.

:func:`chunk_for_model` sizes passages so that what is embedded (the document
heading, the passage and the tokenizer's special tokens) never exceeds the
model's window: no word of the corpus is truncated away before it is embedded.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from switchyard.retrieval.index import Passage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Length = Callable[[str], int]
"""Size of a text in the chunker's unit: characters (``len``) or word pieces (:func:`token_length`)."""

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


def _longest_fit(n: int, fits: Callable[[int], bool]) -> int:
    """The largest i in [0, n) with ``fits(i)``, assuming ``fits`` holds up to a point and then fails; -1 if none."""
    lo, hi = -1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _split_run(text: str, limit: int, length: Length) -> Iterator[str]:
    """Cut one line into pieces of at most ``limit`` at spaces, mid-word only when unavoidable."""
    while length(text) > limit:
        spaces = [i for i, ch in enumerate(text) if ch == " "]
        j = _longest_fit(len(spaces), lambda i: length(text[: spaces[i]]) <= limit)
        cut = spaces[j] if j >= 0 else 0
        if cut <= 0:  # one run longer than a passage: the longest prefix that fits, at least one character
            cut = max(1, _longest_fit(len(text) + 1, lambda i: length(text[:i]) <= limit))
        head, text = text[:cut].rstrip(), text[cut:].lstrip()
        if head:
            yield head
    if text.strip():
        yield text


def _split_paragraph(paragraph: str, limit: int, length: Length) -> Iterator[str]:
    """Pack the lines of a too-long paragraph into pieces of at most ``limit``."""
    current = ""
    for line in paragraph.split("\n"):
        for unit in _split_run(line, limit, length) if length(line) > limit else [line]:
            if not current:
                current = unit
            elif length(current + "\n" + unit) <= limit:
                current += "\n" + unit
            else:
                yield current
                current = unit
    if current.strip():
        yield current


def _pieces(text: str, limit: int, length: Length, piece_limit: int) -> Iterator[str]:
    """Paragraphs of ``text``, each at most ``limit``; longer ones split into pieces of at most ``piece_limit``."""
    for paragraph in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
        paragraph = paragraph.strip("\n").rstrip()
        if not paragraph.strip():
            continue
        if length(paragraph) <= limit:
            yield paragraph
        else:
            yield from _split_paragraph(paragraph, piece_limit, length)


def _tail(text: str, size: int, length: Length) -> str:
    """The longest end of ``text`` of at most ``size`` that starts at a word boundary ("" if none)."""
    if size <= 0:
        return ""
    starts = [0] + [i + 1 for i, ch in enumerate(text[:-1]) if ch.isspace()]
    # fits(j): the suffix from the j-th start counted from the end is small enough
    j = _longest_fit(len(starts), lambda i: length(text[starts[-1 - i] :]) <= size)
    return text[starts[-1 - j] :].strip() if j >= 0 else ""


def chunk_text(
    text: str, limit: int, overlap: int, length: Length = len, piece_limit: int | None = None
) -> list[str]:
    """Split ``text`` into passages of at most ``limit``, measured by ``length``.

    Args:
        text: any text; blank lines separate paragraphs.
        limit: the most units (characters or word pieces) in one passage, >= 1.
        overlap: units repeated from the end of the previous passage, 0 <= overlap < limit.
            Less is repeated when the next paragraph leaves no room.
        length: the size of a text; ``len`` (characters) by default, or :func:`token_length`.
        piece_limit: the most units of a piece cut from a paragraph longer than ``limit``
            (default ``limit``: such pieces fill a passage and carry no overlap;
            ``limit - overlap`` leaves room for it).

    Returns:
        The passages in order, each with ``length(passage) <= limit``; empty for blank text.

    Raises:
        ValueError: the sizes are out of range.
    """
    if limit < 1:
        raise ValueError(f"limit (passage size) must be >= 1, got {limit}")
    if not 0 <= overlap < limit:
        raise ValueError(f"overlap must be in [0, limit={limit}), got {overlap}")
    piece_limit = limit if piece_limit is None else max(1, min(piece_limit, limit))
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, limit, length, piece_limit):
        if not current:
            current = piece
        elif length(current + _SEP + piece) <= limit:
            current += _SEP + piece
        else:
            chunks.append(current)
            tail = _tail(current, min(overlap, limit - length(piece) - length(_SEP)), length)
            current = tail + _SEP + piece if tail and length(tail + _SEP + piece) <= limit else piece
    if current:
        chunks.append(current)
    return chunks


def chunk_document(
    doc: Document, limit: int, overlap: int, length: Length = len, piece_limit: int | None = None
) -> list[Passage]:
    """The passages of ``doc``, each with the document's title and source (see :func:`chunk_text`)."""
    return [
        Passage(text, doc.title, doc.source) for text in chunk_text(doc.text, limit, overlap, length, piece_limit)
    ]


def embedding_text(passage: Passage, heading: str) -> str:
    """What is embedded for ``passage``: its text, led by the document heading unless it already starts with it."""
    heading = heading.strip()
    if not heading or passage.text.startswith(heading):
        return passage.text
    return f"{heading}\n\n{passage.text}"


def token_length(tokenizer: PreTrainedTokenizerBase, cache_size: int = 65_536) -> Length:
    """A :data:`Length` counting the word pieces ``tokenizer`` makes of a text, special tokens excluded.

    Args:
        tokenizer: a Hugging Face tokenizer (``tokenize(text) -> list[str]``), the embedding model's own.
        cache_size: texts whose count is remembered (the splitter measures the same text more than once).
    """
    tokenize = tokenizer.tokenize
    # Counting a whole document is the point here: mark transformers' "longer than the maximum
    # sequence length" warning as already given, so it does not alarm the reader of `switchyard index`.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True

    @functools.lru_cache(maxsize=cache_size)
    def count(text: str) -> int:
        return len(tokenize(text))

    return count


def fit_heading(heading: str, max_tokens: int, length: Length) -> str:
    """``heading`` cut at a space (or mid-word if it must) to at most ``max_tokens`` (unchanged when it fits)."""
    heading = heading.strip()
    if length(heading) <= max_tokens:
        return heading
    return next(_split_run(heading, max(1, max_tokens), length), "")


@dataclass(frozen=True)
class Chunked:
    """Passages made for one embedding model, with what each embeds.

    Attributes:
        passages: in document order.
        texts: what is embedded for each passage (heading + text), same order.
        tokens: word pieces the model sees for each text, special tokens included.
        window: the model's input window in word pieces (256 for all-MiniLM-L6-v2).
    """

    passages: list[Passage]
    texts: list[str]
    tokens: list[int]
    window: int

    @property
    def truncated(self) -> int:
        """Passages whose embedded text is longer than the window (its tail would not be embedded)."""
        return sum(n > self.window for n in self.tokens)

    @property
    def longest(self) -> int:
        """Word pieces of the longest embedded text, special tokens included (0 when empty)."""
        return max(self.tokens, default=0)


def chunk_for_model(
    docs: Sequence[Document],
    tokenizer: PreTrainedTokenizerBase,
    window: int,
    chunk_tokens: int,
    overlap_tokens: int,
    *,
    heading_share: float = 0.25,
) -> Chunked:
    """Chunk ``docs`` so that every embedded text fits ``min(chunk_tokens, window)`` word pieces.

    Each passage's budget is the limit less the tokenizer's special tokens
    (``[CLS]``, ``[SEP]``: 2 for BERT-style models) and the document heading
    that :func:`embedding_text` puts in front; a heading is cut to at most
    ``heading_share`` of the limit so that passages keep room.

    Args:
        docs: documents to split.
        tokenizer: the embedding model's tokenizer (``tokenize``, ``num_special_tokens_to_add``).
        window: the model's input window in word pieces (``max_seq_length``; 256 for all-MiniLM-L6-v2,
            from its model card).
        chunk_tokens: most word pieces one embedded text may hold, special tokens included
            (``retrieval.chunk_tokens``).
        overlap_tokens: word pieces repeated from the end of the passage before
            (``retrieval.chunk_overlap_tokens``).

    Returns:
        The passages, their embedded texts and token counts.

    Raises:
        ValueError: sizes out of range (``chunk_tokens`` leaves no room, or ``overlap_tokens`` is too big).
    """
    length = token_length(tokenizer)
    special = int(tokenizer.num_special_tokens_to_add(pair=False))
    limit = min(chunk_tokens, window) - special
    if limit < 8:
        raise ValueError(f"chunk_tokens={chunk_tokens} leaves {limit} word pieces per passage; expected >= {special + 8}")
    passages: list[Passage] = []
    texts: list[str] = []
    for doc in docs:
        heading = fit_heading(doc.heading or doc.title, int(limit * heading_share), length)
        budget = limit - (length(heading) if heading else 0)
        overlap = min(overlap_tokens, budget // 2)
        for passage in chunk_document(doc, budget, overlap, length, budget - overlap):
            passages.append(passage)
            texts.append(embedding_text(passage, heading))
    tokens = [length(t) + special for t in texts]
    return Chunked(passages, texts, tokens, window)

