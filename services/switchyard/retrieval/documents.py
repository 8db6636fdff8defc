"""Documents to index: CPython's documentation topics, or text files.

The default corpus is ``pydoc_data.topics.topics``, the language-reference
topics that ship with CPython for ``help()`` (for example ``with``, ``try``,
``assignment``), so a fresh install has real documentation to search with no
download.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Sequence

from switchyard.retrieval.chunking import Document

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
"""File types taken from folders; a file named explicitly is read whatever its suffix."""

_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_RST_UNDERLINE = re.compile(r"^([=\-~^*#+`'\":._])\1{2,}\s*$")


def pydoc_documents() -> list[Document]:
    """One document per CPython documentation topic, sorted by topic name.

    title = topic name (``with``), source = ``pydoc_data.topics:with``, heading
    = the topic's first line (``The "with" statement``).
    """
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        # Drop reST heading underlines ("*****"): noise in passages and answers.
        text = "\n".join(line for line in topics[name].splitlines() if not _RST_UNDERLINE.match(line))
        first = next((line.strip() for line in text.splitlines() if line.strip()), name)
        docs.append(Document(text=text, title=name, source=f"pydoc_data.topics:{name}", heading=first))
    return docs


def first_heading(text: str) -> str | None:
    """The first Markdown (``# Title``) or reStructuredText (underlined) heading in ``text``, if any."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:200]):
        if match := _MD_HEADING.match(line):
            return match.group(1)
        stripped = line.strip()
        if (
            stripped
            and not _RST_UNDERLINE.match(line)
            and i + 1 < len(lines)
            and _RST_UNDERLINE.match(lines[i + 1])
            and len(lines[i + 1].strip()) >= len(stripped)
        ):
            return stripped
    return None


def file_document(path: Path) -> Document:
    """A text file as a document: title = its first heading, else its file name; source = the path.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file holds a NUL byte: a binary file (a PDF, an image, an archive), whose bytes would be
            indexed as garbage passages (the message names the file and the byte's offset).
    """
    data = path.read_bytes()
    if (nul := data.find(b"\0")) >= 0:
        raise ValueError(f"{path}: a binary file (a NUL byte at offset {nul}); expected text, Markdown or rst")
    text = data.decode("utf-8", errors="replace")
    title = first_heading(text) or path.name
    return Document(text=text, title=title, source=str(path), heading=title)


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix.lower() in TEXT_SUFFIXES and not any(
            part.startswith(".") for part in path.relative_to(root).parts
        ):
            yield path


def path_documents(paths: Sequence[str | Path]) -> list[Document]:
    """Documents from files and folders (folders: their text, Markdown and rst files, recursively).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file is binary (:func:`file_document`).
        OSError: a file cannot be read.
    """
    docs = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            docs.extend(file_document(p) for p in _files(path))
        elif path.is_file():
            docs.append(file_document(path))
        else:
            raise FileNotFoundError(f"{path}: no such file or folder; expected text, Markdown or rst files")
    return docs
