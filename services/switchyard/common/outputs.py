"""Files the commands write (references, indexes, reports, plots, profiles): found writable before the work, not after it."""

from __future__ import annotations

import argparse
from pathlib import Path


def unwritable(path: str | Path) -> str:
    """Why no file can be written at ``path``; "" when one can.

    A directory there, a file where a folder on its way should be, a folder this user cannot write in, or a
    file system that refuses a new file (``/proc``): the last found by opening the file for appending (and
    removing it again when it was not there before). A folder missing on the way is no problem where the writer
    can make it: found by making the first one (and removing it again). ``os.access`` said yes to ``/proc``
    (and to every folder for root), so ``--plot /proc/x/y.png`` was found wrong only after the run.
    """
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory"
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not target.parent.exists():
        first_missing = target.parent
        while first_missing.parent != existing:
            first_missing = first_missing.parent
        try:
            first_missing.mkdir()
        except OSError as exc:
            return f"cannot make the folder {first_missing} ({exc.strerror or exc})"
        first_missing.rmdir()
        return ""
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        return f"{exc.strerror or exc}"
    if not existed:
        target.unlink(missing_ok=True)
    return ""


def write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path``, making the folders on its way; a write that fails leaves no partial file
    where there was none.

    Raises:
        OSError: the write failed (a full disk, say).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    existed = target.exists()
    try:
        if isinstance(data, str):
            target.write_text(data, encoding="utf-8")
        else:
            target.write_bytes(data)
    except OSError:
        if not existed:
            target.unlink(missing_ok=True)
        raise


def refuse_unwritable(parser: argparse.ArgumentParser, *options: tuple[str, str | Path | None]) -> None:
    """``parser.error`` (exit 2, with its usage) naming the first ``(flag, path)`` of ``options`` whose path no file
    can be written at, and why (:func:`unwritable`); options left unset (None, "") are skipped.

    Called right after parsing, so that a run of minutes is not lost to a path found wrong at its end.
    """
    for flag, path in options:
        if path and (problem := unwritable(path)):
            parser.error(f"{flag}: expected a file that can be written ({problem})")
