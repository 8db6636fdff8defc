"""The stand-in for a section the loading service does not read: any use of it is a ConfigError.

A service loaded with ``load_config(service=...)`` holds, for each section it does not read,
a stand-in made for that section's model by :func:`unread_section`: every public name of the
model (its fields, properties and methods) is a property that raises :class:`ConfigError`
naming the section, its file and the service. Misuse fails on first touch, with a message
instead of a stale default.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pydantic import BaseModel

from switchyard.common.config.base import ConfigError


class _Unread:
    """Base of the stand-ins (``isinstance(section, _Unread)``: the loading service does not read it)."""

    # Underscored: a model's public names (its fields) are all refusing properties of the stand-in.
    __slots__ = ("_section", "_reader", "_where")

    def __init__(self, section: str, reader: str, where: str) -> None:
        """``section``: a key of SECTIONS; ``reader``: the services loading; ``where``: its file and keys."""
        self._section, self._reader, self._where = section, reader, where

    def _refuse(self) -> NoReturn:
        raise ConfigError(
            f"{self._section} ({self._where}) is not among the sections "
            f"the {self._reader} reads; a service reads only its own (SERVICE_SECTIONS)"
        )

    def __repr__(self) -> str:
        return f"<{self._section}: not read by the {self._reader}>"


def _refusing() -> Any:
    return property(lambda self: self._refuse())


_STAND_INS: dict[type[BaseModel], type[_Unread]] = {}


def unread_section(model: type[BaseModel], name: str, reader: str, where: str) -> _Unread:
    """A stand-in for section ``name`` (of ``model``) that ``reader`` does not read.

    Raises (on any public attribute of ``model`` read from it): ConfigError naming ``name``,
    ``where`` (its file and keys) and ``reader``.
    """
    stand_in = _STAND_INS.get(model)
    if stand_in is None:
        names = {n for n in (*model.model_fields, *dir(model)) if not n.startswith("_")}
        stand_in = type(f"Unread{model.__name__}", (_Unread,), {"__slots__": (), **{n: _refusing() for n in names}})
        _STAND_INS[model] = stand_in
    return stand_in(name, reader, where)
