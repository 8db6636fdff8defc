"""The cold tier: KV entries archived out of DRAM, as files through fsspec.

``memory_policy.toml [oss] path`` is an fsspec URL: a local folder by default
(``./cold_data``), ``s3://bucket/prefix``, ``gs://...`` and the rest through
fsspec's backends (installed separately: s3fs, gcsfs, ...). One file per
entry, named after its DRAM key (``seq/<request id>.kv``,
``agent/<agent id>.kv``, the id percent-encoded; a long one shortened with its SHA-256:
:func:`file_name`), holding the entry sealed by
:mod:`.blob` (key, metadata, lengths, digest, payload): a file that does not
prove itself is a miss (``switchyard_tier_corrupt_blobs_total``) and is removed.

A file appears under its final name only once it is whole:

- a local folder: the blob goes to a temporary name in the same folder
  (``.<name>.<pid>.tmp``), is fsynced, renamed over the final name
  (``os.replace``, atomic on POSIX), and the folder is fsynced so that the
  rename survives a power loss. Temporary names whose writer process is gone
  (a crash, ``kill -9``) are removed when a :class:`ColdStore` opens the folder.
- any other fsspec store (S3, GCS, ...): one ``pipe_file`` of the whole blob,
  built in memory first. s3fs sends it as one PUT, or as a multipart upload that
  S3 shows under the key only once it is completed; an upload that fails
  part-way leaves nothing under the key.

File I/O runs in a worker thread (``asyncio.to_thread``), so a slow object
store never stalls the event loop. Like the DRAM tier, a failure is a counted
miss (``switchyard_cold_tier_errors_total``), never a failed task; it is logged
once when the store starts failing and once when it works again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import logging
import os
import time
from typing import Any, Callable
from urllib.parse import quote

from switchyard.common.children import pid_alive
from switchyard.dispatcher.tiers import blob, metrics
from switchyard.dispatcher.tiers.dram import META_FIELDS, Entry

log = logging.getLogger(__name__)
TMP_SUFFIX = ".tmp"
"""Temporary names are ``.<final name>.<writer pid>.tmp``."""


MAX_NAME_CHARS = 160
"""Longest file name (before ``.kv``) an id keeps as it is, percent-encoded: with the temporary name's
``.<name>.kv.<pid>.tmp`` it stays under the 255 bytes file systems allow."""


def file_name(ident: str) -> str:
    """The file name of an entry's id: the id percent-encoded; a name longer than :data:`MAX_NAME_CHARS` (the edge
    takes ids of 256 characters, and a non-ASCII character encodes to up to 12) is that name's first 96 characters
    and the SHA-256 of the whole id, so that every id the edge accepts can be archived (the blob inside names its
    key: :func:`.blob.check` refuses any other)."""
    name = quote(ident, safe="")
    if len(name) <= MAX_NAME_CHARS:
        return name
    return f"{name[:96]}-{hashlib.sha256(ident.encode()).hexdigest()}"


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on a local file system: temporary name, fsync, rename, fsync of the folder.

    Raises:
        OSError: the write, fsync or rename failed; the temporary file is removed and ``path`` is untouched.
    """
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view[:1 << 20])
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_partial_writes(root: str) -> int:
    """Remove temporary names under the local cold folder ``root`` whose writer process is gone; returns how many.

    Only ``.<name>.<pid>.tmp`` files in the kind folders (``seq/``, ``agent/``) are considered; a live
    writer's (another dispatcher sharing the folder) are left alone.
    """
    removed = 0
    try:
        kinds = [e.path for e in os.scandir(root) if e.is_dir()]
    except FileNotFoundError:
        return 0
    for kind in kinds:
        for entry in os.scandir(kind):
            name = entry.name
            if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
                continue
            pid = name[:-len(TMP_SUFFIX)].rpartition(".")[2]
            if pid.isdigit() and pid_alive(int(pid)) and int(pid) != os.getpid():
                continue
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class ColdStore:
    """Archived KV entries under one fsspec URL.

    Args:
        path: ``[oss] path`` (a folder or an fsspec URL).
        key_prefix: ``[dram] key_prefix``, left out of file names.
        storage_options: ``[oss] storage_options``, keyword arguments for the fsspec backend (an S3 endpoint URL,
            credentials).

    Opening a local folder removes the temporary names of writers that are gone (:func:`remove_partial_writes`).

    Raises:
        ValueError: ``path`` names a protocol fsspec does not know, or whose package is not installed, a store
            whose backend connects when opened and cannot (an FTP host unknown or not answering), or a local
            path that is no folder this user can read (a file, a path under a file, no permission).
    """

    def __init__(self, path: str, key_prefix: str = "switchyard:",
                 storage_options: dict[str, Any] | None = None) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        try:
            self.fs, self.root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise ValueError(f"memory_policy.toml [oss] path {path!r}: {exc}") from None
        except OSError as exc:  # a backend that connects when opened (ftp://): a bare "[Errno -2] Name or service
            # not known" or "Connection refused" named no setting, and the dispatcher did not start
            raise ValueError(f"memory_policy.toml [oss] path {path!r}: expected a store that can be opened "
                             f"({type(exc).__name__}: {exc})") from None
        self.path = path
        self.key_prefix = key_prefix + "kv:"
        self.local = isinstance(self.fs, LocalFileSystem)
        self.nbytes = 0
        """Device bytes of the entries this process archived and has not taken back."""
        self._failing_since: float | None = None
        if self.local:
            try:
                removed = remove_partial_writes(self.root)
            except OSError as exc:  # a file where the folder goes, or one this user cannot read: it was a bare
                # "[Errno 20] Not a directory" that named no setting, and the dispatcher did not start
                why = "a file is there" if os.path.isfile(self.root) else exc.strerror
                raise ValueError(f"memory_policy.toml [oss] path {path!r}: expected a folder this user can read and "
                                 f"write ({why})") from None
            if removed:
                log.warning("cold tier at %s: removed %d partial write(s) left by a process that stopped "
                            "while archiving", path, removed)

    def _file(self, key: str, name: Callable[[str], str] = file_name) -> str:
        kind, _, ident = key.removeprefix(self.key_prefix).partition(":")
        return f"{self.root.rstrip('/')}/{kind}/{name(ident)}.kv"

    async def put(self, entry: Entry) -> bool:
        """Archive ``entry`` (with its payload) whole, or not at all; False (counted, logged once per run of
        failures) when the store failed, and then nothing is left under the entry's name."""
        fields = dataclasses.asdict(entry)
        meta = {name: fields[name] for name in META_FIELDS}
        path = self._file(entry.key)

        def write() -> None:
            data = blob.seal(entry.key, meta, entry.payload)
            if self.local:
                _write_atomic(path, data)
            else:  # one request: a PUT, or a multipart upload completed only once every part is in
                self.fs.pipe_file(path, data)

        try:
            await asyncio.to_thread(write)
        except Exception as exc:  # noqa: BLE001 - any store failure is a miss later
            self._failed("put", exc)
            return False
        self._worked()
        self.nbytes += entry.nbytes
        metrics.TIER_BYTES.labels("cold").set(self.nbytes)
        return True

    async def take(self, key: str) -> Entry | None:
        """Read and remove the archived entry under ``key`` (it goes back up); None when absent, on failure, or
        when the file does not prove itself (:func:`.blob.check`: counted, logged once per reason, removed)."""
        legacy = self._file(key, lambda ident: quote(ident, safe=""))  # before long names were hashed
        paths = dict.fromkeys([self._file(key), *([legacy] if len(os.path.basename(legacy)) <= 255 else [])])

        def read() -> tuple[bytes, blob.Opened | None] | None:
            for path in paths:  # the name now, then the one an entry archived before long names were hashed has
                try:
                    data = self.fs.cat_file(path)
                    break
                except FileNotFoundError:
                    continue
            else:
                return None
            opened = blob.check("cold", key, data)
            self.fs.rm(path)
            return data, opened

        try:
            found = await asyncio.to_thread(read)
        except Exception as exc:  # noqa: BLE001
            self._failed("get", exc)
            return None
        self._worked()
        if found is None or found[1] is None:
            return None
        meta, payload = found[1].meta, found[1].payload
        try:
            entry = Entry(key=key, tokens=int(meta["tokens"]), nbytes=int(meta["nbytes"]),
                          priority=str(meta["priority"]), hits=int(meta["hits"]), cost_us=float(meta["cost_us"]),
                          stored_at=float(meta["stored_at"]), payload=payload)
        except (ValueError, KeyError, TypeError) as exc:
            self._failed("get", exc)
            return None
        self.nbytes = max(0, self.nbytes - entry.nbytes)
        metrics.TIER_BYTES.labels("cold").set(self.nbytes)
        return entry

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.COLD_ERRORS.labels(operation).inc()
        detail = errno.errorcode.get((exc.errno if isinstance(exc, OSError) else None) or 0, "")
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning("cold tier at %s failed on %s (%s%s: %s); the KV state will be recomputed. Further "
                        "failures are counted in switchyard_cold_tier_errors_total until it works again",
                        self.path, operation, type(exc).__name__, f" {detail}" if detail else "",
                        str(exc)[:200])
        else:
            log.debug("cold tier at %s failed on %s (%s)", self.path, operation, type(exc).__name__)

    def _worked(self) -> None:
        if self._failing_since is not None:
            log.warning("cold tier at %s works again after %.1f s of failures", self.path,
                        time.monotonic() - self._failing_since)
            self._failing_since = None
