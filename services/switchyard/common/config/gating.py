"""The stand-in for a section the loading service does not read: any use of it is a ConfigError."""

from __future__ import annotations

from typing import Any

from switchyard.common.config.base import ConfigError


class _Unread:
    """Stands for a section the loading service does not read; any use of it is a ConfigError."""

    __slots__ = ("name", "reader", "where")

    def __init__(self, name: str, reader: str, where: str) -> None:
        """``name``: the section (a key of SECTIONS); ``reader``: the services loading; ``where``: its file and keys."""
        self.name, self.reader, self.where = name, reader, where

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ConfigError(
            f"{self.name} ({self.where}) is not among the sections "
            f"the {self.reader} reads; a service reads only its own (SERVICE_SECTIONS)"
        )

    def __repr__(self) -> str:
        return f"<{self.name}: not read by the {self.reader}>"
