"""Plain-text help for the command line: module docstrings without reStructuredText markup.

Docstrings are written in reST (``code``, :mod:`name`, **bold**); a terminal
shows those marks literally. :func:`plain` strips them, and
:func:`parser_for` builds an ``argparse`` parser whose description is a
docstring in plain text with its paragraphs and lists kept.
"""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")  # :func:`x`, :py:mod:`~a.b`
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"(?<![\w`])`([^`]+)`(?![\w`])")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])")


def plain(text: str) -> str:
    """``text`` without reST inline markup: literals, roles, interpreted text, bold and italics keep only their words.

    A ``::`` that ends a paragraph becomes ``:``. Everything else (line breaks, bullets) is kept.
    """
    text = _ROLE.sub(lambda m: m.group(1), text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def parser_for(prog: str, doc: str | None, **kwargs: object) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for ``prog`` whose description is ``doc`` in plain text, line breaks kept."""
    return argparse.ArgumentParser(
        prog=prog,
        description=plain(doc or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,  # type: ignore[arg-type]
    )
